"""A decode step's layers in one C call each over float weights (model/decode_layer.py, cpu/decode_layer.c)
against the per-op path (model/llama.py's DecoderLayer.forward), which is the definition: the same hidden
states, residual stream and KV cache bytes, bit for bit, at 1..9 rows and the most dense_linear takes
(float32 24, bfloat16 8, or 64 on the AMX tiles) and one more, float32 and (where oneDNN prepacks it)
bfloat16, with and without biases, with a sliding window, on 1 and 2 threads; for the native build and
each portable one this CPU runs (those without AVX-512 multiply in oneDNN: no one-call layer there).
"""

from __future__ import annotations

import ctypes
import random
from dataclasses import replace

import pytest
import torch
from engine.attention.test_cpu_paged import any_library  # noqa: F401 (a fixture)
from engine.test_decode_layer import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    _config,
    _decode_step,
    _model,
    _Spy,
    _step_against_per_op,
)

from inflight.engine.attention.backend import CPU_KERNEL_BACKEND, TORCH_BACKEND
from inflight.engine.attention.metadata import SHORT_QUERY_LEN
from inflight.engine.cpu import kernels as cpu_kernels
from inflight.engine.cpu.linear import can_prepack, prepack_linears
from inflight.engine.cpu.quantized import KERNEL_MAX_ROWS
from inflight.engine.model import decode_layer
from inflight.engine.model.decode_layer import DENSE, FusedLayer, LayerCaches, LayerRun
from inflight.engine.model.llama import DecoderLayer, LlamaForCausalLM, OneCallPlan
from inflight.engine.runner import allocate_kv_caches

pytestmark = pytest.mark.skipif(
    cpu_kernels.library() is None or not can_prepack(torch.device("cpu"), torch.float32),
    reason="needs the CPU kernels and oneDNN",
)


def _dense(layer: object) -> FusedLayer | None:
    """The layer's one-call form where its products are dense_linear's (float weights); else None."""
    assert isinstance(layer, DecoderLayer)
    fused = layer.fused()
    return fused if fused is not None and fused.product == DENSE else None


