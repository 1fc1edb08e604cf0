"""Min and max of the short host arrays plan() and its checks handle (tens to thousands of values).

numpy's min/max are ufunc reductions whose set-up costs about a microsecond, several times a plain
argmin/argmax loop over such arrays; plan() takes a handful per call.
"""

from __future__ import annotations

import numpy as np


def largest(values: np.ndarray, empty: int = 0) -> int:
    """The largest value (empty for none)."""
    return int(values[values.argmax()]) if len(values) else empty


def smallest(values: np.ndarray, empty: int = 0) -> int:
    """The smallest value (empty for none)."""
    return int(values[values.argmin()]) if len(values) else empty
