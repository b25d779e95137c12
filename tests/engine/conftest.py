"""Engine tests run torch single-threaded: on a shared, busy 2-core machine OpenMP threads that spin
waiting for each other make tiny-model steps 10x slower, and one thread is plenty for these shapes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True, scope="module")
def _single_torch_thread() -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
