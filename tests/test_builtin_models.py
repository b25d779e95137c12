"""builtin:NAME models are built once per cache dir: concurrent starts on a fresh cache dir both get the
finished model, and temporary folders left by a killed build are cleaned up."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from inflight.cache import CACHE_ENV
from inflight.checkpoints.builtin import BuiltinModelError, build_once, builtin_model_path

RESOLVE = "from inflight.checkpoints.resolve import resolve_model; print(resolve_model('builtin:tiny'))"


def test_two_processes_resolving_at_once_on_a_fresh_cache_both_succeed(tmp_path: Path) -> None:
    env = {**os.environ, CACHE_ENV: str(tmp_path)}
    starts = [
        subprocess.Popen(
            [sys.executable, "-c", RESOLVE],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [process.communicate(timeout=240) for process in starts]
    paths = [out.strip() for out, _ in outputs]
    assert [process.returncode for process in starts] == [0, 0]
    assert paths[0] == paths[1] == str(tmp_path / "models" / "tiny-llama")
    messages = "".join(err for _, err in outputs)
    # The builder names the model where it ends up, never the temporary folder it was written in.
    assert f"ready: {paths[0]}\n" in messages and ".tmp-" not in messages, messages
    from inflight.engine.model.config import ModelConfig

    assert ModelConfig.from_dir(paths[0]).num_hidden_layers > 0
    assert not list((tmp_path / "models").glob(".tmp-*")), "no temporary folder left behind"


def test_a_stale_temp_folder_is_removed_and_a_finished_model_is_reused(tmp_path: Path) -> None:
    stale = tmp_path / "models" / ".tmp-demo-killed123"
    (stale / "demo").mkdir(parents=True)
    (stale / "demo" / "half-written").write_text("x")
    builds: list[Path] = []

    def build(out: Path) -> None:
        builds.append(out)
        out.mkdir()
        (out / "weights").write_text("done")

    final = build_once(tmp_path / "models" / "demo", build, progress=lambda _: None)
    assert (final / "weights").read_text() == "done"
    assert not stale.exists()
    build_once(final, build, progress=lambda _: None)
    assert len(builds) == 1


def test_a_failed_build_leaves_no_model_and_no_temp_folder(tmp_path: Path) -> None:
    def build(out: Path) -> None:
        out.mkdir()
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        build_once(tmp_path / "models" / "demo", build, progress=lambda _: None)
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [".build.lock"]


def test_an_unknown_name_lists_the_builtin_models(tmp_path: Path) -> None:
    with pytest.raises(BuiltinModelError, match=r"builtin:nope.*builtin:tiny.*builtin:smollm2"):
        builtin_model_path("builtin:nope", root=tmp_path)
