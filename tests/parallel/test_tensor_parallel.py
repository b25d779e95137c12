"""Tensor parallelism on CPU (gloo, real worker processes): exact against N=1 and transformers.

Each engine runs 12 prompts (some sharing a 3-block prefix) with fewer slots than requests, a KV pool
small enough to preempt, prefix caching and a token budget below the longest prompt (chunked prefill),
so every scheduling path crosses the rank boundary.
"""

from __future__ import annotations

import functools
import json
import random
import shutil
from pathlib import Path

import jsonschema
import psutil
import pytest
import torch

from inflight.engine.config import EngineConfig
from inflight.engine.engine import LLMEngine
from inflight.engine.model.config import ModelConfig
from inflight.engine.model.errors import ModelLoadError
from inflight.engine.model.shard_layout import ShardLayout, valid_degrees
from inflight.engine.output_processor import RequestOutput
from inflight.engine.sequence import GuidedDecoding, SamplingParams

from support.models import cached_model
from support.reference import hf_greedy

BLOCK_SIZE = 8
NUM_PROMPTS = 12
STRESS = {"max_num_seqs": 4, "num_kv_blocks": 12, "max_num_batched_tokens": 24}
TOP_LOGPROBS = 5


def make_prompts(vocab_size: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(77)
    shared = [rng.randrange(3, vocab_size) for _ in range(3 * BLOCK_SIZE)]
    prompts, max_tokens = [], []
    for i in range(NUM_PROMPTS):
        tail = [rng.randrange(3, vocab_size) for _ in range(rng.randrange(2, 40))]
        prompts.append(shared + tail if i % 3 == 0 else tail)
        max_tokens.append(rng.randrange(6, 16))
    return prompts, max_tokens


@functools.cache
def hf_reference(model_dir: Path) -> list[list[int]]:
    prompts, max_tokens = make_prompts(ModelConfig.from_dir(model_dir).vocab_size)
    return hf_greedy(model_dir, prompts, max_tokens)


def engine(model_dir: Path, tp: int, **overrides: object) -> LLMEngine:
    settings = {"block_size": BLOCK_SIZE, "dtype": "float32", "device": "cpu", **STRESS, **overrides}
    return LLMEngine(model_dir, EngineConfig(tensor_parallel_size=tp, **settings))  # type: ignore[arg-type]


def greedy(llm: LLMEngine, count: int = NUM_PROMPTS) -> list[RequestOutput]:
    """The first `count` prompts of the workload, greedy, with their top log-probabilities."""
    prompts, max_tokens = make_prompts(llm.model_config.vocab_size)
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=TOP_LOGPROBS)
        for n in max_tokens[:count]
    ]
    return llm.generate(prompts[:count], params)


def sampled(llm: LLMEngine) -> list[list[int]]:
    prompts, _ = make_prompts(llm.model_config.vocab_size)
    params = [SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=i) for i in range(len(prompts))]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def worker_processes() -> list[psutil.Process]:
    return psutil.Process().children(recursive=True)


def expected_rank_bytes(full: LLMEngine, tp: int) -> list[int]:
    """Per rank: the RMSNorm weights in full plus 1/tp of every other parameter, plus, when there are
    fewer KV heads than ranks, the k/v rows of the one KV head a rank holds beyond its 1/tp share, plus on
    rank 0 the o_proj biases (added once, before the partial sums are reduced)."""
    params = dict(full.model.named_parameters())

    def size(names: list[str]) -> int:
        return sum(params[n].numel() * params[n].element_size() for n in names)

    replicated = size([n for n in params if "norm" in n])
    o_bias = size([n for n in params if n.endswith("o_proj.bias")])
    sharded = size([n for n in params if "norm" not in n and not n.endswith("o_proj.bias")])
    assert sharded % tp == 0
    config = full.model_config
    kv_rows = config.num_key_value_heads * config.head_dim
    extra_kv_rows = max(0, config.head_dim - kv_rows // tp)  # one whole head instead of a share
    extra = 2 * config.num_hidden_layers * extra_kv_rows * config.hidden_size * full.dtype.itemsize
    base = replicated + sharded // tp + extra
    return [base + o_bias] + [base] * (tp - 1)


def llama_with_attention_bias(folder: Path) -> Path:
    """The tiny llama with `attention_bias`: q/k/v and o_proj biases (o_proj's is added on rank 0 only)."""
    from safetensors.torch import load_file, save_file

    source = cached_model("tiny", "llama")
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    config["attention_bias"] = True
    (folder / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(folder / "model.safetensors"))
    generator = torch.Generator().manual_seed(5)
    for name in list(tensors):
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")):
            rows = tensors[name].shape[0]
            tensors[name.replace(".weight", ".bias")] = torch.randn(rows, generator=generator) * 0.1
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "llama-attention-bias"])
def test_two_ranks_equal_one_rank_and_transformers(arch: str, tmp_path: Path) -> None:
    if arch == "llama-attention-bias":
        model_dir = llama_with_attention_bias(tmp_path / "model")
    else:
        model_dir = cached_model("tiny", arch)
    expected = hf_reference(model_dir)
    single = engine(model_dir, 1)
    reference = greedy(single)
    assert tokens(reference) == expected
    reference_samples = sampled(single)

    split = engine(model_dir, 2)
    try:
        assert len(worker_processes()) == 1
        outputs = greedy(split)
        assert tokens(outputs) == expected
        stats = split.stats()
        prompts, _ = make_prompts(split.model_config.vocab_size)
        assert max(map(len, prompts)) > STRESS["max_num_batched_tokens"]  # some prefills are chunked
        assert stats.num_preemptions > 0
        assert stats.num_prefix_cache_hits >= 2 * BLOCK_SIZE
        # Logits: the top log-probabilities of every generated position agree with one rank's.
        for ours, theirs in zip(outputs, reference, strict=True):
            assert ours.outputs[0].logprobs is not None and theirs.outputs[0].logprobs is not None
            for mine, ref in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs, strict=True):
                assert mine.keys() == ref.keys()
                for token_id, logprob in mine.items():
                    assert abs(logprob.logprob - ref[token_id].logprob) < 1e-4
        assert sampled(split) == reference_samples
        # Each rank holds half of every sharded tensor, all of the norms (rank 0: the o_proj biases).
        assert split.parameter_bytes_per_rank == expected_rank_bytes(single, 2)
        assert split.num_kv_blocks == single.num_kv_blocks
    finally:
        split.close()
    assert worker_processes() == []


