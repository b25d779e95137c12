"""llama.cpp as a benchmark-only tool (#29, #30): built from the source vendored in PyPI's llama-cpp-python
sdist, never a dependency of inflight. `build` downloads the pinned sdist into the cache
(inflight.cache.cache_dir()/llama-cpp/), unpacks it, and builds the CPU tools the benchmarks run
(llama-perplexity, llama-server, llama-quantize, llama-bench) with cmake; it skips what is already built.

    PYTHONPATH=. .venv/bin/python benchmarks/llama_cpp.py build [--jobs 2]
    PYTHONPATH=. .venv/bin/python benchmarks/llama_cpp.py path llama-server   # prints the binary's path
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from inflight.cache import cache_dir

SDIST_VERSION = "0.3.36"
TARGETS = ("llama-perplexity", "llama-server", "llama-quantize", "llama-bench", "llama-tokenize")


def root() -> Path:
    return cache_dir() / "llama-cpp" / SDIST_VERSION


def build_dir() -> Path:
    return root() / "build"


def binary(name: str) -> Path:
    """The built tool `name` (one of TARGETS); says how to build it when it is missing."""
    path = build_dir() / "bin" / name
    if not path.is_file():
        raise SystemExit(f"{path} is missing: run `make llama-cpp` (benchmarks/llama_cpp.py build) first")
    return path


def step(message: str) -> None:
    print(f"llama.cpp: {message}", flush=True)


def tool(name: str) -> str:
    """cmake/ninja from PATH, else from this interpreter's environment (pip-installed on demand)."""
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found:
        return found
    step(f"{name} not found: pip install {name}")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", name], check=True)
    found = shutil.which(name, path=str(Path(sys.executable).parent))
    if not found:
        raise SystemExit(f"pip installed {name} but {name} is not in {Path(sys.executable).parent}")
    return found


def source_dir() -> Path:
    """vendor/llama.cpp of the unpacked sdist, downloading and unpacking it once."""
    unpacked = root() / f"llama_cpp_python-{SDIST_VERSION}"
    source = unpacked / "vendor" / "llama.cpp"
    if source.is_dir():
        return source
    downloads = root() / "sdist"
    downloads.mkdir(parents=True, exist_ok=True)
    step(f"[1/3] downloading the llama-cpp-python {SDIST_VERSION} sdist")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(downloads),
         f"llama-cpp-python=={SDIST_VERSION}"],
        check=True,
    )  # fmt: skip
    (archive,) = downloads.glob("llama_cpp_python-*.tar.gz")
    step(f"unpacking {archive.name}")
    with tarfile.open(archive) as tar:
        tar.extractall(root(), filter="data")
    if not source.is_dir():
        raise SystemExit(f"{archive} has no vendor/llama.cpp: pin another SDIST_VERSION")
    return source


def build(jobs: int) -> None:
    if all((build_dir() / "bin" / name).is_file() for name in TARGETS):
        step(f"already built in {build_dir() / 'bin'}")
        return
    source = source_dir()
    cmake = tool("cmake")
    step("[2/3] configuring (CPU only, native instructions, Release)")
    subprocess.run(
        [cmake, "-S", str(source), "-B", str(build_dir()), "-G", "Ninja",
         f"-DCMAKE_MAKE_PROGRAM={tool('ninja')}", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
         "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF",
         "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON",
         "-DLLAMA_BUILD_SERVER=ON"],
        check=True,
    )  # fmt: skip
    step(f"[3/3] building {', '.join(TARGETS)} with {jobs} jobs (tens of minutes on 2 cores)")
    subprocess.run([cmake, "--build", str(build_dir()), "-j", str(jobs), "--target", *TARGETS], check=True)
    step(f"done: {build_dir() / 'bin'}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    build_parser = commands.add_parser(
        "build", help="download the sdist and build the tools (skips when built)"
    )
    build_parser.add_argument("--jobs", type=int, default=2)
    path_parser = commands.add_parser("path", help="print a built tool's path")
    path_parser.add_argument("name", choices=TARGETS)
    args = parser.parse_args()
    if args.command == "build":
        build(args.jobs)
    else:
        print(binary(args.name))


if __name__ == "__main__":
    main()
