"""The engine's command-line flags, defined once: `inflight serve`, `generate`, `demo` and `bench serve`
take them all (the offline benchmark takes the batching and tensor-parallel ones). Every default is
read from EngineConfig, so the flags and the Python API cannot disagree. No torch is imported here.
"""

from __future__ import annotations

import argparse
from typing import Any, get_args

from pydantic import ValidationError

from inflight.engine.config import EngineConfig, SpeculativeMethod
from inflight.engine.dtypes import DTYPE_CHOICES, KV_CACHE_DTYPE_CHOICES
from inflight.engine.quantization import QUANTIZATION_CHOICES

ArgumentTarget = argparse.ArgumentParser | argparse._ArgumentGroup


def _default(field: str) -> Any:
    return EngineConfig.model_fields[field].default


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add every engine flag to `parser`, in an `engine` group; `engine_config_from_args` reads them."""
    engine = parser.add_argument_group("engine")
    engine.add_argument(
        "--dtype",
        default=_default("dtype"),
        choices=DTYPE_CHOICES,
        help=f"weights and KV cache (default: {EngineConfig.model_fields['dtype'].description})",
    )
    add_kv_cache_dtype_arg(engine)
    engine.add_argument(
        "--device", default=_default("device"), help="cpu, cuda, cuda:1 ... (default: auto = cuda if any)"
    )
    add_quantization_arg(engine)
    add_batching_args(engine)
    engine.add_argument(
        "--num-kv-blocks",
        type=int,
        default=_default("num_kv_blocks"),
        help="KV cache blocks (default: sized from memory)",
    )
    block_size = _default("block_size")
    engine.add_argument(
        "--block-size", type=int, default=block_size, help=f"tokens per KV block (default: {block_size})"
    )
    engine.add_argument(
        "--max-model-len",
        type=int,
        default=_default("max_model_len"),
        help="prompt + output cap (default: the model's)",
    )
    engine.add_argument("--scheduler", choices=("continuous", "static"), default=_default("scheduler"))
    merged = _default("max_merged_prefill_tokens")
    engine.add_argument(
        "--max-merged-prefill-tokens",
        type=int,
        default=merged,
        help=f"{EngineConfig.model_fields['max_merged_prefill_tokens'].description} (default: {merged})",
    )
    engine.add_argument(
        "--max-prefill-tokens-while-decoding",
        type=int,
        default=_default("max_prefill_tokens_while_decoding"),
        help=f"{EngineConfig.model_fields['max_prefill_tokens_while_decoding'].description}",
    )
    engine.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=_default("enable_prefix_caching"),
        help="share KV blocks of identical prompt prefixes (default: on)",
    )
    utilization = _default("gpu_memory_utilization")
    engine.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=utilization,
        help=f"GPU memory share to use (default: {utilization})",
    )
    add_tensor_parallel_arg(engine)
    add_speculative_args(parser)


def add_speculative_args(parser: argparse.ArgumentParser) -> None:
    """Speculative decoding's flags (vLLM's `--speculative-config` holds the same settings)."""
    group = parser.add_argument_group("speculative decoding")
    group.add_argument(
        "--speculative",
        choices=get_args(SpeculativeMethod),
        default=_default("speculative"),
        help="ngram: propose tokens by looking the last n tokens up in the prompt and output; draft: propose "
        "them with --draft-model; either verifies them in one step (greedy outputs are unchanged, sampling "
        "keeps its distribution) (default: off)",
    )
    group.add_argument(
        "--draft-model",
        default=_default("draft_model"),
        help="the draft model for --speculative draft: a folder, a .gguf file or builtin:NAME with the same "
        "tokenizer as --model",
    )
    for field, flag in (
        ("num_speculative_tokens", "--num-speculative-tokens"),
        ("ngram_min", "--ngram-min"),
        ("ngram_max", "--ngram-max"),
        ("speculative_max_running", "--speculative-max-running"),
    ):
        default = _default(field)
        description = EngineConfig.model_fields[field].description
        group.add_argument(flag, type=int, default=default, help=f"{description} (default: {default})")


def add_batching_args(parser: ArgumentTarget) -> None:
    """`--max-slots` and `--max-num-batched-tokens` (the offline benchmark passes them to every system)."""
    slots, budget = _default("max_num_seqs"), _default("max_num_batched_tokens")
    parser.add_argument(
        "--max-slots", type=int, default=slots, help=f"sequences running at once (default: {slots})"
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=budget,
        help=f"token budget per step (default: {budget})",
    )


def add_kv_cache_dtype_arg(parser: ArgumentTarget) -> None:
    """`--kv-cache-dtype` (vLLM's name; `inflight size` and the offline benchmark take it too)."""
    parser.add_argument(
        "--kv-cache-dtype",
        default=_default("kv_cache_dtype"),
        choices=KV_CACHE_DTYPE_CHOICES,
        help=f"KV cache element type (default: {EngineConfig.model_fields['kv_cache_dtype'].description})",
    )


def add_quantization_arg(parser: ArgumentTarget) -> None:
    """`--quantization` (vLLM's name): the weight format (the offline benchmark takes it too)."""
    parser.add_argument(
        "--quantization",
        "-q",
        default=_default("quantization"),
        choices=QUANTIZATION_CHOICES,
        help=f"weight format (default: {EngineConfig.model_fields['quantization'].description})",
    )


def add_tensor_parallel_arg(parser: ArgumentTarget) -> None:
    """`--tensor-parallel-size` (vLLM's name)."""
    size = _default("tensor_parallel_size")
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=size,
        help="ranks the model is split over (one GPU each on CUDA, processes on CPU); must divide the "
        f"attention heads and the MLP's intermediate size (default: {size})",
    )


# EngineConfig's field -> the dest of its flag (the flag is `--` + the dest with dashes).
FLAG_DESTS = {
    "max_num_seqs": "max_slots",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "num_kv_blocks": "num_kv_blocks",
    "block_size": "block_size",
    "max_model_len": "max_model_len",
    "scheduler": "scheduler",
    "max_merged_prefill_tokens": "max_merged_prefill_tokens",
    "max_prefill_tokens_while_decoding": "max_prefill_tokens_while_decoding",
    "enable_prefix_caching": "enable_prefix_caching",
    "dtype": "dtype",
    "kv_cache_dtype": "kv_cache_dtype",
    "device": "device",
    "quantization": "quantization",
    "gpu_memory_utilization": "gpu_memory_utilization",
    "tensor_parallel_size": "tensor_parallel_size",
    "speculative": "speculative",
    "draft_model": "draft_model",
    "num_speculative_tokens": "num_speculative_tokens",
    "ngram_min": "ngram_min",
    "ngram_max": "ngram_max",
    "speculative_max_running": "speculative_max_running",
}


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of the flags `add_engine_args` added; SystemExit naming each flag that is wrong."""
    try:
        return EngineConfig(**{field: getattr(args, dest) for field, dest in FLAG_DESTS.items()})
    except ValidationError as error:
        reasons = []
        for problem in error.errors():
            field = problem["loc"][0] if problem["loc"] else None
            flag = f"--{FLAG_DESTS[field].replace('_', '-')}: " if field in FLAG_DESTS else ""
            reasons.append(f"{flag}{problem['msg']} (got {problem['input']!r})")
        raise SystemExit(f"invalid engine settings: {'; '.join(reasons)}") from error