def constrained(llm: LLMEngine) -> list[RequestOutput]:
    """Half the workload's prompts: a JSON schema greedy and seeded, a regex, and a plain request."""
    prompts, _ = make_prompts(llm.model_config.vocab_size)
    schema = GuidedDecoding("json_schema", json.dumps(JSON_SCHEMA))
    regex = GuidedDecoding("regex", "[a-e]{3,6}!")
    params = [
        SamplingParams(max_tokens=48, temperature=0.0, guided=schema),
        SamplingParams(max_tokens=48, temperature=0.9, seed=3, guided=schema),
        SamplingParams(max_tokens=12, temperature=0.0, guided=regex),
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
    ]
    half = NUM_PROMPTS // 2
    return llm.generate(prompts[:half], [params[i % len(params)] for i in range(half)])


JSON_SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9}, "ok": {"type": "boolean"}},
    "required": ["id", "ok"],
    "additionalProperties": False,
}


def test_two_ranks_constrain_output_as_one_rank() -> None:
    """Rank 0 samples with the grammar masks: the constrained outputs of two ranks equal one rank's."""
    model_dir = cached_model("tiny", "llama")
    roomy = {"num_kv_blocks": 64}
    expected = constrained(engine(model_dir, 1, **roomy))
    split = engine(model_dir, 2, **roomy)
    try:
        outputs = constrained(split)
    finally:
        split.close()
    assert tokens(outputs) == tokens(expected)
    for output in outputs[0::4] + outputs[1::4]:
        jsonschema.validate(json.loads(output.outputs[0].text), JSON_SCHEMA)


def test_four_ranks_replicate_kv_heads() -> None:
    """The tiny preset has 4 query heads and 2 KV heads: at N=4 each KV head lives on two ranks."""
    model_dir = cached_model("tiny", "llama")
    config = ModelConfig.from_dir(model_dir)
    assert valid_degrees(
        config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    ) == [
        1,
        2,
        4,
    ]
    split = engine(model_dir, 4)
    try:
        assert split.model.layout.kv_heads == 1 and config.num_key_value_heads == 2
        assert len(worker_processes()) == 3
        # Half the workload (4 processes share 2 cores here); still more requests than slots.
        half = NUM_PROMPTS // 2
        assert tokens(greedy(split, half)) == hf_reference(model_dir)[:half]
        single = engine(model_dir, 1)
        assert split.parameter_bytes_per_rank == expected_rank_bytes(single, 4)
    finally:
        split.close()
    assert worker_processes() == []


def test_invalid_degree_fails_at_start_naming_the_valid_ones() -> None:
    model_dir = cached_model("tiny", "llama")
    with pytest.raises(
        ModelLoadError, match=r"tensor-parallel size 3 cannot split.*Valid sizes for it: 1, 2, 4"
    ):
        engine(model_dir, 3)
    assert worker_processes() == []


def test_valid_degrees_of_known_models() -> None:
    assert valid_degrees(64, 8, 28672) == [1, 2, 4, 8]  # Llama-3.1-70B
    # SmolLM2-135M: 9 heads / 3 KV heads; 9 would split the heads but not the 1536-wide MLP.
    assert valid_degrees(9, 3, 1536) == [1, 3]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "intermediate", "vocab", "size"),
    [(64, 8, 28672, 128256, 8), (4, 2, 352, 2049, 4), (9, 3, 1536, 49152, 3), (8, 8, 64, 10, 4)],
)
def test_shards_cover_every_head_row_and_token_once(
    heads: int, kv_heads: int, intermediate: int, vocab: int, size: int
) -> None:
    layouts = [ShardLayout(r, size, heads, kv_heads, 64, intermediate, vocab) for r in range(size)]
    assert [h for s in layouts for h in range(s.first_head, s.first_head + s.heads)] == list(range(heads))
    rows = [i for s in layouts for i in range(s.first_intermediate, s.first_intermediate + s.intermediate)]
    assert rows == list(range(intermediate))
    assert [t for s in layouts for t in range(s.vocab_start, s.vocab_end)] == list(range(vocab))
    assert all(s.vocab_rows >= s.vocab_end - s.vocab_start for s in layouts)
    group = heads // kv_heads
    for s in layouts:  # every query head's KV head is on its rank
        for head in range(s.first_head, s.first_head + s.heads):
            assert s.first_kv_head <= head // group < s.first_kv_head + s.kv_heads
    assert {h for s in layouts for h in range(s.first_kv_head, s.first_kv_head + s.kv_heads)} == set(
        range(kv_heads)
    )
