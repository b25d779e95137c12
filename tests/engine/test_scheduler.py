"""Schedulers driven with fake tokens: slots, budgets, chunked prefill, preemption, failures, static."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from inflight.engine.kv_cache import KVCacheManager
from inflight.engine.scheduler import (
    ContinuousScheduler,
    Scheduler,
    StaticScheduler,
    StepRecord,
    create_scheduler,
)
from inflight.engine.sequence import SamplingParams, Sequence


def make(
    policy: str = "continuous",
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 4,
    budget: int = 64,
    max_model_len: int = 256,
    caching: bool = True,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
    return create_scheduler(
        "continuous" if policy == "continuous" else "static",
        kv,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
    )


def request(rid: str, prompt_len: int, max_tokens: int, n: int = 1, first: int = 1) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True)
    return Sequence(rid, [first + i for i in range(prompt_len)], params)


def fake_token(seq: Sequence) -> int:
    return 1000 + seq.num_tokens


def run_step(sched: Scheduler) -> tuple[list[Sequence], StepRecord]:
    records: list[StepRecord] = []
    sched.on_step = records.append
    out = sched.schedule()
    assert len(sched.running) <= sched.max_num_seqs
    assert out.num_batched_tokens <= sched.max_num_batched_tokens
    sampled = {s.seq.seq_id: [fake_token(s.seq)] * s.seq.slots_needed for s in out.sampling}
    forked = sched.update(out, sampled)
    sched.kv_cache.check_consistency()
    return forked, records[0]


def run_all(sched: Scheduler, max_steps: int = 2000) -> list[StepRecord]:
    trace = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return trace
        trace.append(run_step(sched)[1])
    raise AssertionError("scheduler did not finish: deadlock or livelock")


def test_continuous_refills_a_finished_slot_on_the_next_step() -> None:
    sched = make(max_num_seqs=2)
    a, b, c = request("a", 4, 1), request("b", 4, 5), request("c", 4, 3)
    for seq in (a, b, c):
        sched.add(seq)
    _, first = run_step(sched)
    assert first.admitted == ("a", "b") and first.finished == ("a",)
    _, second = run_step(sched)
    assert second.admitted == ("c",)
    assert dict(second.scheduled) == {"b": 1, "c": 4}
    run_all(sched)
    assert [s.num_output_tokens for s in (a, b, c)] == [1, 5, 3]
    assert all(s.finish_reason == "length" for s in (a, b, c))


def test_static_waits_for_the_whole_batch() -> None:
    sched = make("static", max_num_seqs=2)
    for rid, out_len in (("a", 1), ("b", 5), ("c", 3)):
        sched.add(request(rid, 4, out_len))
    trace = run_all(sched)
    admitted = [(r.step, r.admitted) for r in trace if r.admitted]
    # c is admitted only after b (the longest of the first batch) finished at step 4.
    assert admitted == [(0, ("a", "b")), (5, ("c",))]
    assert all(len(r.scheduled) == 1 for r in trace[1:5])  # a's slot stays idle


def test_chunked_prefill_respects_the_budget_and_mixes_with_decode() -> None:
    sched = make(budget=8)
    sched.add(request("short", 3, 6))
    run_step(sched)
    sched.add(request("long", 20, 2))
    _, rec = run_step(sched)
    assert dict(rec.scheduled) == {"short": 1, "long": 7}
    _, rec = run_step(sched)
    assert dict(rec.scheduled) == {"short": 1, "long": 7}
    _, rec = run_step(sched)
    assert dict(rec.scheduled) == {"short": 1, "long": 6}


def test_out_of_blocks_preempts_the_newest_and_recomputes_it() -> None:
    sched = make(num_blocks=6, block_size=4, max_num_seqs=3, caching=False)
    seqs = [request(r, 7, 10, first=10 * i) for i, r in enumerate("abc")]
    for seq in seqs:
        sched.add(seq)
    trace = run_all(sched)
    preempted = [p for r in trace for p in r.preempted]
    assert preempted and preempted[0] == "c"
    assert sched.num_preemptions_total == len(preempted)
    assert all(s.num_output_tokens == 10 and s.finish_reason == "length" for s in seqs)
    assert sched.kv_cache.num_free_blocks == 6


def test_request_that_can_never_fit_fails_with_a_reason() -> None:
    sched = make(num_blocks=4, block_size=4, max_model_len=64)
    too_long = request("long", 70, 1)
    too_big = request("big", 10, 20)  # 30 tokens > 16 in the pool
    ok = request("ok", 4, 2)
    for seq in (too_long, too_big, ok):
        sched.add(seq)
    out = sched.schedule()
    assert [s.seq_id for s in out.failed] == ["long", "big"]
    assert too_long.finish_reason == "error" and "max_model_len is 64" in (too_long.error or "")
    assert too_big.finish_reason == "error" and "whole pool has 4" in (too_big.error or "")
    assert out.admitted == ["ok"]


def test_abort_frees_blocks_everywhere() -> None:
    sched = make(max_num_seqs=1)
    a, b = request("a", 9, 5), request("b", 9, 5)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    assert sched.kv_cache.num_used_blocks > 0
    assert sched.abort("a") == [a] and a.finish_reason == "abort"
    assert sched.abort("b") == [b]
    assert sched.kv_cache.num_used_blocks == 0
    assert not sched.has_unfinished()


def test_prefix_cache_hit_skips_computed_blocks() -> None:
    sched = make(block_size=4)
    sched.add(request("a", 10, 1))
    run_all(sched)
    sched.add(request("b", 10, 1))
    _, rec = run_step(sched)
    assert dict(rec.scheduled) == {"b": 2}  # 8 of 10 prompt tokens were cached
    assert sched.kv_cache.stats().prefix_cache_hits == 8


def test_n_greater_than_one_forks_after_prefill_sharing_blocks() -> None:
    sched = make(block_size=4, max_num_seqs=4)
    parent = request("p", 6, 3, n=3)
    sched.add(parent)
    forked, _ = run_step(sched)
    assert [c.seq_id for c in forked] == ["p#1", "p#2"]
    assert sched.kv_cache.block_table("p#1") == sched.kv_cache.block_table("p")
    out = sched.schedule()
    assert len(out.block_copies) == 2  # two of three writers copy the shared half-full block
    sched.update(out, {s.seq.seq_id: [7] for s in out.sampling})
    run_all(sched)
    assert all(s.num_output_tokens == 3 for s in [parent, *forked])
    assert sched.kv_cache.num_used_blocks == 0


def test_deterministic_decisions() -> None:
    def trace() -> list[StepRecord]:
        sched = make(num_blocks=12, max_num_seqs=3, budget=16)
        for i in range(8):
            sched.add(request(f"r{i}", 3 + 5 * i % 17, 2 + 3 * i % 7, first=i % 2))
        return run_all(sched)

    assert trace() == trace()


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(
        st.tuples(st.integers(1, 30), st.integers(1, 20), st.integers(1, 2)), min_size=1, max_size=12
    ),
    num_blocks=st.integers(4, 24),
    block_size=st.sampled_from([1, 2, 4]),
    max_num_seqs=st.integers(1, 5),
    budget=st.integers(1, 40),
    static=st.booleans(),
    caching=st.booleans(),
    abort_at=st.integers(0, 15),
    prefill_cap=st.one_of(st.none(), st.integers(1, 20)),
)
def test_every_request_finishes_or_fails_with_a_reason(
    lengths: list[tuple[int, int, int]],
    num_blocks: int,
    block_size: int,
    max_num_seqs: int,
    budget: int,
    static: bool,
    caching: bool,
    abort_at: int,
    prefill_cap: int | None,
) -> None:
    cls = StaticScheduler if static else ContinuousScheduler
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
    sched = cls(
        kv,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=48,
        max_prefill_tokens_while_decoding=prefill_cap,
    )
    seqs = [request(f"r{i}", p, o, n=n, first=i % 3) for i, (p, o, n) in enumerate(lengths)]
    for seq in seqs:
        sched.add(seq)
    for step in range(3000):
        if not sched.has_unfinished():
            break
        if step == abort_at:
            sched.abort("r0")
        forked, _ = run_step(sched)
        seqs += forked
    else:
        raise AssertionError("did not finish")
    for seq in seqs:
        assert seq.is_finished
        if seq.finish_reason == "error":
            assert seq.error
        elif seq.finish_reason == "length":
            assert seq.num_output_tokens == seq.params.max_tokens
        else:
            assert seq.finish_reason == "abort" and seq.request_id == "r0"
    assert kv.num_free_blocks == num_blocks


def admissions(trace: list[StepRecord]) -> list[tuple[int, tuple[str, ...]]]:
    return [(r.step, r.admitted) for r in trace if r.admitted]


def test_prompts_that_arrive_together_start_shortest_first_one_step_apart() -> None:
    # Merged into one step, each of these prompts would get its first token after all four prefills.
    sched = make(num_blocks=256, max_num_seqs=8, budget=2048, caching=False)
    for rid, prompt_len in (("a", 100), ("b", 80), ("c", 10), ("d", 70)):
        sched.add(request(rid, prompt_len, 3))
    trace = run_all(sched)
    # c (10 tokens) leaves the step under 64 prompt tokens, so d joins it; b and a get a step each.
    assert admissions(trace) == [(0, ("c", "d")), (1, ("b",)), (2, ("a",))]
    assert dict(trace[1].scheduled) == {"c": 1, "d": 1, "b": 80}


def test_later_arrivals_queue_behind_earlier_ones_whatever_their_length() -> None:
    sched = make(num_blocks=256, max_num_seqs=8, budget=2048, caching=False)
    sched.add(request("a", 100, 3))
    sched.add(request("b", 80, 3))
    run_step(sched)
    sched.add(request("e", 5, 3))
    assert admissions(run_all(sched)) == [(1, ("a",)), (2, ("e",))]


def test_an_aborted_arrival_leaves_the_order_of_the_queue_before_it() -> None:
    sched = make(num_blocks=256, max_num_seqs=1, budget=2048, caching=False)
    sched.add(request("p", 10, 20))
    run_step(sched)
    sched.add(request("q", 100, 3))
    run_step(sched)  # no free slot: q waits
    sched.add(request("r", 50, 3))
    sched.abort("r")
    sched.add(request("s", 30, 3))
    assert [seq.seq_id for seq in sched.waiting] == ["q", "s"]


def test_a_long_queue_merges_prompts_up_to_the_budget_and_staggers_only_its_last_eight() -> None:
    def admitted_per_step(**merged: int) -> list[int]:
        kv = KVCacheManager(512, 4, enable_prefix_caching=False)
        sched = ContinuousScheduler(
            kv, max_num_seqs=16, max_num_batched_tokens=4096, max_model_len=256, **merged
        )
        for i in range(12):
            sched.add(request(f"r{i}", 70, 12))
        return [len(r.admitted) for r in run_all(sched) if r.admitted]

    assert admitted_per_step() == [4, 1, 1, 1, 1, 1, 1, 1, 1]
    assert admitted_per_step(max_merged_prefill_tokens=0) == [12]


def test_static_batches_keep_the_order_of_arrival() -> None:
    sched = make("static", num_blocks=256, max_num_seqs=1, caching=False)
    sched.add(request("long", 40, 2))
    sched.add(request("short", 4, 2))
    assert admissions(run_all(sched)) == [(0, ("long",)), (2, ("short",))]


def capped(budget: int, cap: int | None, max_num_seqs: int = 4) -> Scheduler:
    kv = KVCacheManager(256, 4, enable_prefix_caching=False)
    return ContinuousScheduler(
        kv,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=256,
        max_prefill_tokens_while_decoding=cap,
    )


def test_while_a_sequence_decodes_a_long_prompt_is_prefilled_in_chunks_of_the_cap() -> None:
    """The decode waits for every prompt token of its step: with a cap, it waits for `cap` of them, not for
    a whole budget's; the prompt still finishes, in more steps."""
    sched = capped(budget=64, cap=16)
    sched.add(request("short", 3, 12))
    run_step(sched)
    sched.add(request("long", 60, 2))
    chunks = []
    for _ in range(4):
        _, rec = run_step(sched)
        scheduled = dict(rec.scheduled)
        assert scheduled["short"] == 1
        chunks.append(scheduled["long"])
    assert chunks == [16, 16, 16, 12]
    assert sched.running[-1].num_output_tokens == 1
    uncapped = capped(budget=64, cap=None)
    uncapped.add(request("short", 3, 12))
    run_step(uncapped)
    uncapped.add(request("long", 60, 2))
    _, rec = run_step(uncapped)
    assert dict(rec.scheduled) == {"short": 1, "long": 60}


def test_without_decodes_a_step_prefills_up_to_the_whole_budget() -> None:
    """Nothing decodes in the first step: the prompts there are not held to the cap."""
    sched = capped(budget=64, cap=16)
    sched.add(request("a", 40, 2))
    sched.add(request("b", 40, 2))
    _, rec = run_step(sched)
    assert dict(rec.scheduled) == {"a": 40, "b": 24}


def test_the_cap_bounds_admissions_too_and_every_request_finishes() -> None:
    """Prompts admitted while others decode share the cap with running prompts' chunks; every step's
    prompt tokens stay within it once a sequence decodes."""
    sched = capped(budget=64, cap=10, max_num_seqs=8)
    sched.add(request("first", 2, 30))
    run_step(sched)
    for i in range(6):
        sched.add(request(f"r{i}", 7, 3))
    trace = run_all(sched)
    for rec in trace:
        prompt_tokens = sum(n for sid, n in rec.scheduled if n > 1)
        assert prompt_tokens <= 10
    assert not sched.has_unfinished()
    assert sum(len(rec.admitted) for rec in trace) == 6
