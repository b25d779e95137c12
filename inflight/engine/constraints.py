"""Which tokens a row may draw: the per-request limits applied to a step's logits before sampling.

A row is touched only when its request carries a limit (`min_tokens` not reached yet); every other row
keeps its logits bit for bit, so unconstrained requests draw exactly the tokens they drew without this
step. A forbidden token's logit becomes -inf, so reported logprobs are those of the allowed tokens.
"""

from __future__ import annotations

import torch

from inflight.engine.sampler import SamplingRow


def banned_tokens(row: SamplingRow) -> list[int]:
    """Tokens that would end the sequence before its `min_tokens` (EOS unless ignored, stop token ids)."""
    params = row.params
    if row.output_position >= params.min_tokens:
        return []
    eos = [] if params.ignore_eos else sorted(row.eos_token_ids)
    return [*eos, *(params.stop_token_ids or [])]


def constrain(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """`logits` [len(rows), vocab] with each row's forbidden tokens at -inf (the same tensor when no row
    has a limit)."""
    bans = [(i, banned) for i, row in enumerate(rows) if (banned := banned_tokens(row))]
    if not bans:
        return logits
    logits = logits.clone()
    for i, banned in bans:
        logits[i, torch.tensor(banned, dtype=torch.long, device=logits.device)] = float("-inf")
    return logits
