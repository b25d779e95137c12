"""In one process, a model's decode step with the C kernels of another commit against this checkout's:
both libraries loaded, the engine's library swapped between them every ROUND_TOKENS tokens for ROUNDS
rounds, in an order reversed every round (benchmarks/step_timing.py), so the machine's drift falls on
both alike; prints each one's median decode step (steps with all ROWS sequences decoding) and whether
both generated the same greedy tokens. Python code is this
checkout's for both: only engine/cpu's C files (kernels.c, quant_kernels.c, decode_layer.c and their
headers) come from REV.

    flock /tmp/bench.lock env PYTHONPATH=. .venv/bin/python benchmarks/kernels_ab.py \\
        MODEL ROWS REV [DTYPE]

MODEL: a GGUF file, `builtin:smollm2` or `builtin:llama-1b`; ROWS: sequences decoding together; REV: a git
revision; DTYPE: bfloat16 (default) or float32 (a GGUF file's weights stay quantized).
REV's C files must export every function this checkout's Python calls (kernels.SIGNATURES): since
`1c57be7` that includes `decode_layers`, so earlier revisions are refused; and since `d455b02` decode_layers
reads the step's positions and the model's tables (struct decode_step), so revisions before it are refused
too.
The OpenMP spin count is the engine's (inflight/engine/cpu/openmp.py), set before torch loads.
"""

from __future__ import annotations

import ctypes
import functools
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from inflight.engine.cpu import openmp

# The engine's OpenMP spin count, set as the `inflight` command sets it, before torch loads OpenMP.
openmp.configure(os.environ)

import torch  # noqa: E402

from benchmarks.step_timing import ROUND_TOKENS, ROUNDS, alternate  # noqa: E402
from inflight.checkpoints.resolve import resolve_model  # noqa: E402
from inflight.engine.cpu import kernels  # noqa: E402
from inflight.engine.llm import LLM  # noqa: E402


def library_at(rev: str, folder: Path) -> ctypes.CDLL:
    """The kernels built from `rev`'s engine/cpu C files (written into `folder`)."""
    cpu = kernels.SOURCE.parent
    root = Path(
        subprocess.run(
            ["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True, cwd=cpu
        ).stdout.strip()
    )
    relative = cpu.relative_to(root)
    listed = subprocess.run(
        ["git", "ls-tree", "--name-only", rev, f"{relative}/"],
        capture_output=True,
        text=True,
        check=True,
        cwd=root,
    ).stdout.split()
    sources = folder / "src"
    sources.mkdir()
    for name in listed:
        if name.endswith((".c", ".h")):
            text = subprocess.run(["git", "show", f"{rev}:{name}"], capture_output=True, check=True, cwd=root)
            if name.endswith("decode_layer.c") and b"positions_held" not in text.stdout:
                raise SystemExit(
                    f"{rev}'s decode_layers reads an older struct decode_step (the rows' rotary values, not "
                    "their positions) than this checkout's Python writes: compare against d455b02 or later"
                )
            (sources / Path(name).name).write_bytes(text.stdout)
    built = kernels.build_library(out_dir=folder / "build", source_dir=sources)
    try:
        return kernels.load_library(built)
    except AttributeError as error:  # a function this checkout's Python calls (kernels.SIGNATURES)
        raise SystemExit(
            f"{rev}'s kernels lack a function this checkout calls ({error}): compare against a revision "
            "whose C files export every function in kernels.SIGNATURES"
        ) from None


def use_library(library: ctypes.CDLL) -> None:
    """Make the engine call `library`'s kernels from its next step on."""
    kernels._LIBRARY.library = library


def main() -> None:
    path = resolve_model(sys.argv[1])
    rows = int(sys.argv[2])
    rev = sys.argv[3]
    dtype = sys.argv[4] if len(sys.argv) > 4 else "bfloat16"
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        old = library_at(rev, Path(tmp))
        llm = LLM(path, max_slots=rows, dtype=dtype)
        current = kernels.library()
        assert current is not None, kernels.unavailable_reason()
        libraries = {rev: old, "this checkout": current}
        load_before = os.getloadavg()[0]
        result = alternate(
            llm,
            rows,
            {name: functools.partial(use_library, library) for name, library in libraries.items()},
        )
        use_library(current)
    print(
        f"{path.name} {dtype} rows={rows}, {ROUNDS} rounds of {ROUND_TOKENS} tokens alternated, "
        f"same tokens: {result.same_tokens}, load average {load_before:.2f}-{os.getloadavg()[0]:.2f}"
    )
    for name, seconds in result.seconds.items():
        median = statistics.median(seconds) * 1e3
        print(f"  {name}: median decode step {median:.2f} ms over {len(seconds)} steps")


if __name__ == "__main__":
    main()
