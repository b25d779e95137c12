"""Where inflight keeps what it makes once and reuses: built-in models, compiled CPU kernels, calibrations."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "INFLIGHT_CACHE_DIR"


def cache_dir() -> Path:
    """$INFLIGHT_CACHE_DIR, else ~/.cache/inflight."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "inflight")
