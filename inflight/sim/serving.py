"""What a replica will serve: a roofline cost model over the sizing plan (no torch). It is a model.

A step reads every weight once plus the K/V of every token its sequences attend to, and does 2 FLOPs
per parameter per token in it; it takes the longer of the two at the GPU's datasheet peak (memory
bandwidth, dense 16-bit tensor FLOPs), spread over the tensor-parallel GPUs:

    step_s(tokens, kv_read) = max((weight_bytes_per_gpu + kv_read * kv_bytes_per_token_per_gpu) / bandwidth,
                                  2 * parameters * tokens / (flops * gpus))

A batch of B requests (prompt P, output O; a batch lasts as long as its longest output) is one prefill
step of B * P tokens and then one decode step per output token, each reading the batch's K/V at its
mid-point length:

    batch_s(B, steps) = step_s(B * P, 0) + steps * step_s(B, B * (P + O / 2))
    requests/s        = B / batch_s

Three ways to serve: a naive loop (B = 1), static batching with contiguous KV (B = the requests whose
max_model_len reservations fit, each batch lasting the longest output) and continuous batching with
paged KV (B = the slots of the sizing plan, which holds prompt + output per request; a slot is refilled
as soon as its request ends, so a request costs its own output, not the longest). Peak datasheet
figures make it an upper bound: real kernels reach a share of them.

The batch formula takes any step cost (`StepCost`): the roofline above for a GPU, or a step cost fitted
from timed steps of the real engine (sim/cost_model.py, `inflight demo --calibrate`), which is how it is
checked against `inflight bench serve` on a CPU (benchmarks/serving_model_check.py, docs/demo.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from pydantic import BaseModel, ConfigDict, Field

from inflight.sizing import (
    GIB,
    GPU_CATALOG,
    MIB,
    MODEL_CATALOG,
    EngineLimits,
    ModelShape,
    SizingPlan,
    find_model,
    plan,
    unsupported_architecture,
)


@dataclass(frozen=True)
class GPUSpeed:
    memory_bandwidth_gb_s: float
    dense_16bit_tflops: float
    source: str


# Datasheet peaks (dense, i.e. without the 2:4 sparsity the headline figures assume).
GPU_SPEED: dict[str, GPUSpeed] = {
    "T4": GPUSpeed(320, 65, "NVIDIA T4 datasheet: 320 GB/s, 65 TFLOPS FP16 mixed precision"),
    "L4": GPUSpeed(300, 121, "NVIDIA L4 datasheet: 300 GB/s, 242 TFLOPS BF16 with sparsity (121 dense)"),
    "L40S": GPUSpeed(864, 362, "NVIDIA L40S datasheet: 864 GB/s, 733 TFLOPS BF16 with sparsity (362 dense)"),
    "A100-40GB": GPUSpeed(1555, 312, "NVIDIA A100 datasheet (SXM4 40GB): 1,555 GB/s, 312 TFLOPS BF16"),
    "A100-80GB": GPUSpeed(2039, 312, "NVIDIA A100 datasheet (SXM4 80GB): 2,039 GB/s, 312 TFLOPS BF16"),
    "H100-80GB": GPUSpeed(
        3350, 989, "NVIDIA H100 datasheet (SXM): 3.35 TB/s, 1,979 TFLOPS BF16 with sparsity (989 dense)"
    ),
    "H200-141GB": GPUSpeed(
        4800, 989, "NVIDIA H200 datasheet (SXM): 4.8 TB/s, 1,979 TFLOPS BF16 with sparsity (989 dense)"
    ),
}


class Workload(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt_tokens: int = Field(ge=1, description="tokens per prompt")
    output_tokens: int = Field(ge=1, description="mean output tokens per request")
    max_output_tokens: int | None = Field(
        default=None,
        ge=1,
        description="the longest output (a static batch lasts this long); default the mean",
    )
    requests_per_s: float | None = Field(default=None, gt=0, description="target rate, for the replica count")

    @property
    def longest_output(self) -> int:
        return max(self.output_tokens, self.max_output_tokens or self.output_tokens)


class PolicyEstimate(BaseModel):
    batch: int = Field(description="requests served side by side")
    requests_per_s: float
    output_tokens_per_s: float


class ServingEstimate(BaseModel):
    gpu: str
    gpus: int
    constants: dict[str, int | float | str] = Field(description="every figure the model used, with sources")
    naive: PolicyEstimate
    static: PolicyEstimate
    continuous: PolicyEstimate
    replicas: int | None = Field(description="continuous-batching replicas for the target rate, if given")
    note: str


# Seconds of one engine step: (tokens in the step, K/V tokens its sequences attend to) -> seconds.
StepCost = Callable[[int, int], float]


def step_seconds(shape: ModelShape, sizing: SizingPlan, speed: GPUSpeed, tokens: int, kv_read: int) -> float:
    gpus = sizing.tensor_parallel
    weight_bytes = sizing.weight_bytes_per_gpu
    kv_bytes = kv_read * sizing.kv_bytes_per_token
    memory_s = (weight_bytes + kv_bytes) / (speed.memory_bandwidth_gb_s * 1e9)
    compute_s = 2 * shape.parameter_count() * tokens / (speed.dense_16bit_tflops * 1e12 * gpus)
    return max(memory_s, compute_s)


def roofline(shape: ModelShape, sizing: SizingPlan, speed: GPUSpeed) -> StepCost:
    """The datasheet-peak step cost of a replica planned by `sizing`."""

    def step(tokens: int, kv_read: int) -> float:
        return step_seconds(shape, sizing, speed, tokens, kv_read)

    return step


def policy_estimate(step: StepCost, workload: Workload, batch: int, steps: int) -> PolicyEstimate:
    """`batch` requests side by side: one prefill step of batch * prompt tokens, then `steps` decode steps
    reading the batch's K/V at its mid-point length."""
    p, o = workload.prompt_tokens, workload.output_tokens
    seconds = step(batch * p, 0) + steps * step(batch, batch * (p + o // 2))
    rate = batch / seconds
    return PolicyEstimate(batch=batch, requests_per_s=rate, output_tokens_per_s=rate * o)


def workload_limits(limits: EngineLimits, workload: Workload) -> EngineLimits:
    """`limits` sized for `workload`: slots hold prompt + mean output; max_model_len fits the longest."""
    return replace(
        limits,
        max_model_len=max(limits.max_model_len, workload.prompt_tokens + workload.longest_output),
        expected_tokens_per_seq=workload.prompt_tokens + workload.output_tokens,
    )


def estimate(
    shape: ModelShape, sizing: SizingPlan, gpu: str, workload: Workload, limits: EngineLimits
) -> ServingEstimate:
    """What a replica sized by `sizing` (planned with `workload_limits`) serves three ways.

    Raises ValueError when the GPU has no speed figures or the plan does not fit.
    """
    speed = GPU_SPEED.get(gpu)
    if speed is None:
        raise ValueError(f"no speed figures for GPU {gpu!r}; known: {', '.join(GPU_SPEED)}")
    if not sizing.fits:
        raise ValueError(f"{shape.name} does not fit: {sizing.reason}")
    contiguous = min(limits.max_slots, sizing.kv_tokens // limits.max_model_len)
    step = roofline(shape, sizing, speed)
    continuous = policy_estimate(step, workload, sizing.slots, workload.output_tokens)
    replicas = (
        math.ceil(workload.requests_per_s / continuous.requests_per_s) if workload.requests_per_s else None
    )
    return ServingEstimate(
        gpu=gpu,
        gpus=sizing.tensor_parallel,
        constants={
            "memory_bandwidth_gb_s": speed.memory_bandwidth_gb_s,
            "dense_16bit_tflops": speed.dense_16bit_tflops,
            "gpu_source": speed.source,
            "parameters": shape.parameter_count(),
            "weight_gib_per_gpu": sizing.weight_bytes_per_gpu / GIB,
            "kv_bytes_per_token_per_gpu": sizing.kv_bytes_per_token,
            "model_source": f"{shape.name} config.json (the sizing catalog), {sizing.dtype}",
        },
        naive=policy_estimate(step, workload, 1, workload.output_tokens),
        static=policy_estimate(step, workload, max(contiguous, 1), workload.longest_output),
        continuous=continuous,
        replicas=replicas,
        note="a roofline model at datasheet peaks (an upper bound), not a measurement",
    )


class UnknownChoice(ValueError):
    """A model or GPU the catalog does not know; `param` names which."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class ServingAnswer(BaseModel):
    """The demo page's "what will this GPU serve": the sizing plan and, when it fits, the estimate."""

    model: str
    gpu: str
    gpus: int
    workload: Workload
    fits: bool
    reason: str
    slots: int
    kv_tokens: int
    min_gpus: int | None
    estimate: ServingEstimate | None
    models: list[str] = Field(description="catalog models to choose from")
    gpu_types: list[str] = Field(description="catalog GPU types with speed figures")


def answer(model: str, gpu: str, gpus: int, workload: Workload) -> ServingAnswer:
    """Plan `model` on `gpus` x `gpu` for `workload` and estimate what it serves."""
    shape = find_model(model)
    if shape is None or unsupported_architecture(shape) is not None:
        raise UnknownChoice("model", f"model {model!r} is not in the catalog")
    gpu_type = GPU_CATALOG.get(gpu)
    if gpu_type is None or gpu not in GPU_SPEED:
        raise UnknownChoice("gpu", f"GPU {gpu!r} has no speed figures; known: {', '.join(GPU_SPEED)}")
    limits = workload_limits(EngineLimits(), workload)
    sizing = plan(
        shape, gpu_memory_bytes=gpu_type.memory_mib * MIB, gpus=gpus, limits=limits, gpu_type=gpu_type
    )
    return ServingAnswer(
        model=shape.name,
        gpu=gpu,
        gpus=gpus,
        workload=workload,
        fits=sizing.fits,
        reason=sizing.reason,
        slots=sizing.slots,
        kv_tokens=sizing.kv_tokens,
        min_gpus=sizing.min_gpus,
        estimate=estimate(shape, sizing, gpu, workload, limits) if sizing.fits else None,
        models=[name for name, s in MODEL_CATALOG.items() if unsupported_architecture(s) is None],
        gpu_types=list(GPU_SPEED),
    )
