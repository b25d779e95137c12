"""Speculative decoding with a draft model: a smaller checkpoint with the target's tokenizer proposes the
next tokens (speculative='draft', draft_model=PATH).

The draft is a second LlamaForCausalLM (same device and dtype as the target) with its own paged KV cache:
its own block pool (as many blocks as the target's, each sized from the draft's shape; the engine splits
the KV budget between the two by their bytes per token) holding the tokens of the sequences it proposes
for. Each step, for the decoding sequences that speculate, the draft first computes what its cache lacks
of each sequence (the whole context the first time, then the one or two tokens the last step accepted),
then proposes k tokens with k one-token decode steps batched over those sequences. The target verifies
them in its step (engine/runner.py, engine/rejection.py).

The draft's KV of a sequence is checked against the sequence's tokens before each proposal: the longest
prefix they share is kept (`truncate` drops the rest, such as proposals the target rejected) and the
remainder recomputed, so rejections, preemptions and stop strings need no bookkeeping here. A sequence
the draft pool has no room for gets no proposal that step (no preemption), and a sequence that stops
running loses its draft KV. The draft pool does no prefix caching.

Greedy requests get the draft's argmax (point masses, verified as n-gram proposals are: greedy output
is identical to decoding without speculation). Sampling requests get tokens drawn from the draft's
distribution q (the request's temperature, top-k, top-p and min-p applied to the draft's logits), and
q travels with them for rejection sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inflight.engine.kv_cache import KVCacheManager
from inflight.engine.model.llama import LlamaForCausalLM
from inflight.engine.rejection import DRAFT_STREAM
from inflight.engine.runner import StepInputs, allocate_kv_caches, run_model
from inflight.engine.sampler import Sampler, SamplingRow, argmax_rows
from inflight.engine.sequence import Sequence
from inflight.engine.speculative import Proposal, proposal_room
from inflight.engine.tokenizer import Tokenizer


def check_same_vocabulary(
    target_name: str,
    target: Tokenizer,
    target_vocab_size: int,
    draft_name: str,
    draft: Tokenizer,
    draft_vocab_size: int,
) -> None:
    """Raise ValueError naming both models unless the draft's tokenizer and logits are the target's."""
    if target_vocab_size != draft_vocab_size:
        raise ValueError(
            f"draft model {draft_name} has {draft_vocab_size} logits per token but the target model "
            f"{target_name} has {target_vocab_size}; a draft model needs the target's tokenizer and "
            "vocabulary"
        )
    if target.vocabulary() != draft.vocabulary():
        raise ValueError(
            f"draft model {draft_name} has a different tokenizer vocabulary from the target model "
            f"{target_name}; a draft model needs the target's tokenizer (the same token ids)"
        )


@dataclass
class _Pending:
    """One sequence's share of a proposal round."""

    seq: Sequence
    room: int
    tokens: list[int]
    probs: list[torch.Tensor]


