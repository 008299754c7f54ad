"""`python -m fc_hf.eval.bench ...` is `flexicache bench ...` (and runs the suites' subprocess workers)."""

import sys

from .cli import main

sys.exit(main())
