"""Outputs of the engine: token samples in, `RequestOutput`s out.

What happens to a step's samples outside the core loop (as vLLM v1's output processor does): prompt
logprobs merged per position, logprob tokens decoded, incremental detokenization, stop strings (which
finish the sequence through the scheduler), token counters, and the assembly of each request's output,
cumulative or as a delta since its previous output (see engine.py for the contract).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from inflight.engine.runner import RunnerOutput
from inflight.engine.sampler import SampleResult
from inflight.engine.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from inflight.engine.sequence import FinishReason, PositionLogprobs, SamplingParams, Sequence
from inflight.engine.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger("inflight.engine")


@dataclass
class CompletionOutput:
    """One of a request's n completions, cumulative so far."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    # The stop string or stop token id that ended it (None for EOS, length, abort, error).
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    # Why this completion failed (finish_reason "error"), else None.
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def merge(self, later: CompletionOutput) -> None:
        """Append a later delta of the same completion to this one (in place)."""
        self.text += later.text
        self.token_ids.extend(later.token_ids)
        if later.logprobs is not None:
            self.logprobs = [*(self.logprobs or []), *later.logprobs]
        self.finish_reason = later.finish_reason
        self.stop_reason = later.stop_reason
        self.cumulative_logprob = later.cumulative_logprob
        self.error = later.error


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # Why the request failed (a completion with finish_reason "error"), else None.
    error: str | None = None

    def merge(self, later: RequestOutput) -> None:
        """Fold a later delta output of the same request into this one (in place): what a consumer that
        has not read this one yet would have seen in both."""
        for completion, more in zip(self.outputs, later.outputs, strict=True):
            completion.merge(more)
        self.finished = later.finished
        self.error = later.error
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence | None]
    detokenizers: list[IncrementalDetokenizer]
    texts: list[str] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    prompt_counted: bool = False
    # Delta outputs: per completion, tokens and characters of text already sent; prompt logprobs sent.
    sent_tokens: list[int] = field(default_factory=list)
    sent_chars: list[int] = field(default_factory=list)
    sent_prompt_logprobs: bool = False

    @property
    def finished(self) -> bool:
        parent = self.seqs[0]
        assert parent is not None
        if parent.num_forks_pending and parent.is_finished:
            return True
        return all(s is not None and s.is_finished for s in self.seqs)


