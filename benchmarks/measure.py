"""One implementation on one row: checked against the float32 reference row by row, then timed
eagerly and as a replayed CUDA graph. A step that fails or is wrong is reported in its entry and
not timed; a TypeError, AttributeError or NameError (an API that differs from the one this code
calls) raises, and so does a failure that leaves the GPU unusable (the sync after a reported failure).

Every benchmark that reports a speed checks its outputs with row_problem first: each row (query
token x head, or a layer's token) against its float32 reference within a bound from the dtypes
(flashjit.serving.exactness), so an implementation that drops a chunk of one long request is
reported, not timed."""

from __future__ import annotations

from benchmarks.peers import Impl, Step
from benchmarks.timing import host_us
from flashjit.serving.exactness import Tolerance, check_rows, tolerance

# bf16 output, softmax weights rounded to bf16 before P V: the coarsest any implementation timed here uses
ROW_TOLERANCE = tolerance("bfloat16", mma_dtype="bfloat16")
API_ERRORS = (TypeError, AttributeError, NameError)


def row_problem(out, ref, tol: Tolerance = ROW_TOLERANCE) -> tuple[float, str | None]:
    """(the worst row's relative error, None), or (it, what is wrong) of an output against its float32
    reference: [tokens, heads, head_dim] rows, or [tokens, width] rows of a layer."""
    as_rows = lambda t: t if t.dim() == 3 else t.reshape(t.shape[0], 1, -1)  # noqa: E731
    result = check_rows(as_rows(out), None, as_rows(ref), None, tol)
    return result.worst_out, (None if result.passed else result.failures[0])


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:200]


def checked_output(run, ref, sync, tol: Tolerance = ROW_TOLERANCE) -> tuple[float | None, str | None]:
    """(the worst row's relative error, None), or (None, what went wrong) for a run() that raises or
    is off the reference (row_problem)."""
    try:
        out = run()
        sync()
        err, problem = row_problem(out, ref, tol)
    except API_ERRORS:
        raise
    except Exception as exc:  # noqa: BLE001 - reported in the row; the sync below re-raises if the GPU is lost
        sync()
        return None, describe(exc)
    return (None, problem) if problem else (err, None)


def measure(impl: Impl, ref, timer, *, sync, capture, graph: bool = True, host: bool = False,
            tol: Tolerance = ROW_TOLERANCE) -> dict:
    """{"us", "row_error" (the worst row's), then the step's info, "graph_us", ...} or {"error": ...}.
    host: also the host µs of one eager call ("host_us") and of one replay ("graph_host_us")."""
    err, problem = checked_output(impl.eager.call, ref, sync, tol)
    if problem:
        return {"error": problem}
    entry = {"us": timer.median_us(impl.eager.call), "row_error": err}
    _, problem = checked_output(impl.eager.call, ref, sync, tol)  # the timed calls left it able to run right
    if problem:
        return {"error": f"after the timed calls: {problem}"}
    if impl.eager.info:
        entry.update(impl.eager.info())
    if host:
        entry["host_us"] = host_us(impl.eager.call, sync)
    if graph and impl.graph is not None:
        entry.update(measure_graph(impl.graph, ref, timer, sync=sync, capture=capture, host=host, tol=tol))
    return entry


def measure_graph(make_step, ref, timer, *, sync, capture, host: bool = False, tol: Tolerance = ROW_TOLERANCE) -> dict:
    """The step a server captures, planned before the capture and again before the replays; every
    replay writes the output the capture returned, checked (from NaNs) before it is timed and again
    after: a replay that leans on state its first run used up shows there."""
    state = {}

    def replay_once():
        step: Step = make_step()
        graph, out = capture(step.call)
        state.update(step=step, graph=graph, out=out)
        if step.before_replay:
            step.before_replay()
        out.fill_(float("nan"))
        graph.replay()
        return out

    err, problem = checked_output(replay_once, ref, sync, tol)
    if problem:
        return {"graph_error": problem}
    step, graph = state["step"], state["graph"]
    entry = {"graph_us": timer.median_us(graph.replay), "graph_row_error": err}

    def replay_again():  # as the timed replays ran: no plan between them
        state["out"].fill_(float("nan"))
        graph.replay()
        return state["out"]

    _, problem = checked_output(replay_again, ref, sync, tol)
    if problem:
        return {"graph_error": f"after the timed replays: {problem}"}
    if step.info:
        entry.update({f"graph_{key}": value for key, value in step.info().items()})
    if host:
        entry["graph_host_us"] = host_us(graph.replay, sync)
    return entry


def build_and_measure(name: str, make, case_name: str, ref, timer, *, sync, capture, graph: bool = True,
                      host: bool = False, tol: Tolerance = ROW_TOLERANCE) -> dict:
    """make() (an Impl), then measure() it; a failure to build is reported like a failing step."""
    try:
        try:
            impl = make()
        except API_ERRORS:
            raise
        except Exception as exc:  # noqa: BLE001 - reported in the row, as a failing step is
            sync()
            return {"error": describe(exc)}
        return measure(impl, ref, timer, sync=sync, capture=capture, graph=graph, host=host, tol=tol)
    except API_ERRORS as exc:
        if hasattr(exc, "add_note"):  # Python 3.11+
            exc.add_note(f"benchmarks: {name} on row {case_name!r}: its API differs from the one benchmarks/peers.py calls")
        raise
