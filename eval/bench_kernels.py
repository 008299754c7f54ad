"""Old name of `fc_hf.eval.bench.kernels`, kept only while `tests/test_kernels.py` imports it by this name.

Importing this module gives the real one (the same module object); delete this file once that test
imports `fc_hf.eval.bench.kernels`.
"""

import sys

from .bench import kernels as _kernels

sys.modules[__name__] = _kernels
