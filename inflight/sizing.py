"""GPU memory + model shape -> tensor-parallel degree, KV blocks and slots (pure: no torch, no Kubernetes).

Per tensor-parallel shard (one GPU):

    weight_bytes       = quantized_params * format_bytes + other_params * dtype_bytes   (split over the GPUs)
    kv_bytes_per_token = 2 * layers * kv_heads_per_gpu * head_dim * kv_dtype_bytes
    block_bytes        = block_size * kv_bytes_per_token
    usable             = gpu_mem * gpu_memory_utilization - weight_bytes_per_gpu - activation_reserve
                         (- packed_weight_bytes on CPU)
    kv_blocks          = floor(usable / block_bytes)
    slots              = min(max_slots, floor(kv_blocks * block_size / expected_tokens_per_seq))

A plan *fits* when the KV pool holds at least one sequence of `max_model_len` tokens: a server that
cannot hold one full-length request is not a working server. When it does not fit, the plan names the
smallest GPU count (tensor parallel, on one node) and the smallest catalog GPU type that would.
The operator plans with the engine's own formulas (engine/kv_budget.py's `kv_token_bytes`, the
torch-free modules of the engine); the engine re-measures free memory at start and takes the smaller of
the two plans.

On CPU a float32 or bfloat16 engine holds its linear layers and LM head twice (`packed_weight_bytes`): the
plain matrices, for the C product of one to a few rows, and oneDNN's packed copy for larger products
(engine/cpu/linear.py). The plan counts both.

Bytes come from two tables: the weight format (`quantization`: engine/quantization.py, the bytes per
weight the engine holds, from the kernels' block layout, for the matrices the format quantizes; the rest
stays in `dtype`) and the KV cache's element type (`kv_cache_dtype`
auto = dtype, fp8 = one byte: engine/dtypes.py). FP8 in either needs a GPU with FP8 support (`GPUType.fp8`,
from the datasheets: Ada Lovelace and Hopper and later); on another GPU the plan does not fit and says
what to change.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from inflight.engine.dtypes import CPU_PREPACKED_DTYPES, DTYPE_BYTES, DTYPE_CHOICES, kv_cache_dtype_name
from inflight.engine.kv_budget import kv_token_bytes, step_activation_bytes
from inflight.engine.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from inflight.engine.model.shard_layout import degree_error, valid_degrees
from inflight.engine.quantization import NEEDS_FP8_GPU, QUANTIZED_WEIGHT_BYTES, check_known, holds_quantized

MIB = 1024 * 1024
GIB = 1024 * MIB


# Tensor-parallel degrees tried when a model does not fit: one node has at most 8 GPUs.
TENSOR_PARALLEL_DEGREES = (1, 2, 4, 8)

# Memory a CUDA context, cuBLAS workspaces and the allocator's slack take before any tensor.
CUDA_CONTEXT_BYTES = 512 * MIB
# On CPU the container's memory also holds the Python interpreter, torch and the server.
CPU_RUNTIME_BYTES = 1 * GIB

# Node labels set by NVIDIA GPU feature discovery.
LABEL_GPU_MEMORY = "nvidia.com/gpu.memory"  # MiB per GPU
LABEL_GPU_PRODUCT = "nvidia.com/gpu.product"
LABEL_GPU_COUNT = "nvidia.com/gpu.count"


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only transformer that decide its memory (a Hugging Face config.json)."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    num_experts: int = 1
    attention_bias: bool = False
    max_position_embeddings: int = 131072
    # The Hugging Face architecture (config.json `architectures`); the server runs SUPPORTED_ARCHITECTURES.
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, field) < 1:
                raise ValueError(f"model shape {self.name!r}: {field} must be >= 1")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model shape {self.name!r}: num_attention_heads ({self.num_attention_heads}) must be a "
                f"multiple of num_key_value_heads ({self.num_key_value_heads})"
            )

    def linear_matrices(self) -> list[tuple[int, int]]:
        """(input features, parameters over all layers) of each of the decoder's linear layers: attention
        q/k/v and o, the MLP's gate/up and down (or its experts'), the router."""
        q_size = self.num_attention_heads * self.head_dim
        kv_size = self.num_key_value_heads * self.head_dim
        hidden, intermediate, experts = self.hidden_size, self.intermediate_size, self.num_experts
        per_layer = [
            (hidden, hidden * (q_size + 2 * kv_size)),
            (q_size, q_size * hidden),
            (hidden, experts * 2 * hidden * intermediate),
            (intermediate, experts * intermediate * hidden),
        ]
        if experts > 1:
            per_layer.append((hidden, hidden * experts))
        return [(features, self.num_layers * count) for features, count in per_layer]

    def linear_parameter_count(self) -> int:
        """Parameters of the decoder's linear layers (attention q/k/v/o, MLP or experts, the router)."""
        return sum(count for _, count in self.linear_matrices())

    def embedding_parameter_count(self) -> int:
        """Parameters of the embedding table and the LM head (none of its own when tied)."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    def replicated_parameter_count(self) -> int:
        """Parameters every tensor-parallel shard holds in full: the RMSNorm weights."""
        return (2 * self.num_layers + 1) * self.hidden_size

    def parameter_count(self) -> int:
        """Parameters computed from the shape (embeddings, attention, MLP or experts, norms, LM head)."""
        q_size = self.num_attention_heads * self.head_dim
        kv_size = self.num_key_value_heads * self.head_dim
        biases = self.num_layers * (q_size + 2 * kv_size) if self.attention_bias else 0
        return (
            self.linear_parameter_count()
            + biases
            + self.embedding_parameter_count()
            + self.replicated_parameter_count()
        )

    def tensor_parallel_error(self, degree: int) -> str | None:
        """Why `degree` GPUs cannot split this model (the engine's rule, engine/model/shard_layout.py)."""
        return degree_error(
            self.num_attention_heads, self.num_key_value_heads, self.intermediate_size, degree
        )

    def valid_tensor_parallel(self, degree: int) -> bool:
        return self.tensor_parallel_error(degree) is None


@dataclass(frozen=True)
class GPUType:
    """A GPU model: the memory GPU feature discovery reports (MiB), its product label, and whether it has
    bfloat16 and FP8 (e4m3) tensor cores (datasheets: FP8 from Ada Lovelace and Hopper on; T4 is Turing,
    A10G and A100 Ampere)."""

    name: str
    memory_mib: int
    product: str
    bfloat16: bool = True
    fp8: bool = False


GPU_CATALOG: dict[str, GPUType] = {
    gpu.name: gpu
    for gpu in (
        GPUType("T4", 15360, "Tesla-T4", bfloat16=False),
        GPUType("L4", 23034, "NVIDIA-L4", fp8=True),
        GPUType("A10G", 23028, "NVIDIA-A10G"),
        GPUType("L40S", 46068, "NVIDIA-L40S", fp8=True),
        GPUType("A100-40GB", 40960, "NVIDIA-A100-SXM4-40GB"),
        GPUType("A100-80GB", 81920, "NVIDIA-A100-SXM4-80GB"),
        GPUType("H100-80GB", 81559, "NVIDIA-H100-80GB-HBM3", fp8=True),
        GPUType("H200-141GB", 143771, "NVIDIA-H200", fp8=True),
        GPUType("B200", 183359, "NVIDIA-B200", fp8=True),
    )
}


def fp8_problem(gpu: GPUType | None, quantization: str, kv_cache_dtype: str) -> str | None:
    """Why `gpu` cannot run these weights or this KV cache (FP8 without FP8 tensor cores), with the fix;
    None when it can or the GPU is unknown (memory given as a number)."""
    wants = [f"--quantization {quantization}"] if quantization in NEEDS_FP8_GPU else []
    if kv_cache_dtype == "fp8":
        wants.append("--kv-cache-dtype fp8")
    if gpu is None or gpu.fp8 or not wants:
        return None
    with_fp8 = ", ".join(g.name for g in GPU_CATALOG.values() if g.fp8)
    return (
        f"{gpu.name} has no FP8 support, which {' and '.join(wants)} needs: use a GPU with FP8 ({with_fp8}), "
        "or int8 / GGUF weights (quantization) and kv-cache-dtype auto"
    )


def _llama(name: str, layers: int, hidden: int, heads: int, intermediate: int, tie: bool) -> ModelShape:
    return ModelShape(
        name, layers, hidden, heads, 8, 128 if hidden >= 3072 else 64, intermediate, 128256, tie
    )


def _qwen(name: str, layers: int, hidden: int, heads: int, kv: int, inter: int, vocab: int) -> ModelShape:
    tie = vocab == 151936
    return ModelShape(
        name,
        layers,
        hidden,
        heads,
        kv,
        hidden // heads,
        inter,
        vocab,
        tie,
        attention_bias=True,
        max_position_embeddings=32768,
        architecture="Qwen2ForCausalLM",
    )


def unsupported_architecture(shape: ModelShape) -> str | None:
    """Why the server cannot load this model, or None when it can (one source: the engine's
    SUPPORTED_ARCHITECTURES; mixture-of-experts MLPs are not implemented)."""
    runs = ", ".join(SUPPORTED_ARCHITECTURES)
    if shape.architecture not in SUPPORTED_ARCHITECTURES:
        return f"architecture not supported by the server: {shape.architecture} (the server runs {runs})"
    if shape.num_experts > 1:
        return (
            f"architecture not supported by the server: a mixture-of-experts MLP ({shape.num_experts} "
            f"experts per layer); the server runs dense {runs} models"
        )
    return None


# Values from each model's published config.json (Hugging Face Hub).
MODEL_CATALOG: dict[str, ModelShape] = {
    shape.name: shape
    for shape in (
        _llama("meta-llama/Llama-3.2-1B", 16, 2048, 32, 8192, tie=True),
        _llama("meta-llama/Llama-3.2-3B", 28, 3072, 24, 8192, tie=True),
        _llama("meta-llama/Llama-3.1-8B", 32, 4096, 32, 14336, tie=False),
        _llama("meta-llama/Llama-3.1-70B", 80, 8192, 64, 28672, tie=False),
        _llama("meta-llama/Llama-3.1-405B", 126, 16384, 128, 53248, tie=False),
        _qwen("Qwen/Qwen2.5-0.5B", 24, 896, 14, 2, 4864, 151936),
        _qwen("Qwen/Qwen2.5-1.5B", 28, 1536, 12, 2, 8960, 151936),
        _qwen("Qwen/Qwen2.5-3B", 36, 2048, 16, 2, 11008, 151936),
        _qwen("Qwen/Qwen2.5-7B", 28, 3584, 28, 4, 18944, 152064),
        _qwen("Qwen/Qwen2.5-14B", 48, 5120, 40, 8, 13824, 152064),
        _qwen("Qwen/Qwen2.5-32B", 64, 5120, 40, 8, 27648, 152064),
        _qwen("Qwen/Qwen2.5-72B", 80, 8192, 64, 8, 29568, 152064),
        ModelShape(
            "mistralai/Mistral-7B-v0.3",
            32,
            4096,
            32,
            8,
            128,
            14336,
            32768,
            False,
            max_position_embeddings=32768,
            architecture="MistralForCausalLM",
        ),
        # The engine's built-in random-weight test model (`inflight serve --model builtin:tiny`).
        ModelShape("builtin:tiny", 4, 128, 4, 2, 32, 352, 2048, False, max_position_embeddings=2048),
        # The engine's larger random-weight model (`--model builtin:small`).
        ModelShape("builtin:small", 8, 512, 8, 4, 64, 1408, 8192, False, max_position_embeddings=2048),
        # Llama-3.2-1B's shape with random weights (`--model builtin:llama-1b`).
        ModelShape("builtin:llama-1b", 16, 2048, 32, 8, 64, 8192, 128256, True, max_position_embeddings=8192),
        # SmolLM2-135M-Instruct (`--model builtin:smollm2`).
        ModelShape("builtin:smollm2", 30, 576, 9, 3, 64, 1536, 49152, True, max_position_embeddings=8192),
    )
}

_SUFFIXES = ("-instruct", "-chat", "-it")


def find_model(name: str) -> ModelShape | None:
    """The catalog shape for a Hub id, with or without org and `-Instruct` suffix (case-insensitive)."""
    wanted = name.strip().lower().removeprefix("hf://")
    for suffix in _SUFFIXES:
        wanted = wanted.removesuffix(suffix)
    for key, shape in MODEL_CATALOG.items():
        key = key.lower()
        if wanted in (key, key.split("/")[-1], key.split(":")[-1]):
            return shape
    return None


def shape_of_config(name: str, config: ModelConfig) -> ModelShape:
    """The shape of a checkpoint the engine parsed (its config.json: engine/model/config.py)."""
    return ModelShape(
        name,
        config.num_hidden_layers,
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.intermediate_size,
        config.vocab_size,
        config.tie_word_embeddings,
        attention_bias=config.attention_bias,
        max_position_embeddings=config.max_position_embeddings,
        architecture=config.architecture,
    )


def find_gpu(name_or_product: str) -> GPUType | None:
    """A catalog GPU by our name (`H100-80GB`) or by its GPU-feature-discovery product label."""
    wanted = name_or_product.strip().lower()
    for gpu in GPU_CATALOG.values():
        if wanted in (gpu.name.lower(), gpu.product.lower()):
            return gpu
    # Product labels vary by form factor (SXM/PCIe/NVL): match on the catalog name inside the product.
    for gpu in sorted(GPU_CATALOG.values(), key=lambda g: -len(g.name)):
        if gpu.name.lower() in wanted or gpu.name.split("-")[0].lower() in wanted.split("-"):
            return gpu
    return None


@dataclass(frozen=True)
class NodeGPU:
    """What the pods may land on: GPU memory (MiB) per GPU, product and count, and where that came from."""

    memory_mib: int
    product: str
    count: int
    source: str  # "node-labels", "catalog" or "spec"


def gpu_from_node_labels(nodes: Iterable[Mapping[str, str]]) -> NodeGPU | None:
    """The smallest GPU among the nodes' GPU-feature-discovery labels; None when no node carries them.

    A node with a product label but no memory label is looked up in the GPU catalog.
    """
    found: list[NodeGPU] = []
    for labels in nodes:
        product = labels.get(LABEL_GPU_PRODUCT, "")
        memory = labels.get(LABEL_GPU_MEMORY, "")
        count = int(labels[LABEL_GPU_COUNT]) if labels.get(LABEL_GPU_COUNT, "").isdigit() else 0
        if memory.isdigit():
            found.append(NodeGPU(int(memory), product, count, "node-labels"))
        elif product and (gpu := find_gpu(product)) is not None:
            found.append(NodeGPU(gpu.memory_mib, product, count, "node-labels"))
    return min(found, key=lambda g: (g.memory_mib, g.count)) if found else None


@dataclass(frozen=True)
class EngineLimits:
    """The engine knobs that enter the plan."""

    block_size: int = 16
    max_slots: int = 256
    max_model_len: int = 4096
    max_batched_tokens: int = 8192
    expected_tokens_per_seq: int = 1024
    gpu_memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for field in (
            "block_size",
            "max_slots",
            "max_model_len",
            "max_batched_tokens",
            "expected_tokens_per_seq",
        ):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")


@dataclass(frozen=True)
class SizingPlan:
    """The outcome for one shape on `tensor_parallel` GPUs of `gpu_memory_bytes` each; bytes are per GPU.
    `max_slots_gpus`: the smallest GPU count of this type whose plan gives all `max_slots` slots."""

    model: str
    dtype: str
    quantization: str
    kv_cache_dtype: str
    tensor_parallel: int
    gpu_memory_bytes: int
    gpu_memory_utilization: float
    parameter_count: int
    weight_bytes_total: int
    weight_bytes_per_gpu: int
    packed_weight_bytes: int
    activation_reserve_bytes: int
    kv_bytes_per_token: int
    block_size: int
    block_bytes: int
    kv_blocks: int
    kv_tokens: int
    slots: int
    max_model_len: int
    fits: bool
    reason: str
    min_gpus: int | None
    smallest_gpu_type: str | None
    max_slots_gpus: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def resolve_dtype(dtype: str, gpus: int, gpu: GPUType | None = None) -> str:
    """`auto`: float32 on CPU, float16 on GPUs without bfloat16 (T4), bfloat16 elsewhere."""
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
    if dtype != "auto":
        return dtype
    if gpus == 0:
        return "float32"
    return "float16" if gpu is not None and not gpu.bfloat16 else "bfloat16"


def weight_bytes_per_gpu(
    shape: ModelShape, dtype: str, tensor_parallel: int, quantization: str = "none"
) -> int:
    """Sharded weights split evenly (vocab-parallel embeddings too); norms are held in full by every shard.
    A quantized format holds the matrices it quantizes (`holds_quantized`: the linear layers, and for the
    formats quantized at load the embedding and LM head too) in the bytes per weight the engine holds; the
    rest stays in `dtype`."""
    check_known(quantization)
    replicated = shape.replicated_parameter_count()
    format_bytes = QUANTIZED_WEIGHT_BYTES[quantization] or DTYPE_BYTES[dtype]
    quantized, _ = _matrix_parameters(shape, quantization, shape.embedding_parameter_count())
    other = shape.parameter_count() - replicated - quantized
    sharded = (
        math.ceil(quantized * format_bytes / tensor_parallel)
        + math.ceil(other / tensor_parallel) * DTYPE_BYTES[dtype]
    )
    return sharded + replicated * DTYPE_BYTES[dtype]


def packed_weight_bytes(shape: ModelShape, dtype: str, quantization: str = "none") -> int:
    """The second copy of the weights a CPU engine keeps: every matrix a float32 or bfloat16 engine holds in
    its dtype among the linear layers and the LM head (tied or not) is also packed in oneDNN's layout
    (engine/cpu/linear.py's prepack_linears); quantized matrices are not. bfloat16 is packed only where
    the CPU runs it natively, which a plan cannot see: it counts the copy."""
    if dtype not in CPU_PREPACKED_DTYPES:
        return 0
    _, float_weights = _matrix_parameters(shape, quantization, shape.vocab_size * shape.hidden_size)
    return float_weights * DTYPE_BYTES[dtype]


def _matrix_parameters(shape: ModelShape, quantization: str, table_parameters: int) -> tuple[int, int]:
    """(quantized, kept in the dtype) parameters of the decoder's linear layers and `table_parameters` of
    the embedding table / LM head, by `holds_quantized`."""
    matrices = [(features, count, False) for features, count in shape.linear_matrices()]
    matrices.append((shape.hidden_size, table_parameters, True))
    quantized = sum(
        count for features, count, table in matrices if holds_quantized(quantization, features, table)
    )
    return quantized, sum(count for _, count, _ in matrices) - quantized


def activation_reserve_bytes(
    shape: ModelShape, dtype: str, tensor_parallel: int, limits: EngineLimits
) -> int:
    """Peak transient memory of one step, kept out of the KV pool (the engine's own rule,
    engine/kv_budget.py)."""
    return step_activation_bytes(
        shape.hidden_size,
        shape.intermediate_size // tensor_parallel,
        shape.vocab_size,
        limits.max_batched_tokens,
        limits.max_slots,
        dtype,
    )


def kv_bytes_per_token(shape: ModelShape, dtype: str, tensor_parallel: int) -> int:
    """`dtype`: the KV cache's element type (dtypes.kv_cache_dtype_name)."""
    kv_heads_per_gpu = max(1, shape.num_key_value_heads // tensor_parallel)
    return kv_token_bytes(shape.num_layers, kv_heads_per_gpu, shape.head_dim, dtype)


@dataclass(frozen=True)
class Formats:
    """How the plan stores its numbers: the dtype (resolved), the weight format and the KV cache dtype."""

    dtype: str
    quantization: str = "none"
    kv_cache_dtype: str = "auto"


@dataclass(frozen=True)
class EngineBytes:
    """What one engine holds on one GPU (its shard) or on the CPU besides its KV pool, and a KV token's
    bytes there: the plan's terms."""

    weights: int
    packed: int  # oneDNN's packed copy (CPU)
    reserve: int  # one step's activations + the CUDA context or the CPU runtime
    kv_per_token: int
    kv_dtype: str

    def total(self, kv_tokens: int) -> int:
        """Everything it holds with a KV pool of `kv_tokens` tokens."""
        return self.weights + self.packed + self.reserve + kv_tokens * self.kv_per_token


def engine_bytes(
    shape: ModelShape, formats: Formats, tensor_parallel: int, limits: EngineLimits, on_gpu: bool
) -> EngineBytes:
    dtype = formats.dtype
    overhead = CUDA_CONTEXT_BYTES if on_gpu else CPU_RUNTIME_BYTES
    kv_dtype = kv_cache_dtype_name(formats.kv_cache_dtype, dtype)
    return EngineBytes(
        weights=weight_bytes_per_gpu(shape, dtype, tensor_parallel, formats.quantization),
        packed=0 if on_gpu else packed_weight_bytes(shape, dtype, formats.quantization),
        reserve=activation_reserve_bytes(shape, dtype, tensor_parallel, limits) + overhead,
        kv_per_token=kv_bytes_per_token(shape, kv_dtype, tensor_parallel),
        kv_dtype=kv_dtype,
    )


def _plan_one(
    shape: ModelShape,
    formats: Formats,
    gpu_memory_bytes: int,
    tensor_parallel: int,
    limits: EngineLimits,
    on_gpu: bool,
) -> SizingPlan:
    dtype = formats.dtype
    held = engine_bytes(shape, formats, tensor_parallel, limits, on_gpu)
    weights, packed, reserve = held.weights, held.packed, held.reserve
    per_token, kv_dtype = held.kv_per_token, held.kv_dtype
    block_bytes = limits.block_size * per_token
    usable = math.floor(gpu_memory_bytes * limits.gpu_memory_utilization) - weights - packed - reserve
    packed_text = f" + {packed / GIB:.1f} GiB packed for oneDNN" if packed else ""
    kv_blocks = max(0, usable // block_bytes)
    kv_tokens = kv_blocks * limits.block_size
    slots = min(limits.max_slots, kv_tokens // min(limits.expected_tokens_per_seq, limits.max_model_len))
    budget = f"{limits.gpu_memory_utilization:g} x {gpu_memory_bytes / GIB:.1f} GiB"
    unsupported = unsupported_architecture(shape)
    degree_problem = shape.tensor_parallel_error(tensor_parallel)
    if unsupported is not None:
        fits = False
        reason = unsupported
    elif degree_problem is not None:
        fits = False
        valid = valid_degrees(shape.num_attention_heads, shape.num_key_value_heads, shape.intermediate_size)
        reason = (
            f"{tensor_parallel} GPUs cannot split {shape.name}: {degree_problem} "
            f"(valid tensor-parallel sizes: {', '.join(map(str, valid))})"
        )
    elif usable <= 0:
        fits = False
        reason = (
            f"weights ({weights / GIB:.1f} GiB{' per GPU' if on_gpu else packed_text}) plus activation "
            f"reserve ({reserve / GIB:.1f} GiB) exceed {budget}"
        )
    elif kv_tokens < limits.max_model_len:
        fits = False
        reason = (
            f"the KV pool left after weights holds {kv_tokens} tokens, fewer than one max-model-len "
            f"sequence ({limits.max_model_len})"
        )
    else:
        fits = True
        reason = (
            f"{kv_blocks} KV blocks ({kv_tokens} tokens) {'per GPU' if on_gpu else 'on CPU'} after "
            f"{weights / GIB:.1f} GiB of weights{packed_text} within {budget}; {slots} slots"
        )
    return SizingPlan(
        model=shape.name,
        dtype=dtype,
        quantization=formats.quantization,
        kv_cache_dtype=kv_dtype,
        tensor_parallel=tensor_parallel,
        gpu_memory_bytes=gpu_memory_bytes,
        gpu_memory_utilization=limits.gpu_memory_utilization,
        parameter_count=shape.parameter_count(),
        weight_bytes_total=weight_bytes_per_gpu(shape, dtype, 1, formats.quantization),
        weight_bytes_per_gpu=weights,
        packed_weight_bytes=packed,
        activation_reserve_bytes=reserve,
        kv_bytes_per_token=per_token,
        block_size=limits.block_size,
        block_bytes=block_bytes,
        kv_blocks=kv_blocks if fits else 0,
        kv_tokens=kv_tokens if fits else 0,
        slots=slots if fits else 0,
        max_model_len=limits.max_model_len,
        fits=fits,
        reason=reason,
        min_gpus=None,
        smallest_gpu_type=None,
    )


def plan(
    shape: ModelShape,
    *,
    gpu_memory_bytes: int,
    gpus: int,
    dtype: str = "auto",
    limits: EngineLimits | None = None,
    gpu_type: GPUType | None = None,
    quantization: str = "none",
    kv_cache_dtype: str = "auto",
) -> SizingPlan:
    """Size `shape` on `gpus` GPUs of `gpu_memory_bytes` each (`gpus=0`: CPU, memory = the container's),
    its weights in `quantization` (engine/quantization.py) and its KV cache in `kv_cache_dtype`.

    The result always carries `min_gpus` (the smallest tensor-parallel degree on this GPU that fits, or
    None when even 8 do not), `max_slots_gpus` (the smallest that gives all max_slots slots) and
    `smallest_gpu_type` (the smallest catalog GPU on which `gpus` fit).
    """
    limits = limits or EngineLimits()
    if gpus < 0:
        raise ValueError(f"gpus must be >= 0, got {gpus}")
    on_gpu = gpus > 0
    formats = Formats(resolve_dtype(dtype, gpus, gpu_type), quantization, kv_cache_dtype)
    result = _plan_one(shape, formats, gpu_memory_bytes, max(1, gpus), limits, on_gpu)
    fp8_missing = fp8_problem(gpu_type, quantization, kv_cache_dtype) if on_gpu else None
    if fp8_missing is not None:
        result = replace(result, fits=False, reason=fp8_missing, kv_blocks=0, kv_tokens=0, slots=0)
    if unsupported_architecture(shape) is not None or fp8_missing is not None:
        return result  # no GPU count of this type helps
    min_gpus = max_slots_gpus = None
    if on_gpu:
        for degree in TENSOR_PARALLEL_DEGREES:
            tried = _plan_one(shape, formats, gpu_memory_bytes, degree, limits, on_gpu=True)
            if tried.fits and min_gpus is None:
                min_gpus = degree
            if tried.fits and tried.slots == limits.max_slots:
                max_slots_gpus = degree
                break
    smallest_type = None
    if on_gpu:
        for gpu in sorted(GPU_CATALOG.values(), key=lambda g: g.memory_mib):
            if fp8_problem(gpu, quantization, kv_cache_dtype) is not None:
                continue
            gpu_formats = replace(formats, dtype=resolve_dtype(dtype, gpus, gpu))
            if _plan_one(shape, gpu_formats, gpu.memory_mib * MIB, gpus, limits, on_gpu=True).fits:
                smallest_type = gpu.name
                break
    if not result.fits and on_gpu:
        hints = []
        if min_gpus is not None:
            hints.append(f"use {min_gpus} GPUs of this type (tensor parallel)")
        if smallest_type is not None:
            hints.append(f"use {gpus} x {smallest_type} or larger")
        if not hints:
            hints.append("no GPU in the catalog fits it on one node; use a smaller model or dtype")
        result = replace(result, reason=f"{result.reason}: {' or '.join(hints)}")
    return replace(result, min_gpus=min_gpus, smallest_gpu_type=smallest_type, max_slots_gpus=max_slots_gpus)
