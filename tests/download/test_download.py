"""`inflight download` against a fake Hub over real HTTP: what is fetched, resume, checks, exit codes."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from inflight.cli import main
from inflight.download.errors import ExitCode
from inflight.download.progress import parse_progress

from support.fake_hub import FakeHub, Repo, serve_hub

REPO_ROOT = Path(__file__).resolve().parents[2]
SHARD_1 = "model-00001-of-00002.safetensors"
SHARD_2 = "model-00002-of-00002.safetensors"
NEEDED = {
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "model.safetensors.index.json",
    SHARD_1,
    SHARD_2,
}


def checkpoint() -> dict[str, bytes]:
    """A made checkpoint: what the engine needs plus files it must not fetch."""
    rng = random.Random(0)
    index = {"metadata": {}, "weight_map": {"a.weight": SHARD_1, "b.weight": SHARD_2, "c.weight": SHARD_2}}
    return {
        "config.json": json.dumps({"model_type": "llama", "num_hidden_layers": 2}).encode(),
        "generation_config.json": b'{"do_sample": false}',
        "tokenizer.json": json.dumps({"model": {"type": "BPE", "vocab": {"a": 0}}}).encode(),
        "tokenizer_config.json": b'{"chat_template": "{{ messages }}"}',
        "model.safetensors.index.json": json.dumps(index).encode(),
        SHARD_1: rng.randbytes(3 << 20),
        SHARD_2: rng.randbytes(1 << 20),
        "consolidated.safetensors": rng.randbytes(1 << 20),  # not in the index: not fetched
        "pytorch_model.bin": b"pickle",
        "README.md": b"# a model",
        "onnx/model.onnx": b"onnx",
    }


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    fake = FakeHub()
    files = checkpoint()
    fake.repos["org/model"] = Repo(files)
    fake.repos["org/gated"] = Repo(files, token="good-token")
    fake.repos["org/corrupt"] = Repo(files, wrong_sha256={SHARD_2})
    fake.repos["org/gguf"] = Repo(
        {"m.Q4_1.gguf": b"GGUF" + bytes(1000), "m.Q8_0.gguf": b"GGUF" + bytes(2000)}
    )
    with serve_hub(fake):
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
        yield fake


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["download", *args, "--progress-interval", "0"])
    out, err = capsys.readouterr()
    return code, out, err


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def assert_complete(dest: Path) -> None:
    files = checkpoint()
    assert {p.name for p in dest.iterdir()} == NEEDED | {".inflight-download.json"}
    for name in NEEDED:
        assert sha((dest / name).read_bytes()) == sha(files[name]), name


def test_full_download_fetches_only_what_the_engine_needs(
    hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "hf://org/model", str(tmp_path / "m"))
    assert (code, err) == (0, "")
    assert_complete(tmp_path / "m")
    total = sum(len(checkpoint()[n]) for n in NEEDED)
    progress = [parse_progress(line) for line in out.splitlines() if line.startswith("progress ")]
    assert progress[-1] == (total, total)
    done = [p[0] for p in progress if p is not None]
    assert done == sorted(done) and all(p is not None and p[1] == total for p in progress)
    assert f"file {SHARD_1} {3 << 20} bytes sha256 ok" in out
    assert "file config.json" in out and "git blob id ok" in out
    assert {name for name, _ in hub.requests} == NEEDED  # not the .bin, README, onnx, consolidated

    hub.requests.clear()  # a second run (a restarted Job) finds the marker and fetches nothing
    code, out, _ = run(capsys, "hf://org/model", str(tmp_path / "m"))
    assert code == 0 and "already complete" in out and hub.requests == []


def test_a_dropped_connection_resumes_with_a_range_request(
    hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hub.drop_once[SHARD_1] = 1_000_000
    code, out, _ = run(capsys, "hf://org/model", str(tmp_path / "m"))
    assert code == 0
    assert hub.ranges(SHARD_1) == [None, "bytes=1000000-"]
    assert "retry 1/5" in out
    assert_complete(tmp_path / "m")


def test_a_server_without_range_support_restarts_the_file(
    hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hub.ignore_range = True
    hub.drop_once[SHARD_1] = 1_000_000
    code, out, _ = run(capsys, "hf://org/model", str(tmp_path / "m"))
    assert code == 0 and hub.ranges(SHARD_1) == [None, "bytes=1000000-"]  # asked, got the whole file
    assert_complete(tmp_path / "m")
    total = sum(len(checkpoint()[n]) for n in NEEDED)
    assert parse_progress(out) == (total, total)  # the restarted bytes are not counted twice


def test_a_killed_download_resumes_on_the_next_run(hub: FakeHub, tmp_path: Path) -> None:
    dest = tmp_path / "m"
    hub.block_at = (SHARD_1, 1_500_000)  # the server sends 1.5 MB of 3 MiB, then stalls
    env = {**os.environ, "HF_ENDPOINT": hub.url, "PYTHONPATH": str(REPO_ROOT)}
    command = [sys.executable, "-m", "inflight.cli", "download", "hf://org/model", str(dest)]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    part = dest / f"{SHARD_1}.part"
    deadline = time.monotonic() + 60
    while not (part.exists() and part.stat().st_size == 1_500_000):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait(60)
    assert not (dest / SHARD_1).exists() and not (dest / ".inflight-download.json").exists()
    hub.block_at = None
    hub.release.set()

    second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr
    assert f"resuming {SHARD_1} at byte 1500000" in second.stdout
    assert hub.ranges(SHARD_1)[-1] == "bytes=1500000-"
    assert_complete(dest)


def test_gated_repo_needs_a_token(
    hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, _, err = run(capsys, "hf://org/gated", str(tmp_path / "m"))
    assert code == ExitCode.AUTH == 3
    assert "authentication (exit 3)" in err and "HTTP 401" in err and "set HF_TOKEN or --token-file" in err
    monkeypatch.setenv("HF_TOKEN", "wrong")
    code, _, err = run(capsys, "hf://org/gated", str(tmp_path / "m"))
    assert code == 3 and "the token was rejected" in err
    token = tmp_path / "token"
    token.write_text("good-token\n")
    code, _, err = run(capsys, "hf://org/gated", str(tmp_path / "m"), "--token-file", str(token))
    assert (code, err) == (0, "")
    assert_complete(tmp_path / "m")


def test_not_found(hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "hf://org/nothing", str(tmp_path / "m"))
    assert code == ExitCode.NOT_FOUND == 4
    assert "not found (exit 4)" in err and "HTTP 404" in err and "RepoNotFound" in err
    code, _, err = run(capsys, "hf://org/model", str(tmp_path / "m"), "--revision", "v9")
    assert code == 4 and "RevisionNotFound" in err
    code, _, err = run(capsys, "hf://org/gguf/m.Q2_K.gguf", str(tmp_path / "g"))
    assert code == 4 and "'m.Q2_K.gguf'" in err and "m.Q4_1.gguf" in err


def test_checksum_mismatch_deletes_the_bad_file(
    hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "m"
    code, _, err = run(capsys, "hf://org/corrupt", str(dest))
    assert code == ExitCode.CHECKSUM == 6
    assert f"checksum (exit 6): {SHARD_2} is corrupt: sha256 {sha(checkpoint()[SHARD_2])}" in err
    assert not (dest / SHARD_2).exists() and not (dest / f"{SHARD_2}.part").exists()
    assert not (dest / ".inflight-download.json").exists()


def test_one_gguf_file(hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, _ = run(capsys, "hf://org/gguf/m.Q4_1.gguf", str(tmp_path / "g"))
    assert code == 0
    assert {p.name for p in (tmp_path / "g").iterdir()} == {"m.Q4_1.gguf", ".inflight-download.json"}
    code, _, err = run(capsys, "hf://org/gguf", str(tmp_path / "h"))
    assert code == ExitCode.USAGE and "GGUF files only" in err and "m.Q8_0.gguf" in err


def test_network_failure_and_disk_full(
    hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    hub.always_fail = 503
    code, _, err = run(capsys, "hf://org/model", str(tmp_path / "m"), "--retries", "1")
    assert code == ExitCode.NETWORK == 7 and "HTTP 503" in err and "gave up after 1 retries" in err
    hub.always_fail = None

    import shutil

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1 << 20))
    code, _, err = run(capsys, "hf://org/model", str(tmp_path / "m"))
    assert code == ExitCode.DISK_FULL == 5 and "1.0 MiB free but the download needs 4.0 MiB more" in err


def test_bad_sources(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "gs://bucket/x", str(tmp_path))
    assert code == ExitCode.USAGE and "expected an hf:// or s3:// source" in err
    code, _, err = run(capsys, "hf://a/b/c", str(tmp_path))
    assert code == ExitCode.USAGE and "hf://ORG/REPO" in err


def test_every_exit_code_is_documented(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["download", "--help"])
    help_text = capsys.readouterr().out
    docs = (REPO_ROOT / "docs" / "model-cache.md").read_text()
    for code in ExitCode:
        assert f"\n  {int(code)}  " in help_text and f"\n| {int(code)} | " in docs, code
