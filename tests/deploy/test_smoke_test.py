"""`flashjit run-example`'s GPU step (flashjit.deploy.smoke_test.decode_check) on the CPU, with the
float32 reference standing in for the kernel: it passes a decoder that computes the reference and
fails one that reads a wrong page or skips a chunk of the longest request."""

from __future__ import annotations

import pytest
import torch

from flashjit.deploy import smoke_test
from flashjit.serving import batch_decode
from flashjit.serving.reference import decode_reference


class ReferenceDecoder:
    """BatchDecode's plan/run surface over decode_reference; `fault` breaks one request's pages."""

    fault = None

    def __init__(self, engine, device=None):
        self.spec = type("Spec", (), {"name": "reference"})()

    def plan(self, indptr, indices, last_page_len, *args, mask="none", **kwargs):
        indices = indices.clone()
        long = int(torch.argmax(indptr[1:] - indptr[:-1]))
        first = int(indptr[long])
        if self.fault == "page off by one":  # the long request's second page read from its first
            indices[first + 1] = indices[first]
        elif self.fault == "skipped chunk":  # the long request's second page (16 keys) not read
            indptr = indptr.clone()
            indices = torch.cat([indices[:first + 1], indices[first + 2:]])
            indptr[long + 1:] -= 1
        self.tables = (indptr, indices, last_page_len, mask)

    def run(self, q, kv_cache, return_lse=False):
        indptr, indices, last, mask = self.tables
        out, lse = decode_reference(q, *kv_cache, indptr, indices, last, mask=mask)
        return out.to(q.dtype), lse


@pytest.fixture
def reference_decoder(monkeypatch):
    monkeypatch.setattr(batch_decode, "BatchDecode", ReferenceDecoder)
    return ReferenceDecoder


def test_the_reference_passes(reference_decoder):
    result = smoke_test.decode_check(None, device="cpu")
    assert result.passed, result.failures
    assert 0 < result.worst_row_err < result.tolerance


@pytest.mark.parametrize("fault", ["page off by one", "skipped chunk"])
def test_a_wrong_page_or_a_skipped_chunk_fails(reference_decoder, monkeypatch, fault):
    monkeypatch.setattr(reference_decoder, "fault", fault)
    result = smoke_test.decode_check(None, device="cpu")
    assert not result.passed
    assert any("another number of keys" in f for f in result.failures) == (fault == "skipped chunk")
    assert any("off the reference" in f for f in result.failures)
