"""Operator tests: the shared helpers (CRD checks, the kmock adapter) live next to the tests."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
