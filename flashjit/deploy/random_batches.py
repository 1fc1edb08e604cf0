"""Random paged batches for `flashjit check-mask`, the GPU tests and benchmarks: shuffled pages, never zeros.

Tensors are made on the CPU from a seeded generator, then moved, so a seed gives the same batch on
any device. tests/gpu/batches.py re-exports this module.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class PagedBatch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    indptr: torch.Tensor        # CPU int32
    indices: torch.Tensor       # GPU int32
    last_page_len: torch.Tensor  # CPU int32
    qo_indptr: torch.Tensor     # CPU int32
    page_size: int
    kv_layout: str

    @property
    def kv_lens(self) -> list[int]:
        n = (self.indptr[1:] - self.indptr[:-1]).tolist()
        return [(p - 1) * self.page_size + int(l) if p else 0 for p, l in zip(n, self.last_page_len.tolist())]


def make_batch(kv_lens, *, num_qo_heads, num_kv_heads, head_dim, page_size, dtype=torch.bfloat16, q_lens=1,
               kv_layout="NHD", spare_pages=3, seed=0, device="cuda") -> PagedBatch:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q_lens = [q_lens] * len(kv_lens) if isinstance(q_lens, int) else list(q_lens)
    pages_per = [-(-n // page_size) for n in kv_lens]
    total = sum(pages_per) + spare_pages
    perm = torch.randperm(total, generator=gen).to(torch.int32)
    indptr = torch.zeros(len(kv_lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(pages_per, dtype=torch.int32), 0)
    last = torch.tensor([n - (p - 1) * page_size if p else 0 for n, p in zip(kv_lens, pages_per)], dtype=torch.int32)
    qo = torch.zeros(len(kv_lens) + 1, dtype=torch.int32)
    qo[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
    shape = (total, page_size, num_kv_heads, head_dim) if kv_layout == "NHD" else (total, num_kv_heads, page_size, head_dim)
    k = torch.randn(shape, generator=gen).to(dtype).to(device)
    v = torch.randn(shape, generator=gen).to(dtype).to(device)
    q = torch.randn(int(qo[-1]), num_qo_heads, head_dim, generator=gen).to(dtype).to(device)
    return PagedBatch(q, k, v, indptr, perm[: int(indptr[-1])].to(device), last, qo, page_size, kv_layout)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-6)).item()
