"""One decode step on the GPU checked against the float32 torch reference (`flashjit run-example`).

Kept out of the CLI so the CLI stays argument parsing and printing. The batch mixes lengths (one
short request, one that ends mid-page, long ones the planner may split) over shuffled page ids,
so the page table, split-KV and merge paths all run. Every row (query token x head) is judged on
its own (flashjit.serving.exactness), and a second run with zero queries counts the keys each row
read: a skipped chunk or a wrong page of one request fails the check.
"""

from __future__ import annotations

import dataclasses

KV_LENS = (1, 37, 700, 2049)
NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16


@dataclasses.dataclass(frozen=True)
class DecodeCheckResult:
    spec_name: str
    kv_lens: tuple[int, ...]
    worst_row_err: float  # the worst row's ||out - ref|| / ||ref||
    tolerance: float      # its bound (exactness.tolerance of bf16)
    failures: tuple[str, ...]

    @property
    def passed(self) -> bool:
        return not self.failures


def gpu_available() -> bool:
    """True when torch imports and sees a CUDA GPU."""
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def decode_check(engine, *, device="cuda", kv_lens=KV_LENS, mask: str = "none",
                 seed: int = 0) -> DecodeCheckResult:
    """Plan and run BatchDecode on random bf16 data and compare with decode_reference."""
    import torch

    from ..serving import exactness
    from ..serving.batch_decode import BatchDecode
    from ..serving.reference import decode_reference

    gen = torch.Generator().manual_seed(seed)
    pages_per_request = [-(-n // PAGE_SIZE) for n in kv_lens]
    total_pages = sum(pages_per_request) + 3  # a few pages no request uses
    page_ids = torch.randperm(total_pages, generator=gen)[: sum(pages_per_request)]
    indptr = torch.tensor([0] + pages_per_request).cumsum(0).to(torch.int32)
    last_page_len = torch.tensor([n - (p - 1) * PAGE_SIZE for n, p in zip(kv_lens, pages_per_request)], dtype=torch.int32)

    shape = (total_pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(shape, generator=gen).to(torch.bfloat16)
    q = torch.randn((len(kv_lens), NUM_QO_HEADS, HEAD_DIM), generator=gen).to(torch.bfloat16)

    device = torch.device(device)
    indices = page_ids.to(torch.int32).to(device)
    decoder = BatchDecode(engine, device=device)
    decoder.plan(indptr, indices, last_page_len, NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE,
                 q_dtype=torch.bfloat16, mask=mask)
    cache = (k_cache.to(device), v_cache.to(device))
    tol = exactness.tolerance(torch.bfloat16)
    failures, worst = [], 0.0
    for probe in (q, torch.zeros_like(q)):
        out, lse = decoder.run(probe.to(device), cache, return_lse=True)
        ref, ref_lse = decode_reference(probe, k_cache, v_cache, indptr, page_ids, last_page_len, mask=mask)
        rows = exactness.check_rows(out.cpu(), lse.cpu(), ref, ref_lse, tol)
        worst = max(worst, rows.worst_out)
        failures += rows.failures
        if not probe.any():  # zero queries: each row's LSE is ln(keys it read)
            failures += exactness.check_key_counts(lse.cpu(), exactness.key_counts(ref_lse))
    return DecodeCheckResult(decoder.spec.name, tuple(kv_lens), worst, tol.out, tuple(failures))
