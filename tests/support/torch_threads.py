"""One torch intra-op thread while a test module runs, restored afterwards for other test areas.

On a busy 2-core machine OpenMP threads that spin waiting for each other make a tiny model's step 10-20x
slower, and one thread is plenty for these shapes (tensor-parallel workers use one each too). A
conftest turns it on for its directory by importing it: `from support.torch_threads import one_torch_thread`.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
