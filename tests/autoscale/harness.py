"""The real operator for the autoscaling integration tests, with short autoscaling rounds."""

from __future__ import annotations

import contextlib
from typing import Any

from emulated import running_operator as _running_operator


def running_operator(autoscale_seconds: float = 1.0) -> contextlib.AbstractAsyncContextManager[Any]:
    return _running_operator(autoscale_seconds=autoscale_seconds, scrape_timeout_seconds=1.0)
