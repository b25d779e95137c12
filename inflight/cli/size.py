"""`inflight size`: the sizing plan the operator would use for a model on a GPU type (or a CPU)."""

from __future__ import annotations

import argparse
import json
import sys

from pydantic import ValidationError

from inflight.engine.cli_args import add_kv_cache_dtype_arg, add_quantization_arg
from inflight.engine.dtypes import DTYPE_CHOICES
from inflight.sim import serving

SHAPE_KEYS = {
    "layers": "num_layers",
    "hidden": "hidden_size",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "intermediate": "intermediate_size",
    "vocab": "vocab_size",
    "tie": "tie_word_embeddings",
    "experts": "num_experts",
    "bias": "attention_bias",
}


def register(commands: argparse._SubParsersAction) -> None:
    size = commands.add_parser(
        "size",
        help="size a model on a GPU: does it fit, KV blocks, tokens, slots, GPUs needed",
        description="Print the sizing plan the operator would use. Model from the built-in catalog "
        "(--model) or a shape (--shape layers=80,hidden=8192,heads=64,kv_heads=8,head_dim=128,"
        "intermediate=28672,vocab=128256[,tie=0,experts=1,bias=0]).",
    )
    what = size.add_mutually_exclusive_group()
    what.add_argument("--model", help="catalog model, e.g. meta-llama/Llama-3.1-70B or llama-3.1-70b")
    what.add_argument("--shape", help="model shape as key=value pairs, comma-separated")
    what.add_argument("--list", action="store_true", help="list catalog models and GPU types")
    size.add_argument("--gpu", default="H100-80GB", help="catalog GPU type (default H100-80GB); see --list")
    size.add_argument("--gpu-memory-mib", type=int, default=None, help="GPU (or CPU) memory in MiB instead")
    size.add_argument("--gpus", type=int, default=1, help="GPUs per replica (tensor parallel); 0 = CPU")
    size.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    size.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    add_quantization_arg(size)  # sizing plans auto as none: name a quantized format to plan its bytes
    add_kv_cache_dtype_arg(size)
    size.add_argument("--block-size", type=int, default=16)
    size.add_argument("--max-slots", type=int, default=256)
    size.add_argument("--max-model-len", type=int, default=4096)
    size.add_argument("--max-batched-tokens", type=int, default=8192)
    size.add_argument("--expected-tokens-per-request", type=int, default=1024)
    size.add_argument(
        "--workload",
        help="what the replica will serve: prompt=N,output=N[,max_output=N][,rate=R] (tokens, requests/s); "
        "adds predicted requests/s and tokens/s (naive loop, static, continuous + paged KV) and replicas",
    )
    size.add_argument("--json", action="store_true", help="machine-readable output")
    size.set_defaults(func=_run_size)


def _parse_shape(text: str) -> dict[str, int | bool]:
    values: dict[str, int | bool] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in SHAPE_KEYS:
            raise ValueError(
                f"--shape item {item!r}: expected key=value with key one of {', '.join(SHAPE_KEYS)}"
            )
        field = SHAPE_KEYS[key]
        values[field] = value.strip() in ("1", "true", "yes") if key in ("tie", "bias") else int(value)
    missing = [key for key in list(SHAPE_KEYS)[:7] if SHAPE_KEYS[key] not in values]
    if missing:
        raise ValueError(f"--shape is missing {', '.join(missing)}")
    values.setdefault("tie_word_embeddings", False)
    return values


WORKLOAD_KEYS = {
    "prompt": "prompt_tokens",
    "output": "output_tokens",
    "max_output": "max_output_tokens",
    "rate": "requests_per_s",
}


def _parse_workload(text: str) -> serving.Workload:
    values: dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in WORKLOAD_KEYS:
            raise ValueError(
                f"--workload item {item!r}: expected key=value with key one of {', '.join(WORKLOAD_KEYS)}"
            )
        values[WORKLOAD_KEYS[key.strip()]] = value.strip()
    try:
        return serving.Workload.model_validate(values)
    except ValidationError as error:
        problems = "; ".join(f"{e['loc'][0]}: {e['msg']}" for e in error.errors())
        raise ValueError(f"--workload: {problems}") from None


