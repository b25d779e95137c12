"""Sizing: the formula of docs/operator.md (Sizing) checked against arithmetic written out by hand."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from inflight import sizing
from inflight.cli import main
from inflight.sizing import GIB, MIB, EngineLimits, find_gpu, find_model, gpu_from_node_labels, plan

LLAMA_70B = find_model("meta-llama/Llama-3.1-70B-Instruct")
H100_MIB = 81559


def test_catalog_parameter_counts_match_the_published_sizes() -> None:
    published = {  # billions, from the model cards
        "meta-llama/Llama-3.2-1B": 1.24,
        "meta-llama/Llama-3.2-3B": 3.21,
        "meta-llama/Llama-3.1-8B": 8.03,
        "meta-llama/Llama-3.1-70B": 70.55,
        "meta-llama/Llama-3.1-405B": 405.85,
        "Qwen/Qwen2.5-0.5B": 0.49,
        "Qwen/Qwen2.5-7B": 7.62,
        "Qwen/Qwen2.5-72B": 72.71,
        "mistralai/Mistral-7B-v0.3": 7.25,
        "builtin:smollm2": 0.13,
    }
    for name, billions in published.items():
        assert sizing.MODEL_CATALOG[name].parameter_count() / 1e9 == pytest.approx(billions, abs=0.01), name


def test_llama_8b_parameters_by_hand() -> None:
    shape = find_model("llama-3.1-8b")
    assert shape is not None
    per_layer = (
        4096 * 4096  # q
        + 2 * 4096 * 1024  # k, v: 8 KV heads x 128
        + 4096 * 4096  # o
        + 3 * 4096 * 14336  # gate, up, down
    )
    embeddings = 128256 * 4096
    norms = (2 * 32 + 1) * 4096
    assert shape.parameter_count() == 32 * per_layer + 2 * embeddings + norms == 8_030_261_248


def test_llama_70b_bf16_does_not_fit_one_h100() -> None:
    assert LLAMA_70B is not None
    result = plan(LLAMA_70B, gpu_memory_bytes=H100_MIB * MIB, gpus=1, gpu_type=find_gpu("H100-80GB"))
    assert result.dtype == "bfloat16"
    assert result.weight_bytes_per_gpu == 70_553_706_496 * 2  # 141.1 GB > 0.9 x 85.5 GB
    assert not result.fits
    assert result.kv_blocks == result.kv_tokens == result.slots == 0
    assert result.min_gpus == 2
    assert "use 2 GPUs of this type" in result.reason


def test_llama_70b_bf16_fits_four_h100_with_the_stated_kv_pool() -> None:
    assert LLAMA_70B is not None
    result = plan(LLAMA_70B, gpu_memory_bytes=H100_MIB * MIB, gpus=4)
    # Hand arithmetic, per GPU (tensor parallel 4):
    norms = (2 * 80 + 1) * 8192
    weights = ((70_553_706_496 - norms) // 4 + norms) * 2  # sharded evenly; norms replicated; bf16
    assert result.weight_bytes_per_gpu == weights == 35_278_831_616
    activations = 8192 * (4 * 8192 + 2 * 28672 // 4) * 2  # max_batched_tokens x residual + MLP, bf16
    logits = 256 * 128256 * 4  # one float32 row per slot
    reserve = activations + logits + 512 * MIB  # + CUDA context
    assert result.activation_reserve_bytes == reserve
    kv_per_token = 2 * 80 * (8 // 4) * 128 * 2  # K and V, 80 layers, 2 KV heads per GPU, head_dim 128, bf16
    assert result.kv_bytes_per_token == kv_per_token == 81_920
    usable = int(H100_MIB * MIB * 0.9) - weights - reserve
    blocks = usable // (16 * kv_per_token)
    assert result.fits
    assert result.kv_blocks == blocks == 30_708
    assert result.kv_tokens == 30_708 * 16 == 491_328
    assert result.slots == min(256, 491_328 // 1024) == 256


def test_slots_follow_expected_tokens_when_the_pool_is_small() -> None:
    shape = find_model("llama-3.1-8b")
    assert shape is not None
    limits = EngineLimits(expected_tokens_per_seq=4096, max_model_len=8192)
    result = plan(shape, gpu_memory_bytes=23034 * MIB, gpus=1, limits=limits)  # one L4
    assert result.fits
    assert result.slots == result.kv_tokens // 4096 < 256


def test_t4_auto_dtype_is_float16_and_cpu_is_float32() -> None:
    shape = find_model("qwen2.5-0.5b")
    assert shape is not None
    t4 = find_gpu("T4")
    assert plan(shape, gpu_memory_bytes=15360 * MIB, gpus=1, gpu_type=t4).dtype == "float16"
    assert plan(shape, gpu_memory_bytes=8 * GIB, gpus=0).dtype == "float32"


def test_too_short_kv_pool_does_not_fit_and_names_a_bigger_gpu() -> None:
    shape = find_model("llama-3.1-8b")
    assert shape is not None
    result = plan(shape, gpu_memory_bytes=15360 * MIB, gpus=1, dtype="float16")  # 16 GB weights on a T4
    assert not result.fits
    assert result.min_gpus == 2
    assert result.smallest_gpu_type == "A10G"  # 23028 MiB, just below the L4's 23034


def test_405b_fits_on_no_single_h100_node_but_on_eight_h200() -> None:
    shape = find_model("llama-3.1-405b")
    assert shape is not None
    result = plan(shape, gpu_memory_bytes=H100_MIB * MIB, gpus=8)
    assert not result.fits and result.min_gpus is None
    assert result.smallest_gpu_type == "H200-141GB"


def test_tensor_parallel_must_split_heads() -> None:
    shape = find_model("qwen2.5-0.5b")  # 14 heads, 2 KV heads
    assert shape is not None
    result = plan(shape, gpu_memory_bytes=81920 * MIB, gpus=4)
    assert not result.fits
    assert "cannot split" in result.reason


def test_smallest_gpu_among_labelled_nodes_wins() -> None:
    nodes = [
        {
            "nvidia.com/gpu.memory": "81559",
            "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
            "nvidia.com/gpu.count": "8",
        },
        {
            "nvidia.com/gpu.memory": "46068",
            "nvidia.com/gpu.product": "NVIDIA-L40S",
            "nvidia.com/gpu.count": "4",
        },
        {"kubernetes.io/os": "linux"},
    ]
    gpu = gpu_from_node_labels(nodes)
    assert gpu is not None
    assert (gpu.memory_mib, gpu.product, gpu.count, gpu.source) == (46068, "NVIDIA-L40S", 4, "node-labels")
    assert gpu_from_node_labels([{"kubernetes.io/os": "linux"}]) is None
    product_only = gpu_from_node_labels([{"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}])
    assert product_only is not None and product_only.memory_mib == 81920


def test_gpu_lookup_by_product_label_variants() -> None:
    assert find_gpu("NVIDIA-H100-80GB-HBM3") == sizing.GPU_CATALOG["H100-80GB"]
    assert find_gpu("h200-141gb") == sizing.GPU_CATALOG["H200-141GB"]
    assert find_gpu("NVIDIA-L4") == sizing.GPU_CATALOG["L4"]
    assert find_gpu("Radeon") is None


def test_size_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["size", "--model", "meta-llama/Llama-3.1-70B", "--gpu", "H100-80GB", "--gpus", "4", "--json"]
    )
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert {"fits", "kv_blocks", "kv_tokens", "slots", "min_gpus", "weight_bytes_per_gpu"} <= set(out)
    assert (out["fits"], out["kv_blocks"], out["min_gpus"]) == (True, 30_708, 2)
    assert main(["size", "--model", "llama-3.1-70b", "--gpus", "1"]) == 1  # does not fit: exit 1
    text = capsys.readouterr().out
    assert "fits:                 no" in text and "min GPUs of this type: 2" in text


def test_size_cli_shape_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    shape = "layers=80,hidden=8192,heads=64,kv_heads=8,head_dim=128,intermediate=28672,vocab=128256"
    assert main(["size", "--shape", shape, "--gpus", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_blocks"] == 30_708
    assert main(["size", "--model", "gpt-9"]) == 2
    assert "not in the catalog" in capsys.readouterr().err
    assert main(["size", "--shape", "layers=2"]) == 2
    assert "missing" in capsys.readouterr().err


def test_the_catalog_lists_only_models_the_server_runs() -> None:
    from inflight.engine.model.config import SUPPORTED_ARCHITECTURES

    for shape in sizing.MODEL_CATALOG.values():
        assert shape.architecture in SUPPORTED_ARCHITECTURES and shape.num_experts == 1, shape.name
        assert sizing.unsupported_architecture(shape) is None
    assert find_model("mixtral-8x7b-v0.1") is None


MOE = sizing.ModelShape("acme/moe", 32, 4096, 32, 8, 128, 14336, 32000, False, num_experts=8)


@pytest.mark.parametrize(
    ("shape", "named"),
    [(MOE, "mixture-of-experts MLP (8 experts"), (replace(MOE, num_experts=1, architecture="GPT2LMHeadModel"),
                                                    "GPT2LMHeadModel")],
)  # fmt: skip
def test_a_model_the_server_cannot_load_never_fits(shape: sizing.ModelShape, named: str) -> None:
    result = plan(shape, gpu_memory_bytes=H100_MIB * MIB, gpus=8, gpu_type=find_gpu("H100-80GB"))
    assert not result.fits
    assert result.reason.startswith("architecture not supported by the server")
    assert named in result.reason
    assert (result.min_gpus, result.smallest_gpu_type, result.slots) == (None, None, 0)


def test_size_cli_says_architecture_not_supported(capsys: pytest.CaptureFixture[str]) -> None:
    shape = "layers=32,hidden=4096,heads=32,kv_heads=8,head_dim=128,intermediate=14336,vocab=32000,experts=8"
    assert main(["size", "--shape", shape, "--gpus", "8"]) == 1
    assert "architecture not supported by the server" in capsys.readouterr().out


def test_sizing_imports_without_torch() -> None:
    code = "import sys, inflight.sizing; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_llama_70b_fp8_weights_and_kv_fit_two_h100_with_every_slot() -> None:
    """The issue's plan (#30): FP8 weights + FP8 KV on H100-80GB need 2 GPUs a replica for all 256 slots,
    where bfloat16 needs 4."""
    assert LLAMA_70B is not None
    h100 = find_gpu("H100-80GB")
    result = plan(
        LLAMA_70B,
        gpu_memory_bytes=H100_MIB * MIB,
        gpus=2,
        gpu_type=h100,
        quantization="fp8",
        kv_cache_dtype="fp8",
    )
    # Hand arithmetic, per GPU (tensor parallel 2): the linear layers in one byte a weight, the
    # embeddings and LM head (128256 x 8192 each) in bfloat16, the norms replicated in bfloat16.
    linear = 80 * (8192 * (8192 + 2 * 1024) + 8192 * 8192 + 3 * 8192 * 28672)
    norms = (2 * 80 + 1) * 8192
    assert linear + 2 * 128256 * 8192 + norms == 70_553_706_496
    weights = linear // 2 + (2 * 128256 * 8192 // 2) * 2 + norms * 2
    assert result.weight_bytes_per_gpu == weights
    assert result.kv_cache_dtype == "float8_e4m3fn"
    assert result.kv_bytes_per_token == 2 * 80 * (8 // 2) * 128 * 1 == 81_920  # one byte an element
    reserve = 8192 * (4 * 8192 + 2 * 28672 // 2) * 2 + 256 * 128256 * 4 + 512 * MIB  # activations: bf16
    assert result.kv_blocks == (int(H100_MIB * MIB * 0.9) - weights - reserve) // (16 * 81_920) == 29_727
    assert result.fits and result.slots == 256
    assert result.max_slots_gpus == 2
    bfloat16 = plan(LLAMA_70B, gpu_memory_bytes=H100_MIB * MIB, gpus=2, gpu_type=h100)
    assert bfloat16.slots == 28 and bfloat16.max_slots_gpus == 4


def test_an_fp8_kv_cache_holds_twice_the_blocks_per_token_byte() -> None:
    assert LLAMA_70B is not None
    auto = plan(LLAMA_70B, gpu_memory_bytes=H100_MIB * MIB, gpus=4)
    fp8 = plan(LLAMA_70B, gpu_memory_bytes=H100_MIB * MIB, gpus=4, kv_cache_dtype="fp8")
    assert fp8.block_bytes * 2 == auto.block_bytes
    assert fp8.kv_blocks == 2 * auto.kv_blocks  # same budget left after the same weights


@pytest.mark.parametrize(("quantization", "kv_cache_dtype"), [("fp8", "auto"), ("none", "fp8")])
def test_fp8_on_a_gpu_without_fp8_does_not_fit_and_says_what_to_change(
    quantization: str, kv_cache_dtype: str
) -> None:
    assert LLAMA_70B is not None
    a100 = find_gpu("A100-80GB")
    assert a100 is not None and not a100.fp8
    result = plan(
        LLAMA_70B,
        gpu_memory_bytes=a100.memory_mib * MIB,
        gpus=8,
        gpu_type=a100,
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
    )
    assert not result.fits and result.slots == 0
    assert "A100-80GB has no FP8 support" in result.reason and "H100-80GB" in result.reason
    on_h100 = plan(
        LLAMA_70B, gpu_memory_bytes=H100_MIB * MIB, gpus=2, quantization="fp8", kv_cache_dtype=kv_cache_dtype
    )
    assert on_h100.smallest_gpu_type == "L40S"  # the smallest catalog GPU with FP8 that holds it on 2


def test_cpu_formats_are_counted_in_the_bytes_the_engine_holds() -> None:
    """Blocks of 32 weights as the kernels hold them (float16 scales; Q4_K's float32), not the GGUF file's
    bytes: the formats quantized at load hold the embeddings and LM head too, a GGUF file's own Q4_K
    (its embeddings' types unknown) plans them in the dtype. tests/engine/test_quantized.py checks these
    against loaded models."""
    assert LLAMA_70B is not None
    linear = LLAMA_70B.linear_parameter_count()
    embeddings = 2 * 128256 * 8192
    rest = LLAMA_70B.parameter_count() - linear - embeddings
    for quantization, per_weight in (
        ("int8", 34 / 32),
        ("q8_0", 34 / 32),
        ("q4_0", 20 / 32),
        ("q4_1", 20 / 32),
    ):
        assert (
            sizing.weight_bytes_per_gpu(LLAMA_70B, "bfloat16", 1, quantization)
            == round((linear + embeddings) * per_weight) + rest * 2
        )
    q4_k = sizing.weight_bytes_per_gpu(LLAMA_70B, "bfloat16", 1, "q4_k")
    assert q4_k == round(linear * 24 / 32) + (embeddings + rest) * 2


def test_a_cpu_plan_counts_the_packed_copy_of_float_weights() -> None:
    """A float32 or bfloat16 engine on CPU keeps oneDNN's packed copy of every float linear layer and of
    the tied LM head besides the plain matrices (tests/engine/test_quantized.py checks it against a loaded
    model): Llama-3.2-1B in float32 needs 16 GiB, not 8. A GPU plan, float16 and Q4_1 (its matrices and
    LM head quantized) hold one copy."""
    llama_1b = find_model("builtin:llama-1b")
    assert llama_1b is not None
    float_matrices = llama_1b.linear_parameter_count() + 128256 * 2048
    on_8 = plan(llama_1b, gpu_memory_bytes=8 * GIB, gpus=0)
    assert on_8.packed_weight_bytes == 4 * float_matrices
    assert not on_8.fits and "(4.6 GiB + 4.6 GiB packed for oneDNN)" in on_8.reason
    on_16 = plan(llama_1b, gpu_memory_bytes=16 * GIB, gpus=0)
    unpacked = plan(llama_1b, gpu_memory_bytes=16 * GIB, gpus=0, dtype="float16")
    assert on_16.fits and unpacked.fits and unpacked.packed_weight_bytes == 0
    assert on_16.kv_blocks * on_16.block_bytes < 16 * GIB * 0.9 - 2 * on_16.weight_bytes_per_gpu
    assert plan(llama_1b, gpu_memory_bytes=16 * GIB, gpus=0, dtype="bfloat16").packed_weight_bytes == (
        2 * float_matrices
    )
    assert plan(llama_1b, gpu_memory_bytes=16 * GIB, gpus=0, quantization="q4_1").packed_weight_bytes == 0
    assert plan(llama_1b, gpu_memory_bytes=80 * GIB, gpus=1).packed_weight_bytes == 0


def test_a_matrix_without_whole_blocks_is_planned_in_the_dtype() -> None:
    """The engine quantizes a matrix only with a multiple of 32 input features: an intermediate size of
    360 leaves each down projection (360 inputs) in the dtype, and with a hidden size of 120 every matrix."""
    odd = sizing.ModelShape("odd", 2, 128, 4, 2, 32, 360, 1024, False)
    down = 2 * 360 * 128
    rest = odd.parameter_count() - odd.linear_parameter_count() - 2 * 1024 * 128
    assert sizing.weight_bytes_per_gpu(odd, "float32", 1, "q8_0") == (
        round((odd.linear_parameter_count() - down + 2 * 1024 * 128) * 34 / 32) + (down + rest) * 4
    )
    narrow = sizing.ModelShape("narrow", 2, 120, 4, 2, 30, 360, 1024, False)
    assert sizing.weight_bytes_per_gpu(narrow, "float32", 1, "q8_0") == 4 * narrow.parameter_count()


def test_size_cli_plans_fp8_weights_and_kv(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--model", "llama-3.1-70b", "--gpu", "H100-80GB", "--gpus", "2"]
    assert main(["size", *flags, "--quantization", "fp8", "--kv-cache-dtype", "fp8"]) == 0
    text = capsys.readouterr().out
    assert "fp8 weights" in text and "float8_e4m3fn" in text
    assert "slots:                256" in text and "GPUs for all 256 slots: 2" in text
    assert main(["size", *flags]) == 0
    assert "GPUs for all 256 slots: 4" in capsys.readouterr().out
    assert main(["size", *flags, "--gpu", "A100-80GB", "--kv-cache-dtype", "fp8"]) == 1
    assert "no FP8 support" in capsys.readouterr().out
