"""Speculative decoding: what a proposer gives the scheduler, how many tokens a sequence may be proposed,
and the n-gram prompt-lookup proposer (no torch; the draft-model proposer is engine/draft.py).

A decoding sequence whose last n tokens (n from `ngram_max` down to `ngram_min`) occurred earlier in its
prompt + output proposes the up-to-k tokens that followed their latest earlier occurrence. The step then
computes the sequence's last token and the proposals together (one query of k + 1 tokens over the paged
KV cache, like a prefill chunk) and samples a token after each of them; the runner keeps the samples up to
and including the first one that differs from its proposal, the scheduler keeps the KV of the accepted
tokens and frees the blocks past them.

Each position's sample is drawn exactly as a step without proposals would draw it (same logits, same
penalties and limits, the seeded noise keyed by the output position), so greedy and seeded outputs are
identical to decoding without speculation. For a proposal (a point mass on one token t) this is
rejection sampling: t is accepted with probability p(t), and on rejection the emitted token is the
target's own draw conditioned on not being t, i.e. p with t removed and renormalized. A draft model's
sampled proposals carry the distributions q they were drawn from (`Proposal.probs`); those are verified
with the general rule instead (engine/rejection.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from inflight.engine.config import EngineConfig
from inflight.engine.sequence import Sequence

if TYPE_CHECKING:
    import torch


@dataclass
class Proposal:
    token_ids: list[int]
    # The distributions the tokens were drawn from (float32 [len(token_ids), vocab]), or None when each
    # token is a point mass (an n-gram lookup, or a draft model's greedy choice).
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    @property
    def max_running(self) -> int:
        """Speculation is off for a step in which more sequences than this run (the step's cost grows with
        its tokens once the batch is large, while proposals that miss are wasted work)."""
        ...

    def propose(self, seqs: list[Sequence], running: list[Sequence]) -> dict[str, Proposal]:
        """Proposals (by seq_id; none for a sequence that gets none) for `seqs`, decoding sequences about
        to compute their last token; `running` is every running sequence (a proposer with per-sequence
        state drops that of the others)."""
        ...


def proposal_room(seq: Sequence, num_tokens: int) -> int:
    """How many of `num_tokens` proposals a sequence may get this step (0: none). Never past max_tokens or
    the context: the last sample may be a token beyond the proposals. A sequence with a grammar or about
    to fork gets none."""
    if seq.params.guided is not None or seq.num_forks_pending:
        return 0
    return max(
        0,
        min(num_tokens, seq.max_tokens - seq.num_output_tokens - 1, seq.max_model_len - seq.num_tokens - 1),
    )


@dataclass(frozen=True)
class NgramProposer:
    num_tokens: int
    ngram_min: int
    ngram_max: int
    max_running: int

    @classmethod
    def from_config(cls, config: EngineConfig) -> NgramProposer:
        return cls(
            num_tokens=config.num_speculative_tokens,
            ngram_min=config.ngram_min,
            ngram_max=config.ngram_max,
            max_running=config.speculative_max_running,
        )

    def propose(self, seqs: list[Sequence], running: list[Sequence]) -> dict[str, Proposal]:
        proposals = {}
        for seq in seqs:
            room = proposal_room(seq, self.num_tokens)
            found = lookup(seq.token_ids, self.ngram_min, self.ngram_max, room) if room else []
            if found:
                proposals[seq.seq_id] = Proposal(found)
        return proposals


def lookup(tokens: list[int], ngram_min: int, ngram_max: int, count: int) -> list[int]:
    """The up-to-`count` tokens that followed the latest earlier occurrence of the longest suffix of
    `tokens` (between ngram_min and ngram_max long) that occurred before; [] if none did."""
    total = len(tokens)
    for n in range(min(ngram_max, total - 1), ngram_min - 1, -1):
        suffix = tokens[total - n :]
        first = suffix[0]
        # Latest start i < total - n with tokens[i : i + n] == suffix.
        for i in range(total - n - 1, -1, -1):
            if tokens[i] == first and tokens[i : i + n] == suffix:
                return tokens[i + n : i + n + count]
    return []
