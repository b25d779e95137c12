"""Which sequences run each step, and how many new tokens each computes (no torch).

One scheduler, two admission policies (`AdmissionPolicy` objects; `ContinuousScheduler` and
`StaticScheduler` are the scheduler with each):

- continuous (`CONTINUOUS`): every step, the running sequences first (one decode token each, or the next
  chunk of an unfinished prefill), then waiting requests are admitted into free slots while the token
  budget lasts (prefill, chunked when it exceeds the budget) and, while at most
  `STAGGERED_PREFILL_MAX_WAITING` requests wait, the step's prompt tokens are fewer than
  `max_merged_prefill_tokens` (the first always starts). While any running sequence decodes, the step's
  prompt tokens (chunks and admissions) stop at `max_prefill_tokens_while_decoding`: every decode in the
  step waits for them. A finished sequence's slot is refilled on the very next step.

With the continuous policy, requests added between two `schedule()` calls queue shortest prompt first
among themselves, behind those queued before.
- static (`STATIC`): admits up to `max_num_seqs` requests only when nothing is running; the batch runs
  until its longest member finishes (members that finish early leave their slot idle).

Out of KV blocks, both preempt the most recently admitted running sequence: its blocks are freed, it goes
back to the front of the waiting queue and is recomputed (prompt + tokens so far) when readmitted.
A request that can never fit (longer than max_model_len, or needing more blocks than the whole pool) is
failed with finish_reason "error" and a message, never retried forever.

Driving it (what LLMEngine does; the simulator does the same with fake tokens):

    out = scheduler.schedule()                 # SchedulerOutput: scheduled (seq, num_new_tokens, block_table)
    ... compute out.scheduled; sample a token for each seq in out.sampling (n tokens if it forks) ...
    scheduler.update(out, {seq.seq_id: [token, ...]})   # appends tokens, finishes, frees, forks
    scheduler.finish(seq_id, "stop", stop_reason)       # optional: engine-side stops (stop strings)

Each step's decisions are reported as a `StepRecord` to `on_step` (when set) at the end of `update`.
Deterministic: the same sequence of add/schedule/update calls gives the same decisions.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from inflight.engine.config import MAX_MERGED_PREFILL_TOKENS, STAGGERED_PREFILL_MAX_WAITING, SchedulerPolicy
from inflight.engine.kv_cache import KVAllocator
from inflight.engine.sequence import Sequence, SequenceStatus
from inflight.engine.speculative import Proposal, Proposer

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class AdmissionPolicy:
    """When waiting requests may join the running ones."""

    name: SchedulerPolicy
    # Admit only while nothing runs (a batch runs until all its members finish).
    only_when_idle: bool
    # Stop admitting once the step's token budget is spent (else admit and prefill in later steps).
    within_budget: bool

    def may_admit(self, num_running: int) -> bool:
        return not (self.only_when_idle and num_running)


CONTINUOUS = AdmissionPolicy("continuous", only_when_idle=False, within_budget=True)
STATIC = AdmissionPolicy("static", only_when_idle=True, within_budget=False)


@dataclass(frozen=True)
class CapacityError:
    """Why a request can never run on this engine, whatever else runs: `message` says what to change,
    `param` names the request field it is about ("prompt", "max_tokens" or "n"), `code` is the OpenAI
    error code an API answers with."""

    code: str
    message: str
    param: str


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int
    # Tokens already in the KV cache before this step (the new tokens start at this position).
    num_computed_tokens: int
    # The sequence's KV blocks in token order as of this step (the runner reads them, not the manager).
    block_table: list[int] = field(default_factory=list)
    # Proposed next tokens (speculative decoding): computed after the sequence's last token, in the
    # step's `num_new_tokens`, and a token is sampled after each of them too.
    draft_token_ids: list[int] = field(default_factory=list)
    # The distributions the proposals were drawn from (Proposal.probs), None for point masses.
    draft_probs: torch.Tensor | None = None
    # True if this step computes the sequence's last token, so a next token is sampled (fixed at
    # schedule time; the sequence grows in `update`).
    samples: bool = field(init=False)
    # Tokens `update` appended to the sequence (more than one when proposals were accepted).
    num_appended: int = 0

    def __post_init__(self) -> None:
        computed = self.num_computed_tokens + self.num_new_tokens - len(self.draft_token_ids)
        self.samples = computed == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    step: int
    scheduled: list[ScheduledSequence]
    admitted: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    # Requests failed this step (never fit); already FINISHED with finish_reason "error".
    failed: list[Sequence] = field(default_factory=list)
    # KV block copies (src, dst) to perform before running the step (copy-on-write after forks).
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def sampling(self) -> list[ScheduledSequence]:
        return [s for s in self.scheduled if s.samples]

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class StepRecord:
    """What one step decided, by sequence id; the simulator's trace is compared against the engine's."""

    step: int
    scheduled: tuple[tuple[str, int], ...]
    admitted: tuple[str, ...]
    preempted: tuple[str, ...]
    finished: tuple[str, ...]
    failed: tuple[str, ...]


class Scheduler:
    """Batches sequences over a KV cache; `admission` decides when waiting requests may join."""

    admission: AdmissionPolicy = CONTINUOUS

    def __init__(
        self,
        kv_cache: KVAllocator,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        max_merged_prefill_tokens: int = MAX_MERGED_PREFILL_TOKENS,
        max_prefill_tokens_while_decoding: int | None = None,
        on_step: Callable[[StepRecord], None] | None = None,
        proposer: Proposer | None = None,
    ) -> None:
        """`max_merged_prefill_tokens`: EngineConfig's (0: no limit); `max_prefill_tokens_while_decoding`:
        EngineConfig's, resolved for the device (None: the token budget); `proposer`: speculative
        decoding's (None: off)."""
        if max_num_seqs < 1 or max_num_batched_tokens < 1 or max_model_len < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and max_model_len must all be >= 1")
        if max_merged_prefill_tokens < 0:
            raise ValueError("max_merged_prefill_tokens must be >= 0")
        if max_prefill_tokens_while_decoding is not None and max_prefill_tokens_while_decoding < 1:
            raise ValueError("max_prefill_tokens_while_decoding must be >= 1 (or None: the token budget)")
        self.kv_cache = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.max_merged_prefill_tokens = max_merged_prefill_tokens
        self.max_prefill_tokens_while_decoding = max_prefill_tokens_while_decoding
        self.on_step = on_step
        self.proposer = proposer
        self.waiting: deque[Sequence] = deque()
        # How many of the last sequences in `waiting` were added since the last `schedule()`.
        self._num_arrived = 0
        # In admission order: the last one is the first to be preempted.
        self.running: list[Sequence] = []
        self._failed: list[Sequence] = []
        self.num_preemptions_total = 0
        self.num_steps = 0

    # ---- requests in and out

    def capacity_error(
        self, num_prompt_tokens: int, max_tokens: int | None, n: int = 1
    ) -> CapacityError | None:
        """Why a request of this size (n completions) can never run here, or None if it can."""
        too_long = "context_length_exceeded"
        if num_prompt_tokens < 1:
            return CapacityError("invalid_value", "the prompt is empty; send at least one token", "prompt")
        if num_prompt_tokens >= self.max_model_len:
            return CapacityError(
                too_long,
                f"the prompt has {num_prompt_tokens} tokens but this engine's max_model_len is "
                f"{self.max_model_len} (prompt + at least one generated token must fit); shorten the prompt",
                "prompt",
            )
        total = num_prompt_tokens + (max_tokens if max_tokens is not None else 1)
        if total > self.max_model_len:
            return CapacityError(
                too_long,
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} exceeds "
                f"max_model_len {self.max_model_len}; lower max_tokens or shorten the prompt",
                "max_tokens",
            )
        pool_tokens = self.kv_cache.num_blocks * self.kv_cache.block_size
        if total > pool_tokens:
            return CapacityError(
                too_long,
                f"prompt + max_tokens = {total} tokens needs {self.kv_cache.blocks_for(total)} KV blocks but "
                f"the whole pool has {self.kv_cache.num_blocks} ({pool_tokens} tokens); "
                "lower max_tokens or give the engine more KV blocks",
                "max_tokens",
            )
        if n > self.max_num_seqs:
            return CapacityError(
                "invalid_value", f"n={n} needs {n} slots but the engine has {self.max_num_seqs}; lower n", "n"
            )
        return None

    def add(self, seq: Sequence) -> None:
        """Queue a new request (its index-0 sequence).

        A request that can never fit is not queued: it is failed ("error") and reported by the next
        `schedule()` in `SchedulerOutput.failed`.
        """
        seq.max_model_len = self.max_model_len
        seq.max_tokens = (
            seq.params.max_tokens
            if seq.params.max_tokens is not None
            else self.max_model_len - seq.num_prompt_tokens
        )
        error = self.capacity_error(seq.num_prompt_tokens, seq.params.max_tokens, seq.slots_needed)
        if error is not None:
            seq.finish("error", error=error.message)
            self._failed.append(seq)
            return
        seq.status = SequenceStatus.WAITING
        # Requests added between two steps arrived together as far as the engine can tell: among them the
        # shortest prompt goes first (ties keep their order), behind everything queued before them. A
        # static batch waits for its longest member anyway: it keeps the order of arrival.
        position = len(self.waiting)
        first = position if self.admission.only_when_idle else max(0, position - self._num_arrived)
        while position > first and self.waiting[position - 1].num_prompt_tokens > seq.num_prompt_tokens:
            position -= 1
        self.waiting.insert(position, seq)
        self._num_arrived += 1

    def abort(self, request_id: str) -> list[Sequence]:
        """Stop every sequence of the request, free its blocks; returns the sequences it stopped."""
        stopped = [s for s in [*self.waiting, *self.running] if s.request_id == request_id]
        for seq in stopped:
            self._remove(seq)
            seq.finish("abort")
        return stopped

    def finish(
        self, seq_id: str, reason: str, stop_reason: int | str | None = None, error: str | None = None
    ) -> Sequence | None:
        """Finish a running or waiting sequence from outside (a stop string matched, or the engine failed
        it: reason "error" with `error`); free its blocks. An `update` of the step it was in skips it."""
        for seq in [*self.running, *self.waiting]:
            if seq.seq_id == seq_id:
                self._remove(seq)
                seq.finish(reason, stop_reason=stop_reason, error=error)
                return seq
        return None

    def _remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            if self.waiting.index(seq) >= len(self.waiting) - self._num_arrived:
                self._num_arrived -= 1
            self.waiting.remove(seq)
        self.kv_cache.free(seq.seq_id)

    # ---- figures

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._failed)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def _slots_used(self) -> int:
        return sum(s.slots_needed for s in self.running)

    @property
    def policy(self) -> SchedulerPolicy:
        return self.admission.name

    # ---- one step

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(step=self.num_steps, scheduled=[], failed=self._failed)
        self._failed = []
        self._num_arrived = 0
        budget = self.max_num_batched_tokens
        # Running sequences with one token left to compute: they decode this step.
        decoding = [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]
        # Prompt tokens (prefill chunks, not decodes) this step computes so far, and at most.
        prefill_tokens = 0
        prefill_room = self._prefill_room(bool(decoding))
        scheduled_ids: set[str] = set()

        # 1. Running sequences, oldest first: next prefill chunk or one decode token each (plus proposals).
        proposals: dict[str, Proposal] = {}
        if self.proposer is not None and len(self.running) <= self.proposer.max_running:
            proposals = self.proposer.propose(decoding, self.running)
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if num_new > 1:
                num_new = min(num_new, prefill_room - prefill_tokens)
            if num_new <= 0:
                i += 1
                continue
            proposal = proposals.get(seq.seq_id) if num_new == 1 else None
            if proposal is not None:
                scheduled = self._draft(seq, proposal, budget)
                if scheduled is not None:
                    out.scheduled.append(scheduled)
                    scheduled_ids.add(seq.seq_id)
                    budget -= scheduled.num_new_tokens
                    i += 1
                    continue
            while not self.kv_cache.allocate(seq.seq_id, seq.num_computed_tokens, num_new):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSequence(seq, num_new, seq.num_computed_tokens))
                scheduled_ids.add(seq.seq_id)
                budget -= num_new
                if seq.num_tokens - seq.num_computed_tokens > 1:
                    prefill_tokens += num_new
                i += 1

        # 2. Admit waiting requests into free slots (none after a preemption: blocks are short). Once the
        # step computes `max_merged_prefill_tokens` prompt tokens, it is bound by computing, not by reading
        # the weights: a further prompt in it would add its time to every token the step gives, so, unless
        # the queue is long, it waits for the next step.
        if not out.preempted and self.admission.may_admit(len(self.running)):
            while self.waiting:
                seq = self.waiting[0]
                if self._slots_used() + seq.slots_needed > self.max_num_seqs:
                    break
                if self.admission.within_budget and (
                    min(budget, prefill_room - prefill_tokens) <= 0 or self._staggers_prefill(prefill_tokens)
                ):
                    break
                if not self.kv_cache.holds(seq.seq_id):
                    self._match_prefix(seq)
                num_new = min(seq.num_tokens - seq.num_computed_tokens, budget, prefill_room - prefill_tokens)
                if not self.kv_cache.allocate(seq.seq_id, seq.num_computed_tokens, max(num_new, 0)):
                    self.kv_cache.free(seq.seq_id)
                    seq.num_computed_tokens = 0
                    break
                self.waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                out.admitted.append(seq.seq_id)
                if num_new > 0:
                    out.scheduled.append(ScheduledSequence(seq, num_new, seq.num_computed_tokens))
                    budget -= num_new
                    prefill_tokens += num_new

        for item in out.scheduled:
            item.block_table = list(self.kv_cache.block_table(item.seq.seq_id))
        out.block_copies = self.kv_cache.take_pending_copies()
        self.num_steps += 1
        return out

    def _prefill_room(self, decodes: bool) -> int:
        """The prompt tokens a step may compute: max_prefill_tokens_while_decoding where a running sequence
        `decodes` in it, else the whole token budget."""
        cap = self.max_prefill_tokens_while_decoding
        if cap is not None and decodes:
            return min(cap, self.max_num_batched_tokens)
        return self.max_num_batched_tokens

    def _staggers_prefill(self, prefill_tokens: int) -> bool:
        """Whether the next waiting prompt waits for the next step, with `prefill_tokens` in this one."""
        return (
            0 < self.max_merged_prefill_tokens <= prefill_tokens
            and len(self.waiting) <= STAGGERED_PREFILL_MAX_WAITING
        )

    def _draft(self, seq: Sequence, proposal: Proposal, budget: int) -> ScheduledSequence | None:
        """The sequence's step with the proposals that fit the step's token budget and the free KV blocks
        (allocated), or None (nothing allocated)."""
        draft = proposal.token_ids[: budget - 1]
        if not draft or not self.kv_cache.allocate(seq.seq_id, seq.num_computed_tokens, 1 + len(draft)):
            return None
        probs = None if proposal.probs is None else proposal.probs[: len(draft)]
        return ScheduledSequence(seq, 1 + len(draft), seq.num_computed_tokens, [], draft, probs)

    def _match_prefix(self, seq: Sequence) -> None:
        # Requests that want prompt logprobs compute every prompt position, so they skip the cache.
        tokens = seq.token_ids if seq.params.prompt_logprobs is None else []
        seq.num_computed_tokens = self.kv_cache.match_prefix(seq.seq_id, tokens, seq.params.cache_salt)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.kv_cache.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq.seq_id)

    def update(self, out: SchedulerOutput, sampled: Mapping[str, Iterable[int]]) -> list[Sequence]:
        """Record that `out` ran: advance computed tokens, append sampled tokens, fork, finish and free.

        `sampled[seq_id]` holds the sampled token(s) of each sequence in `out.sampling`: one, or n for a
        sequence that forks (its first token, then one for each new sibling). Returns the sequences that
        came into being by forking this step (the engine adds them to their request); finished ones are
        those whose `is_finished` is now true.
        """
        forked: list[Sequence] = []
        finished: list[str] = []
        for item in out.scheduled:
            seq = item.seq
            if seq.is_finished:  # aborted or failed between schedule and update
                continue
            if item.draft_token_ids:
                self._accept(item, list(sampled[seq.seq_id]), finished)
                continue
            seq.num_computed_tokens = item.num_computed_tokens + item.num_new_tokens
            self.kv_cache.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
            if not item.samples:
                continue
            tokens = list(sampled[seq.seq_id])
            item.num_appended = 1
            group = [seq]
            if seq.num_forks_pending:
                for index in range(1, seq.num_forks_pending + 1):
                    child = seq.fork(index)
                    self.kv_cache.fork(seq.seq_id, child.seq_id)
                    group.append(child)
                    forked.append(child)
                seq.num_forks_pending = 0
                self.running[self.running.index(seq) + 1 : self.running.index(seq) + 1] = group[1:]
            if len(tokens) != len(group):
                raise ValueError(f"{seq.seq_id}: expected {len(group)} sampled tokens, got {len(tokens)}")
            for member, token in zip(group, tokens, strict=True):
                member.append_token(token)
                if member.is_finished:
                    self._remove(member)
                    finished.append(member.seq_id)
        if self.on_step is not None:
            self.on_step(
                StepRecord(
                    step=out.step,
                    scheduled=tuple((s.seq.seq_id, s.num_new_tokens) for s in out.scheduled),
                    admitted=tuple(out.admitted),
                    preempted=tuple(out.preempted),
                    finished=tuple(finished),
                    failed=tuple(s.seq_id for s in out.failed),
                )
            )
        return forked

    def _accept(self, item: ScheduledSequence, tokens: list[int], finished: list[str]) -> None:
        """Apply a speculative step: `tokens` are the accepted proposals and the sample after them. The KV of
        the last token and the accepted proposals is kept; the blocks past it are freed."""
        seq = item.seq
        num_accepted = len(tokens) - 1
        if (
            not 0 <= num_accepted <= len(item.draft_token_ids)
            or tokens[:-1] != item.draft_token_ids[:num_accepted]
        ):
            raise ValueError(f"{seq.seq_id}: samples {tokens} do not extend proposals {item.draft_token_ids}")
        seq.num_computed_tokens = item.num_computed_tokens + 1 + num_accepted
        self.kv_cache.truncate(seq.seq_id, seq.num_computed_tokens)
        self.kv_cache.cache_full_blocks(seq.seq_id, seq.token_ids + tokens[:-1], seq.num_computed_tokens)
        for token in tokens:
            seq.append_token(token)
            item.num_appended += 1
            if seq.is_finished:
                self._remove(seq)
                finished.append(seq.seq_id)
                return


class ContinuousScheduler(Scheduler):
    """Admit waiting requests whenever slots, budget and blocks allow (in-flight batching)."""

    admission = CONTINUOUS


class StaticScheduler(Scheduler):
    """Admit a batch of up to max_num_seqs requests only when nothing runs; it runs until all finish."""

    admission = STATIC


SCHEDULERS: dict[SchedulerPolicy, type[Scheduler]] = {
    cls.admission.name: cls for cls in (ContinuousScheduler, StaticScheduler)
}


def create_scheduler(
    policy: SchedulerPolicy,
    kv_cache: KVAllocator,
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    max_merged_prefill_tokens: int = MAX_MERGED_PREFILL_TOKENS,
    max_prefill_tokens_while_decoding: int | None = None,
    proposer: Proposer | None = None,
) -> Scheduler:
    return SCHEDULERS[policy](
        kv_cache,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        max_merged_prefill_tokens=max_merged_prefill_tokens,
        max_prefill_tokens_while_decoding=max_prefill_tokens_while_decoding,
        proposer=proposer,
    )
