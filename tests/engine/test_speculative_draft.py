"""Speculative decoding with a draft model (engine/draft.py, engine/rejection.py): greedy outputs equal
transformers' (a smaller draft with the same vocabulary, and the target as its own draft, which must
accept every proposal), sampling keeps the target's distribution (rejection sampling, checked exactly on
synthetic distributions and statistically through the engine), the draft's KV stays right through
rejections, preemptions and budget cuts, and a draft with another vocabulary is refused."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from inflight.engine.config import EngineConfig
from inflight.engine.draft import DraftProposer
from inflight.engine.engine import LLMEngine
from inflight.engine.output_processor import RequestOutput
from inflight.engine.rejection import rejection_sample
from inflight.engine.sampler import race_draws
from inflight.engine.sequence import SamplingParams

from support.models import truncated_model
from support.reference import hf_greedy

BLOCK_SIZE = 8


def chi2_bound(freedom: int) -> float:
    """The chi-square distribution's 1 - 1e-4 quantile (Wilson-Hilferty; within 2 % from 3 degrees of
    freedom). The tests' seeds are fixed, so they are deterministic: the bound says how unlikely a correct
    sampler was to fail them."""
    z = 3.719  # the standard normal's 1 - 1e-4 quantile
    return float(freedom * (1 - 2 / (9 * freedom) + z * (2 / (9 * freedom)) ** 0.5) ** 3)


@pytest.fixture(scope="module")
def draft_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama's first 3 of 4 layers: smaller, same vocabulary, close enough to be accepted often."""
    return truncated_model(tiny_llama_dir, 3, tmp_path_factory.mktemp("draft"))


def engine(
    model_dir: Path, draft: Path | None, donor: LLMEngine | None = None, **overrides: Any
) -> LLMEngine:
    settings: dict[str, Any] = {"block_size": BLOCK_SIZE, "dtype": "float32", "device": "cpu", **overrides}
    if draft is not None:
        settings.setdefault("speculative_max_running", 64)
        settings.update(speculative="draft", draft_model=str(draft))
    return LLMEngine(model_dir, EngineConfig(**settings), share_model_of=donor)


def draft_of(eng: LLMEngine) -> DraftProposer:
    assert isinstance(eng.scheduler.proposer, DraftProposer)
    return eng.scheduler.proposer


def prompts_of(count: int, vocab: int = 2048) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(2, 30))] for _ in range(count)]


def checked_generate(eng: LLMEngine, prompts: list[Any], params: list[SamplingParams]) -> list[RequestOutput]:
    """generate(), checking both KV pools' bookkeeping after every step, and that the draft holds KV only
    for unfinished sequences (and those finished this step: it lets go at its next proposal), blocks
    covering the tokens it says it holds."""
    draft = draft_of(eng)
    step = eng.step

    def checked_step() -> list[RequestOutput]:
        outputs = step()
        eng.kv_cache.check_consistency()
        draft.kv.check_consistency()
        unfinished = {s.seq_id for s in [*eng.scheduler.running, *eng.scheduler.waiting]}
        for seq_id, tokens in draft._cached.items():
            assert seq_id in unfinished or any(o.request_id in seq_id and o.finished for o in outputs)
            assert len(draft.kv.block_table(seq_id)) == draft.kv.blocks_for(len(tokens))
        return outputs

    eng.step = checked_step  # type: ignore[method-assign]
    outputs = eng.generate(prompts, params)
    assert eng.kv_cache.num_used_blocks == 0
    return outputs


# ---- greedy: identical to transformers


SETTINGS: list[dict[str, Any]] = [
    {"max_num_seqs": 8},
    {"max_num_seqs": 8, "num_kv_blocks": 10, "enable_prefix_caching": False},  # preemption
    {"max_num_seqs": 3, "max_num_batched_tokens": 16, "num_speculative_tokens": 7},  # budget cuts
]


