"""What one engine step costs on the virtual clock: a fixed part plus a part per token in the step.

The fixed part is what a step costs however few tokens it carries (reading every weight once, kernel
launches, Python); the per-token part is the marginal cost of one more token (prefill chunks carry
many). `inflight demo --calibrate` fits both by least squares from timed steps of the real engine.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field


class CostModel(BaseModel):
    model_config = ConfigDict(frozen=True)

    fixed_s: float = Field(ge=0.0, description="seconds per step, whatever it carries")
    per_token_s: float = Field(ge=0.0, description="seconds per token scheduled in the step")
    source: str = Field(description="where the figures come from")

    def step_seconds(self, num_tokens: int) -> float:
        return self.fixed_s + self.per_token_s * num_tokens


# Illustrative figures of a 7-8B model on one data-centre GPU: a decode step is bound by reading
# the weights (~15 ms), and each token in the step adds ~0.1 ms of compute (prefill-heavy steps).
DEFAULT_COST_MODEL = CostModel(
    fixed_s=0.015,
    per_token_s=0.0001,
    source="built-in default, an 8B-class model on one GPU",
)


def fit_cost_model(samples: Sequence[tuple[int, float]], source: str) -> CostModel:
    """Least-squares fit of seconds = fixed + per_token * tokens over (tokens, seconds) samples.

    Negative coefficients (noise on a flat curve) are clamped to zero and the other refitted.
    """
    if len(samples) < 2:
        raise ValueError(f"need at least 2 timed steps to fit a cost model, got {len(samples)}")
    n = float(len(samples))
    mean_x = sum(tokens for tokens, _ in samples) / n
    mean_y = sum(seconds for _, seconds in samples) / n
    var_x = sum((tokens - mean_x) ** 2 for tokens, _ in samples)
    if var_x == 0:
        raise ValueError("all timed steps carried the same number of tokens; cannot separate the parts")
    cov = sum((tokens - mean_x) * (seconds - mean_y) for tokens, seconds in samples)
    per_token = cov / var_x
    fixed = mean_y - per_token * mean_x
    if per_token < 0:
        per_token, fixed = 0.0, mean_y
    if fixed < 0:
        fixed = 0.0
        per_token = sum(t * s for t, s in samples) / sum(t * t for t, _ in samples)
    return CostModel(fixed_s=fixed, per_token_s=per_token, source=source)


def save_cost_model(model: CostModel, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(model.model_dump_json(indent=2) + "\n")


def load_cost_model(path: Path) -> CostModel | None:
    """The calibrated cost model saved at `path`, or None when there is none (or it is unreadable)."""
    try:
        return CostModel.model_validate(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None