class OutputProcessor:
    """The engine's requests from the outputs' side: what has been generated and sent for each."""

    def __init__(self, tokenizer: Tokenizer, scheduler: Scheduler) -> None:
        """`scheduler`: where a sequence that matched a stop string is finished (its blocks freed)."""
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self._requests: dict[str, _Request] = {}
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        # Speculative decoding: tokens proposed, and those of them accepted.
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __bool__(self) -> bool:
        return bool(self._requests)

    def add(self, seq: Sequence, prompt: str | None) -> None:
        """Track the request whose index-0 sequence `seq` was just queued (`prompt`: its text, if any)."""
        params = seq.params
        self._requests[seq.request_id] = _Request(
            request_id=seq.request_id,
            prompt=prompt,
            prompt_token_ids=seq.prompt_token_ids,
            params=params,
            seqs=[seq] + [None] * (params.n - 1),
            detokenizers=[
                IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, params.skip_special_tokens)
                for _ in range(params.n)
            ],
            texts=[""] * params.n,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            sent_tokens=[0] * params.n,
            sent_chars=[0] * params.n,
        )

    def remove(self, request_id: str) -> bool:
        """Forget a request (aborted); False if it was unknown or already finished."""
        return self._requests.pop(request_id, None) is not None

    def add_forks(self, forked: Iterable[Sequence]) -> None:
        """Sequences that came into being by forking this step join their request's completions."""
        for child in forked:
            self._requests[child.request_id].seqs[child.index] = child

    def process(self, out: SchedulerOutput, result: RunnerOutput) -> list[RequestOutput]:
        """The outputs of a step that ran (`out`, then `result`) and was applied to the scheduler."""
        progressed: dict[str, _Request] = {}
        for seq_id, (first_token, chunk) in result.prompt_logprobs.items():
            request = self._requests[seq_id]
            # A recompute after preemption repeats chunks already recorded: keep each position once.
            if request.prompt_logprobs is not None and len(request.prompt_logprobs) == first_token:
                request.prompt_logprobs.extend(chunk)
        for item in out.sampling:
            parent = item.seq
            request = self._requests[parent.request_id]
            progressed[request.request_id] = request
            samples = result.samples.get(parent.seq_id)
            if samples is None:  # its draw failed: already finished with "error"
                continue
            try:
                if item.draft_token_ids:
                    self._record_speculative(request, item, samples)
                    self.num_draft_tokens += len(item.draft_token_ids)
                    self.num_accepted_tokens += len(samples) - 1
                else:
                    members = [parent] if len(samples) == 1 else [s for s in request.seqs if s is not None]
                    for member, sample in zip(members, samples, strict=True):
                        self._record_sample(request, member, sample)
            except Exception as error:
                logger.warning(
                    "request %s failed: processing its tokens raised %r", request.request_id, error
                )
                self._fail(request, f"processing this request's output failed: {error}")
                continue
            if not request.prompt_counted:
                request.prompt_counted = True
                self.num_prompt_tokens += len(request.prompt_token_ids)
        for seq in out.failed:
            if seq.request_id in self._requests:
                progressed[seq.request_id] = self._requests[seq.request_id]
        outputs = []
        for request in progressed.values():
            finished = request.finished
            if finished:
                del self._requests[request.request_id]
            outputs.append(self._output(request, finished))
        return outputs

    def _record_speculative(
        self, request: _Request, item: ScheduledSequence, samples: list[SampleResult]
    ) -> None:
        """Record the tokens a speculative step appended to one sequence, one at a time as steps without
        proposals would have: a stop string completed by one of them ends the sequence there, and the
        tokens after it are dropped."""
        seq = item.seq
        first = seq.num_output_tokens - item.num_appended
        for j in range(item.num_appended):
            last = j == item.num_appended - 1
            stop = self._record_sample(request, seq, samples[j], first + j, last)
            if stop is not None and not last:
                seq.truncate_output(first + j + 1)
                # Finished by the stop string, not by an EOS or max_tokens among the dropped tokens.
                seq.finish("stop", stop_reason=stop)
                return

    def _record_sample(
        self,
        request: _Request,
        member: Sequence,
        sample: SampleResult,
        position: int | None = None,
        last: bool = True,
    ) -> str | None:
        """Record the sample of output token `position` (default the last); `last`: no later token of the
        sequence was appended this step. Returns the stop string the token completed, if any."""
        self.num_generation_tokens += 1
        if member.params.logprobs is not None:
            if member.logprobs is None:
                member.logprobs = []
            assert sample.top_logprobs is not None
            for token_id, logprob in sample.top_logprobs.items():
                logprob.decoded_token = self.tokenizer.decode([token_id], skip_special_tokens=False)
            member.logprobs.append(sample.top_logprobs)
            member.cumulative_logprob += sample.logprob
        token = member.output_token_ids[-1 if position is None else position]
        return self._detokenize(request, member, token, last)

    def _fail(self, request: _Request, reason: str) -> None:
        """End every unfinished sequence of the request with finish_reason "error"; free their blocks."""
        for seq in request.seqs:
            if seq is not None and not seq.is_finished:
                self.scheduler.finish(seq.seq_id, "error", error=reason)

    def _detokenize(self, request: _Request, seq: Sequence, token: int, last: bool) -> str | None:
        detok = request.detokenizers[seq.index]
        before = len(detok.text)
        detok.add(token)
        if seq.is_finished and last:
            detok.flush()
        stops = seq.params.stop_strings
        if stops and len(detok.text) > before:
            # Only text that this token added can complete a stop string.
            search_from = max(0, before - max(len(s) for s in stops) + 1)
            found = [(i, s) for s in stops if (i := detok.text.find(s, search_from)) >= 0]
            if found:
                index, stop = min(found)
                keep = len(stop) if seq.params.include_stop_str_in_output else 0
                detok.text = detok.text[: index + keep]
                if not seq.is_finished:
                    self.scheduler.finish(seq.seq_id, "stop", stop_reason=stop)
                elif seq.finish_reason == "length":
                    seq.finish("stop", stop_reason=stop)
                request.texts[seq.index] = detok.text
                return stop
        request.texts[seq.index] = detok.text
        return None

    def _output(self, request: _Request, finished: bool) -> RequestOutput:
        parent = request.seqs[0]
        assert parent is not None
        delta = request.params.output_kind == "delta"
        completions = []
        for index, seq in enumerate(request.seqs):
            if seq is None:  # a sibling not forked yet (the parent failed before its prompt finished)
                completions.append(CompletionOutput(index, "", [], parent.finish_reason, error=parent.error))
                continue
            text = request.texts[index]
            stops = seq.params.stop_strings
            if stops and not seq.is_finished:
                # Hold back a tail that may still grow into a stop string.
                text = text[: max(0, len(text) - max(len(s) for s in stops) + 1)]
            token_ids, logprobs = seq.output_token_ids, seq.logprobs
            if delta:
                sent, sent_chars = request.sent_tokens[index], request.sent_chars[index]
                request.sent_tokens[index], request.sent_chars[index] = (
                    len(token_ids),
                    max(sent_chars, len(text)),
                )
                token_ids, text = token_ids[sent:], text[sent_chars:]
                if logprobs is not None:
                    seq.logprobs = []  # they go out now: the engine keeps none of them
            completions.append(
                CompletionOutput(
                    index=index,
                    text=text,
                    token_ids=list(token_ids),
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    logprobs=None if logprobs is None else list(logprobs),
                    cumulative_logprob=seq.cumulative_logprob if seq.params.logprobs is not None else None,
                    error=seq.error,
                )
            )
        prompt_logprobs = None if request.prompt_logprobs is None else list(request.prompt_logprobs)
        if delta and request.sent_prompt_logprobs:
            prompt_logprobs = None
        request.sent_prompt_logprobs = True
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=completions,
            finished=finished,
            prompt_logprobs=prompt_logprobs,
            error=next((c.error for c in completions if c.error is not None), None),
        )
