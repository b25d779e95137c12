"""From a ModelServer spec and the labels of the nodes it may land on to a sizing plan (pure).

Model shape: `model.shape`, else `model.catalogName`, else the catalog entry of an hf:// source or
a built-in model (builtin:NAME). GPU memory: the smallest GPU among the nodes matching `nodeSelector`
that carry GPU feature discovery labels, else the catalog's `resources.gpu.type`, else
`resources.gpu.memoryMiB`. On CPU (`gpu.count: 0`) the container's memory limit is the budget.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from inflight import sizing
from inflight.operator.api.types import BUILTIN_SOURCES, ModelServerSpec

_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][-+]?[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)?$")
_SUFFIX: dict[str | None, Decimal | int] = {
    None: 1,
    "m": Decimal("0.001"),
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}


class SizingError(Exception):
    """The spec cannot be sized; the message says what to change. `reason` is a CamelCase word."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def parse_quantity(text: str) -> int:
    """A Kubernetes quantity (`16Gi`, `500M`, `1e9`) in base units, rounded up."""
    match = _QUANTITY.match(text.strip())
    if match is None:
        raise ValueError(f"{text!r} is not a Kubernetes quantity (e.g. 16Gi, 500Mi, 2)")
    try:
        value = Decimal(match.group(1)) * _SUFFIX[match.group(2)]
    except InvalidOperation as error:
        raise ValueError(f"{text!r} is not a Kubernetes quantity (e.g. 16Gi, 500Mi, 2)") from error
    return int(value.to_integral_value(rounding="ROUND_CEILING"))


