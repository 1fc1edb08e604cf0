"""Context-parallel batches and their checks, shared by the CPU tests (one process and gloo) and the GPU tests."""

from __future__ import annotations

import dataclasses
import itertools

import torch

from flashjit.deploy.random_batches import make_batch
from flashjit.parallel import split_page_table
from flashjit.parallel.shard_mask import GLOBAL_MASKS
from flashjit.serving.reference import decode_reference

PAGE_SIZE = 4
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
# Zero keys, fewer keys than query tokens, one page, many pages; several query tokens beside one.
KV_LENS = [37, 0, 16, 101, 2, 9]
Q_LENS = [3, 1, 2, 4, 3, 1]


def global_masks(windows) -> list[tuple[str, int | None]]:
    """(mask, window_left) of every mask context-parallel decode takes (shard_mask.GLOBAL_MASKS),
    sliding_window once per window in windows."""
    return [(mask, window) for mask in GLOBAL_MASKS for window in (windows if mask == "sliding_window" else (None,))]


MASKS = global_masks((5, 0))


@dataclasses.dataclass(frozen=True)
class Layout:
    kind: str
    block_pages: int = 1
    uneven: bool = False  # contiguous: unequal cuts, some shards empty

    def cuts(self, batch, world: int):
        """Page cuts per request: rank 0 empty, the last rank most of the pages, for uneven layouts."""
        if not self.uneven:
            return None
        pages = (batch.indptr[1:] - batch.indptr[:-1]).tolist()
        return [[0, 0] + [min(n, (r + 1) * 1) for r in range(world - 2)] + [n] if world > 1 else [0, n]
                for n in pages]


LAYOUTS = [Layout("contiguous"), Layout("contiguous", uneven=True), Layout("interleaved"),
           Layout("interleaved", block_pages=3)]


def batch(device="cpu", dtype=torch.float32, seed=1, kv_lens=KV_LENS, q_lens=Q_LENS, page_size=PAGE_SIZE,
          heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM):
    return make_batch(kv_lens, num_qo_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, page_size=page_size,
                      dtype=dtype, q_lens=q_lens, device=device, seed=seed)


def splits(b, world: int, layout: Layout):
    return split_page_table(b.indptr, b.indices.cpu().numpy(), b.last_page_len, b.page_size, world, layout=layout.kind,
                            block_pages=layout.block_pages, cuts=layout.cuts(b, world))


def reference(b, mask: str, window_left):
    params = {} if window_left is None else {"window_left": window_left}
    return decode_reference(b.q, b.k_cache, b.v_cache, b.indptr, b.indices, b.last_page_len, qo_indptr=b.qo_indptr,
                            mask=mask, mask_params=params)


def assert_matches(out, lse, ref, ref_lse, atol=1e-5, what=""):
    """out within atol (absolute and relative to ref), the same rows -inf, lse within 1e-5.
    (Plain comparisons: torch.testing imports torch.distributed.tensor, a second per process.)"""
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), what
    error = ((out.float() - ref).abs() - atol * ref.abs()).max().item() if ref.numel() else 0.0
    assert error <= atol, f"{what}: out off by {error:.3g}"
    assert torch.equal(lse == float("-inf"), ref_lse == float("-inf")), what
    live = ref_lse != float("-inf")
    lse_error = ((lse[live] - ref_lse[live]).abs() - 1e-5 * ref_lse[live].abs()).max().item() if live.any() else 0.0
    assert lse_error <= max(atol, 1e-5), f"{what}: lse off by {lse_error:.3g}"


def gloo_worker(rank: int, world: int, init_file: str):
    """One rank of a gloo group: layouts, masks and outputs against the reference of the whole cache."""
    import torch.distributed as dist

    from flashjit.parallel import ContextParallelDecode, ReferenceDecoder, Shard

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        b = batch()
        # The collectives and each rank's part, over two layouts and masks; the in-process tests
        # cover every layout and mask through the same shard decodes and merge.
        gloo_masks = [("causal", None), ("sliding_window", 5)]
        references = {m: reference(b, *m) for m in gloo_masks}
        layouts = [Layout("contiguous", uneven=True), Layout("interleaved", block_pages=3)]
        decoders = {output: ContextParallelDecode(output=output, decoder=ReferenceDecoder)
                    for output in ("replicated", "heads")}  # planned again for each case, as a server does
        for layout, (mask, window_left), output in itertools.product(layouts, gloo_masks, decoders):
            what = f"rank {rank}/{world} {layout} {mask} {window_left} {output}"
            decoder = decoders[output]
            shard = Shard.from_split(splits(b, world, layout)[rank], "cpu")
            decoder.plan(shard, b.kv_lens, HEADS, KV_HEADS, HEAD_DIM, b.page_size, qo_indptr=b.qo_indptr, mask=mask,
                         window_left=window_left)
            out, lse = decoder.run(b.q, (b.k_cache, b.v_cache), return_lse=True)
            ref, ref_lse = references[mask, window_left]
            if output == "heads":
                part = HEADS // world
                ref, ref_lse = ref[:, rank * part:(rank + 1) * part], ref_lse[:, rank * part:(rank + 1) * part]
            assert_matches(out, lse, ref, ref_lse, what=what)
    finally:
        dist.destroy_process_group()


def nccl_worker(rank: int, world: int, init_file: str, output: str):
    """One rank of an NCCL group on GPU `rank`: BatchDecode on its shard against single-GPU decode."""
    import torch.distributed as dist

    import flashjit
    from flashjit.parallel import ContextParallelDecode, Shard
    from flashjit.serving.exactness import assert_exact, tolerance

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        b = batch(device="cuda", dtype=torch.bfloat16, kv_lens=[0, 1, 17, 300, 2048, 5000], q_lens=2, page_size=16,
                  heads=8, kv_heads=2, head_dim=128)
        for layout, (mask, window_left) in itertools.product(
                [Layout("contiguous", uneven=True), Layout("interleaved", block_pages=2)],
                global_masks((100,))):
            single = flashjit.BatchDecode()
            single.plan(b.indptr, b.indices, b.last_page_len, 8, 2, 128, 16, qo_indptr=b.qo_indptr, mask=mask,
                        window_left=window_left)
            want, want_lse = single.run(b.q, (b.k_cache, b.v_cache), return_lse=True)
            decoder = ContextParallelDecode(output=output)
            decoder.plan(Shard.from_split(splits(b, world, layout)[rank], "cuda"), b.kv_lens, 8, 2, 128, 16,
                         qo_indptr=b.qo_indptr, mask=mask, window_left=window_left)
            out, lse = decoder.run(b.q, (b.k_cache, b.v_cache), return_lse=True)
            if output == "heads":
                part = 8 // world
                want, want_lse = want[:, rank * part:(rank + 1) * part], want_lse[:, rank * part:(rank + 1) * part]
            assert_exact(out, lse, want.float(), want_lse, tolerance(torch.bfloat16), f"rank {rank} {layout} {mask} {output}")
    finally:
        dist.destroy_process_group()
