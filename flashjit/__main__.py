"""`python -m flashjit`: the flashjit command."""

import sys

from .deploy.cli import main

sys.exit(main())
