"""use_cuda_graph=True: the sizes every plan must fit, so that a captured run() replays correctly
after any later plan. One kernel (built for max_q_len query tokens per request), buffers fixed by
the first plan, and the page ids in one buffer of max_num_pages: the decoder's own, into which
plan() copies them, or the caller's (page_ids_buffer), which the kernels read in place."""

from __future__ import annotations

from .. import validation
from .buffers import Capacity
from .device_planner import DevicePlanner
from .plan_setup import LOG2E

_REFUSED = "plan() with use_cuda_graph=True"
# Work items beyond one per request that the capacity holds: waves of split chunks for the long
# requests of a skewed batch. The eager plan of a 64-request log-uniform batch takes 2.3 waves,
# so 4 leave it room. A planned chunk cuts no request into more than one wave of items
# (worklist/split.chunk_candidates), so a graph of up to SPLIT_WAVES requests holds a wave a request
# instead: every padding position is a CTA each replay launches, which reads its record and exits.
SPLIT_WAVES = 4
# A sharing graph's partial slots: a shared record writes one per member, so a request takes one
# per chunk of its shared spans. Eager plans of 16 to 64 samples of one prompt take 6 to 24 a
# request; the partials stay within SHARED_PARTIAL_BYTES (a larger batch takes fewer chunks).
SHARED_SLOTS_PER_REQUEST = 32
SHARED_PARTIAL_BYTES = 64 << 20


def captured_values(setup) -> dict:
    """The values a captured launch holds besides its kernel (BatchDecode's Setup or BatchDecodeMLA's):
    name -> value, a tensor parameter by its address."""
    values = {"sm_scale": setup.sm_scale_log2 / LOG2E}
    for name in ("num_qo_heads", "num_kv_heads"):
        if hasattr(setup, name):
            values[name] = getattr(setup, name)
    for what, params in (("mask param", getattr(setup, "params", {})),
                         ("variant param", getattr(setup, "variant_params", {}))):
        for name, value in params.items():
            values[f"{what} {name}"] = _Address(value.data_ptr()) if hasattr(value, "data_ptr") else value
    return values


class _Address(int):
    """A tensor parameter's address: what a captured launch holds of it."""

    def __repr__(self):
        return f"the tensor at {int(self):#x}"


def graph_limits(use_cuda_graph: bool, device, max_batch_size, max_num_pages, max_tokens,
                 max_q_len, page_ids_buffer=None) -> "GraphLimits | None":
    """BatchDecode's CUDA-graph arguments checked: GraphLimits with use_cuda_graph, else None."""
    if page_ids_buffer is not None:
        import torch

        if not use_cuda_graph:
            validation.fail("page_ids_buffer", "None unless use_cuda_graph=True", "a tensor")
        validation.tensor("page_ids_buffer", page_ids_buffer, dtype=torch.int32, device=device, ndim=1)
        if not page_ids_buffer.is_contiguous() or page_ids_buffer.numel() < 1:
            validation.fail("page_ids_buffer", "a contiguous, non-empty int32 tensor", tuple(page_ids_buffer.shape))
        if max_num_pages is None:
            max_num_pages = page_ids_buffer.numel()
        elif max_num_pages != page_ids_buffer.numel():
            validation.fail("max_num_pages", f"page_ids_buffer's length {page_ids_buffer.numel()} (or None)",
                            max_num_pages)
    for name, value in (("max_batch_size", max_batch_size), ("max_num_pages", max_num_pages)):
        if use_cuda_graph and (not isinstance(value, int) or value < 1):
            validation.fail(name, "a positive int when use_cuda_graph=True", value)
    if max_q_len is not None and (not use_cuda_graph or not isinstance(max_q_len, int) or max_q_len < 1):
        validation.fail("max_q_len", "a positive int, with use_cuda_graph=True", max_q_len)
    if not use_cuda_graph:
        return None
    return GraphLimits(device, max_batch_size, max_num_pages, max_tokens, max_q_len, page_ids_buffer)


