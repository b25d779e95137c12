"""A decode step's layers in one C call each over quantized weights (model/decode_layer.py,
cpu/decode_layer.c) against the per-op path (model/llama.py's DecoderLayer.forward), which is the
definition: the same hidden states, residual stream and KV cache bytes, bit for bit, for both kernel
formats (s8, u4), 1..8 rows, float32 and bfloat16 activations, bfloat16/float32 and float8 KV caches, with
and without biases, with a sliding window, on 1 and 2 threads; for the native build and each portable one
this CPU runs. And the quantized LM head's float32 logits are the kernel's sums, not bfloat16 values
widened. (test_dense_layer.py: the same over float weights.)
"""

from __future__ import annotations

import ctypes
import random
from dataclasses import replace

import pytest
import torch
from engine.attention.test_cpu_paged import any_library  # noqa: F401 (a fixture)

from inflight.engine.attention.backend import CPU_KERNEL_BACKEND, TORCH_BACKEND
from inflight.engine.attention.metadata import SHORT_QUERY_LEN, AttentionMetadata
from inflight.engine.cpu import kernels as cpu_kernels
from inflight.engine.cpu import quantized
from inflight.engine.cpu.quantized import KERNEL_MAX_ROWS, QuantizedLinear, quantized_linear
from inflight.engine.gguf.repack import quantize
from inflight.engine.model import decode_layer
from inflight.engine.model.config import ModelConfig
from inflight.engine.model.decode_layer import LayerCaches, LayerRun
from inflight.engine.model.llama import LlamaForCausalLM, OneCallPlan, RotaryEmbedding
from inflight.engine.runner import allocate_kv_caches

from support.paged_cases import make_case

BLOCK_SIZE = 8
# Room for a step of 65 sequences (one more than the tile products take), 4 blocks each at most.
NUM_BLOCKS = 4 * 65 + 1


def _config(bias: bool, window: int | None) -> ModelConfig:
    """The two-layer model of these tests, of test_dense_layer.py and of model/test_mlp_blocks.py."""
    return ModelConfig(
        architecture="MistralForCausalLM" if window else "LlamaForCausalLM",
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=256,
        attention_bias=bias,
        o_proj_bias=bias,
        sliding_window=window,
        torch_dtype="float32",
    )


