"""ModelRunner: a scheduler step in, sampled tokens out.

Builds the flattened batch (see attention/metadata.py) from the scheduled sequences, runs the model,
computes logits only where they are needed (the last token of each sequence whose context is complete
after this step, and every prompt position of sequences that asked for prompt logprobs) and samples.

The model's inputs of a step are first gathered as plain lists (`StepInputs`), then turned into tensors
by `run_model`; with tensor parallelism rank 0 sends those lists to the other ranks, which run
`run_model` on their shards with the same inputs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

import torch

from inflight.engine.attention.metadata import AttentionMetadata
from inflight.engine.constraints import TokenConstraints
from inflight.engine.cpu import huge_pages
from inflight.engine.cpu.quantized import one_token_rows
from inflight.engine.model.config import ModelConfig
from inflight.engine.model.llama import LlamaForCausalLM
from inflight.engine.rejection import ACCEPT_STREAM, rejection_sample
from inflight.engine.sampler import Sampler, SampleResult, SamplingRow, race_draws, top_logprobs
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


@dataclass
class StepInputs:
    """Everything the model needs for one step, as plain lists (small to pickle and send)."""

    # (src, dst) KV blocks to copy before the step (copy-on-write).
    block_copies: list[tuple[int, int]]
    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    # Padded with 0 to the longest table.
    block_tables: list[list[int]]
    # Sequences whose last new token alone needs a hidden state (see LlamaForCausalLM.forward), or None.
    last_rows_of: list[int] | None = None
    # With last_rows_of None: the rows of the step's tokens that need logits.
    logit_rows: list[int] = field(default_factory=list)


class StepBroadcast(Protocol):
    """The other tensor-parallel ranks, seen from rank 0 (parallel/group.py)."""

    def send_step(self, inputs: StepInputs) -> None:
        """Hand the step's inputs to every other rank before rank 0 runs it."""

    def failure(self, error: BaseException) -> Exception:
        """The error to raise instead of `error` after a step failed: the ranks are out of step now."""


@torch.inference_mode()
def run_model(
    model: LlamaForCausalLM,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    inputs: StepInputs,
    device: torch.device,
) -> torch.Tensor | None:
    """Copy the step's KV blocks, run the model on its tokens and return the logits of the rows that need
    them (None when no row does). Every tensor-parallel rank runs this with the same inputs."""
    copy_blocks(kv_caches, inputs.block_copies, device)
    if not inputs.input_ids:
        return None
    input_ids = torch.tensor(inputs.input_ids, dtype=torch.long, device=device)
    positions = torch.tensor(inputs.positions, dtype=torch.long, device=device)
    query_start = [0]
    for n in inputs.query_lens:
        query_start.append(query_start[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(inputs.slots, dtype=torch.long, device=device),
        query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(inputs.seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(inputs.block_tables, dtype=torch.int32, device=device),
        query_lens_list=inputs.query_lens,
        seq_lens_list=inputs.seq_lens,
        max_query_len=max(inputs.query_lens),
        max_seq_len=max(inputs.seq_lens),
    )
    # A decode step's rows are each a sequence's one new token, and a speculative verify step's (a few new
    # rows a sequence) tokens a decode step would also take one at a time: weights kept quantized multiply
    # them as they would at batch 1, however many share the step (cpu/quantized.py).
    with one_token_rows(meta.is_short_queries):
        if inputs.last_rows_of is not None:
            hidden = model(input_ids, positions, kv_caches, meta, last_rows_of=inputs.last_rows_of)
        else:
            hidden = model(input_ids, positions, kv_caches, meta)
            if not inputs.logit_rows:
                return None
            if inputs.logit_rows != list(range(hidden.shape[0])):  # else every row, in order: no copy
                hidden = hidden[torch.tensor(inputs.logit_rows, dtype=torch.long, device=device)]
        return model.compute_logits(hidden)


def accept_proposals(scheduled: list[ScheduledSequence], result: RunnerOutput) -> None:
    """Keep each speculating sequence's samples up to and including the first that differs from its
    proposal (the later ones were drawn after a token the sequence will not have)."""
    for item in scheduled:
        samples = result.samples.get(item.seq.seq_id)
        if not item.draft_token_ids or samples is None:
            continue
        num_accepted = 0
        for proposed, sample in zip(item.draft_token_ids, samples, strict=False):
            if sample.token_id != proposed:
                break
            num_accepted += 1
        del samples[num_accepted + 1 :]


def copy_blocks(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]], copies: list[tuple[int, int]], device: torch.device
) -> None:
    if not copies:
        return
    src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=device)
    dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=device)
    for k_cache, v_cache in kv_caches:
        k_cache[dst] = k_cache[src]
        v_cache[dst] = v_cache[src]


