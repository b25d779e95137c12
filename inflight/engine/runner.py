"""ModelRunner: a scheduler step in, sampled tokens out.

Builds the flattened batch (see attention/metadata.py) from the scheduled sequences, runs the model,
computes logits only where they are needed (the last token of each sequence whose context is complete
after this step, and every prompt position of sequences that asked for prompt logprobs) and samples.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from inflight.engine.attention.metadata import AttentionMetadata
from inflight.engine.kv_cache import KVCacheManager
from inflight.engine.model.llama import LlamaForCausalLM
from inflight.engine.sampler import Sampler, SampleResult, SamplingRow, top_logprobs
from inflight.engine.scheduler import ScheduledSequence, SchedulerOutput
from inflight.engine.sequence import Logprob, PositionLogprobs

logger = logging.getLogger("inflight.engine")


@dataclass
class RunnerOutput:
    # seq_id -> one result per draw (n for a sequence that forks this step).
    samples: dict[str, list[SampleResult]] = field(default_factory=dict)
    # seq_id -> (index of the first prompt token predicted, logprobs of the tokens this step predicted).
    prompt_logprobs: dict[str, tuple[int, list[PositionLogprobs]]] = field(default_factory=dict)
    # seq_id -> why its draw failed (its request fails alone; it has no entry in `samples`).
    failed: dict[str, str] = field(default_factory=dict)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        kv_cache: KVCacheManager,
        sampler: Sampler,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.sampler = sampler
        self.device = device

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self._copy_blocks(out.block_copies)
        result = RunnerOutput()
        if not out.scheduled:
            return result
        input_ids, positions, meta = self._prepare(out.scheduled)

        # Rows of the step's tokens that need logits: prompt-logprob rows first, then one per sampling
        # sequence (its last new token).
        logit_rows: list[int] = []
        prompt_spans: list[tuple[str, int, int]] = []
        sample_rows: list[int] = []
        sample_seqs: list[int] = []
        sampling: list[SamplingRow] = []
        owners: list[str] = []
        start = 0
        for index, item in enumerate(out.scheduled):
            seq = item.seq
            end = start + item.num_new_tokens
            if seq.params.prompt_logprobs is not None and seq.index == 0:
                # Position p predicts prompt token p + 1 while p + 1 is still in the prompt.
                first = item.num_computed_tokens
                last = min(item.num_computed_tokens + item.num_new_tokens, seq.num_prompt_tokens - 1)
                if last > first:
                    prompt_spans.append((seq.seq_id, len(logit_rows), last - first))
                    logit_rows.extend(range(start, start + last - first))
            if item.samples:
                sample_rows.append(end - 1)
                sample_seqs.append(index)
                for draw in range(seq.slots_needed):
                    sampling.append(
                        SamplingRow(
                            params=seq.params,
                            token_ids=seq.token_ids,
                            num_prompt_tokens=seq.num_prompt_tokens,
                            index=seq.index + draw,
                            output_position=seq.num_output_tokens,
                        )
                    )
                    owners.append(seq.seq_id)
            start = end

        num_prompt_rows = len(logit_rows)
        draws_per_row = [item.seq.slots_needed for item in out.scheduled if item.samples]
        if not logit_rows and sample_rows and len(sample_rows) < len(input_ids):
            # Only last tokens are read (a prefill or chunked step): the last layer computes just those.
            hidden = self.model(input_ids, positions, self.kv_caches, meta, last_rows_of=sample_seqs)
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
            hidden = hidden[torch.tensor(logit_rows + sample_rows, dtype=torch.long, device=self.device)]
        logits = self.model.compute_logits(hidden)
        if prompt_spans:
            self._prompt_logprobs(logits[:num_prompt_rows], prompt_spans, out.scheduled, result)
        if sampling:
            sample_logits = logits[num_prompt_rows:]
            if any(d > 1 for d in draws_per_row):
                repeat = torch.tensor(draws_per_row, device=self.device)
                sample_logits = sample_logits.repeat_interleave(repeat, dim=0)
            self._sample(sample_logits, sampling, owners, result)
        return result

    def _sample(
        self, logits: torch.Tensor, rows: list[SamplingRow], owners: list[str], result: RunnerOutput
    ) -> None:
        """Draw every row at once. Should that raise (one request's parameters can break a batched op),
        draw each sequence's rows alone: only the sequences whose own draw fails are reported failed."""
        try:
            drawn = self.sampler(logits, rows)
        except Exception as error:
            logger.warning("sampling the batch failed (%s); sampling each sequence alone", error)
        else:
            for owner, sample in zip(owners, drawn, strict=True):
                result.samples.setdefault(owner, []).append(sample)
            return
        by_owner: dict[str, list[int]] = {}
        for i, owner in enumerate(owners):
            by_owner.setdefault(owner, []).append(i)
        for owner, indices in by_owner.items():
            try:
                result.samples[owner] = self.sampler(logits[indices], [rows[i] for i in indices])
            except Exception as error:
                logger.warning("sequence %s failed: sampling raised %r", owner, error)
                result.failed[owner] = f"sampling failed for this request: {error}"

    def _prepare(
        self, scheduled: list[ScheduledSequence]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        for item in scheduled:
            start = item.num_computed_tokens
            end = start + item.num_new_tokens
            table = self.kv_cache.block_table(item.seq.seq_id)
            input_ids.extend(item.seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(item.num_new_tokens)
            seq_lens.append(end)
            tables.append(table)
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        query_start = [0]
        for n in query_lens:
            query_start.append(query_start[-1] + n)
        device = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
            query_lens_list=query_lens,
            seq_lens_list=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
        return (
            torch.tensor(input_ids, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device),
            meta,
        )

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    def _prompt_logprobs(
        self,
        logits: torch.Tensor,
        spans: list[tuple[str, int, int]],
        scheduled: list[ScheduledSequence],
        result: RunnerOutput,
    ) -> None:
        logprobs = torch.log_softmax(logits, dim=-1)
        by_id = {item.seq.seq_id: item for item in scheduled}
        for seq_id, row, count in spans:
            item = by_id[seq_id]
            k = item.seq.params.prompt_logprobs or 0
            first = item.num_computed_tokens + 1
            targets = item.seq.prompt_token_ids[first : first + count]
            target_ids = torch.tensor(targets, dtype=torch.long, device=logits.device)
            block = logprobs[row : row + count]
            chosen = block.gather(1, target_ids[:, None])[:, 0]
            ranks = ((block > chosen[:, None]).sum(dim=-1) + 1).tolist()
            entries = []
            for j, (token, value) in enumerate(zip(targets, chosen.tolist(), strict=True)):
                entry = top_logprobs(block[j], k)
                entry[token] = Logprob(value, ranks[j])
                entries.append(entry)
            result.prompt_logprobs[seq_id] = (first, entries)
