"""One implementation on one row: checked against the float32 reference, then timed eagerly and as
a replayed CUDA graph. A step that fails or is wrong is reported in its entry and not timed; a
TypeError, AttributeError or NameError (an API that differs from the one this code calls) raises,
and so does a failure that leaves the GPU unusable (the sync after a reported failure)."""

from __future__ import annotations

from benchmarks.peers import Impl, Step
from benchmarks.timing import host_us

TOLERANCE = 1e-2  # relative error (Frobenius) against the float32 reference
API_ERRORS = (TypeError, AttributeError, NameError)


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:200]


def checked_output(run, ref, sync) -> tuple[float | None, str | None]:
    """(relative error, None), or (None, what went wrong) for a run() that raises or is off the reference."""
    from flashjit.deploy.random_batches import rel_error

    try:
        out = run()
        sync()
        err = rel_error(out, ref)
    except API_ERRORS:
        raise
    except Exception as exc:  # noqa: BLE001 - reported in the row; the sync below re-raises if the GPU is lost
        sync()
        return None, describe(exc)
    if not err <= TOLERANCE:
        return None, f"rel error {err:.2e}"
    return err, None


def measure(impl: Impl, ref, timer, *, sync, capture, graph: bool = True, host: bool = False) -> dict:
    """{"us", "rel_error", then the step's info, "graph_us", ...} or {"error": ...}. host: also the
    host µs of one eager call ("host_us") and of one replay ("graph_host_us")."""
    err, problem = checked_output(impl.eager.call, ref, sync)
    if problem:
        return {"error": problem}
    entry = {"us": timer.median_us(impl.eager.call), "rel_error": err}
    if impl.eager.info:
        entry.update(impl.eager.info())
    if host:
        entry["host_us"] = host_us(impl.eager.call, sync)
    if graph and impl.graph is not None:
        entry.update(measure_graph(impl.graph, ref, timer, sync=sync, capture=capture, host=host))
    return entry


def measure_graph(make_step, ref, timer, *, sync, capture, host: bool = False) -> dict:
    """The step a server captures, planned before the capture and again before the replays; every
    replay writes the output the capture returned, checked once (from NaNs) before it is timed."""
    state = {}

    def replay_once():
        step: Step = make_step()
        graph, out = capture(step.call)
        state.update(step=step, graph=graph)
        if step.before_replay:
            step.before_replay()
        out.fill_(float("nan"))
        graph.replay()
        return out

    err, problem = checked_output(replay_once, ref, sync)
    if problem:
        return {"graph_error": problem}
    step, graph = state["step"], state["graph"]
    entry = {"graph_us": timer.median_us(graph.replay), "graph_rel_error": err}
    if step.info:
        entry.update({f"graph_{key}": value for key, value in step.info().items()})
    if host:
        entry["graph_host_us"] = host_us(graph.replay, sync)
    return entry


def build_and_measure(name: str, make, case_name: str, ref, timer, *, sync, capture, graph: bool = True,
                      host: bool = False) -> dict:
    """make() (an Impl), then measure() it; a failure to build is reported like a failing step."""
    try:
        try:
            impl = make()
        except API_ERRORS:
            raise
        except Exception as exc:  # noqa: BLE001 - reported in the row, as a failing step is
            sync()
            return {"error": describe(exc)}
        return measure(impl, ref, timer, sync=sync, capture=capture, graph=graph, host=host)
    except API_ERRORS as exc:
        if hasattr(exc, "add_note"):  # Python 3.11+
            exc.add_note(f"benchmarks: {name} on row {case_name!r}: its API differs from the one benchmarks/peers.py calls")
        raise
