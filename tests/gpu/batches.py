"""Random paged batches for GPU tests and benchmarks (the package's flashjit.batches, shared with check-mask)."""

from flashjit.batches import PagedBatch, make_batch, rel_error  # noqa: F401
