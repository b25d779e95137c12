"""One 2048-token prefill step (16 prompts of 128 tokens, one output token each) of a model with float
weights, the MLP whole against in row blocks (`MLP_BLOCK_BYTES`, engine/model/llama.py), alternating
in one process; prints each setting's median step.

    PYTHONPATH=. .venv/bin/python benchmarks/prefill_step.py builtin:llama-1b bfloat16 [5]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from inflight.engine.cpu import openmp

# The engine's OpenMP spin count, set as the `inflight` command sets it, before torch loads OpenMP.
openmp.configure(os.environ)

import torch  # noqa: E402

from inflight.checkpoints.resolve import resolve_model  # noqa: E402
from inflight.engine.config import EngineConfig  # noqa: E402
from inflight.engine.engine import LLMEngine  # noqa: E402
from inflight.engine.model import llama  # noqa: E402
from inflight.engine.sequence import SamplingParams  # noqa: E402

SETTINGS = {"whole": 2**62, "row blocks": llama.MLP_BLOCK_BYTES}


def main() -> None:
    model, dtype = sys.argv[1], sys.argv[2]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    torch.set_num_threads(2)
    config = EngineConfig(
        dtype=dtype, device="cpu", quantization="none", max_num_seqs=64, enable_prefix_caching=False
    )
    engine = LLMEngine(resolve_model(model), config)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    seconds: dict[str, list[float]] = {name: [] for name in SETTINGS}
    outputs: dict[str, list[list[int]]] = {}
    for round_ in range(rounds + 1):
        for name, block_bytes in SETTINGS.items():
            llama.MLP_BLOCK_BYTES = block_bytes
            for i in range(16):
                engine.add_request(
                    f"{round_}-{name}-{i}", [(7 * i + j) % 1000 + 10 for j in range(128)], params
                )
            started = time.perf_counter()
            finished = []
            while engine.has_unfinished_requests():
                finished.extend(engine.step())
            if round_:  # the first round builds oneDNN's primitives for these shapes
                seconds[name].append(time.perf_counter() - started)
            done = sorted(
                (o for o in finished if o.finished), key=lambda o: int(o.request_id.rsplit("-", 1)[1])
            )
            outputs[name] = [list(o.outputs[0].token_ids) for o in done]
    for name, times in seconds.items():
        print(f"{model} {dtype} {name}: median {statistics.median(times) * 1e3:.1f} ms ({len(times)} steps)")
    print("same tokens:", outputs["whole"] == outputs["row blocks"])


if __name__ == "__main__":
    main()