@pytest.mark.parametrize("own_draft", [False, True], ids=["smaller-draft", "target-as-draft"])
def test_greedy_equals_transformers(tiny_llama_dir: Path, draft_dir: Path, own_draft: bool) -> None:
    prompts = prompts_of(8)
    max_tokens = [random.Random(i).randrange(1, 40) for i in range(len(prompts))]
    expected = hf_greedy(tiny_llama_dir, prompts, max_tokens)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
    draft = tiny_llama_dir if own_draft else draft_dir
    for overrides in SETTINGS:
        eng = engine(tiny_llama_dir, draft, **overrides)
        outputs = checked_generate(eng, prompts, params)
        assert [o.outputs[0].token_ids for o in outputs] == expected, overrides
        stats = eng.stats()
        assert stats.num_draft_tokens > 0, overrides
        if own_draft:
            # The target proposes what it then computes: everything is accepted.
            assert stats.num_accepted_tokens == stats.num_draft_tokens, overrides
        else:
            assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, overrides
        if "num_kv_blocks" in overrides:
            assert stats.num_preemptions > 0


def test_off_above_the_running_limit(tiny_llama_dir: Path, draft_dir: Path) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    eng = engine(tiny_llama_dir, draft_dir, max_num_seqs=8, speculative_max_running=2)
    eng.generate(prompts_of(3), params)  # three run to the end together
    assert eng.stats().num_draft_tokens == 0
    eng.generate(prompts_of(2), params)
    assert eng.stats().num_draft_tokens > 0


# ---- sampling: the target's distribution


def test_rejection_sampling_emits_the_target_distribution() -> None:
    """Whatever q the proposals come from, the first emitted token is distributed as p_1, and after an
    accepted first proposal the second as p_2 (exact frequencies over many draws, chi-square bound)."""
    gen = torch.Generator().manual_seed(5)
    p = torch.tensor([[0.5, 0.2, 0.2, 0.1, 0.0], [0.1, 0.1, 0.1, 0.3, 0.4]])
    q = torch.tensor([[0.1, 0.6, 0.1, 0.1, 0.1], [0.4, 0.1, 0.1, 0.2, 0.2]])
    bonus_p = torch.tensor([0.25, 0.25, 0.25, 0.25, 0.0])
    draws = 20000
    first: Counter[int] = Counter()
    second: Counter[int] = Counter()
    for _ in range(draws):
        draft = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(2)]
        bonus = int(torch.multinomial(bonus_p, 1, generator=gen))
        uniforms = 1 - torch.rand(2, generator=gen)
        noise = torch.empty(2, race_draws(5)).exponential_(generator=gen)
        tokens = rejection_sample(p, draft, q, uniforms, noise, bonus)
        assert tokens[:-1] == draft[: len(tokens) - 1]
        first[tokens[0]] += 1
        if len(tokens) > 1:
            second[tokens[1]] += 1
    assert chi_square(first, p[0]) < chi2_bound(3)
    assert chi_square(second, p[1]) < chi2_bound(4)


def chi_square(counts: Counter[int], probs: torch.Tensor) -> float:
    """Pearson's statistic of `counts` against `probs` (cells of probability 0 must be empty)."""
    total = sum(counts.values())
    statistic = 0.0
    for token, prob in enumerate(probs.tolist()):
        if prob == 0:
            assert counts[token] == 0, f"token {token} has probability 0 but was drawn"
            continue
        expected = total * prob
        statistic += (counts[token] - expected) ** 2 / expected
    return statistic