def matches(selector: Mapping[str, str] | None, labels: Mapping[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in (selector or {}).items())


def model_shape(spec: ModelServerSpec) -> sizing.ModelShape:
    """The shape to size, from spec.model.shape or the catalog; a model the server cannot load is refused."""
    shape = _shape_of(spec)
    unsupported = sizing.unsupported_architecture(shape)
    if unsupported is not None:
        raise SizingError("UnsupportedArchitecture", f"model {shape.name!r}: {unsupported}")
    return shape


def _shape_of(spec: ModelServerSpec) -> sizing.ModelShape:
    model = spec.model
    if model.shape is not None:
        s = model.shape
        return sizing.ModelShape(
            name=model.catalog_name or model.name,
            num_layers=s.num_layers,
            hidden_size=s.hidden_size,
            num_attention_heads=s.num_attention_heads,
            num_key_value_heads=s.num_key_value_heads,
            head_dim=s.head_dim,
            intermediate_size=s.intermediate_size,
            vocab_size=s.vocab_size,
            tie_word_embeddings=s.tie_word_embeddings,
            num_experts=s.num_experts,
            attention_bias=s.attention_bias,
        )
    if model.catalog_name:
        lookup = model.catalog_name
    elif model.source.startswith("hf://") or model.source in BUILTIN_SOURCES:
        lookup = model.source.removeprefix("hf://")
    else:
        lookup = model.source
    shape = sizing.find_model(lookup)
    if shape is None:
        known = ", ".join(sizing.MODEL_CATALOG)
        raise SizingError(
            "UnknownModel",
            f"model {lookup!r} is not in the sizing catalog; set spec.model.catalogName to one of {known}, "
            "or give spec.model.shape",
        )
    return shape


@dataclass(frozen=True)
class Placement:
    """What the Deployment runs with: the plan and where its memory figure came from."""

    plan: sizing.SizingPlan
    gpu_type: str  # catalog name, node product label, or "cpu"
    gpu_memory_mib: int
    gpu_memory_source: str  # node-labels, catalog, spec or cpu


def node_gpu(spec: ModelServerSpec, node_labels: Iterable[Mapping[str, str]]) -> sizing.NodeGPU:
    """Per-GPU memory of the smallest GPU the pods may land on."""
    gpu = spec.resources.gpu
    eligible = [labels for labels in node_labels if matches(spec.node_selector, labels)]
    counts = [int(c) for labels in eligible if (c := labels.get(sizing.LABEL_GPU_COUNT, "")).isdigit()]
    if counts and max(counts) < gpu.count:
        raise SizingError(
            "NotEnoughGPUsPerNode",
            f"resources.gpu.count is {gpu.count} but the nodes the pods may land on have at most "
            f"{max(counts)} GPUs each, so the pods would stay Pending: lower resources.gpu.count, choose "
            "nodes with more GPUs (nodeSelector), or add such nodes",
        )
    big_enough = [
        labels
        for labels in eligible
        if not labels.get(sizing.LABEL_GPU_COUNT, "").isdigit()
        or int(labels[sizing.LABEL_GPU_COUNT]) >= gpu.count
    ]
    from_nodes = sizing.gpu_from_node_labels(big_enough)
    if from_nodes is not None:
        return from_nodes
    if gpu.type is not None:
        entry = sizing.find_gpu(gpu.type)
        if entry is None:
            known = ", ".join(sizing.GPU_CATALOG)
            raise SizingError("UnknownGPUType", f"resources.gpu.type {gpu.type!r} is not one of {known}")
        return sizing.NodeGPU(entry.memory_mib, entry.name, gpu.count, "catalog")
    if gpu.memory_mi_b is not None:
        return sizing.NodeGPU(gpu.memory_mi_b, "unknown", gpu.count, "spec")
    where = f"matching nodeSelector {spec.node_selector}" if spec.node_selector else "in the cluster"
    raise SizingError(
        "NoGPUInfo",
        f"no node {where} carries {sizing.LABEL_GPU_MEMORY} or {sizing.LABEL_GPU_PRODUCT} labels (install "
        "NVIDIA GPU feature discovery), and the spec names no GPU: set resources.gpu.type (e.g. L4, "
        "H100-80GB) or resources.gpu.memoryMiB",
    )


def engine_limits(spec: ModelServerSpec) -> sizing.EngineLimits:
    """The engine settings the plan is made for (spec.engine and model.maxModelLen)."""
    engine = spec.engine
    return sizing.EngineLimits(
        block_size=engine.block_size,
        max_slots=engine.max_slots,
        max_model_len=spec.model.max_model_len,
        max_batched_tokens=engine.max_batched_tokens,
        expected_tokens_per_seq=engine.expected_tokens_per_request,
        gpu_memory_utilization=engine.gpu_memory_utilization,
    )


def place(spec: ModelServerSpec, node_labels: Iterable[Mapping[str, str]]) -> Placement:
    """Size the spec for the nodes it may land on. Raises SizingError when it cannot be sized at all.

    A plan that does not fit is returned (with `plan.fits` False), not raised: its reason names the GPU
    count or type that would fit.
    """
    shape = model_shape(spec)
    limits = engine_limits(spec)
    dtype, quantization = spec.model.dtype.value, spec.model.quantization or "none"
    kv_cache_dtype = spec.engine.kv_cache_dtype
    gpus = spec.resources.gpu.count
    if gpus == 0:
        memory = parse_quantity(spec.resources.memory)
        result = sizing.plan(
            shape,
            gpu_memory_bytes=memory,
            gpus=0,
            dtype=dtype,
            limits=limits,
            quantization=quantization,
            kv_cache_dtype=kv_cache_dtype,
        )
        return Placement(result, "cpu", memory // sizing.MIB, "cpu")
    gpu = node_gpu(spec, node_labels)
    gpu_type = sizing.find_gpu(gpu.product) if gpu.product != "unknown" else None
    fp8_missing = sizing.fp8_problem(gpu_type, quantization, kv_cache_dtype)
    if fp8_missing is not None:
        raise SizingError("NoFP8Support", f"{fp8_missing} (GPU from {gpu.source}: {gpu.product})")
    result = sizing.plan(
        shape,
        gpu_memory_bytes=gpu.memory_mib * sizing.MIB,
        gpus=gpus,
        dtype=dtype,
        limits=limits,
        gpu_type=gpu_type,
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
    )
    return Placement(result, gpu.product, gpu.memory_mib, gpu.source)
