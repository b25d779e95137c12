"""Our paged model's logits equal transformers' for every supported architecture.

Sequences run through a paged KV cache with small, shuffled blocks (so block boundaries are crossed and
blocks are not contiguous) in prefill, decode, chunked-prefill and mixed steps; each row of logits is
compared with transformers' full forward over the same tokens.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from inflight.engine.attention.metadata import AttentionMetadata
from inflight.engine.loader import load_model
from inflight.engine.model.llama import LlamaForCausalLM
from inflight.engine.runner import allocate_kv_caches

ARCHS = ["llama", "qwen2", "mistral"]
ATOL = 1e-4


class PagedRun:
    """Drives a model step by step over its own paged cache, like the engine's runner does."""

    def __init__(
        self, model: LlamaForCausalLM, dtype: torch.dtype, block_size: int = 4, num_blocks: int = 96
    ):
        self.model = model
        self.block_size = block_size
        self.caches = allocate_kv_caches(model.config, num_blocks, block_size, dtype, "cpu")
        self.free_blocks = list(range(1, num_blocks))  # block 0 is the table padding; never handed out
        random.Random(1).shuffle(self.free_blocks)
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    @torch.no_grad()
    def step(self, chunks: list[tuple[str, list[int]]], last_only: bool = False) -> list[torch.Tensor]:
        """Run one batched step of new tokens per sequence; return each sequence's logits rows (with
        `last_only`, the model computes and returns only each sequence's last row)."""
        ids, positions, slots, query_lens, seq_lens = [], [], [], [], []
        for seq, tokens in chunks:
            start = self.lens.get(seq, 0)
            table = self.tables.setdefault(seq, [])
            end = start + len(tokens)
            while len(table) * self.block_size < end:
                table.append(self.free_blocks.pop())
            ids += tokens
            positions += range(start, end)
            slots += [
                table[p // self.block_size] * self.block_size + p % self.block_size for p in range(start, end)
            ]
            query_lens.append(len(tokens))
            seq_lens.append(end)
            self.lens[seq] = end
        width = max(len(self.tables[seq]) for seq, _ in chunks)
        tables = [self.tables[seq] + [0] * (width - len(self.tables[seq])) for seq, _ in chunks]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            query_lens_list=query_lens,
            seq_lens_list=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
        if last_only:
            last_rows_of = list(range(len(chunks)))
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.caches, meta, last_rows_of)
            assert hidden.shape[0] == len(chunks)
            return list(self.model.compute_logits(hidden)[:, None])
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.caches, meta)
        logits = self.model.compute_logits(hidden)
        return [logits[starts[i] : starts[i + 1]] for i in range(len(chunks))]


def _tokens(n: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, vocab) for _ in range(n)]


@pytest.fixture(scope="module")
def checkpoints(tiny_llama_dir: Path, tiny_qwen2_dir: Path, tiny_mistral_dir: Path) -> dict[str, Path]:
    return {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir, "mistral": tiny_mistral_dir}


