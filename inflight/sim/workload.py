"""The demo's fixed workload: 30 requests, most with short outputs, a few very long ones.

The shape is what makes the point about batching: under static batching every batch waits for its
longest member, so a handful of long requests keeps the short ones' slots idle. The workload is
seeded (the same on every machine) and the long requests sit at evenly spread positions, so at the
demo's default of 8 slots every static batch holds one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

NUM_REQUESTS = 30
LONG_POSITIONS = (2, 7, 12, 17, 22, 27)
SHORT_OUTPUT_RANGE = (8, 32)
LONG_OUTPUT_RANGE = (150, 300)
PROMPT_RANGE = (16, 128)
# Token ids drawn from a range every byte-level vocabulary has, past the usual special tokens.
TOKEN_ID_RANGE = (16, 255)
DEFAULT_SEED = 0


@dataclass(frozen=True)
class DemoRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    # Predetermined output: the simulator "generates" exactly these; the real engine is asked for
    # len(output_token_ids) tokens with ignore_eos.
    output_token_ids: tuple[int, ...]
    long: bool

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_tokens(self) -> int:
        return len(self.output_token_ids)


def demo_workload(seed: int = DEFAULT_SEED) -> list[DemoRequest]:
    """The 30 demo requests, in arrival order (all arrive at t=0)."""
    rng = random.Random(seed)
    requests = []
    for index in range(NUM_REQUESTS):
        long = index in LONG_POSITIONS
        low, high = LONG_OUTPUT_RANGE if long else SHORT_OUTPUT_RANGE
        prompt_len = rng.randint(*PROMPT_RANGE)
        output_len = rng.randint(low, high)
        requests.append(
            DemoRequest(
                request_id=f"r{index:02d}",
                prompt_token_ids=tuple(rng.randint(*TOKEN_ID_RANGE) for _ in range(prompt_len)),
                output_token_ids=tuple(rng.randint(*TOKEN_ID_RANGE) for _ in range(output_len)),
                long=long,
            )
        )
    return requests


def small_workload(seed: int = DEFAULT_SEED) -> list[DemoRequest]:
    """A 6-request slice of the same shape (4 short, 2 long, outputs scaled down) for fast tests."""
    rng = random.Random(seed)
    requests = []
    for index in range(6):
        long = index in (1, 4)
        output_len = rng.randint(20, 30) if long else rng.randint(2, 8)
        prompt_len = rng.randint(5, 40)
        requests.append(
            DemoRequest(
                request_id=f"s{index}",
                prompt_token_ids=tuple(rng.randint(*TOKEN_ID_RANGE) for _ in range(prompt_len)),
                output_token_ids=tuple(rng.randint(*TOKEN_ID_RANGE) for _ in range(output_len)),
                long=long,
            )
        )
    return requests
