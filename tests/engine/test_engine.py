"""LLMEngine / LLM behaviour on the tiny llama checkpoint: seeds, stops, n > 1, failures, aborts, logprobs."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from inflight import LLM, SamplingParams
from inflight.engine.config import CPU_PREFILL_TOKENS_WHILE_DECODING, EngineConfig
from inflight.engine.engine import LLMEngine
from inflight.engine.model.config import ModelConfig
from inflight.engine.model.llama import LlamaForCausalLM
from inflight.engine.output_processor import RequestOutput
from inflight.engine.sampler import SampleResult, SamplingRow
from inflight.sizing import find_model, shape_of_config

PROMPTS = ["def main(", "import os\nimport sys", "class Foo:\n    def", "x = 1", "for i in range(10):"]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(tiny_llama_dir, max_slots=8, num_kv_blocks=128, block_size=8, dtype="float32", device="cpu")


def greedy(max_tokens: int = 12, **kwargs: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)  # type: ignore[arg-type]


def test_generate_returns_one_output_per_prompt_in_order(llm: LLM) -> None:
    outputs = llm.generate(PROMPTS, greedy())
    assert [o.prompt for o in outputs] == PROMPTS
    for output in outputs:
        assert output.finished
        assert output.prompt_token_ids == llm.tokenizer.encode(output.prompt or "")
        (completion,) = output.outputs
        assert len(completion.token_ids) == 12 and completion.finish_reason == "length"
        assert completion.text == llm.tokenizer.decode(completion.token_ids)
    # Token-id prompts give the same as their text.
    again = llm.generate([o.prompt_token_ids for o in outputs], greedy())
    assert [a.outputs[0].token_ids for a in again] == [o.outputs[0].token_ids for o in outputs]


def test_seeded_request_is_the_same_alone_and_inside_a_full_batch(llm: LLM) -> None:
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=42, ignore_eos=True)
    alone = llm.generate(["def main("], seeded)[0].outputs[0].token_ids
    crowd = [SamplingParams(max_tokens=20, temperature=0.9, ignore_eos=True) for _ in range(7)]
    batch = llm.generate([*PROMPTS, "a", "b", "def main("], [*crowd, seeded])
    assert batch[-1].outputs[0].token_ids == alone
    other_seed = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=43, ignore_eos=True)
    assert llm.generate(["def main("], other_seed)[0].outputs[0].token_ids != alone


def test_greedy_n_copies_share_the_prompt_blocks_and_match_n_equals_one(llm: LLM) -> None:
    engine = llm.engine
    single = llm.generate([PROMPTS[1]], greedy(10))[0].outputs[0].token_ids
    engine.add_request("fork", PROMPTS[1], greedy(10, n=3))
    engine.step()  # prefill, then fork into three sequences
    tables = [engine.kv_cache.block_table(s) for s in ("fork", "fork#1", "fork#2")]
    assert tables[0][0] == tables[1][0] == tables[2][0]  # the prompt's first block is shared
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    final = outputs[-1]
    assert final.finished and [c.index for c in final.outputs] == [0, 1, 2]
    # Copy-on-write kept every copy's cache intact: all three equal the single greedy run.
    assert all(c.token_ids == single for c in final.outputs)
    assert engine.kv_cache.num_used_blocks == 0


def test_sampled_n_gives_different_completions(llm: LLM) -> None:
    params = SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=1, ignore_eos=True)
    completions = llm.generate(["x = 1"], params)[0].outputs
    assert len({tuple(c.token_ids) for c in completions}) == 3


def test_stop_string_truncates_the_text_and_names_the_stop(llm: LLM) -> None:
    full = llm.generate([PROMPTS[0]], greedy(16))[0].outputs[0]
    stop = full.text[5:8]
    assert stop
    engine = llm.engine
    engine.add_request("stop", PROMPTS[0], greedy(16, stop=[stop, "never appears \u2603"]))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    got = outputs[-1].outputs[0]
    assert got.text == full.text[: full.text.index(stop)]
    assert got.finish_reason == "stop" and got.stop_reason == stop
    assert len(got.token_ids) < 16
    # Streamed (cumulative) texts only grow and never show a stop string, even partly.
    texts = [o.outputs[0].text for o in outputs]
    assert all(got.text.startswith(t) for t in texts)


def test_stop_token_id_and_eos_end_the_sequence(llm: LLM) -> None:
    full = llm.generate([PROMPTS[2]], greedy(12))[0].outputs[0].token_ids
    third = full[2]
    first_at = full.index(third)
    got = llm.generate([PROMPTS[2]], greedy(12, stop_token_ids=[third]))[0].outputs[0]
    assert got.token_ids == full[: first_at + 1]
    assert got.finish_reason == "stop" and got.stop_reason == third
    engine = llm.engine
    saved = engine.eos_token_ids
    engine.eos_token_ids = frozenset({third})
    try:
        eos = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=12, temperature=0))[0].outputs[0]
        ignored = llm.generate([PROMPTS[2]], greedy(12))[0].outputs[0]
    finally:
        engine.eos_token_ids = saved
    assert eos.token_ids == full[: first_at + 1] and eos.finish_reason == "stop" and eos.stop_reason is None
    assert ignored.token_ids == full


def test_request_that_can_never_fit_fails_with_a_reason(tiny_llama_dir: Path) -> None:
    engine = LLMEngine(tiny_llama_dir, EngineConfig(num_kv_blocks=4, block_size=8, device="cpu"))
    assert engine.max_model_len == 32
    assert engine.capacity_error(30, SamplingParams(max_tokens=8)) is not None
    engine.add_request("big", list(range(5, 35)), SamplingParams(max_tokens=8))
    engine.add_request("ok", list(range(5, 15)), greedy(4))
    outputs = {o.request_id: o for o in engine.step()}
    failed = outputs["big"]
    assert failed.finished and failed.outputs[0].finish_reason == "error"
    assert failed.error and "max_model_len 32" in failed.error
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_cache.num_used_blocks == 0


def test_abort_frees_blocks_and_stops_outputs(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("a", PROMPTS[1], greedy(30))
    engine.add_request("b", PROMPTS[2], greedy(5))
    engine.step()
    engine.step()
    used = engine.kv_cache.num_used_blocks
    engine.abort("a")
    assert engine.kv_cache.num_used_blocks < used
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert {o.request_id for o in outputs} == {"b"}
    assert engine.kv_cache.num_used_blocks == 0
    engine.abort("unknown")  # ignored


def test_logprobs_and_cumulative_logprob(llm: LLM) -> None:
    completion = llm.generate([PROMPTS[3]], greedy(6, logprobs=3))[0].outputs[0]
    assert completion.logprobs is not None and len(completion.logprobs) == 6
    total = 0.0
    for token, position in zip(completion.token_ids, completion.logprobs, strict=True):
        assert position[token].rank == 1  # greedy takes the most likely token
        assert len(position) == 3
        assert position[token].decoded_token == llm.tokenizer.decode([token], skip_special_tokens=False)
        total += position[token].logprob
    assert completion.cumulative_logprob == pytest.approx(total)


def test_prompt_logprobs_match_a_full_forward_and_survive_chunking(tiny_llama_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    prompt = "import os\nimport sys\nimport json\nclass Foo:\n    def bar(self):"
    params = greedy(2, prompt_logprobs=1)
    # float32: compared with transformers' float32 forward within 1e-4.
    chunked = LLM(
        tiny_llama_dir,
        num_kv_blocks=64,
        block_size=8,
        max_num_batched_tokens=7,
        device="cpu",
        dtype="float32",
    )
    whole = LLM(tiny_llama_dir, num_kv_blocks=64, block_size=8, device="cpu", dtype="float32")
    a = chunked.generate([prompt], params)[0]
    b = whole.generate([prompt], params)[0]
    ids = a.prompt_token_ids
    assert a.prompt_logprobs is not None and b.prompt_logprobs is not None
    assert len(a.prompt_logprobs) == len(ids) and a.prompt_logprobs[0] is None
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.inference_mode():
        reference = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    for pos in range(1, len(ids)):
        for entries in (a.prompt_logprobs[pos], b.prompt_logprobs[pos]):
            assert entries is not None
            assert entries[ids[pos]].logprob == pytest.approx(reference[pos - 1, ids[pos]].item(), abs=1e-4)
            assert math.isfinite(entries[ids[pos]].logprob)


def test_bad_requests_raise_value_error(llm: LLM) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.engine.add_request("bad", [10**7], greedy())
    llm.engine.add_request("dup", "x", greedy(1))
    with pytest.raises(ValueError, match="already in use"):
        llm.engine.add_request("dup", "x", greedy(1))
    llm.engine.abort("dup")


def test_stats_count_tokens_and_prefix_hits(tiny_llama_dir: Path) -> None:
    llm = LLM(tiny_llama_dir, num_kv_blocks=64, block_size=4, max_slots=2, device="cpu")
    prompt = list(range(10, 30))
    llm.generate([prompt, prompt, prompt], greedy(3))
    stats = llm.engine.stats()
    assert stats.num_generation_tokens == 9
    assert stats.num_prompt_tokens == 60
    assert stats.num_prefix_cache_hits >= 16
    assert stats.num_running == stats.num_waiting == stats.num_used_blocks == 0
    assert stats.num_blocks == 64 and stats.max_num_seqs == 2


def test_preempted_and_forked_sequences_recompute_to_the_same_tokens(tiny_llama_dir: Path) -> None:
    prompts = [list(range(10 + i, 40 + i)) for i in range(6)]
    params = [
        SamplingParams(n=2, max_tokens=20, temperature=0.0, ignore_eos=True),
        *[SamplingParams(max_tokens=20, temperature=0.9, seed=i, ignore_eos=True) for i in range(5)],
    ]
    roomy = LLM(tiny_llama_dir, num_kv_blocks=128, block_size=8, max_slots=8, device="cpu")
    tight = LLM(tiny_llama_dir, num_kv_blocks=16, block_size=8, max_slots=8, device="cpu")
    expected = roomy.generate(prompts, params)
    got = tight.generate(prompts, params)
    assert roomy.engine.stats().num_preemptions == 0
    assert tight.engine.stats().num_preemptions > 0
    for want, have in zip(expected, got, strict=True):
        assert [c.token_ids for c in have.outputs] == [c.token_ids for c in want.outputs]
    assert expected[0].outputs[0].token_ids == expected[0].outputs[1].token_ids  # greedy copies agree


def test_generate_with_a_bad_prompt_leaves_nothing_behind(llm: LLM) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(["fine", [10**7]], greedy(2))
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv_cache.num_used_blocks == 0


POISON_SEED = 666  # the poisoned sampler below raises for rows of requests with this seed


def poison_sampling(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch, after_tokens: int) -> None:
    """Make the engine's sampler raise for any batch holding a POISON_SEED request past `after_tokens`."""
    sampler = engine.runner.sampler

    def poisoned(logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampleResult]:
        if any(r.params.seed == POISON_SEED and r.output_position >= after_tokens for r in rows):
            raise RuntimeError("poisoned sampling parameters")
        return sampler(logits, rows)

    monkeypatch.setattr(engine.runner, "sampler", poisoned)