@pytest.fixture(scope="module")
def reference_logits(checkpoints: dict[str, Path]):
    """transformers' float32 logits for a token list, per architecture (one model load each)."""
    from transformers import AutoModelForCausalLM

    models = {
        arch: AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        for arch, path in checkpoints.items()
    }

    @torch.no_grad()
    def logits(arch: str, ids: list[int]) -> torch.Tensor:
        return models[arch](torch.tensor([ids])).logits[0].float()

    return logits


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_then_decode_matches_transformers(arch, checkpoints, reference_logits) -> None:
    model = load_model(checkpoints[arch])
    # 45 tokens: crosses many 4-token blocks and Mistral's 32-token sliding window.
    ids = _tokens(45, seed=0, vocab=model.config.vocab_size)
    expected = reference_logits(arch, ids)
    run = PagedRun(model, torch.float32)
    (prefill,) = run.step([("a", ids[:37])])
    got = [prefill] + [run.step([("a", [token])])[0] for token in ids[37:]]
    torch.testing.assert_close(torch.cat(got), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_after_cached_prefix_matches_transformers(
    arch, checkpoints, reference_logits
) -> None:
    model = load_model(checkpoints[arch])
    ids = _tokens(50, seed=1, vocab=model.config.vocab_size)
    expected = reference_logits(arch, ids)
    run = PagedRun(model, torch.float32)
    got, start = [], 0
    for size in (9, 6, 1, 15, 19):  # the later chunks attend to a cached prefix (and past the window)
        got += run.step([("a", ids[start : start + size])])
        start += size
    torch.testing.assert_close(torch.cat(got), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batch_equals_separate_runs(arch, checkpoints, reference_logits) -> None:
    """Sequences prefilling (fresh and chunked) and decoding in one step, as continuous batching does."""
    model = load_model(checkpoints[arch])
    vocab = model.config.vocab_size
    a, b, c, d = (_tokens(n, seed=s, vocab=vocab) for n, s in ((41, 2), (23, 3), (38, 4), (12, 5)))
    run = PagedRun(model, torch.float32)
    first_a, first_c = run.step([("a", a[:40]), ("c", c[:20])])
    # a decodes while b prefills from scratch and c continues its prefill after a cached prefix;
    # then b and c decode while d prefills.
    step_a, step_b, step_c = run.step([("a", a[40:]), ("b", b[:22]), ("c", c[20:37])])
    step_b2, step_c2, step_d = run.step([("b", b[22:]), ("c", c[37:]), ("d", d)])
    torch.testing.assert_close(torch.cat([first_a, step_a]), reference_logits(arch, a), atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat([step_b, step_b2]), reference_logits(arch, b), atol=ATOL, rtol=0)
    torch.testing.assert_close(
        torch.cat([first_c, step_c, step_c2]), reference_logits(arch, c), atol=ATOL, rtol=0
    )
    torch.testing.assert_close(step_d, reference_logits(arch, d), atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_last_rows_only_skips_the_rest_of_the_last_layer(arch, checkpoints, reference_logits) -> None:
    """A step that needs only each sequence's last row (no prompt logprobs) gives the same logits, and
    still writes every token's K/V: the next steps read them."""
    model = load_model(checkpoints[arch])
    vocab = model.config.vocab_size
    a, b = _tokens(41, seed=2, vocab=vocab), _tokens(39, seed=3, vocab=vocab)
    expected_a, expected_b = reference_logits(arch, a), reference_logits(arch, b)
    run = PagedRun(model, torch.float32)
    (first_a,) = run.step([("a", a[:35])], last_only=True)
    step_a, step_b = run.step([("a", a[35:36]), ("b", b[:30])], last_only=True)
    last_a, last_b = run.step([("a", a[36:]), ("b", b[30:])], last_only=True)
    for got, want in ((first_a, 34), (step_a, 35), (last_a, 40)):
        torch.testing.assert_close(got[0], expected_a[want], atol=ATOL, rtol=0)
    for got, want in ((step_b, 29), (last_b, 38)):
        torch.testing.assert_close(got[0], expected_b[want], atol=ATOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_half_precision_tracks_float32(arch, dtype, checkpoints, reference_logits) -> None:
    model = load_model(checkpoints[arch], dtype=dtype)
    assert model.embed_tokens.weight.dtype == dtype
    ids = _tokens(30, seed=6, vocab=model.config.vocab_size)
    expected = reference_logits(arch, ids)
    run = PagedRun(model, dtype)
    (prefill,) = run.step([("a", ids[:24])])
    got = torch.cat([prefill] + [run.step([("a", [t])])[0] for t in ids[24:]])
    assert got.dtype == torch.float32
    assert torch.isfinite(got).all()
    # Half precision keeps ~3 significant digits: the logits stay close and mostly agree on the argmax.
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9
