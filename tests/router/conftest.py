"""Import paths (`router_harness`, the operator tests' emulator helpers); the module-shared real servers."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "operator"))
sys.path.insert(0, str(Path(__file__).parent))

from router_harness import KV_BLOCKS, ServerProcess, start_servers, stop_servers


@pytest.fixture(scope="module")
def servers(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServerProcess]]:
    started = start_servers(
        tiny_llama_dir, 3, tmp_path_factory.mktemp("servers"), "--num-kv-blocks", str(KV_BLOCKS)
    )
    yield started
    stop_servers(started)
