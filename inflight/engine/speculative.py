"""Speculative decoding by n-gram prompt lookup: which tokens to propose for a sequence (no torch).

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
target's own draw conditioned on not being t, i.e. p with t removed and renormalized.
"""

from __future__ import annotations

from dataclasses import dataclass

from inflight.engine.config import EngineConfig
from inflight.engine.sequence import Sequence


@dataclass(frozen=True)
class NgramProposer:
    num_tokens: int
    ngram_min: int
    ngram_max: int
    # Speculation is off for a step in which more sequences than this run (the step's cost grows with its
    # tokens once the batch is large, while proposals that miss are wasted work).
    max_running: int

    @classmethod
    def from_config(cls, config: EngineConfig) -> NgramProposer | None:
        if config.speculative is None:
            return None
        return cls(
            num_tokens=config.num_speculative_tokens,
            ngram_min=config.ngram_min,
            ngram_max=config.ngram_max,
            max_running=config.speculative_max_running,
        )

    def propose(self, seq: Sequence) -> list[int]:
        """Up to `num_tokens` proposed next tokens for a sequence about to decode one token (maybe none)."""
        params = seq.params
        if params.guided is not None or seq.num_forks_pending:
            return []
        # Never propose past max_tokens or the context: the last sample may be a token beyond the proposals.
        room = min(
            self.num_tokens,
            seq.max_tokens - seq.num_output_tokens - 1,
            seq.max_model_len - seq.num_tokens - 1,
        )
        if room <= 0:
            return []
        return lookup(seq.token_ids, self.ngram_min, self.ngram_max, room)


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
