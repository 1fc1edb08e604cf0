"""A custom mask from an empty file to a running kernel: chunked local attention (docs/masks.md).

    python examples/masks/chunked.py      # register, check on the CPU, compile; with a GPU, run and compare

Query position q_pos sees the keys of its own chunk, causally: q_pos // chunk * chunk <= kv_pos <= q_pos.
The template is chunked.cuh.j2 next to this file; packaged, `register` would be the entry point
(pyproject.toml: [project.entry-points."flashjit.masks"] chunked = "my_masks.chunked:register").
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

import flashjit

TEMPLATE = Path(__file__).with_name("chunked.cuh.j2")


def kv_span(kv_lens, q_lens, params):
    """Walk from the chunk of each request's first query token: earlier pages are never read."""
    chunk = params["chunk"]
    if chunk < 1:  # the kernel divides by it
        raise ValueError(f"mask param chunk: expected a positive int, got {chunk}")
    first_q_pos = np.maximum(kv_lens - q_lens, 0)
    return first_q_pos // chunk * chunk, kv_lens


def reference(q_pos, kv_pos, request, params):
    """The torch predicate decode_reference and check-mask compare the kernel with."""
    chunk = params["chunk"]
    return (kv_pos <= q_pos) & (kv_pos // chunk == q_pos // chunk)


def sample_params(rng, kv_lens, q_lens, page_size, device):
    """Parameters for check-mask's random batches: chunks inside a page, a page, across pages."""
    return {"chunk": rng.choice([1, page_size, 37, 256])}


def register():
    return flashjit.register_mask("chunked", template=TEMPLATE, params={"chunk": "int"}, kv_span=kv_span,
                                  reference=reference, sample_params=sample_params, replace=True)


def main() -> int:
    import torch

    from flashjit.deploy.mask_check import check_mask, gpu_available

    register()
    report = check_mask("chunked", archs=None if gpu_available() else "sm_90")  # host check, compile, GPU cases
    print("\n".join(report.notes + report.failures()))
    print("check-mask chunked:", "PASS" if report.passed else "FAIL")
    if not gpu_available():
        return 0 if report.passed else 1

    # One decode step by hand: 3 requests, 2 query tokens each, GQA 32/8, head_dim 128, pages of 16.
    from flashjit.deploy.random_batches import make_batch
    from flashjit.serving.reference import decode_reference

    batch = make_batch([70, 1000, 4097], num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16, q_lens=2)
    decoder = flashjit.BatchDecode(device="cuda")
    decoder.plan(batch.indptr, batch.indices, batch.last_page_len, 32, 8, 128, 16, qo_indptr=batch.qo_indptr,
                 mask="chunked", mask_params={"chunk": 256}, q_dtype=torch.bfloat16)
    out = decoder.run(batch.q, (batch.k_cache, batch.v_cache))
    ref, _ = decode_reference(batch.q, batch.k_cache, batch.v_cache, batch.indptr, batch.indices,
                              batch.last_page_len, qo_indptr=batch.qo_indptr, mask="chunked",
                              mask_params={"chunk": 256})
    err = (out.float() - ref).abs().max().item()
    print(f"{decoder.spec.name}: max abs error {err:.2e} vs the float32 reference")
    return 0 if report.passed and err < 2e-2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
