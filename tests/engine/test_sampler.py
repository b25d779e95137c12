"""Sampler on hand-made logits: greedy, temperature, top-k/top-p/min-p, penalties, seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from inflight.engine import sampler as sampler_module
from inflight.engine.sampler import RACE_BLOCK, Sampler, SamplingRow, race, race_draws, sampling_weights
from inflight.engine.sequence import SamplingParams

# probabilities 0.5, 0.3, 0.2, 0 (token 3 is impossible)
PROBS = [0.5, 0.3, 0.2]
LOGITS = [math.log(p) for p in PROBS] + [-1e9]


def rows(
    params: SamplingParams, count: int, context: list[int] | None = None, prompt: int = 0
) -> list[SamplingRow]:
    return [SamplingRow(params, context or [], prompt, index=0, output_position=i) for i in range(count)]


def draw(params: SamplingParams, count: int = 3000, logits: list[float] = LOGITS) -> list[int]:
    sampler = Sampler(seed=0)
    batch = torch.tensor([logits] * count)
    return [r.token_id for r in sampler(batch, rows(params, count))]


def frequencies(tokens: list[int]) -> list[float]:
    return [tokens.count(t) / len(tokens) for t in range(4)]


def test_greedy_takes_the_argmax() -> None:
    assert set(draw(SamplingParams(temperature=0), 5)) == {0}


def test_temperature_one_follows_the_distribution() -> None:
    freq = frequencies(draw(SamplingParams(temperature=1.0, seed=None)))
    for got, want in zip(freq, [*PROBS, 0.0], strict=True):
        assert abs(got - want) < 0.04


def test_low_temperature_sharpens() -> None:
    assert frequencies(draw(SamplingParams(temperature=0.2)))[0] > 0.85


def test_top_k_keeps_only_the_k_most_likely() -> None:
    tokens = draw(SamplingParams(top_k=2))
    assert set(tokens) == {0, 1}
    assert abs(frequencies(tokens)[0] - 0.5 / 0.8) < 0.04


@pytest.mark.parametrize(("top_p", "allowed"), [(0.5, {0}), (0.7, {0, 1}), (0.85, {0, 1, 2})])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p: float, allowed: set[int]) -> None:
    assert set(draw(SamplingParams(top_p=top_p), 1000)) == allowed


def test_min_p_drops_tokens_below_a_share_of_the_best() -> None:
    assert set(draw(SamplingParams(min_p=0.5), 1000)) == {0, 1}  # 0.2 < 0.5 * 0.5


def test_repetition_penalty_discourages_seen_tokens() -> None:
    sampler = Sampler()
    logits = torch.tensor([[2.0, 1.5, -1.0, 0.0]])
    plain = sampler(logits, rows(SamplingParams(temperature=0), 1, context=[0, 2]))
    assert plain[0].token_id == 0
    penalized = sampler(
        logits, rows(SamplingParams(temperature=0, repetition_penalty=2.0), 1, context=[0, 2])
    )
    assert penalized[0].token_id == 1  # 2.0 / 2 = 1.0 < 1.5


def test_presence_and_frequency_penalties_use_output_tokens_only() -> None:
    sampler = Sampler()
    logits = torch.tensor([[2.0, 1.5, 0.0, 0.0]])
    # Token 0 appears in the prompt only (first 2 context tokens): no penalty.
    in_prompt = sampler(
        logits, rows(SamplingParams(temperature=0, presence_penalty=1.0), 1, [0, 0], prompt=2)
    )
    assert in_prompt[0].token_id == 0
    # Twice in the output: 2.0 - 2 * 0.3 = 1.4 < 1.5.
    in_output = sampler(
        logits, rows(SamplingParams(temperature=0, frequency_penalty=0.3), 1, [3, 0, 0], prompt=1)
    )
    assert in_output[0].token_id == 1


def test_seeded_draw_depends_only_on_seed_index_and_position() -> None:
    params = SamplingParams(seed=7)
    sampler = Sampler(seed=123)
    logits = torch.randn(1, 50)
    alone = sampler(logits, [SamplingRow(params, [], 0, index=0, output_position=5)])[0].token_id
    crowd = torch.cat([torch.randn(3, 50), logits, torch.randn(2, 50)])
    crowd_rows = [SamplingRow(SamplingParams(seed=i), [], 0, 0, 5) for i in range(3)]
    crowd_rows += [SamplingRow(params, [], 0, index=0, output_position=5)]
    crowd_rows += [SamplingRow(SamplingParams(), [], 0, 0, 5) for _ in range(2)]
    assert Sampler(seed=999)(crowd, crowd_rows)[3].token_id == alone
    # Across positions the seeded draws vary (not one fixed token).
    varied = {sampler(logits, [SamplingRow(params, [], 0, 0, p)])[0].token_id for p in range(40)}
    assert len(varied) > 5


def test_logprobs_report_the_raw_distribution_with_ranks() -> None:
    sampler = Sampler()
    logits = torch.tensor([LOGITS])
    result = sampler(logits, rows(SamplingParams(temperature=0, logprobs=2), 1))[0]
    assert result.token_id == 0
    assert result.top_logprobs is not None
    assert set(result.top_logprobs) == {0, 1}
    assert result.top_logprobs[1].rank == 2
    assert result.top_logprobs[1].logprob == pytest.approx(math.log(0.3), rel=1e-5)
    assert result.logprob == pytest.approx(math.log(0.5), rel=1e-5)


def test_sampled_token_outside_top_logprobs_is_added_with_its_rank() -> None:
    sampler = Sampler()
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    params = SamplingParams(temperature=0, logprobs=1, repetition_penalty=100.0)
    result = sampler(logits, rows(params, 1, context=[3, 2]))[0]
    assert result.token_id == 1  # penalties moved the choice; logprobs stay raw
    assert result.top_logprobs is not None
    assert set(result.top_logprobs) == {3, 1}
    assert result.top_logprobs[1].rank == 3


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", -0.1, "temperature"),
        ("top_p", 0.0, "top_p"),
        ("min_p", 1.5, "min_p"),
        ("n", 0, "n must be"),
        ("max_tokens", 0, "max_tokens"),
        ("logprobs", 21, "logprobs"),
        ("repetition_penalty", 0.0, "repetition_penalty"),
        ("stop", [""], "stop strings"),
    ],
)
def test_invalid_params_raise_value_error_naming_the_field(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_stop_accepts_a_single_string_and_top_k_minus_one_disables() -> None:
    params = SamplingParams(stop="END", top_k=-1)
    assert params.stop_strings == ["END"]
    assert params.top_k == 0


def _full_sort_filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The top-k / top-p set by ranking the whole vocabulary: the definition the sampler must match."""
    vocab = logits.shape[0]
    sorted_logits, order = logits.sort(descending=True)
    sorted_logits = sorted_logits.masked_fill(torch.arange(vocab) >= (top_k or vocab), float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    sorted_logits = sorted_logits.masked_fill(probs.cumsum(-1) - probs >= top_p, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)


def test_top_k_top_p_over_a_large_vocabulary_equals_a_full_sort() -> None:
    """Mixed rows over a 49152-token vocabulary: top_k alone, top_p alone (peaked, so the candidates
    suffice), both, neither, and a flat row whose top_p set is larger than the candidates ranked first."""
    torch.manual_seed(0)
    vocab = 49152
    peaked = torch.randn(5, vocab) * 4
    flat = torch.randn(1, vocab) * 0.01
    logits = torch.cat([peaked, flat])
    settings = [(50, 1.0), (0, 0.9), (40, 0.8), (0, 1.0), (1, 0.5), (0, 0.95)]
    batch = [
        SamplingRow(SamplingParams(temperature=1.0, top_k=k, top_p=p), [], 0, index=0, output_position=0)
        for k, p in settings
    ]
    filtered = Sampler(seed=0)._top_k_top_p(logits, batch)
    for i, (k, p) in enumerate(settings):
        expected = logits[i] if (k, p) == (0, 1.0) else _full_sort_filter(logits[i], k, p)
        kept, want = torch.isfinite(filtered[i]), torch.isfinite(expected)
        assert torch.equal(kept, want), f"row {i}: {int(kept.sum())} tokens kept, want {int(want.sum())}"
        torch.testing.assert_close(filtered[i][kept], expected[want])


@pytest.fixture(params=["C kernel", "torch"])
def race_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """`race` on CPU runs kernels.c's race_rows; "torch": its torch form (the one other devices run)."""
    if request.param == "torch":
        monkeypatch.setattr(sampler_module.cpu_kernels, "library_for", lambda *tensors: None)
    return str(request.param)


def test_the_race_in_two_rounds_draws_each_entry_with_its_probability(race_path: str) -> None:
    """Weights spread over three blocks of RACE_BLOCK entries, the last one partial (padded): each entry is
    drawn with its share of the mass (within 0.01 over 40,000 draws, > 4 standard deviations), a zero
    entry and the padding never."""
    vocab = 2 * RACE_BLOCK + 188
    weights = torch.zeros(vocab)
    chosen = {3: 0.25, RACE_BLOCK - 1: 0.05, RACE_BLOCK + 7: 0.3, 2 * RACE_BLOCK + 100: 0.2, vocab - 1: 0.1}
    for index, weight in chosen.items():
        weights[index] = weight * 2  # unnormalized
    weights[RACE_BLOCK + 8 : RACE_BLOCK + 108] = 0.1 * 2 / 100  # a spread-out tenth
    draws = 40000
    gen = torch.Generator().manual_seed(11)
    noise = torch.empty(draws, race_draws(vocab)).exponential_(generator=gen)
    tokens = race(weights.expand(draws, vocab).contiguous(), noise)
    counts = torch.bincount(tokens, minlength=vocab)
    assert counts.shape[0] == vocab  # nothing past the vocabulary
    for index, weight in chosen.items():
        assert abs(counts[index].item() / draws - weight) < 0.01, index
    spread = counts[RACE_BLOCK + 8 : RACE_BLOCK + 108].sum().item() / draws
    assert abs(spread - 0.1) < 0.01
    assert counts[weights == 0].sum().item() == 0
    assert race_draws(vocab) == 3 + RACE_BLOCK


def test_the_races_c_kernel_picks_what_its_torch_form_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both forms of `race` take the same entry for the same weights and draws, the first of equal ones in
    both rounds; the vocabulary a partial last block."""
    vocab = 3 * RACE_BLOCK + 57
    gen = torch.Generator().manual_seed(3)
    weights = torch.rand(300, vocab, generator=gen) ** 8  # peaked, as softmax rows are
    weights[:, : 2 * RACE_BLOCK] *= (torch.rand(300, 1, generator=gen) < 0.5).float()  # whole blocks at 0
    noise = torch.empty(300, race_draws(vocab)).exponential_(generator=gen)
    ties = torch.ones(2, vocab), torch.ones(2, race_draws(vocab))  # every block, every entry equal
    picked = [race(weights, noise), race(*ties)]
    monkeypatch.setattr(sampler_module.cpu_kernels, "library_for", lambda *tensors: None)
    assert picked[0].tolist() == race(weights, noise).tolist()
    assert picked[1].tolist() == race(*ties).tolist() == [0, 0]
    with pytest.raises(ValueError, match="noise of shape"):
        race(weights, noise[:, :-1])


def test_the_sampling_weights_kernel_gives_the_tempered_softmax(monkeypatch: pytest.MonkeyPatch) -> None:
    """kernels.c's tempered_weights against the softmax form other devices run: the same distribution per
    row once normalized (temperature, min_p), filtered (-inf) tokens and those under min_p exactly 0."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 3 * 1000 + 7, generator=gen) * 4
    logits[1, ::3] = float("-inf")  # tokens a top-k / top-p filter or a grammar took out
    temperatures, min_p = [1.0, 0.7, 2.0, 0.05], [0.0, 0.0, 0.05, 0.1]
    ours = sampling_weights(logits, temperatures, min_p)
    monkeypatch.setattr(sampler_module.cpu_kernels, "library_for", lambda *tensors: None)
    reference = sampling_weights(logits, temperatures, min_p)
    normalized = [weights / weights.sum(-1, keepdim=True) for weights in (ours, reference)]
    torch.testing.assert_close(*normalized, rtol=1e-5, atol=1e-9)
    assert torch.equal(ours == 0, reference == 0)
    assert bool((ours[1, ::3] == 0).all()) and int((ours[2] == 0).sum()) > 0
    assert ours.max(dim=-1).values.tolist() == [1.0] * 4  # the likeliest token weighs 1