def _float_model(dtype: torch.dtype, bias: bool, window: int | None) -> LlamaForCausalLM:
    """Two layers with random float weights, prepacked as the engine does."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(_config(bias, window), CPU_KERNEL_BACKEND, torch.device("cpu"))
    with torch.no_grad():
        for parameter in model.parameters():
            scale = 0.5 if parameter.dim() == 1 else 0.2
            parameter.copy_(torch.randn_like(parameter) * scale + (1.0 if parameter.dim() == 1 else 0.0))
    model.to(dtype)
    prepack_linears(model, batch_size_hint=8)
    return model


def native_dtypes() -> list[torch.dtype]:
    return [d for d in (torch.float32, torch.bfloat16) if can_prepack(torch.device("cpu"), d)]


@pytest.mark.parametrize("dtype", native_dtypes())
@pytest.mark.parametrize(("bias", "window"), [(False, None), (True, None), (False, 6)])
def test_a_decode_step_equals_the_per_op_path_bit_for_bit(
    any_library: ctypes.CDLL,  # noqa: F811 (the fixture)
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    bias: bool,
    window: int | None,
    torch_threads: int,
) -> None:
    """On 1 thread and on 2 (the kernels' OpenMP loops then split their work); 1..9 rows, and the most
    dense_linear takes and one more (the per-op path both times, with oneDNN's products)."""
    spy = _Spy(any_library)
    monkeypatch.setattr(cpu_kernels, "library", lambda: spy)
    model = _float_model(dtype, bias, window)  # prepacked with this build's dense_linear_max_rows
    fused = _dense(model.layers[0])
    max_rows = 0 if fused is None else fused.max_rows
    rng = random.Random(1)
    for rows in sorted({1, 2, 3, 4, 5, 6, 7, 8, 9, max_rows, max_rows + 1} - {0}):
        one_call = rows <= max_rows
        meta, positions = _decode_step(rows, rng)
        ids = torch.tensor([rng.randrange(64) for _ in range(rows)])
        caches = allocate_kv_caches(model.config, NUM_BLOCKS, BLOCK_SIZE, dtype, "cpu")
        for k, v in caches:  # earlier tokens' keys and values
            k.copy_(torch.randn(k.shape).to(dtype))
            v.copy_(torch.randn(v.shape).to(dtype))
        per_op_caches = [(k.clone(), v.clone()) for k, v in caches]
        with torch.inference_mode():
            spy.clear()
            one = model(ids, positions, caches, meta)
            assert spy.layers == (2 if one_call else 0)
            if one_call:  # and each call's products dense_linear's
                assert all(_dense(layer) is not None for layer in model.layers)
            with monkeypatch.context() as patch:
                patch.setattr(decode_layer.DecodeStep, "start", lambda *args: None)
                spy.clear()
                per_op = model(ids, positions, per_op_caches, meta)
                assert "decode_layers" not in spy.calls
                assert ("dense_linear" in spy.calls) == one_call
        assert one.dtype == dtype and torch.equal(one, per_op), f"{rows} rows"
        for (k, v), (k_ref, v_ref) in zip(caches, per_op_caches, strict=True):
            assert torch.equal(k, k_ref) and torch.equal(v, v_ref), f"{rows} rows"


def test_steps_and_layers_the_one_call_cannot_take_run_the_per_op_path() -> None:
    """A sequence of more than SHORT_QUERY_LEN new rows, more rows than dense_linear takes, a float8 KV cache,
    weights kept quantized or not prepacked, or the torch attention backend: no one-call step or layer."""
    model = _float_model(torch.float32, False, None)
    layer = _dense(model.layers[0])
    max_rows = cpu_kernels.library().dense_linear_max_rows(cpu_kernels.DTYPE_CODES[torch.float32], 64)
    if max_rows == 0:  # a build without AVX2 + FMA: its products are oneDNN's, so no layer is one call
        assert layer is None
        pytest.skip("dense_linear takes no float32 rows on this build (no AVX2 + FMA)")
    assert layer is not None and layer.max_rows == max_rows
    assert _dense(model.layers[0]) is layer  # built once
    rng = random.Random(2)
    caches = LayerCaches(allocate_kv_caches(model.config, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu"))
    fp8 = LayerCaches(allocate_kv_caches(model.config, NUM_BLOCKS, BLOCK_SIZE, torch.float8_e4m3fn, "cpu"))
    one_head = allocate_kv_caches(model.config, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu", num_kv_heads=1)
    start = decode_layer.DecodeStep.start
    run = LayerRun(0, [layer])
    ends = OneCallPlan.of(model).ends
    for rows in (2, max_rows + 1):
        meta, positions = _decode_step(rows, rng)
        ids = torch.zeros(rows, dtype=torch.int64)
        longer = SHORT_QUERY_LEN + 1
        prefill = replace(meta, query_lens_list=[longer] + [1] * (rows - 1), max_query_len=longer)
        assert start(run, ends, ids, positions, prefill, caches) is None
        assert start(run, ends, ids, positions, meta, fp8) is None
        assert start(None, ends, ids, positions, meta, caches) is None
        step = start(run, ends, ids, positions, meta, caches)
        assert (step is not None) == (rows <= max_rows)
        if step is not None:
            assert step.takes(run)
            other = start(run, ends, ids, positions, meta, LayerCaches(one_head))
            assert other is not None and not other.takes(run)  # caches of another KV head count
    assert _dense(_model("q4_1", torch.float32, False, None).layers[0]) is None
    assert _dense(LlamaForCausalLM(model.config, CPU_KERNEL_BACKEND, torch.device("cpu")).layers[0]) is None
    model.layers[0].self_attn.backend = TORCH_BACKEND
    assert _dense(model.layers[0]) is None
    model.layers[0].self_attn.backend = CPU_KERNEL_BACKEND
    held = model.layers[0].mlp.down_proj
    model.layers[0].mlp.down_proj = model.layers[1].mlp.down_proj
    rebuilt = _dense(model.layers[0])
    assert rebuilt is not None and rebuilt is not layer  # a module replaced: not the cached pointers
    model.layers[0].mlp.down_proj = held
    model.layers[0].input_layernorm.to(torch.float64)  # its weight moved (and no kernel dtype)
    assert _dense(model.layers[0]) is None


def test_a_later_run_of_quantized_layers_takes_only_the_rows_its_kernel_takes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Layer 0 float (dense_linear's products), layer 1 kept quantized: two runs. At KERNEL_MAX_ROWS + 1
    rows, outside `one_token_rows`, the quantized kernel does not take the rows, so layer 1 runs per op
    (by the dequantized weights) while layer 0 runs in C: bit for bit the per-op path."""
    library = cpu_kernels.library()
    assert library is not None
    spy = _Spy(library)
    monkeypatch.setattr(cpu_kernels, "library", lambda: spy)
    model = _float_model(torch.float32, False, None)
    layer = _dense(model.layers[0])
    if layer is None or layer.max_rows <= KERNEL_MAX_ROWS:
        pytest.skip(f"dense_linear takes at most {KERNEL_MAX_ROWS} float32 rows on this build")
    model.layers[1] = _model("q8_0", torch.float32, False, None).layers[1]
    rows = KERNEL_MAX_ROWS + 1
    meta, positions = _decode_step(rows, random.Random(6))
    ids = torch.tensor([random.Random(7).randrange(64) for _ in range(rows)])
    caches = allocate_kv_caches(model.config, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu")
    assert _step_against_per_op(model, ids, positions, caches, meta, spy, monkeypatch) == 1
