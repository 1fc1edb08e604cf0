"""The kernel families, one folder each (spec, tiling, argument structs, kernel object, family), and
the one place they are registered with the engine (jit/family.py).

Importing flashjit imports this package, so every family is registered before any spec is built.
"""

from ..jit.family import register_family
from .decode.family import DECODE
from .merge_states.family import MERGE_STATES
from .mla.family import MLA

register_family(DECODE)
register_family(MLA)
register_family(MERGE_STATES)