class GraphLimits:
    """The fixed sizes of CUDA-graph mode; `previous` is the decoder's current plan (None before the first)."""

    def __init__(self, device, max_batch_size: int, max_num_pages: int, max_tokens: int | None,
                 max_q_len: int | None, page_ids_buffer=None):
        import torch

        self.max_batch_size, self.max_tokens, self.max_q_len = max_batch_size, max_tokens, max_q_len
        # Every plan's page ids are here: one address for every replay.
        self.page_ids = (torch.zeros(max_num_pages, dtype=torch.int32, device=device) if page_ids_buffer is None
                         else page_ids_buffer)
        self.device = device
        self.planner: DevicePlanner | None = None  # made by the first plan the GPU planner serves

    def device_planner(self, setup) -> DevicePlanner | None:
        """The GPU planner, where it serves the setup's kernel (host_planned_because: None), else
        None: plan on the host."""
        if self.host_planned_because(setup) is not None:
            return None
        if self.planner is None:
            self.planner = DevicePlanner(self.max_batch_size, self.device)
        return self.planner

    def host_planned_because(self, setup) -> str | None:
        """Why the setup's plans are made on the host, None where the GPU planner serves them: its
        module has the planner, the mask computes its spans on the GPU, and max_batch_size fits the
        planner's shared memory on this device."""
        if setup.spec.shared_prefix:
            return "share_prefixes=True plans on the host, where it finds the shared prefixes"
        if setup.loaded.plan is None:
            return f"the module of {setup.spec.name} has no GPU planner"
        if not setup.kernel.mask.plans_on_device:
            return (f"mask {setup.kernel.mask.name!r} computes its spans on the host (the GPU planner takes none, "
                    "causal and sliding_window)")
        if self.max_batch_size > setup.loaded.plan_max_batch:
            return (f"max_batch_size={self.max_batch_size} is over the {setup.loaded.plan_max_batch} requests the "
                    "GPU planner's shared memory holds on this device")
        return None

    def check_page_id_count(self, count: int):
        if count > self.page_ids.numel():
            validation.fail("indices", f"at most max_num_pages={self.page_ids.numel()} page ids", count)

    def kernel_q_len(self, largest_q: int, previous) -> int:
        """The kernel's query tokens per request: max_q_len (default the first plan's largest),
        which also serves batches with fewer."""
        fixed = self.max_q_len if previous is None else previous.setup.spec.max_q_len
        if fixed is None:
            return largest_q
        if largest_q > fixed:
            validation.fail(_REFUSED, f"at most max_q_len={fixed} query tokens per request "
                            "(set max_q_len when constructing BatchDecode)", largest_q)
        return fixed

    def check_kernel(self, setup, previous):
        """Refuses a setup whose launch differs from the first plan's: a captured graph replays the
        kernel, grid and argument values it was captured with (heads, sm_scale, the mask's and the
        variant's parameters, a tensor's address among them), so a plan changing any of them would
        be ignored by every replay."""
        if previous is None:
            return
        if setup.spec != previous.setup.spec:
            validation.fail(_REFUSED, f"the first plan's kernel {previous.setup.spec.name}", setup.spec.name)
        first = captured_values(previous.setup)
        for name, value in captured_values(setup).items():
            if value != first[name]:
                validation.fail(f"{_REFUSED}: {name}", f"the first plan's {first[name]!r} (a captured graph replays "
                                "it; plan another configuration on a BatchDecode of its own)", repr(value))

    def capacity(self, spec, batch: int, tokens: int, one_wave_items: int, previous,
                 fixed_split_tokens: int | None = None, shared_slot_bytes: int | None = None,
                 planned_chunk: bool = True) -> Capacity:
        """The buffer sizes, fixed at the first plan: a work item per request and SPLIT_WAVES waves
        of splits (one_wave_items: the work items one wave of CTAs holds), or, where the first plan
        lets the planner choose the chunk (planned_chunk) and nothing is shared, a wave per request
        if that is fewer: no planned chunk makes more items than that. A first plan with
        fixed_split_tokens holds every batch the page-id buffer can: its requests (max_batch_size)
        have at most max_num_pages x page_size tokens in all, so at most max_batch_size + those
        tokens // fixed_split_tokens items; otherwise a batch over the capacity would make a replay's
        GPU planner fall back to one item per request, and its rounding would depend on the batch.
        shared_slot_bytes (a sharing graph's partial bytes per slot) sizes the partials for
        SHARED_SLOTS_PER_REQUEST. A batch beyond the capacity is refused."""
        if previous is not None:
            cap = previous.buffers.capacity
        else:
            max_tokens = self.max_tokens or self.max_batch_size * spec.max_q_len
            work = self.max_batch_size + SPLIT_WAVES * one_wave_items
            if planned_chunk and shared_slot_bytes is None:
                work = min(work, self.max_batch_size * one_wave_items)
            if fixed_split_tokens is not None:
                work = max(work, self.max_batch_size + self.page_ids.numel() * spec.page_size // fixed_split_tokens)
            slots = 0 if shared_slot_bytes is None else min(self.max_batch_size * SHARED_SLOTS_PER_REQUEST,
                                                             SHARED_PARTIAL_BYTES // shared_slot_bytes)
            cap = Capacity(self.max_batch_size, max_tokens, work, slots)
        if batch > cap.batch or tokens > cap.tokens:
            validation.fail(_REFUSED, f"at most {cap.batch} requests and {cap.tokens} query tokens",
                            f"{batch} requests, {tokens} tokens")
        return cap

    def refuse_new_buffers(self):
        validation.fail(_REFUSED, "the buffers of the first plan", "a larger plan")

    def hold_page_ids(self, indices, count: int):
        """The fixed page-id buffer, with the plan's count ids copied in (queued on the current stream),
        unless indices is that buffer: the caller wrote them in place."""
        if indices.data_ptr() != self.page_ids.data_ptr():
            self.page_ids[:count].copy_(indices[:count], non_blocking=True)
        return self.page_ids
