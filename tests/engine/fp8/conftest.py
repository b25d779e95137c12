"""Run the Triton kernels through Triton's interpreter on CPU tensors.

TRITON_INTERPRET must be set before the kernels are decorated (at import of triton_kernels); a module
imported earlier without it is reloaded.
"""

from __future__ import annotations

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

_KERNELS = "inflight.engine.fp8.triton_kernels"
if _KERNELS in sys.modules:
    importlib.reload(sys.modules[_KERNELS])