def _model(quantization: str, dtype: torch.dtype, bias: bool, window: int | None) -> LlamaForCausalLM:
    """Two layers with random weights, every projection kept quantized in `quantization`."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(_config(bias, window), CPU_KERNEL_BACKEND, torch.device("cpu"))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.5 + (1.0 if parameter.dim() == 1 else 0.0))
    model.to(dtype)
    for layer in model.layers:
        for owner, name in (
            (layer.self_attn, "qkv_proj"),
            (layer.self_attn, "o_proj"),
            (layer.mlp, "gate_up_proj"),
            (layer.mlp, "down_proj"),
        ):
            linear = getattr(owner, name)
            weight = quantize(linear.weight.detach().float(), quantization)
            quantized = QuantizedLinear(linear.in_features, linear.out_features, weight.layout, linear.bias)
            quantized.weight = weight
            setattr(owner, name, quantized)
    return model


def _decode_step(rows: int, rng: random.Random) -> tuple[AttentionMetadata, torch.Tensor]:
    """`rows` sequences with one new token each after 0..30 earlier ones, in shuffled blocks; and their
    positions."""
    free = list(range(1, NUM_BLOCKS))
    rng.shuffle(free)
    seq_lens = [rng.randint(1, 31) for _ in range(rows)]
    tables = [[free.pop() for _ in range(-(-n // BLOCK_SIZE))] for n in seq_lens]
    width = max(len(t) for t in tables)
    slots = [
        t[(n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE
        for t, n in zip(tables, seq_lens, strict=True)
    ]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.arange(rows + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        query_lens_list=[1] * rows,
        seq_lens_list=seq_lens,
        max_query_len=1,
        max_seq_len=max(seq_lens),
    )
    return meta, torch.tensor([n - 1 for n in seq_lens])


class _Spy:
    """The kernels, recording which functions are looked up (called) and how many layers decode_layers ran
    (`layers`)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.library = library
        self.calls: list[str] = []
        self.layers = 0

    def clear(self) -> None:
        self.calls.clear()
        self.layers = 0

    def __getattr__(self, name: str) -> object:
        self.calls.append(name)
        function = getattr(self.library, name)
        if name != "decode_layers":
            return function

        def counted(*args: object) -> object:
            count = args[3]
            assert isinstance(count, int)
            self.layers += count
            return function(*args)

        return counted


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("quantization", ["q8_0", "q4_1"])  # the s8 and u4 kernel formats
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8_kv", [False, True])
@pytest.mark.parametrize(("bias", "window"), [(False, None), (True, None), (False, 6)])
def test_a_decode_step_equals_the_per_op_path_bit_for_bit(
    any_library: ctypes.CDLL,  # noqa: F811 (the fixture)
    monkeypatch: pytest.MonkeyPatch,
    quantization: str,
    dtype: torch.dtype,
    fp8_kv: bool,
    bias: bool,
    window: int | None,
    torch_threads: int,
) -> None:
    """On 1 thread and on 2 (the kernels' OpenMP loops then split their work); 1..KERNEL_MAX_ROWS rows,
    and 12 as run_model gives a decode step (`one_token_rows`: one call where the kernel rounds x to int8,
    the per-op path both times elsewhere)."""
    spy = _Spy(any_library)
    monkeypatch.setattr(cpu_kernels, "library", lambda: spy)
    model = _model(quantization, dtype, bias, window)
    kv_dtype = torch.float8_e4m3fn if fp8_kv else dtype
    rng = random.Random(1)
    for rows in (*range(1, KERNEL_MAX_ROWS + 1), 12):
        one_call = rows <= KERNEL_MAX_ROWS or bool(any_library.quant_linear_int8_activations())
        meta, positions = _decode_step(rows, rng)
        ids = torch.tensor([rng.randrange(64) for _ in range(rows)])
        caches = allocate_kv_caches(model.config, NUM_BLOCKS, BLOCK_SIZE, kv_dtype, "cpu")
        for k, v in caches:  # earlier tokens' keys and values
            k.copy_(torch.randn(k.shape).clamp(-4, 4).to(kv_dtype))
            v.copy_(torch.randn(v.shape).clamp(-4, 4).to(kv_dtype))
        per_op_caches = [(k.clone(), v.clone()) for k, v in caches]
        with torch.inference_mode(), quantized.one_token_rows():
            spy.clear()
            fused = model(ids, positions, caches, meta)
            assert spy.layers == (2 if one_call else 0)
            assert spy.calls.count("decode_layers") == (1 if one_call else 0)  # both layers in one call
            with monkeypatch.context() as patch:
                patch.setattr(decode_layer.DecodeStep, "start", lambda *args: None)
                spy.clear()
                per_op = model(ids, positions, per_op_caches, meta)
                assert "decode_layers" not in spy.calls
        assert fused.dtype == dtype and torch.equal(fused, per_op), f"{rows} rows"
        for (k, v), (k_ref, v_ref) in zip(caches, per_op_caches, strict=True):
            assert torch.equal(_bits(k), _bits(k_ref)) and torch.equal(_bits(v), _bits(v_ref)), f"{rows} rows"