def test_a_request_whose_sampling_fails_fails_alone(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = LLMEngine(
        tiny_llama_dir, EngineConfig(max_num_seqs=8, num_kv_blocks=64, block_size=8, device="cpu")
    )
    prompts = PROMPTS[:4]
    params = [greedy(8), greedy(8, seed=POISON_SEED), greedy(8, n=2), greedy(8)]
    reference = engine.generate(prompts, [greedy(8), greedy(8), greedy(8, n=2), greedy(8)])
    poison_sampling(engine, monkeypatch, after_tokens=3)
    outputs = engine.generate(prompts, params)
    failed = outputs[1]
    assert failed.finished and failed.outputs[0].finish_reason == "error"
    assert failed.error is not None and "poisoned sampling parameters" in failed.error
    assert failed.outputs[0].error == failed.error
    assert failed.outputs[0].token_ids == reference[1].outputs[0].token_ids[:3]  # what it had before
    for index in (0, 2, 3):  # the others, batched with it all along, are untouched
        assert [c.token_ids for c in outputs[index].outputs] == [
            c.token_ids for c in reference[index].outputs
        ]
        assert all(c.finish_reason == "length" for c in outputs[index].outputs)
    assert engine.kv_cache.num_used_blocks == 0 and not engine.has_unfinished_requests()


def test_a_forking_request_whose_first_draw_fails_fails_alone(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = LLMEngine(
        tiny_llama_dir, EngineConfig(max_num_seqs=8, num_kv_blocks=64, block_size=8, device="cpu")
    )
    reference = engine.generate(PROMPTS[:2], greedy(5))
    poison_sampling(engine, monkeypatch, after_tokens=0)
    outputs = engine.generate(PROMPTS[:2], [greedy(5), greedy(5, n=3, seed=POISON_SEED)])
    assert outputs[0].outputs[0].token_ids == reference[0].outputs[0].token_ids
    assert [c.finish_reason for c in outputs[1].outputs] == ["error"] * 3
    assert outputs[1].error is not None and "poisoned" in outputs[1].error
    assert engine.kv_cache.num_used_blocks == 0


def test_huge_top_k_means_no_top_k_and_tiny_temperature_is_greedy(llm: LLM) -> None:
    seeded = {"max_tokens": 8, "temperature": 0.8, "seed": 3, "ignore_eos": True}
    unfiltered = llm.generate([PROMPTS[0]], SamplingParams(**seeded))[0].outputs[0].token_ids  # type: ignore[arg-type]
    huge = llm.generate([PROMPTS[0]], SamplingParams(**{**seeded, "top_k": 2**63}))[0].outputs[0]  # type: ignore[arg-type]
    assert huge.token_ids == unfiltered
    tiny = SamplingParams(max_tokens=8, temperature=1e-300, ignore_eos=True)
    assert tiny.greedy
    assert (
        llm.generate([PROMPTS[0]], tiny)[0].outputs[0].token_ids
        == llm.generate([PROMPTS[0]], greedy(8))[0].outputs[0].token_ids
    )


@pytest.mark.parametrize(
    "field", ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"]
)
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_sampling_params_reject_non_finite_numbers(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_a_request_whose_output_processing_fails_fails_alone(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = LLMEngine(
        tiny_llama_dir, EngineConfig(max_num_seqs=8, num_kv_blocks=64, block_size=8, device="cpu")
    )
    reference = engine.generate(PROMPTS[:2], greedy(6))
    detokenize = engine.outputs._detokenize

    def broken(request: Any, seq: Any, *rest: Any) -> str | None:
        if request.request_id.endswith("-1") and seq.num_output_tokens >= 3:  # the second prompt only
            raise UnicodeError("undecodable bytes")
        return detokenize(request, seq, *rest)

    monkeypatch.setattr(engine.outputs, "_detokenize", broken)
    good, bad = engine.generate(PROMPTS[:2], greedy(6))
    assert good.outputs[0].token_ids == reference[0].outputs[0].token_ids
    assert bad.outputs[0].finish_reason == "error"
    assert bad.error is not None and "undecodable bytes" in bad.error
    assert engine.kv_cache.num_used_blocks == 0 and not engine.has_unfinished_requests()


def test_delta_outputs_add_up_to_the_cumulative_ones(llm: LLM) -> None:
    engine = llm.engine
    # n=2, logprobs, prompt logprobs, and a stop string that holds back the text's tail while running.
    params = greedy(12, n=2, logprobs=2, prompt_logprobs=1, stop=["\x00never"])
    engine.add_request("cumulative", PROMPTS[2], params)
    engine.add_request("delta", PROMPTS[2], replace(params, output_kind="delta"))
    seen: dict[str, list[RequestOutput]] = {"cumulative": [], "delta": []}
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen[output.request_id].append(output)
    final, deltas = seen["cumulative"][-1], seen["delta"]
    assert len(deltas) > 2 and deltas[-1].finished
    for index, whole in enumerate(final.outputs):
        parts = [d.outputs[index] for d in deltas]
        assert [t for p in parts for t in p.token_ids] == whole.token_ids
        assert "".join(p.text for p in parts) == whole.text
        assert [lp for p in parts for lp in p.logprobs or []] == whole.logprobs
        assert parts[-1].finish_reason == whole.finish_reason == "length"
    assert [d.prompt_logprobs is not None for d in deltas] == [True] + [False] * (len(deltas) - 1)
    assert deltas[0].prompt_logprobs == final.prompt_logprobs
    # Merging the deltas (what the server does for a consumer that fell behind) gives the same again.
    merged = deltas[0]
    for later in deltas[1:]:
        merged.merge(later)
    assert merged.finished and merged.prompt_logprobs == final.prompt_logprobs
    for mine, whole in zip(merged.outputs, final.outputs, strict=True):
        assert (mine.token_ids, mine.text, mine.logprobs, mine.finish_reason, mine.cumulative_logprob) == (
            whole.token_ids,
            whole.text,
            whole.logprobs,
            whole.finish_reason,
            whole.cumulative_logprob,
        )


def test_offline_prompts_keep_the_whole_budget_while_others_decode(tiny_llama_dir: Path) -> None:
    """LLM (offline) schedules for throughput: no cap on prompt tokens beside decodes unless one is given;
    the server's engine (LLMEngine from EngineConfig's defaults) holds them to the CPU default."""
    offline = LLM(tiny_llama_dir, num_kv_blocks=64, block_size=8, device="cpu", max_num_batched_tokens=1024)
    assert offline.engine.scheduler.max_prefill_tokens_while_decoding == 1024
    chosen = LLM(
        tiny_llama_dir, num_kv_blocks=64, block_size=8, device="cpu", max_prefill_tokens_while_decoding=32
    )
    assert chosen.engine.scheduler.max_prefill_tokens_while_decoding == 32
    served = LLMEngine(tiny_llama_dir, EngineConfig(num_kv_blocks=64, block_size=8, device="cpu"))
    assert served.scheduler.max_prefill_tokens_while_decoding == CPU_PREFILL_TOKENS_WHILE_DECODING


def test_the_cpu_prefill_cap_follows_the_models_layers(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The served engine's cap on prompt tokens beside decodes comes from the work of its model's layers:
    what the loaded projections multiply a token (as the sizing's shape counts them), and fewer tokens
    for layers ten times SmolLM2-135M's."""
    served = LLMEngine(tiny_llama_dir, EngineConfig(num_kv_blocks=64, block_size=8, device="cpu"))
    shape = shape_of_config("tiny", ModelConfig.from_dir(tiny_llama_dir))
    assert served.model.layer_weights() == shape.linear_parameter_count()
    served.model.layers[0].mlp.down_proj = torch.nn.Identity()
    with pytest.raises(TypeError, match="projection is a Identity: no weights to count"):
        served.model.layer_weights()
    smollm2 = find_model("builtin:smollm2")
    assert smollm2 is not None
    ten_times = 10 * smollm2.linear_parameter_count()
    monkeypatch.setattr(LlamaForCausalLM, "layer_weights", lambda _: ten_times)
    larger = LLMEngine(tiny_llama_dir, EngineConfig(num_kv_blocks=64, block_size=8, device="cpu"))
    assert larger.scheduler.max_prefill_tokens_while_decoding == CPU_PREFILL_TOKENS_WHILE_DECODING // 10
