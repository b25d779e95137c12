"""Run the Triton kernels through Triton's interpreter on CPU tensors.

TRITON_INTERPRET must be set before the kernels are decorated (at import of triton_kernels); a module
imported earlier without it is reloaded.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).parent))  # the tests import the shared helpers in paged_cases.py

_KERNELS = "inflight.engine.attention.triton_kernels"
if _KERNELS in sys.modules:
    importlib.reload(sys.modules[_KERNELS])