def test_engine_sampling_keeps_the_target_distribution(tiny_llama_dir: Path, draft_dir: Path) -> None:
    """Seeded requests (top_k 4: a four-token vocabulary per position) whose second token is the first
    speculated one: its frequencies given the first token match the target's probabilities."""
    prompt = prompts_of(1)[0]
    count = 1200
    params = [
        SamplingParams(max_tokens=3, temperature=1.0, top_k=4, seed=seed, ignore_eos=True)
        for seed in range(count)
    ]
    eng = engine(tiny_llama_dir, draft_dir, max_num_seqs=64)
    outputs = eng.generate([prompt] * count, params)
    stats = eng.stats()
    # Proposals were drawn from q and both accepted and rejected (residual draws happened).
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    by_first: dict[int, Counter[int]] = {}
    for output in outputs:
        tokens = output.outputs[0].token_ids
        by_first.setdefault(tokens[0], Counter())[tokens[1]] += 1
    reference = engine(tiny_llama_dir, None)
    statistic, freedom = 0.0, 0
    for first, counts in by_first.items():
        if sum(counts.values()) < 100:
            continue
        probe = SamplingParams(max_tokens=1, temperature=0.0, logprobs=4)
        top = reference.generate([[*prompt, first]], probe)[0].outputs[0].logprobs
        assert top is not None
        logprobs = {t: lp.logprob for t, lp in top[0].items()}
        ids = sorted(logprobs)
        probs = torch.softmax(torch.tensor([logprobs[t] for t in ids]), dim=0)
        assert set(counts) <= set(ids), "a token outside the target's top 4 was emitted"
        statistic += chi_square(Counter({ids.index(t): n for t, n in counts.items()}), probs)
        freedom += 3
    assert freedom >= 3
    assert statistic < chi2_bound(freedom)


def test_seeded_sampling_is_reproducible(tiny_llama_dir: Path, draft_dir: Path) -> None:
    prompts = prompts_of(4)
    params = [
        SamplingParams(max_tokens=20, temperature=0.8, seed=i, ignore_eos=True, logprobs=1) for i in range(4)
    ]
    first = [o.outputs[0].token_ids for o in engine(tiny_llama_dir, draft_dir).generate(prompts, params)]
    alone = [
        engine(tiny_llama_dir, draft_dir).generate([p], [s])[0].outputs[0].token_ids
        for p, s in zip(prompts, params, strict=True)
    ]
    assert first == alone


def test_an_engine_sharing_a_donors_model_shares_its_draft_too(tiny_llama_dir: Path, draft_dir: Path) -> None:
    donor = engine(tiny_llama_dir, draft_dir, max_num_seqs=4)
    sharer = engine(tiny_llama_dir, draft_dir, donor, max_num_seqs=4)
    assert sharer.model is donor.model and sharer.draft_model is donor.draft_model is not None
    assert draft_of(sharer).kv is not draft_of(donor).kv  # its own draft KV pool
    prompts = prompts_of(4)
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)] * len(prompts)
    expected = hf_greedy(tiny_llama_dir, prompts, [12] * len(prompts))
    assert [o.outputs[0].token_ids for o in checked_generate(sharer, prompts, params)] == expected
    other = engine(tiny_llama_dir, tiny_llama_dir, donor, max_num_seqs=4)
    assert other.model is donor.model and other.draft_model is not donor.draft_model


# ---- refused at start


def test_a_draft_with_another_vocabulary_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    other = truncated_model(tiny_llama_dir, 1, tmp_path / "other")
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    token = next(t for t, i in vocab.items() if i == 100)
    vocab[token + "-renamed"] = vocab.pop(token)
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    for weights in other.glob("*.safetensors"):
        weights.unlink()  # refused from its tokenizer and config, before any weights are read
    with pytest.raises(ValueError, match="different tokenizer vocabulary") as error:
        engine(tiny_llama_dir, other)
    assert str(other) in str(error.value) and str(tiny_llama_dir) in str(error.value)


def test_config_needs_a_draft_model() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="needs draft_model"):
        EngineConfig(speculative="draft")
    with pytest.raises(ValidationError, match="set speculative='draft'"):
        EngineConfig(draft_model="/models/draft")


def test_command_line_flags() -> None:
    import argparse

    from inflight.engine.cli_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(["--speculative", "draft", "--draft-model", "/m/d"]))
    assert (config.speculative, config.draft_model) == ("draft", "/m/d")
    with pytest.raises(SystemExit, match="needs draft_model"):
        engine_config_from_args(parser.parse_args(["--speculative", "draft"]))
