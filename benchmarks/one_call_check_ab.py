"""One process, three engines on the same float weights, stepped in alternating blocks: the model code of
an earlier commit (its model/llama.py and model/decode_layer.py, read with `git show`), this checkout's,
and this checkout's with the layers' one-call forms never checked after the first step (the bound of what
checking them costs). The machine's speed moves by 25 % between minutes; alternating blocks of steps in
one process compares the three at the same minutes (#29, docs/benchmarks.md).

    flock /tmp/bench.lock env PYTHONPATH=. .venv/bin/python \\
        benchmarks/one_call_check_ab.py COMMIT ROWS TOKENS BLOCK ROUNDS [MODEL]

Each round adds ROWS requests (64-token prompts, TOKENS greedy tokens) to each engine, then steps them
BLOCK steps at a time in turn until all are done; the decode steps are timed (the prefill step and the
step that finishes the requests are left out). MODEL: `builtin:smollm2` (default, `--quantization none`)
or a GGUF file; bfloat16, 2 torch threads, 64 slots. The engines' greedy tokens must agree.
All three use this checkout's C kernels, so COMMIT must be `d455b02` or later: before `1c57be7`, the model
code called `decode_layer` (one layer a call), which the kernels no longer export, and before `d455b02` it
wrote an older struct decode_step (the rows' rotary values, not their positions) than the kernels read.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

from inflight.engine.cpu import openmp

# The engine's OpenMP spin count, set as the `inflight` command sets it, before torch loads OpenMP.
openmp.configure(os.environ)

import torch  # noqa: E402

from inflight.checkpoints.resolve import resolve_model  # noqa: E402
from inflight.engine.config import EngineConfig  # noqa: E402
from inflight.engine.engine import LLMEngine  # noqa: E402
from inflight.engine.model.decode_layer import Links  # noqa: E402
from inflight.engine.sequence import SamplingParams  # noqa: E402


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _old_model_code(commit: str, folder: Path) -> ModuleType:
    """`commit`'s model/llama.py, importing `commit`'s model/decode_layer.py."""
    files = {}
    for name in ("decode_layer", "llama"):
        source = subprocess.run(
            ["git", "show", f"{commit}:inflight/engine/model/{name}.py"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        if name == "decode_layer" and ".decode_layer(" in source:
            raise SystemExit(
                f"{commit}'s model code calls decode_layer, which this checkout's kernels replaced with "
                "decode_layers (one call a run of layers) at 1c57be7: compare against d455b02 or later"
            )
        if name == "decode_layer" and "positions_held" not in source:
            raise SystemExit(
                f"{commit}'s model code writes an older struct decode_step (the rows' rotary values, not "
                "their positions) than this checkout's kernels read: compare against d455b02 or later"
            )
        files[name] = source.replace(
            "from inflight.engine.model.decode_layer import", "from old_decode_layer import"
        )
        (folder / f"old_{name}.py").write_text(files[name])
    _load("old_decode_layer", folder / "old_decode_layer.py")
    return _load("old_llama", folder / "old_llama.py")


def main() -> None:
    commit, (rows, tokens, block, rounds) = sys.argv[1], (int(a) for a in sys.argv[2:6])
    model = sys.argv[6] if len(sys.argv) > 6 else "builtin:smollm2"
    torch.set_num_threads(2)
    config = EngineConfig(dtype="bfloat16", device="cpu", quantization="none", max_num_seqs=64)
    with tempfile.TemporaryDirectory() as folder:
        old = _old_model_code(commit, Path(folder))
    engines = {name: LLMEngine(resolve_model(model), config) for name in ("old", "new", "bound")}
    old_model = engines["old"].model
    old_model.__class__ = old.LlamaForCausalLM
    for layer in old_model.layers:
        layer.__class__ = old.DecoderLayer
        layer._fused = None
    bound = engines["bound"].model
    nothing = Links.of((), ())
    kept = dataclasses.replace(bound._one_call_plan(), head=nothing, rest=nothing)
    bound._one_call_plan = lambda: kept  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, dict[str, list[int]]] = {name: {} for name in engines}
    for r in range(rounds):
        for engine in engines.values():
            for i in range(rows):
                prompt = [1 + i, 100 + i, 200, 300, 400, 500, 600, 700] * 8
                engine.add_request(f"{r}-{i}", prompt, params)
            engine.step()
        while any(engine.has_unfinished_requests() for engine in engines.values()):
            for name, engine in engines.items():
                for _ in range(block):
                    if not engine.has_unfinished_requests():
                        break
                    started = time.perf_counter()
                    finished = [out for out in engine.step() if out.finished]
                    if not finished:
                        seconds[name].append(time.perf_counter() - started)
                    for out in finished:
                        outputs[name][out.request_id] = list(out.outputs[0].token_ids)
    for name, times in seconds.items():
        times.sort()
        print(
            f"{name:5s} {rows} rows: median step {statistics.median(times) * 1e3:.2f} ms, "
            f"mean {statistics.fmean(times) * 1e3:.2f}, 10th percentile {times[len(times) // 10] * 1e3:.2f} "
            f"({len(times)} steps)"
        )
    print("greedy tokens agree:", outputs["old"] == outputs["new"] == outputs["bound"])


if __name__ == "__main__":
    main()
