"""Context-parallel decode: each rank attends its shard of every request's keys, the partial states
are exchanged with torch.distributed and merged exactly with merge_states.

    rank r:  state_r = BatchDecode over the rank's pages, return_lse      (shard_mask: global masks)
             all-gather (o, lse) of every rank, in one collective        (states.StateSlots)
             out = merge_states(states)                                    (every rank: the whole output)
    or, output="heads": all-to-all of each rank's states by query head; rank r merges its heads
             (a reduce-scatter over heads: 1/world of the all-gather's bytes, the output sharded by head)

The queries (and out) are the same on every rank; a rank's cache holds its own pages only.
SequentialContextParallelDecode runs every shard one after another in one process through the same
shard decode and merge, with the gather replaced by writing each state into its slot: one GPU
checks the whole path. The shard attention is injectable: `decoder` builds one BatchDecode-like
object per shard (plan()/run(out=, lse=)); ReferenceDecoder runs it in torch on the CPU.
"""

from __future__ import annotations

import numpy as np

from .. import validation
from ..masks.key_range import key_range_params
from ..serving.merge_states import merge_states
from .layout import Contiguous, Interleaved, shard_local_lens
from .shard_mask import check_global_mask, shard_mask
from .states import StateSlots

OUTPUTS = ("replicated", "heads")


class Shard:
    """One rank's part of a batch: its local page table (as BatchDecode.plan takes it: indptr and
    last_page_len on the host, indices on the decoder's device) and its layout (layout.Contiguous
    or layout.Interleaved), which says where its keys sit in the sequence."""

    def __init__(self, indptr, indices, last_page_len, layout):
        if not isinstance(layout, (Contiguous, Interleaved)):
            validation.fail("layout", "flashjit.parallel.Contiguous(offsets) or Interleaved(rank, world)", repr(layout))
        self.indptr, self.indices, self.last_page_len, self.layout = indptr, indices, last_page_len, layout

    @classmethod
    def from_split(cls, split: dict, device) -> "Shard":
        """A shard of layout.split_page_table's output, its page ids moved to device."""
        import torch

        return cls(torch.from_numpy(split["indptr"]), torch.from_numpy(split["indices"]).to(device),
                   torch.from_numpy(split["last_page_len"]), split["layout"])


class _ShardDecode:
    """The decode of one shard: the global mask turned local (prepare: checks only), then the
    decoder's plan and run."""

    def __init__(self, decoder):
        self.decoder = decoder
        self.mask = None

    @staticmethod
    def prepare(shard: Shard, global_lens: np.ndarray, qo_indptr: np.ndarray, page_size: int, mask: str,
                window_left):
        """(the shard's local key counts, its ShardMask); raises on a shard that does not fit."""
        indptr = validation.host_int_array("shard indptr", shard.indptr)
        last = validation.host_int_array("shard last_page_len", shard.last_page_len)
        if len(indptr) != len(global_lens) + 1 or len(last) != len(global_lens):
            validation.fail("shard", f"a page table of {len(global_lens)} requests (global_kv_lens' length)",
                            f"indptr of {len(indptr)} and last_page_len of {len(last)} values")
        local_lens = shard_local_lens(indptr, last, page_size)
        shard.layout.check(local_lens, global_lens, page_size)
        return local_lens, shard_mask(shard.layout, local_lens, global_lens, qo_indptr, page_size, mask, window_left)

    def plan(self, shard: Shard, local, qo_indptr: np.ndarray, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             page_size: int, options: dict, device):
        import torch

        self.mask = None
        params = (None if local.mask == "none" else
                  key_range_params(local.qo_indptr, local.begin, local.end, device=device))
        self.decoder.plan(shard.indptr, shard.indices, shard.last_page_len, num_qo_heads, num_kv_heads, head_dim,
                          page_size, qo_indptr=torch.from_numpy(qo_indptr.astype(np.int32)), mask=local.mask,
                          mask_params=params, **options)
        self.mask = local

    def run(self, q, kv_cache, out, lse, k_scale, v_scale):
        self.decoder.run(q, kv_cache, out=out, lse=lse, k_scale=k_scale, v_scale=v_scale)


class _Planned:
    """What plan() fixed for run(): the batch's shape and where the states go."""

    def __init__(self, tokens, num_qo_heads, head_dim, global_lens, local_lens):
        self.tokens, self.num_qo_heads, self.head_dim = tokens, num_qo_heads, head_dim
        self.global_lens, self.local_lens = global_lens, local_lens