def _run_size(args: argparse.Namespace) -> int:
    from inflight import sizing

    if args.list:
        print("models:")
        for shape in sizing.MODEL_CATALOG.values():
            print(f"  {shape.name:34} {shape.parameter_count() / 1e9:8.2f}B parameters")
        print("GPU types:")
        for gpu in sizing.GPU_CATALOG.values():
            fp8 = ", FP8" if gpu.fp8 else ""
            print(f"  {gpu.name:12} {gpu.memory_mib:7d} MiB  ({gpu.product}{fp8})")
        return 0
    try:
        if args.shape:
            shape = sizing.ModelShape(name="custom", **_parse_shape(args.shape))  # type: ignore[arg-type]
        elif args.model:
            found = sizing.find_model(args.model)
            if found is None:
                raise ValueError(
                    f"model {args.model!r} is not in the catalog; see `inflight size --list` or --shape"
                )
            shape = found
        else:
            raise ValueError("give --model NAME or --shape ... (or --list)")
        gpu_type = sizing.find_gpu(args.gpu) if args.gpus > 0 else None
        if args.gpu_memory_mib is not None:
            memory_mib = args.gpu_memory_mib
        elif gpu_type is not None:
            memory_mib = gpu_type.memory_mib
        else:
            raise ValueError(
                f"GPU type {args.gpu!r} is not in the catalog (see --list); or give --gpu-memory-mib"
                if args.gpus > 0
                else "--gpus 0 (CPU) needs --gpu-memory-mib: the container's memory"
            )
        limits = sizing.EngineLimits(
            block_size=args.block_size,
            max_slots=args.max_slots,
            max_model_len=args.max_model_len,
            max_batched_tokens=args.max_batched_tokens,
            expected_tokens_per_seq=args.expected_tokens_per_request,
            gpu_memory_utilization=args.gpu_memory_utilization,
        )
        workload = _parse_workload(args.workload) if args.workload else None
        if workload is not None:
            if gpu_type is None:
                raise ValueError("--workload needs a catalog GPU type (--gpu) for its speed figures")
            limits = serving.workload_limits(limits, workload)
        result = sizing.plan(
            shape,
            gpu_memory_bytes=memory_mib * sizing.MIB,
            gpus=args.gpus,
            dtype=args.dtype,
            limits=limits,
            gpu_type=gpu_type,
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
        )
        estimate = None
        if workload is not None and gpu_type is not None and result.fits:
            estimate = serving.estimate(shape, result, gpu_type.name, workload, limits)
    except ValueError as error:
        print(f"inflight size: {error}", file=sys.stderr)
        return 2
    if args.json:
        body = result.to_dict()
        if estimate is not None:
            body["serving"] = estimate.model_dump()
        print(json.dumps(body, indent=2))
    else:
        where = f"{args.gpus} x {gpu_type.name if gpu_type else f'{memory_mib} MiB'}" if args.gpus else "CPU"
        formats = (
            result.dtype
            if result.quantization in ("auto", "none")
            else f"{result.quantization} weights, {result.dtype}"
        )
        print(f"{shape.name} ({result.parameter_count / 1e9:.2f}B parameters, {formats}) on {where}")
        print(f"  fits:                 {'yes' if result.fits else 'no'}")
        print(f"  weights per GPU:      {result.weight_bytes_per_gpu / sizing.GIB:.2f} GiB")
        if result.packed_weight_bytes:
            print(f"  oneDNN packed copy:   {result.packed_weight_bytes / sizing.GIB:.2f} GiB (CPU)")
        print(f"  KV bytes per token:   {result.kv_bytes_per_token} (per GPU, {result.kv_cache_dtype})")
        print(f"  KV blocks:            {result.kv_blocks} x {result.block_size} tokens")
        print(f"  KV tokens:            {result.kv_tokens}")
        print(f"  slots:                {result.slots}")
        if args.gpus > 0:
            min_gpus = result.min_gpus if result.min_gpus is not None else "more than 8"
            print(f"  min GPUs of this type: {min_gpus} (tensor parallel)")
            all_slots = result.max_slots_gpus if result.max_slots_gpus is not None else "more than 8"
            print(f"  GPUs for all {args.max_slots} slots: {all_slots}")
            valid = sizing.valid_degrees(
                shape.num_attention_heads, shape.num_key_value_heads, shape.intermediate_size
            )
            print(
                f"  valid GPU counts:     {', '.join(map(str, valid))} (tensor-parallel sizes that split it)"
            )
            print(f"  smallest GPU type:    {result.smallest_gpu_type or 'none in the catalog'}")
        print(f"  {result.reason}")
        if estimate is not None:
            _print_estimate(estimate)
    return 0 if result.fits else 1


def _print_estimate(estimate: serving.ServingEstimate) -> None:
    print(f"what it serves ({estimate.note}):")
    for name, label in (("naive", "naive loop"), ("static", "static batching"), ("continuous", "continuous")):
        policy: serving.PolicyEstimate = getattr(estimate, name)
        print(
            f"  {label + ':':17} {policy.requests_per_s:9.2f} requests/s {policy.output_tokens_per_s:11,.0f} "
            f"output tokens/s  ({policy.batch} side by side)"
        )
    if estimate.replicas is not None:
        print(f"  replicas for the target rate (continuous): {estimate.replicas}")
    print("  constants:")
    for key, value in estimate.constants.items():
        print(f"    {key}: {f'{value:.2f}' if isinstance(value, float) else value}")
