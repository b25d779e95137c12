"""Autoscaling tests reuse the operator tests' emulator helpers (`emulated`, `kube_emulator`)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "operator"))
