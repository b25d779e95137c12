"""EngineConfig: slots, KV pool, budgets and policy for one engine (pydantic; no torch)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from inflight.engine.dtypes import DType, KVCacheDType
from inflight.engine.quantization import Quantization

SchedulerPolicy = Literal["continuous", "static"]
SpeculativeMethod = Literal["ngram", "draft"]
KVAllocatorKind = Literal["paged", "contiguous"]
# A step starts a further waiting prompt's prefill only while it holds fewer prompt tokens than this...
MAX_MERGED_PREFILL_TOKENS = 64
# ...or while more requests wait than this: prompts started one a step end the batch up to one step
# later each, which a short queue costs little and a long one (a burst, an offline batch) too much.
STAGGERED_PREFILL_MAX_WAITING = 8
ContiguousReserve = Literal["max_model_len", "prompt_plus_max_tokens"]
# Prompt tokens a CPU step computes while other sequences decode in it (max_prefill_tokens_while_decoding's
# default there): a 2,048-token chunk held every decode of a SmolLM2 step ~1.6 s on two cores, 256 ~0.2 s;
# served long prompts' ITL p50 below vLLM-CPU's, at ~4 % fewer tokens/s than 512 (docs/benchmarks.md).
CPU_PREFILL_TOKENS_WHILE_DECODING = 256
# ...and no more work than those 256 tokens are through SmolLM2-135M's layers (106,168,320 weights, one
# multiply-add each a token): a model with larger layers computes fewer prompt tokens a step while others
# decode (llama-1b: 27, where 256 held its decodes ~1.3 s a step), but not fewer than a KV block's 16.
CPU_PREFILL_WORK_WHILE_DECODING = CPU_PREFILL_TOKENS_WHILE_DECODING * 106_168_320
CPU_MIN_PREFILL_TOKENS_WHILE_DECODING = 16


def cpu_prefill_tokens_while_decoding(layer_weights: int) -> int:
    """The CPU default of max_prefill_tokens_while_decoding for a model whose decoder layers multiply
    `layer_weights` weights a token (LlamaForCausalLM.layer_weights)."""
    by_work = CPU_PREFILL_WORK_WHILE_DECODING // max(layer_weights, 1)
    return max(CPU_MIN_PREFILL_TOKENS_WHILE_DECODING, min(CPU_PREFILL_TOKENS_WHILE_DECODING, by_work))


class EngineConfig(BaseModel):
    """How one engine batches and where its KV cache lives.

    num_kv_blocks None: derived at start from `kv_cache_memory_gib` (CPU) or the free GPU memory times
    `gpu_memory_utilization` (CUDA), capped at what max_num_seqs full-length sequences could use.
    max_model_len None: the model's max_position_embeddings, capped at the KV pool's capacity.
    """

    model_config = ConfigDict(extra="forbid")

    max_num_seqs: int = Field(default=64, ge=1, description="slots: sequences that may run in one step")
    max_num_batched_tokens: int = Field(
        default=2048, ge=1, description="token budget per step (prefill chunks + decodes)"
    )
    max_merged_prefill_tokens: int = Field(
        default=MAX_MERGED_PREFILL_TOKENS,
        ge=0,
        description="a step starts a further waiting request's prefill only while the prompt tokens already "
        f"in it are fewer than this (the first always starts) while at most {STAGGERED_PREFILL_MAX_WAITING} "
        "requests wait, so prompts that arrive together get their first tokens one after another, "
        "shortest first, instead of all after the last; 0 = start them all while the token budget lasts",
    )
    max_prefill_tokens_while_decoding: int | None = Field(
        default=None,
        ge=1,
        description="prompt tokens a step computes while other sequences decode in it (each decode waits "
        "for the whole step); default (None): on CPU "
        f"{CPU_PREFILL_TOKENS_WHILE_DECODING}, or fewer for a model whose layers are larger than "
        f"SmolLM2-135M's (the same work, at least {CPU_MIN_PREFILL_TOKENS_WHILE_DECODING}); on CUDA the "
        "step's token budget. Set to the token budget (2048 by default) it makes vLLM's trade, for "
        "traffic that reads whole answers: more tokens/s on long prompts, longer gaps between streamed "
        "tokens (docs/engine.md)",
    )
    num_kv_blocks: int | None = Field(default=None, ge=1, description="KV cache blocks; None = derive")
    block_size: int = Field(default=16, ge=1, le=1024, description="tokens per KV block")
    max_model_len: int | None = Field(default=None, ge=2, description="prompt + output cap per sequence")
    scheduler: SchedulerPolicy = "continuous"
    enable_prefix_caching: bool = True
    # Internal and demo use (the demo page's memory panel): no command-line flag.
    kv_allocator: KVAllocatorKind = Field(
        default="paged",
        description="paged = KV blocks taken as tokens are written (KVCacheManager); contiguous = each "
        "request reserves its worst case as consecutive blocks up front, as servers before PagedAttention "
        "did (ContiguousKVCache: no prefix caching, no n > 1, no speculative decoding)",
    )
    contiguous_reserve: ContiguousReserve = Field(
        default="max_model_len",
        description="what a request reserves with kv_allocator=contiguous: max_model_len tokens, or its own "
        "prompt + max_tokens",
    )
    dtype: DType = Field(
        default="auto",
        description="auto = bfloat16 on CUDA and on CPUs with native bfloat16 (AVX512-BF16 / AMX), else "
        "float32",
    )
    kv_cache_dtype: KVCacheDType = Field(
        default="auto",
        description="auto = the dtype above; fp8 = float8 e4m3 (half of bfloat16's bytes: twice the blocks)",
    )
    device: str = Field(default="auto", description="auto = cuda if available, else cpu")
    quantization: Quantization = Field(
        default="auto",
        description="auto = the checkpoint's format (a GGUF file's Q8_0/Q4_0/Q4_1/Q4_K blocks kept "
        "quantized on CPU, an FP8 checkpoint's float8 weights); none = dequantize everything; fp8 = float8 "
        "e4m3 weights with per-channel scales (any device); int8, q8_0, q4_0, q4_1 = quantize at load "
        "(CPU; engine/quantization.py)",
    )
    kv_cache_memory_gib: float = Field(
        default=1.0, gt=0, description="KV pool size on CPU if num_kv_blocks unset"
    )
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1, description="share of GPU memory to use")
    seed: int = Field(default=0, description="seed for requests without their own")
    tensor_parallel_size: int = Field(
        default=1, ge=1, description="ranks (processes, one GPU each on CUDA) the model is split over"
    )
    # Speculative decoding (engine/speculative.py).
    speculative: SpeculativeMethod | None = Field(
        default=None,
        description="ngram = propose tokens by prompt lookup; draft = propose them with a smaller model of "
        "the same tokenizer (draft_model); either verifies them in one step; None = off",
    )
    draft_model: str | None = Field(
        default=None,
        description="the draft model's checkpoint (a folder or .gguf file) for speculative='draft'",
    )
    num_speculative_tokens: int = Field(default=4, ge=1, le=32, description="tokens proposed per step")
    ngram_min: int = Field(default=2, ge=1, description="shortest n-gram matched against the context")
    ngram_max: int = Field(default=4, ge=1, description="longest n-gram matched against the context")
    speculative_max_running: int = Field(
        default=4, ge=1, description="speculate only while at most this many sequences run (else off)"
    )

    def prefill_tokens_while_decoding(self, device_type: str, layer_weights: int) -> int:
        """max_prefill_tokens_while_decoding, its default resolved for a device of `device_type` ("cpu",
        "cuda") and a model whose layers multiply `layer_weights` weights a token: a GPU step of a full
        budget is short enough that decodes need no smaller one."""
        if self.max_prefill_tokens_while_decoding is not None:
            return self.max_prefill_tokens_while_decoding
        if device_type == "cpu":
            return cpu_prefill_tokens_while_decoding(layer_weights)
        return self.max_num_batched_tokens

    @model_validator(mode="after")
    def _ngram_range(self) -> EngineConfig:
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must be <= ngram_max ({self.ngram_max})")
        return self

    @model_validator(mode="after")
    def _draft_model(self) -> EngineConfig:
        if self.speculative == "draft" and self.draft_model is None:
            raise ValueError("speculative='draft' needs draft_model (the smaller model's checkpoint)")
        if self.speculative != "draft" and self.draft_model is not None:
            raise ValueError(
                f"draft_model is set but speculative is {self.speculative!r}; set speculative='draft'"
            )
        if self.speculative == "draft" and self.tensor_parallel_size > 1:
            raise ValueError(
                "speculative='draft' runs the draft model on one device; set tensor_parallel_size=1 "
                "(or use speculative='ngram')"
            )
        return self

    @model_validator(mode="after")
    def _contiguous_kv(self) -> EngineConfig:
        if self.kv_allocator == "contiguous":
            if self.enable_prefix_caching:
                raise ValueError(
                    "kv_allocator='contiguous' shares no KV blocks, so it cannot cache prefixes; "
                    "set enable_prefix_caching=False (or use kv_allocator='paged')"
                )
            if self.speculative is not None:
                raise ValueError(
                    "kv_allocator='contiguous' does not support speculative decoding (proposals may run past "
                    "a request's reservation); set speculative=None (or use kv_allocator='paged')"
                )
        return self
