"""Import paths: the operator tests' emulator helpers (`emulated`, `kube_emulator`) and our `harness`."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "operator"))
sys.path.insert(0, str(Path(__file__).parent))