class DraftProposer:
    """Proposes with a draft model over its own paged KV cache (see the module doc)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype,
        device: torch.device,
        *,
        num_tokens: int,
        max_running: int,
        seed: int,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.num_tokens = num_tokens
        self.max_running = max_running
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.kv_caches = allocate_kv_caches(model.config, num_blocks, block_size, kv_dtype, device)
        self.sampler = Sampler(seed, device)
        # seq_id -> the tokens whose KV the draft cache holds for it (in order).
        self._cached: dict[str, list[int]] = {}

    def forget(self, seq_id: str) -> None:
        self.kv.free(seq_id)
        self._cached.pop(seq_id, None)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], running: list[Sequence]) -> dict[str, Proposal]:
        keep = {s.seq_id for s in running}
        for seq_id in [s for s in self._cached if s not in keep]:
            self.forget(seq_id)
        pending: list[_Pending] = []
        starts: list[int] = []
        max_positions = self.model.config.max_position_embeddings
        for seq in seqs:
            room = min(proposal_room(seq, self.num_tokens), max_positions - seq.num_tokens)
            if room <= 0:
                continue
            start = self._reusable(seq)
            # The cache covers the context and every proposal but the last (never computed).
            if not self.kv.allocate(seq.seq_id, start, seq.num_tokens - start + room - 1):
                self.forget(seq.seq_id)
                continue
            pending.append(_Pending(seq, room, [], []))
            starts.append(start)
        if not pending:
            return {}
        inputs = [p.seq.token_ids[start:] for p, start in zip(pending, starts, strict=True)]
        active = pending
        for step in range(max(p.room for p in pending)):
            logits = self._forward(active, starts, inputs)
            self._draw(active, logits)
            active_next = [i for i, p in enumerate(active) if p.room > step + 1]
            starts = [active[i].seq.num_tokens + step for i in active_next]
            inputs = [[active[i].tokens[-1]] for i in active_next]
            active = [active[i] for i in active_next]
            if not active:
                break
        proposals = {}
        for p in pending:
            self._cached[p.seq.seq_id] = p.seq.token_ids + p.tokens[:-1]
            probs = torch.stack(p.probs) if p.probs else None
            proposals[p.seq.seq_id] = Proposal(p.tokens, probs)
        return proposals

    def _reusable(self, seq: Sequence) -> int:
        """Tokens of the draft's KV of `seq` still valid (their prefix agrees with the sequence; at least
        the last token is left to compute); the cache is cut to them."""
        held = self._cached.get(seq.seq_id)
        if held is None or not self.kv.holds(seq.seq_id):
            self.forget(seq.seq_id)
            self.kv.match_prefix(seq.seq_id, [])
            return 0
        tokens = seq.token_ids
        limit = min(len(held), len(tokens) - 1)
        valid = 0
        while valid < limit and held[valid] == tokens[valid]:
            valid += 1
        self.kv.truncate(seq.seq_id, valid)
        return valid

    def _forward(self, batch: list[_Pending], starts: list[int], inputs: list[list[int]]) -> torch.Tensor:
        """The draft's logits after the last of each sequence's `inputs` (computed from `starts` on)."""
        bs = self.block_size
        step = StepInputs([], [], [], [], [], [], [])
        tables = []
        for item, start, tokens in zip(batch, starts, inputs, strict=True):
            table = self.kv.block_table(item.seq.seq_id)
            end = start + len(tokens)
            step.input_ids.extend(tokens)
            step.positions.extend(range(start, end))
            step.slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            step.query_lens.append(len(tokens))
            step.seq_lens.append(end)
            tables.append(table)
        width = max(len(t) for t in tables)
        step.block_tables = [t + [0] * (width - len(t)) for t in tables]
        step.last_rows_of = list(range(len(batch)))
        logits = run_model(self.model, self.kv_caches, step, self.device)
        assert logits is not None
        return logits

    def _draw(self, batch: list[_Pending], logits: torch.Tensor) -> None:
        """Append each sequence's next proposal: the argmax for a greedy request, else a draw from q."""
        rows = [
            SamplingRow(
                params=p.seq.params,
                token_ids=[],
                num_prompt_tokens=p.seq.num_prompt_tokens,
                index=p.seq.index,
                output_position=p.seq.num_output_tokens + len(p.tokens),
                request_id=p.seq.request_id,
            )
            for p in batch
        ]
        greedy = [p.seq.params.greedy for p in batch]
        chosen = argmax_rows(logits).tolist()
        sampling = [i for i, g in enumerate(greedy) if not g]
        if sampling:
            sample_rows = [rows[i] for i in sampling]
            probs = self.sampler.filtered_probs(logits[sampling], sample_rows)
            probs = probs / probs.sum(dim=-1, keepdim=True)
            drawn = self.sampler.draw(probs, sample_rows, DRAFT_STREAM).tolist()
            for row, i in enumerate(sampling):
                chosen[i] = drawn[row]
                batch[i].probs.append(probs[row])
        for p, token in zip(batch, chosen, strict=True):
            p.tokens.append(token)