def _batch_args(global_kv_lens, qo_indptr, q_len, mask, window_left):
    global_lens = validation.host_int_array("global_kv_lens", global_kv_lens).astype(np.int64)
    if np.any(global_lens < 0):
        validation.fail("global_kv_lens", "key counts >= 0", global_lens[:8].tolist())
    batch = len(global_lens)
    if qo_indptr is None:
        q_len = 1 if q_len is None else q_len
        if not isinstance(q_len, int) or isinstance(q_len, bool) or q_len < 1:
            validation.fail("q_len", "an int >= 1 (query tokens per request)", repr(q_len))
        qo = np.arange(batch + 1, dtype=np.int64) * q_len
    else:
        qo = validation.host_int_array("qo_indptr", qo_indptr).astype(np.int64)
        if len(qo) != batch + 1 or qo[0] != 0 or np.any(np.diff(qo) < 0):
            validation.fail("qo_indptr", f"{batch + 1} increasing offsets from 0 (one request per global_kv_lens entry)",
                            qo[:8].tolist())
    check_global_mask(mask, window_left)
    return global_lens, qo


def _check_query(q, planned: _Planned):
    shape = (planned.tokens, planned.num_qo_heads, planned.head_dim)
    if not hasattr(q, "shape") or tuple(q.shape) != shape:
        validation.fail("q", f"a tensor {shape} (tokens, qo_heads, head_dim of the plan)", getattr(q, "shape", q))


class ContextParallelDecode:
    """One rank's side of context-parallel decode over a torch.distributed process group.

    group: the process group of the ranks that share the context (None: the default group).
    output: "replicated" (all-gather: every rank returns the whole [tokens, qo_heads, head_dim]) or
    "heads" (all-to-all by query head, qo_heads divisible by the group's size: rank r returns heads
    r*H/world .. (r+1)*H/world - 1, moving 1/world of the all-gather's bytes).
    decoder: a factory of the shard's decoder, default BatchDecode(engine, device); give
    ReferenceDecoder to attend on the CPU.
    """

    def __init__(self, group=None, *, engine=None, device=None, output: str = "replicated", decoder=None):
        import torch
        import torch.distributed as dist

        if output not in OUTPUTS:
            validation.fail("output", " or ".join(map(repr, OUTPUTS)), repr(output))
        self.group, self.output = group, output
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.device = torch.device(device if device is not None else
                                   ("cuda" if dist.get_backend(group) == "nccl" else "cpu"))
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.engine = engine
        self._shard = _ShardDecode(_make_decoder(decoder, engine, self.device))
        self._planned = None
        self._send = self._recv = None

    def plan(self, shard: Shard, global_kv_lens, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
             *, qo_indptr=None, q_len: int | None = None, mask: str = "none", window_left: int | None = None,
             **decode_options) -> "ContextParallelDecode":
        """Plan this rank's shard. global_kv_lens: each request's keys over all ranks (the query tokens
        are its newest global positions); decode_options go to BatchDecode.plan (q_dtype, kv_dtype,
        kv_layout, sm_scale, chunk_tokens, ...). Masks: none, causal, sliding_window (window_left)."""
        global_lens, qo = _batch_args(global_kv_lens, qo_indptr, q_len, mask, window_left)
        if self.output == "heads" and num_qo_heads % self.world:
            validation.fail("num_qo_heads", f"a multiple of the group's {self.world} ranks with output='heads'",
                            num_qo_heads)
        local_lens, local = self._shard.prepare(shard, global_lens, qo, page_size, mask, window_left)
        self._planned = None  # a decoder refusing its plan leaves no plan to run
        self._shard.plan(shard, local, qo, num_qo_heads, num_kv_heads, head_dim, page_size, decode_options,
                         self.device)
        self._planned = _Planned(int(qo[-1]), num_qo_heads, head_dim, global_lens, local_lens)
        return self

    def run(self, q, kv_cache, *, k_scale=None, v_scale=None, return_lse: bool = False):
        """The merged attention of q (the same on every rank) over every rank's shard: out (and lse, natural log)."""
        import torch.distributed as dist

        planned = self._planned
        if planned is None:
            raise RuntimeError("ContextParallelDecode.run() called before plan()")
        _check_query(q, planned)
        tokens, heads, dim = q.shape
        world = self.world
        if self.output == "replicated":
            send, recv = self._slots(1, tokens, heads, dim, q), self._slots(world, tokens, heads, dim, q, recv=True)
            self._shard.run(q, kv_cache, send.o()[0], send.lse()[0], k_scale, v_scale)
            if tokens:
                _all_gather(recv.buffer.view(-1), send.buffer.view(-1), group=self.group)
        else:
            part = heads // world
            send, recv = self._slots(world, tokens, part, dim, q), self._slots(world, tokens, part, dim, q, recv=True)
            o, lse = q.new_empty(tokens, heads, dim), q.new_empty(tokens, heads, dtype=_float32())
            self._shard.run(q, kv_cache, o, lse, k_scale, v_scale)
            send.o().copy_(o.view(tokens, world, part, dim).transpose(0, 1))
            send.lse().copy_(lse.view(tokens, world, part).transpose(0, 1))
            if tokens:
                dist.all_to_all_single(recv.buffer, send.buffer, group=self.group)
        out, lse = merge_states(recv.o(), recv.lse(), engine=self.engine)
        return (out, lse) if return_lse else out

    def _slots(self, slots, tokens, heads, dim, q, recv=False) -> StateSlots:
        held = self._recv if recv else self._send
        if held is None or not held.fits(slots, tokens, heads, dim, q.dtype, q.device):
            held = StateSlots.allocate(slots, tokens, heads, dim, q.dtype, q.device)
            if recv:
                self._recv = held
            else:
                self._send = held
        return held


