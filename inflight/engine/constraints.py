"""Which tokens a row may draw: the per-request limits applied to a step's logits before sampling.

Limits: a grammar (`SamplingParams.guided`, masks from `engine/guided.py`), `allowed_token_ids`,
`logit_bias`, and `min_tokens` (EOS and stop token ids are not drawn before it). `start()` runs before
the forward pass and begins the grammar masks on a worker thread (llguidance computes them without the
GIL, packed 32 tokens to an int32 word); `apply()` waits for them and limits the logits in place, the
grammar rows in one pass over the packed words (a C kernel on CPU). A row is touched only when its
request carries a limit: every other row keeps its logits bit for bit, so unconstrained requests draw
exactly the tokens they drew without this step. A forbidden token's logit is -inf, so reported logprobs
are those of the constrained distribution.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from inflight.engine.errors import ConstraintFailure
from inflight.engine.guided import GrammarMatchers, apply_token_bitmask
from inflight.engine.sampler import SamplingRow
from inflight.engine.sequence import GuidedDecoding


def banned_tokens(row: SamplingRow) -> list[int]:
    """Tokens that would end the sequence before its `min_tokens` (EOS unless ignored, stop token ids)."""
    params = row.params
    if row.output_position >= params.min_tokens:
        return []
    eos = [] if params.ignore_eos else sorted(row.eos_token_ids)
    return [*eos, *(params.stop_token_ids or [])]


def has_token_limits(row: SamplingRow) -> bool:
    """Whether the row has a limit other than a grammar (`allowed_token_ids`, `logit_bias`, `min_tokens`)."""
    params = row.params
    return bool(
        params.logit_bias or params.allowed_token_ids is not None or row.output_position < params.min_tokens
    )


@dataclass
class GrammarMasks:
    """A step's grammar masks: bitmask row k (int32 words, engine/guided.py) is for step row rows[k]."""

    rows: list[int]
    bitmask: torch.Tensor
    # Step rows that cannot draw (their grammar failed or allows no token), with why.
    failed: dict[int, str]


@dataclass
class PendingLimits:
    """One step's limits, its grammar masks possibly still being computed."""

    rows: list[SamplingRow]
    masks: Future[GrammarMasks] | None

    def apply(self, logits: torch.Tensor) -> tuple[torch.Tensor, dict[int, str]]:
        """Limit `logits` [len(rows), vocab] in place (rows without a limit are left as they are) and
        return them, with the rows that cannot draw at all and why (their grammar failed, or no token is
        left)."""
        failed: dict[int, str] = {}
        if self.masks is not None:
            masks = self.masks.result()
            apply_token_bitmask(logits, masks.rows, masks.bitmask)
            failed.update(masks.failed)
        limited = [i for i, row in enumerate(self.rows) if has_token_limits(row)]
        if not limited:
            return logits, failed
        device = logits.device
        for i in limited:
            params = self.rows[i].params
            if params.allowed_token_ids is not None:
                keep = torch.tensor(params.allowed_token_ids, dtype=torch.long, device=device)
                outside = torch.ones(logits.shape[1], dtype=torch.bool, device=device)
                outside[keep] = False
                logits[i].masked_fill_(outside, float("-inf"))
            if params.logit_bias:
                ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=device)
                bias = torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype, device=device)
                logits[i].index_add_(0, ids, bias)
            banned = banned_tokens(self.rows[i])
            if banned:
                logits[i, torch.tensor(banned, dtype=torch.long, device=device)] = float("-inf")
        # A grammar row alone was checked on its bitmask; these may have lost their last tokens here.
        alive = [i for i in limited if i not in failed]
        if alive:
            index = torch.tensor(alive, dtype=torch.long, device=device)
            for i, dead in zip(alive, torch.isneginf(logits[index]).all(dim=1).tolist(), strict=True):
                if dead:
                    failed[i] = ConstraintFailure(
                        "no token may be drawn (its grammar, allowed_token_ids and min_tokens exclude all)"
                    )
        return logits, failed


class TokenConstraints:
    """Starts each step's limits (grammar masks on a worker thread, overlapping the forward pass)."""

    def __init__(self, grammars: GrammarMatchers) -> None:
        self.grammars = grammars
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="inflight-masks")

    def start(self, rows: list[SamplingRow]) -> PendingLimits:
        """Called before the forward pass, with the rows it will sample."""
        guided: list[int] = []
        specs: list[tuple[str, int, GuidedDecoding, list[int]]] = []
        for i, row in enumerate(rows):
            if row.params.guided is not None:
                guided.append(i)
                # A copy of the output so far: the engine thread appends to token_ids after sampling.
                output = row.token_ids[row.num_prompt_tokens :]
                specs.append((row.request_id, row.index, row.params.guided, output))
        masks = self._pool.submit(self._grammar_masks, specs, guided) if specs else None
        return PendingLimits(rows, masks)

    def _grammar_masks(
        self, specs: list[tuple[str, int, GuidedDecoding, list[int]]], guided: list[int]
    ) -> GrammarMasks:
        """On the mask thread: the packed masks of the step's grammar rows (`guided`), and which fail."""
        bitmask, failed = self.grammars.masks(specs)
        return GrammarMasks(guided, bitmask, {guided[k]: why for k, why in failed.items()})

    def release(self, request_id: str) -> None:
        self.grammars.release(request_id)

    def close(self) -> None:
        self._pool.shutdown(wait=False)