def test_steps_and_layers_the_one_call_cannot_take_run_the_per_op_path() -> None:
    """A sequence of more than SHORT_QUERY_LEN new rows, more than KERNEL_MAX_ROWS rows, float weights or the
    torch attention backend: no one-call step or layer."""
    model = _model("q4_1", torch.float32, False, None)
    rng = random.Random(2)
    caches = LayerCaches(allocate_kv_caches(model.config, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu"))
    start = decode_layer.DecodeStep.start
    fused = model.layers[0].fused()
    assert fused is not None
    layer = LayerRun(0, [fused])
    ends = OneCallPlan.of(model).ends
    for rows in (2, KERNEL_MAX_ROWS + 1):
        meta, positions = _decode_step(rows, rng)
        ids = torch.zeros(rows, dtype=torch.int64)
        longer = SHORT_QUERY_LEN + 1
        prefill = replace(meta, query_lens_list=[longer] + [1] * (rows - 1), max_query_len=longer)
        assert start(layer, ends, ids, positions, prefill, caches) is None
        assert start(layer, ends, ids.int(), positions, meta, caches) is None  # ids the C call cannot read
        decode = start(layer, ends, ids, positions, meta, caches)
        assert (decode is not None) == (rows <= KERNEL_MAX_ROWS)
        with quantized.one_token_rows():  # as run_model runs a decode step: any count where x is int8
            decode = start(layer, ends, ids, positions, meta, caches)
        library = cpu_kernels.library()
        assert library is not None
        int8 = bool(library.quant_linear_int8_activations())
        assert (decode is not None) == (rows <= KERNEL_MAX_ROWS or int8)
    float_model = LlamaForCausalLM(model.config, CPU_KERNEL_BACKEND, torch.device("cpu"))
    assert float_model.layers[0].fused() is None
    for layer in model.layers:
        layer.self_attn.backend = TORCH_BACKEND
    assert model.layers[0].fused() is None
    for layer in model.layers:
        layer.self_attn.backend = CPU_KERNEL_BACKEND
    assert model.layers[0].fused() is model.layers[0].fused() is not None  # built once
    held = model.layers[0].mlp.down_proj
    model.layers[0].mlp.down_proj = float_model.layers[0].mlp.down_proj
    assert model.layers[0].fused() is None  # a module replaced: not the cached pointers
    model.layers[0].mlp.down_proj = held
    assert model.layers[0].fused() is not None
    model.layers[0].input_layernorm.to(torch.float64)  # its weight moved (and no kernel dtype)
    assert model.layers[0].fused() is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_verify_step_runs_each_row_as_a_decode_of_its_sequence(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """Sequences of up to SHORT_QUERY_LEN new rows (a speculative verify step) run one call a layer, each row
    a decode over its sequence's keys up to its own position: the outputs and later layers' keys and values
    agree with the per-op path's prompt attention within rounding (the first layer's bit for bit); a row's
    output is the same bits as the same row alone in a decode step after the rows before it."""
    library = cpu_kernels.library()
    assert library is not None
    spy = _Spy(library)
    monkeypatch.setattr(cpu_kernels, "library", lambda: spy)
    model = _model("q8_0", dtype, False, None)
    rng = random.Random(4)
    query_lens = [3, 1, 2]
    seq_lens = [rng.randint(1, 24) + q for q in query_lens]
    config = model.config
    meta = make_case(
        seq_lens,
        query_lens,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        block_size=BLOCK_SIZE,
    ).meta
    positions = torch.tensor([p for n, q in zip(seq_lens, query_lens, strict=True) for p in range(n - q, n)])
    ids = torch.tensor([rng.randrange(64) for _ in range(sum(query_lens))])
    caches = allocate_kv_caches(model.config, NUM_BLOCKS, BLOCK_SIZE, dtype, "cpu")
    for k, v in caches:
        k.copy_(torch.randn(k.shape).clamp(-4, 4).to(dtype))
        v.copy_(torch.randn(v.shape).clamp(-4, 4).to(dtype))
    before = [(k.clone(), v.clone()) for k, v in caches]
    per_op_caches = [(k.clone(), v.clone()) for k, v in caches]
    with torch.inference_mode():
        spy.clear()
        fused = model(ids, positions, caches, meta)
        assert spy.layers == 2
        with monkeypatch.context() as patch:
            patch.setattr(decode_layer.DecodeStep, "start", lambda *args: None)
            per_op = model(ids, positions, per_op_caches, meta)
    # The first layer's keys and values come before any attention: bit for bit; later ones within rounding.
    assert torch.equal(_bits(caches[0][0]), _bits(per_op_caches[0][0]))
    assert torch.equal(_bits(caches[0][1]), _bits(per_op_caches[0][1]))
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    for (k, v), (k_ref, v_ref) in zip(caches[1:], per_op_caches[1:], strict=True):
        torch.testing.assert_close(k.float(), k_ref.float(), atol=tolerance, rtol=tolerance)
        torch.testing.assert_close(v.float(), v_ref.float(), atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(fused.float(), per_op.float(), atol=tolerance, rtol=tolerance)
    # The first sequence's last row (its third) as a one-row decode step over the same keys: the first two
    # rows' keys and values are in the cache as the verify step wrote them.
    row = query_lens[0] - 1
    alone = replace(
        meta,
        slot_mapping=meta.slot_mapping[row : row + 1],
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=meta.seq_lens[:1],
        block_tables=meta.block_tables[:1],
        query_lens_list=[1],
        seq_lens_list=meta.seq_lens_list[:1],
        max_query_len=1,
        max_seq_len=meta.seq_lens_list[0],
    )
    caches_alone = [(k.clone(), v.clone()) for k, v in before]
    with torch.inference_mode(), quantized.one_token_rows():
        model(
            ids[:row],
            positions[:row],
            caches_alone,
            replace(
                meta,
                slot_mapping=meta.slot_mapping[:row],
                query_start_loc=torch.tensor([0, row], dtype=torch.int32),
                seq_lens=meta.seq_lens[:1] - 1,
                block_tables=meta.block_tables[:1],
                query_lens_list=[row],
                seq_lens_list=[meta.seq_lens_list[0] - 1],
                max_query_len=row,
                max_seq_len=meta.seq_lens_list[0] - 1,
            ),
        )
        single = model(ids[row : row + 1], positions[row : row + 1], caches_alone, alone)
    assert torch.equal(_bits(single[0]), _bits(fused[row]))


def _step_against_per_op(
    model: LlamaForCausalLM,
    ids: torch.Tensor,
    positions: torch.Tensor,
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    meta: AttentionMetadata,
    spy: _Spy,
    monkeypatch: pytest.MonkeyPatch,
    last_rows_of: list[int] | None = None,
) -> int:
    """A decode step in one-call runs of layers where it can, asserted bit for bit the per-op path's output
    and caches (run on copies of the caches); how many layers ran as one call."""
    per_op_caches = [(k.clone(), v.clone()) for k, v in caches]
    with torch.inference_mode():
        spy.clear()
        fused = model(ids, positions, caches, meta, last_rows_of)
        count = spy.layers
        with monkeypatch.context() as patch:
            patch.setattr(decode_layer.DecodeStep, "start", lambda *args: None)
            per_op = model(ids, positions, per_op_caches, meta, last_rows_of)
    assert torch.equal(fused, per_op)
    for (k, v), (k_ref, v_ref) in zip(caches, per_op_caches, strict=True):
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    return count


def test_the_one_call_step_looks_up_the_embeddings_and_applies_the_last_norm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the first and last layers run in C, so do the embedding lookup and the model's last norm (none
    in Python; bit for bit the per-op path: the tests above); a token id outside the vocabulary or a position
    outside the rotary tables raises IndexError there, as the per-op path's lookups do."""
    library = cpu_kernels.library()
    assert library is not None
    spy = _Spy(library)
    monkeypatch.setattr(cpu_kernels, "library", lambda: spy)
    model = _model("q8_0", torch.float32, False, None)
    meta, positions = _decode_step(2, random.Random(6))
    caches = allocate_kv_caches(model.config, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu")

    def not_here(*args: object) -> None:
        raise AssertionError("run in Python")

    with torch.inference_mode():
        with monkeypatch.context() as patch:
            patch.setattr(LlamaForCausalLM, "_embed", not_here)
            patch.setattr(RotaryEmbedding, "__call__", not_here)
            patch.setattr(model.norm, "forward", not_here)
            spy.clear()
            model(torch.tensor([5, 17]), positions, caches, meta)
            assert spy.calls.count("decode_layers") == 1
        vocab, held = model.config.vocab_size, model.rotary.cos.shape[0]
        refused = [
            (torch.tensor([5, vocab]), positions, "outside the vocabulary's 64 ids"),
            (torch.tensor([-1, 17]), positions, "outside the vocabulary"),
            (torch.tensor([5, 17]), torch.tensor([3, held]), "outside the 256 the rotary tables hold"),
        ]
        for ids, rows_positions, message in refused:
            with pytest.raises(IndexError, match=message):
                model(ids, rows_positions, caches, meta)
            with monkeypatch.context() as patch:
                patch.setattr(decode_layer.DecodeStep, "start", lambda *args: None)
                with pytest.raises(IndexError):
                    model(ids, rows_positions, caches, meta)


def test_layers_after_one_the_kernels_cannot_take_still_run_as_one_call(
    any_library: ctypes.CDLL,  # noqa: F811 (the fixture)
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A first layer with a float projection (as a GGUF file's dequantized Q6_K tensor in layer 0): the
    step still runs the quantized layers after it as one call each, bit for bit the per-op path."""
    spy = _Spy(any_library)
    monkeypatch.setattr(cpu_kernels, "library", lambda: spy)
    model = _model("q8_0", torch.float32, False, None)
    float_model = LlamaForCausalLM(model.config, CPU_KERNEL_BACKEND, torch.device("cpu"))
    model.layers[0].mlp.down_proj = float_model.layers[0].mlp.down_proj
    assert model.layers[0].fused() is None and model.layers[1].fused() is not None
    meta, positions = _decode_step(3, random.Random(3))
    ids = torch.tensor([5, 17, 42])
    caches = allocate_kv_caches(model.config, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu")
    assert _step_against_per_op(model, ids, positions, caches, meta, spy, monkeypatch) == 1


def test_a_step_that_keeps_some_rows_runs_its_last_layer_per_op(
    any_library: ctypes.CDLL,  # noqa: F811 (the fixture)
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With `last_rows_of` (only some sequences' last rows read, as in a step of short prompts), the run
    stops before the last layer, which runs per op for the kept rows alone: bit for bit the per-op path."""
    spy = _Spy(any_library)
    monkeypatch.setattr(cpu_kernels, "library", lambda: spy)
    model = _model("q8_0", torch.float32, False, None)
    meta, positions = _decode_step(3, random.Random(5))
    ids = torch.tensor([5, 17, 42])
    caches = allocate_kv_caches(model.config, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu")
    assert _step_against_per_op(model, ids, positions, caches, meta, spy, monkeypatch, [2, 0]) == 1


@pytest.mark.parametrize("quantization", ["q8_0", "q4_1"])
def test_the_quantized_lm_head_gives_the_kernels_float32_sums(quantization: str) -> None:
    """bfloat16 hidden states, float32 logits: the same sums the bfloat16 output rounds, unrounded."""
    model = _model(quantization, torch.bfloat16, False, None)
    head = quantize(torch.randn(64, 64, generator=torch.Generator().manual_seed(3)), quantization)
    model.lm_head = QuantizedLinear(64, 64, head.layout, None)
    model.lm_head.weight = head
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    assert torch.equal(logits.to(torch.bfloat16), quantized_linear(hidden, head))
    assert not torch.equal(logits, logits.to(torch.bfloat16).float())  # not bfloat16 values widened


def test_a_change_between_steps_rebuilds_the_one_call_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layers' one-call forms are kept between steps and checked once a step (Links): a module, a
    quantized weight or one of its tensors replaced, a tensor moved (`.data`, as `.to()` moves it), the
    attention backend swapped or the layers reordered after a step all make the next step run what the
    modules now hold, bit for bit the per-op path (stale pointers would run the old weights)."""
    library = cpu_kernels.library()
    assert library is not None
    spy = _Spy(library)
    monkeypatch.setattr(cpu_kernels, "library", lambda: spy)
    model = _model("q8_0", torch.float32, False, None)
    float_model = LlamaForCausalLM(model.config, CPU_KERNEL_BACKEND, torch.device("cpu"))
    meta, positions = _decode_step(3, random.Random(4))
    ids = torch.tensor([5, 17, 42])
    caches = allocate_kv_caches(model.config, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu")

    def one_call_layers() -> int:
        return _step_against_per_op(model, ids, positions, caches, meta, spy, monkeypatch)

    assert one_call_layers() == 2
    layer = model.layers[1]
    weight = layer.mlp.down_proj.weight
    layer.self_attn.o_proj.weight = model.layers[0].self_attn.o_proj.weight
    assert one_call_layers() == 2
    weight.scales = weight.scales * 2
    assert one_call_layers() == 2
    norm = layer.post_attention_layernorm.weight
    norm.data = norm.detach() * 1.5
    assert one_call_layers() == 2
    model.layers[0], model.layers[1] = model.layers[1], model.layers[0]
    assert one_call_layers() == 2
    held = layer.mlp.down_proj
    layer.mlp.down_proj = float_model.layers[1].mlp.down_proj
    assert one_call_layers() == 1
    layer.mlp.down_proj = held
    assert one_call_layers() == 2
    layer.self_attn.backend = TORCH_BACKEND
    assert one_call_layers() == 1
    layer.self_attn.backend = CPU_KERNEL_BACKEND
    assert one_call_layers() == 2
    # What the C call reads around the layers: the embeddings, the last norm, the rotary tables.
    model.embed_tokens.weight.data = model.embed_tokens.weight.detach().flip(0)
    assert one_call_layers() == 2
    model.norm.weight.data = model.norm.weight.detach() * 1.5
    assert one_call_layers() == 2
    model.norm.eps = 1.0
    assert one_call_layers() == 2
    model.rotary = RotaryEmbedding(model.config.model_copy(update={"rope_theta": 100.0}), torch.device("cpu"))
    assert one_call_layers() == 2
