"""`python -m flashjit`: the flashjit command."""

import sys

from .cli import main

sys.exit(main())