class SequentialContextParallelDecode:
    """Every shard of a context-parallel batch in one process, one after another: the shard decodes
    and the merge of ContextParallelDecode, with each state written into its slot instead of gathered.

    world: the number of shards; decoder: as for ContextParallelDecode (one decoder per shard).
    """

    def __init__(self, world: int, *, engine=None, device="cuda", decoder=None):
        import torch

        if not isinstance(world, int) or isinstance(world, bool) or world < 1:
            validation.fail("world", "an int >= 1 (shards)", repr(world))
        self.world, self.engine, self.device = world, engine, torch.device(device)
        self._shards = [_ShardDecode(_make_decoder(decoder, engine, self.device)) for _ in range(world)]
        self._planned = None
        self._slots = None

    def plan(self, shards, global_kv_lens, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
             *, qo_indptr=None, q_len: int | None = None, mask: str = "none", window_left: int | None = None,
             **decode_options) -> "SequentialContextParallelDecode":
        """plan() of ContextParallelDecode for each of the world shards (a list of Shard), which must
        together hold each request's global keys once."""
        shards = list(shards)
        if len(shards) != self.world:
            validation.fail("shards", f"{self.world} shards (one per rank)", len(shards))
        global_lens, qo = _batch_args(global_kv_lens, qo_indptr, q_len, mask, window_left)
        prepared = [_ShardDecode.prepare(shard, global_lens, qo, page_size, mask, window_left) for shard in shards]
        counts = np.sum([local_lens for local_lens, _ in prepared], axis=0)
        if not np.array_equal(counts, global_lens):
            validation.fail("shards", "local key counts that add up to global_kv_lens", counts[:8].tolist())
        self._planned = None  # a decoder refusing its plan leaves no plan to run
        for decode, shard, (_, local) in zip(self._shards, shards, prepared):
            decode.plan(shard, local, qo, num_qo_heads, num_kv_heads, head_dim, page_size, decode_options, self.device)
        self._planned = _Planned(int(qo[-1]), num_qo_heads, head_dim, global_lens, [n for n, _ in prepared])
        return self

    def run(self, q, kv_caches, *, k_scale=None, v_scale=None, return_lse: bool = False):
        """kv_caches: one cache per shard (a list), or one cache all shards' page ids index."""
        planned = self._planned
        if planned is None:
            raise RuntimeError("SequentialContextParallelDecode.run() called before plan()")
        _check_query(q, planned)
        caches = list(kv_caches) if isinstance(kv_caches, list) else [kv_caches] * self.world
        if len(caches) != self.world:
            validation.fail("kv_caches", f"one cache or a list of {self.world}", len(caches))
        tokens, heads, dim = q.shape
        if self._slots is None or not self._slots.fits(self.world, tokens, heads, dim, q.dtype, q.device):
            self._slots = StateSlots.allocate(self.world, tokens, heads, dim, q.dtype, q.device)
        o, lse = self._slots.o(), self._slots.lse()
        for r, (shard, cache) in enumerate(zip(self._shards, caches)):
            shard.run(q, cache, o[r], lse[r], k_scale, v_scale)
        out, out_lse = merge_states(o, lse, engine=self.engine)
        return (out, out_lse) if return_lse else out


def _all_gather(output, input, group):
    """torch.distributed's all-gather into one tensor, by its current name (all_gather_single from 2.13)."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, input, group=group)


def _make_decoder(factory, engine, device):
    if factory is not None:
        return factory(engine, device)
    from ..serving.batch_decode import BatchDecode

    return BatchDecode(engine, device=device)


def _float32():
    import torch

    return torch.float32