def kv_cache_shape(
    config: ModelConfig, num_blocks: int, block_size: int, num_kv_heads: int | None = None
) -> tuple[int, ...]:
    """Shape of one layer's K (or V) cache: [num_blocks, block_size, num_kv_heads, head_dim]
    (`num_kv_heads`: this rank's, default all of the model's)."""
    return (num_blocks, block_size, num_kv_heads or config.num_key_value_heads, config.head_dim)


def allocate_kv_caches(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: str | torch.device,
    num_kv_heads: int | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed (K, V) cache pairs, one per layer; on CPU all in one allocation on huge pages where Linux
    gives them (engine/cpu/huge_pages.py: a decode step reads every cached row)."""
    shape = kv_cache_shape(config, num_blocks, block_size, num_kv_heads)
    layers = config.num_hidden_layers
    if torch.device(device).type == "cpu":
        pool = huge_pages.zeros((layers, 2, *shape), dtype, "KV cache")
        return [(pool[i, 0], pool[i, 1]) for i in range(layers)]
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(layers)
    ]


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        sampler: Sampler,
        device: torch.device,
        constraints: TokenConstraints,
        broadcast: StepBroadcast | None = None,
    ) -> None:
        """`constraints`: the requests' limits on what each row may draw (grammars, logit_bias, ...);
        `broadcast`: the other tensor-parallel ranks (None without tensor parallelism)."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.sampler = sampler
        self.constraints = constraints
        self.device = device
        self.broadcast = broadcast

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        result = RunnerOutput()
        if not out.scheduled:
            if out.block_copies:
                self._run(StepInputs(out.block_copies, [], [], [], [], [], []))
            return result
        inputs = self._prepare(out)

        # Rows of the step's tokens that need logits: prompt-logprob rows first, then one per sampling
        # sequence (its last new token; every new token of a speculating one).
        logit_rows: list[int] = []
        prompt_spans: list[tuple[str, int, int]] = []
        sample_rows: list[int] = []
        sample_seqs: list[int] = []
        sampling: list[SamplingRow] = []
        owners: list[str] = []
        speculative = False
        # Speculating sequences whose proposals were drawn from a draft's q, with their first sampling row.
        drawn_proposals: list[tuple[ScheduledSequence, int]] = []
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
            if item.draft_token_ids:
                # A sample after the last token and after each proposal (speculative decoding).
                sample_rows.extend(range(start, end))
                speculative = True
                if item.draft_probs is not None:
                    drawn_proposals.append((item, len(sampling)))
                for j in range(len(item.draft_token_ids) + 1):
                    sampling.append(
                        SamplingRow(
                            params=seq.params,
                            token_ids=seq.token_ids + item.draft_token_ids[:j] if j else seq.token_ids,
                            num_prompt_tokens=seq.num_prompt_tokens,
                            index=seq.index,
                            output_position=seq.num_output_tokens + j,
                            eos_token_ids=seq.eos_token_ids,
                            request_id=seq.request_id,
                        )
                    )
                    owners.append(seq.seq_id)
            elif item.samples:
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
                            eos_token_ids=seq.eos_token_ids,
                            request_id=seq.request_id,
                        )
                    )
                    owners.append(seq.seq_id)
            start = end

        num_prompt_rows = len(logit_rows)
        draws_per_row = [item.seq.slots_needed for item in out.scheduled if item.samples]
        if not logit_rows and not speculative and sample_rows and len(sample_rows) < len(inputs.input_ids):
            # Only last tokens are read (a prefill or chunked step): the last layer computes just those.
            inputs.last_rows_of = sample_seqs
        else:
            inputs.logit_rows = logit_rows + sample_rows
        limits = self.constraints.start(sampling) if sampling else None
        logits = self._run(inputs)
        if logits is None:
            return result
        if prompt_spans:
            self._prompt_logprobs(logits[:num_prompt_rows], prompt_spans, out.scheduled, result)
        if sampling:
            sample_logits = logits[num_prompt_rows:]
            if any(d > 1 for d in draws_per_row):
                repeat = torch.tensor(draws_per_row, device=self.device)
                sample_logits = sample_logits.repeat_interleave(repeat, dim=0)
            assert limits is not None
            limited, failed = limits.apply(sample_logits)
            self._sample_allowed(limited, sampling, owners, failed, result)
            if speculative:
                for item, first in drawn_proposals:
                    self._rejection_sample(item, limited, sampling, first, result)
                accept_proposals(out.scheduled, result)
        return result

    def _rejection_sample(
        self,
        item: ScheduledSequence,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        first: int,
        result: RunnerOutput,
    ) -> None:
        """Replace the samples of a sequence whose proposals a draft drew from q by rejection sampling's
        tokens (engine/rejection.py); the target's own draw after the last proposal is the bonus token."""
        samples = result.samples.get(item.seq.seq_id)
        if samples is None or item.draft_probs is None:
            return
        k = len(item.draft_token_ids)
        own = rows[first : first + k]
        target = self.sampler.probabilities(logits[first : first + k], own)
        uniforms = torch.exp(-self.sampler.noise(own, 1, target, ACCEPT_STREAM))[:, 0]
        tokens = rejection_sample(
            target,
            item.draft_token_ids,
            item.draft_probs,
            uniforms,
            self.sampler.noise(own, race_draws(target.shape[1]), target),
            samples[k].token_id,
        )
        end = first + len(tokens)
        result.samples[item.seq.seq_id] = self.sampler.results(logits[first:end], tokens, rows[first:end])

    def _sample_allowed(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        owners: list[str],
        failed: dict[int, str],
        result: RunnerOutput,
    ) -> None:
        """Sample every row except those of sequences with a row that cannot draw (they fail alone)."""
        for i, why in failed.items():
            logger.warning("sequence %s failed: %s", owners[i], why)
            result.failed[owners[i]] = why
        if not failed:
            self._sample(logits, rows, owners, result)
            return
        keep = [i for i, owner in enumerate(owners) if owner not in result.failed]
        if keep:
            self._sample(logits[keep], [rows[i] for i in keep], [owners[i] for i in keep], result)

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

    def _run(self, inputs: StepInputs) -> torch.Tensor | None:
        if self.broadcast is None:
            return run_model(self.model, self.kv_caches, inputs, self.device)
        try:
            self.broadcast.send_step(inputs)
            return run_model(self.model, self.kv_caches, inputs, self.device)
        except Exception as error:
            raise self.broadcast.failure(error) from error

    def _prepare(self, out: SchedulerOutput) -> StepInputs:
        bs = self.block_size
        inputs = StepInputs(out.block_copies, [], [], [], [], [], [])
        tables: list[list[int]] = []
        for item in out.scheduled:
            start = item.num_computed_tokens
            end = start + item.num_new_tokens
            table = item.block_table
            # The proposals of a speculating sequence follow its last token.
            inputs.input_ids.extend(item.seq.token_ids[start:end] + item.draft_token_ids)
            inputs.positions.extend(range(start, end))
            inputs.slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            inputs.query_lens.append(item.num_new_tokens)
            inputs.seq_lens.append(end)
            tables.append(table)
        width = max(len(t) for t in tables)
        inputs.block_tables = [t + [0] * (width - len(t)) for t in tables]
        return inputs

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
