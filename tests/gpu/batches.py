"""Random paged batches and the per-row exactness checks for GPU tests and benchmarks (the package's
flashjit.deploy.random_batches and flashjit.serving.exactness, shared with check-mask and run-example)."""

import zlib

from flashjit.deploy.random_batches import PagedBatch, make_batch, rel_error  # noqa: F401
from flashjit.serving.exactness import (Tolerance, assert_exact, check_key_counts, check_rows,  # noqa: F401
                                        key_counts, tolerance)


def seed_of(*parts) -> int:
    """A seed from the parts' text: the same in every process (hash() of a str is not)."""
    return zlib.crc32(repr(parts).encode())
