"""The module-shared real servers of the router tests (helpers: tests/support/router_harness.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from support.router_harness import KV_BLOCKS, ServerProcess, start_servers, stop_servers


@pytest.fixture(scope="module")
def servers(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServerProcess]]:
    started = start_servers(
        tiny_llama_dir, 3, tmp_path_factory.mktemp("servers"), "--num-kv-blocks", str(KV_BLOCKS)
    )
    yield started
    stop_servers(started)
