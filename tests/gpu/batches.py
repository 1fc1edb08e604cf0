"""Random paged batches for GPU tests and benchmarks (the package's flashjit.deploy.random_batches, shared with check-mask)."""

from flashjit.deploy.random_batches import PagedBatch, make_batch, rel_error  # noqa: F401
