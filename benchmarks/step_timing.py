"""Timing one engine's decode steps inside one process, shared by the A/B scripts: the same random prompts,
a timer on every step with all sequences decoding, and variants of the engine (a kernel library, a row
limit) alternated every ROUND_TOKENS tokens for ROUNDS rounds, so that the machine's drift falls on all
variants alike."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping

import torch

from inflight.engine.llm import LLM
from inflight.engine.sequence import SamplingParams

PROMPT_TOKENS = 64
ROUNDS = 8
ROUND_TOKENS = 32


def random_prompts(llm: LLM, rows: int) -> list[list[int]]:
    """`rows` prompts of PROMPT_TOKENS token ids drawn from `llm`'s vocabulary (seed 0, so every script
    and every run gets the same ones)."""
    gen = torch.Generator().manual_seed(0)
    vocab = llm.tokenizer.vocab_size
    return [torch.randint(100, vocab - 100, (PROMPT_TOKENS,), generator=gen).tolist() for _ in range(rows)]


def timed_steps(llm: LLM, rows: int) -> list[float]:
    """Wrap the engine's step to record the seconds of each step with all `rows` sequences running and
    none waiting (decode steps); returns the list it appends to."""
    engine = llm.engine
    step = engine.step
    times: list[float] = []

    def timed() -> list:  # type: ignore[type-arg]
        start = time.perf_counter()
        out = step()
        if len(engine.scheduler.running) == rows and not engine.scheduler.waiting:
            times.append(time.perf_counter() - start)
        return out

    engine.step = timed  # type: ignore[method-assign]
    return times


@dataclasses.dataclass(frozen=True)
class Alternated:
    """Each variant's decode-step seconds over the counted rounds, and whether all variants generated
    the same greedy tokens."""

    seconds: dict[str, list[float]]
    same_tokens: bool


def alternate(llm: LLM, rows: int, variants: Mapping[str, Callable[[], None]]) -> Alternated:
    """Generate ROUND_TOKENS greedy tokens for `rows` random prompts once per variant per round, after
    calling that variant's setter; the order reverses every round (no variant always runs first) and
    round 0 warms up uncounted."""
    prompts = random_prompts(llm, rows)
    params = SamplingParams(temperature=0.0, max_tokens=ROUND_TOKENS, ignore_eos=True)
    steps = timed_steps(llm, rows)
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    tokens: dict[str, list[list[int]]] = {}
    names = list(variants)
    for round_ in range(ROUNDS + 1):
        for name in names if round_ % 2 else names[::-1]:
            variants[name]()
            steps.clear()
            generated = llm.generate(prompts, params)
            if round_ > 0:
                seconds[name] += steps
                tokens[name] = [list(o.outputs[0].token_ids) for o in generated]
    return Alternated(seconds, len({repr(t) for t in tokens.values()}) == 1)
