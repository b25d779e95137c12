"""Next-token choice per row of logits: penalties, greedy or temperature + top-k / top-p / min-p, seeds.

Sampling uses the exponential race (argmax of probs / Exp(1) noise), which draws from the filtered
distribution, in two rounds (`race`): a block of RACE_BLOCK tokens by the blocks' masses, then a token
within the block, which is the same distribution with ~450 draws a row instead of one a vocabulary entry
(torch draws Exp(1) noise on one thread: with one draw for each of SmolLM2's 49,152 entries, a 64-row
sampled decode step took 1.8x as long). A request with a seed draws its noise from a generator keyed by
(seed, sequence index, output position) alone, so its tokens are the same whatever else shares the batch,
and the same again after a preemption recomputes it. Requests without a seed share one engine-wide
generator.

Reported logprobs are those of the model's raw distribution (before penalties, temperature and filters).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inflight.engine.cpu import kernels as cpu_kernels
from inflight.engine.sequence import Logprob, PositionLogprobs, SamplingParams

SEED_MASK = (1 << 63) - 1
# Tokens a block of the race's first round (`race`).
RACE_BLOCK = 256
# Tokens ranked first for a top_p row without top_k; more only when these do not reach its top_p mass.
TOP_P_CANDIDATES = 1024


@dataclass
class SamplingRow:
    """One draw from one row of logits. A forking sequence has n rows sharing one logits row."""

    params: SamplingParams
    # Prompt + output tokens so far (repetition penalty) and the output tokens (presence/frequency).
    token_ids: list[int]
    num_prompt_tokens: int
    # Sequence index within its request and position of the token being drawn (seeded noise key).
    index: int
    output_position: int
    # The sequence's end-of-sequence ids (min_tokens keeps them from being drawn early).
    eos_token_ids: frozenset[int] = frozenset()
    # The request it belongs to (constrained decoding keeps one grammar matcher per sequence).
    request_id: str = ""


@dataclass
class SampleResult:
    token_id: int
    logprob: float
    top_logprobs: PositionLogprobs | None


class Sampler:
    def __init__(self, seed: int = 0, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampleResult]:
        """Draw one token for each row; `logits` is float32 [len(rows), vocab]."""
        want_logprobs = any(r.params.logprobs is not None for r in rows)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        logits = self._apply_penalties(logits, rows)
        greedy = all(r.params.greedy for r in rows)
        chosen = argmax_rows(logits) if greedy else self._sample(logits, rows)
        token_ids: list[int] = chosen.tolist()
        if raw_logprobs is None:
            return [SampleResult(t, 0.0, None) for t in token_ids]
        return self._with_logprobs(raw_logprobs, chosen, token_ids, rows)

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        penalized = [
            i
            for i, r in enumerate(rows)
            if r.params.repetition_penalty != 1.0 or r.params.presence_penalty or r.params.frequency_penalty
        ]
        if not penalized:
            return logits
        logits = logits.clone()
        for i in penalized:
            params = rows[i].params
            row = logits[i]
            if params.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(rows[i].token_ids)), dtype=torch.long, device=logits.device)
                values = row[seen]
                row[seen] = torch.where(
                    values > 0, values / params.repetition_penalty, values * params.repetition_penalty
                )
            output = rows[i].token_ids[rows[i].num_prompt_tokens :]
            if output and (params.presence_penalty or params.frequency_penalty):
                ids = torch.tensor(output, dtype=torch.long, device=logits.device)
                counts = torch.zeros_like(row).index_add_(0, ids, torch.ones_like(ids, dtype=row.dtype))
                row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(
                    row.dtype
                )
        return logits

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        drawn = self.draw(self.filtered_probs(logits, rows), rows)
        if not any(r.params.greedy for r in rows):
            return drawn
        greedy = torch.tensor([r.params.greedy for r in rows], device=logits.device)
        return torch.where(greedy, argmax_rows(logits), drawn)

    def draw(self, probs: torch.Tensor, rows: list[SamplingRow], stream: int = 0) -> torch.Tensor:
        """A token from each row of `probs` (float32 [len(rows), vocab], unnormalized), by `race` with each
        row's noise (`noise`, of `stream`)."""
        return race(probs, self.noise(rows, race_draws(probs.shape[1]), probs, stream))

    def probabilities(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The distributions a non-greedy draw of each row picks from: penalties, temperature, top-k, top-p
        and min-p applied, unnormalized (`sampling_weights`)."""
        return self.filtered_probs(self._apply_penalties(logits, rows), rows)

    def filtered_probs(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """`probabilities` of logits whose penalties are already applied."""
        temperatures = [r.params.temperature if not r.params.greedy else 1.0 for r in rows]
        min_p = [r.params.min_p for r in rows]
        if any(r.params.top_k > 0 or r.params.top_p < 1.0 for r in rows):
            # top_p's mass is that of the tempered distribution: the filters see the tempered logits.
            tempered = logits / torch.tensor(temperatures, dtype=logits.dtype, device=logits.device)[:, None]
            return sampling_weights(self._top_k_top_p(tempered, rows), [1.0] * len(rows), min_p)
        return sampling_weights(logits, temperatures, min_p)

    def noise(self, rows: list[SamplingRow], width: int, like: torch.Tensor, stream: int = 0) -> torch.Tensor:
        """Exp(1) noise [len(rows), width] in `like`'s dtype and device: a seeded row's from a generator keyed
        by (seed, sequence index, output position, `stream`) alone, the others' from the engine-wide
        generator. Stream 0 is the draw of the token itself; speculative decoding keys its other draws with
        others."""
        noise = like.new_empty((len(rows), width))
        unseeded = [i for i, r in enumerate(rows) if r.params.seed is None]
        if len(unseeded) == len(rows):
            return noise.exponential_(generator=self.generator)
        if unseeded:
            noise[unseeded] = like.new_empty((len(unseeded), width)).exponential_(generator=self.generator)
        for i, r in enumerate(rows):
            if r.params.seed is not None:
                key = (r.params.seed, r.index, r.output_position) + ((stream,) if stream else ())
                generator = torch.Generator(device=like.device)
                generator.manual_seed(hash(key) & SEED_MASK)
                noise[i].exponential_(generator=generator)
        return noise

    def results(
        self, logits: torch.Tensor, token_ids: list[int], rows: list[SamplingRow]
    ) -> list[SampleResult]:
        """SampleResults of tokens chosen for `rows` by other means (speculative decoding's rejection
        sampling), with the logprobs their rows ask for."""
        if not any(r.params.logprobs is not None for r in rows):
            return [SampleResult(t, 0.0, None) for t in token_ids]
        chosen = torch.tensor(token_ids, dtype=torch.long, device=logits.device)
        return self._with_logprobs(torch.log_softmax(logits, dim=-1), chosen, token_ids, rows)

    def _top_k_top_p(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """`logits` with every token outside each row's top-k / top-p set at -inf (rows with neither
        filter are left as they are).

        Only the best candidates are ranked (`topk`), not the whole vocabulary: the rows' largest top_k,
        at least TOP_P_CANDIDATES when a row has top_p without top_k. Such a row whose candidates do not
        reach its top_p mass makes the step rank the whole vocabulary instead."""
        vocab = logits.shape[1]
        bounded = [r.params.top_k for r in rows if 0 < r.params.top_k < vocab]
        candidates = max(bounded, default=0)
        if len(bounded) < len(rows):
            candidates = max(candidates, TOP_P_CANDIDATES)
        candidates = min(vocab, candidates)
        filtered = self._rank_and_filter(logits, rows, candidates)
        if filtered is None:
            filtered = self._rank_and_filter(logits, rows, vocab)
        assert filtered is not None
        unfiltered = [r.params.top_k in range(1, vocab) or r.params.top_p < 1.0 for r in rows]
        unfiltered = [not filters for filters in unfiltered]
        if any(unfiltered):
            keep = torch.tensor(unfiltered, device=logits.device)[:, None]
            filtered = torch.where(keep, logits, filtered)
        return filtered

    def _rank_and_filter(
        self, logits: torch.Tensor, rows: list[SamplingRow], candidates: int
    ) -> torch.Tensor | None:
        """The filter over the `candidates` best tokens of each row; None when that is too few for a row
        without top_k (the tokens beyond them could be inside its top_p set)."""
        vocab = logits.shape[1]
        device = logits.device
        # top_k at or above the vocabulary keeps every token (and could overflow a tensor of int64).
        top_k = torch.tensor([min(r.params.top_k, vocab) or vocab for r in rows], device=device)
        if candidates < vocab:
            sorted_logits, order = logits.topk(candidates, dim=-1)
        else:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(candidates, device=device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
        # Probabilities among each row's top-k tokens (all of the vocabulary for a row without top_k).
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        unbounded = top_k > candidates
        if candidates < vocab and bool(unbounded.any()):
            peak = sorted_logits[:, :1]
            whole = (sorted_logits - peak).exp() / (logits - peak).exp().sum(dim=-1, keepdim=True)
            sorted_probs = torch.where(unbounded[:, None], whole, sorted_probs)
        top_p = torch.tensor([r.params.top_p for r in rows], dtype=logits.dtype, device=device)
        # Drop a token when the tokens ranked above it already reach top_p (the first always stays).
        cumulative = sorted_probs.cumsum(dim=-1)
        short = unbounded & (cumulative[:, -1] < top_p) & (top_p < 1.0)
        if candidates < vocab and bool(short.any()):
            return None
        above = cumulative - sorted_probs
        sorted_logits = sorted_logits.masked_fill(above >= top_p[:, None], float("-inf"))
        return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)

    def _with_logprobs(
        self, raw: torch.Tensor, chosen: torch.Tensor, token_ids: list[int], rows: list[SamplingRow]
    ) -> list[SampleResult]:
        chosen_logprobs = raw.gather(1, chosen[:, None])[:, 0]
        ranks = ((raw > chosen_logprobs[:, None]).sum(dim=-1) + 1).tolist()
        chosen_list: list[float] = chosen_logprobs.tolist()
        results = []
        for i, r in enumerate(rows):
            top: PositionLogprobs | None = None
            if r.params.logprobs is not None:
                top = top_logprobs(raw[i], r.params.logprobs)
                top[token_ids[i]] = Logprob(chosen_list[i], ranks[i])
            results.append(SampleResult(token_ids[i], chosen_list[i], top))
        return results


def sampling_weights(logits: torch.Tensor, temperatures: list[float], min_p: list[float]) -> torch.Tensor:
    """Each row's distribution at its temperature, with the tokens under min_p times the likeliest's
    probability at 0 (float32 [rows, vocab], unnormalized: e^((logit - the row's largest) / temperature)
    on CPU, kernels.c's tempered_weights; softmax elsewhere)."""
    rows, vocab = logits.shape
    library = cpu_kernels.library_for(logits)
    if library is not None and logits.dtype == torch.float32 and logits.is_contiguous():
        inverse = torch.tensor([1.0 / t for t in temperatures], dtype=torch.float32)
        floors = torch.tensor(min_p, dtype=torch.float32)
        out = torch.empty_like(logits)
        library.tempered_weights(
            logits.data_ptr(), rows, vocab, inverse.data_ptr(), floors.data_ptr(), out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        return out
    device = logits.device
    probs = torch.softmax(logits / torch.tensor(temperatures, dtype=logits.dtype, device=device)[:, None], -1)
    if any(p > 0 for p in min_p):
        floors = torch.tensor(min_p, dtype=probs.dtype, device=device)[:, None]
        probs = probs.masked_fill(probs < probs.max(dim=-1, keepdim=True).values * floors, 0.0)
    return probs


def race_blocks(vocab: int) -> int:
    """The blocks of RACE_BLOCK entries `race`'s first round splits `vocab` entries into (the last padded)."""
    return -(-vocab // RACE_BLOCK)


def race_draws(vocab: int) -> int:
    """The Exp(1) draws `race` takes a row over `vocab` entries: one a block, then one a block's token."""
    return race_blocks(vocab) + RACE_BLOCK


def race(weights: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """One index drawn from each row of `weights` [rows, vocab] (float32, non-negative, unnormalized, a
    positive entry in each row) with probability proportional to its entry, by the exponential race in two
    rounds: the block of RACE_BLOCK entries whose mass over its Exp(1) draw is largest (the last block is
    padded with zeros), then the entry of that block whose weight over its draw is largest. A block wins
    with probability its share of the mass and an entry within it with its share of the block's: p_i in
    all, as the race over every entry. `noise`: Exp(1) [rows, race_draws(vocab)], the blocks' draws first.
    On CPU one pass of kernels.c's race_rows (torch's ops took ~75 us a SmolLM2 row), torch's elsewhere."""
    rows, vocab = weights.shape
    if noise.shape != (rows, race_draws(vocab)):
        raise ValueError(f"race: noise of shape {tuple(noise.shape)} for weights {(rows, vocab)}")
    library = cpu_kernels.library_for(weights, noise)
    if (
        library is not None
        and weights.dtype == torch.float32
        and weights.is_contiguous()
        and noise.is_contiguous()
    ):
        out = torch.empty(rows, dtype=torch.int64)
        library.race_rows(
            weights.data_ptr(),
            rows,
            vocab,
            RACE_BLOCK,
            noise.data_ptr(),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out
    blocks = race_blocks(vocab)
    padded = F.pad(weights, (0, blocks * RACE_BLOCK - vocab)) if vocab % RACE_BLOCK else weights
    grouped = padded.reshape(rows, blocks, RACE_BLOCK)
    block = argmax_rows(grouped.sum(dim=-1) / noise[:, :blocks])
    within = grouped[torch.arange(rows, device=weights.device), block]
    return block * RACE_BLOCK + argmax_rows(within / noise[:, blocks:])


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of a float32 [rows, vocab] block: one C pass on CPU (torch's took 1.1 ms for
    57 rows of 49152 logits, the C pass 0.2 ms: a few percent of a decode step), torch's elsewhere."""
    library = cpu_kernels.library_for(x)
    if library is None or x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous() or not x.shape[1]:
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    library.argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
    return out


def top_logprobs(logprobs: torch.Tensor, k: int) -> PositionLogprobs:
    """The k most likely tokens of one row of log-probabilities, with ranks 1..k."""
    if k == 0:
        return {}
    values, ids = logprobs.topk(k)
    pairs = zip(ids.tolist(), values.tolist(), strict=True)
    return {int(t): Logprob(float(v), rank) for rank, (t, v) in enumerate(pairs, 1)}
