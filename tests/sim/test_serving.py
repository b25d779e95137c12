"""The serving cost model (`inflight/sim/serving.py`) and `inflight size --workload`."""

from __future__ import annotations

import json
import math

import pytest

from inflight.bench.served import arrival_offsets
from inflight.cli import main
from inflight.sim.cost_model import CostModel
from inflight.sim.serving import (
    GPU_SPEED,
    GPUSpeed,
    Workload,
    estimate,
    policy_estimate,
    step_seconds,
    workload_limits,
)
from inflight.sizing import GPU_CATALOG, MIB, EngineLimits, SizingPlan, find_model, plan

SEED = Workload(prompt_tokens=512, output_tokens=256, max_output_tokens=1024, requests_per_s=50)


def _plan(gpus: int, workload: Workload = SEED) -> tuple[SizingPlan, EngineLimits]:
    shape = find_model("meta-llama/Llama-3.1-70B")
    assert shape is not None
    limits = workload_limits(EngineLimits(), workload)
    gpu = GPU_CATALOG["H100-80GB"]
    return plan(shape, gpu_memory_bytes=gpu.memory_mib * MIB, gpus=gpus, limits=limits, gpu_type=gpu), limits


def test_a_decode_step_is_bound_by_reading_the_weights_and_a_prefill_by_compute() -> None:
    shape = find_model("meta-llama/Llama-3.1-70B")
    assert shape is not None
    sizing, _ = _plan(4)
    speed = GPU_SPEED["H100-80GB"]
    decode = step_seconds(shape, sizing, speed, 1, 0)
    assert decode == pytest.approx(sizing.weight_bytes_per_gpu / 3350e9)
    twice_as_fast = GPUSpeed(2 * speed.memory_bandwidth_gb_s, speed.dense_16bit_tflops, "test")
    assert step_seconds(shape, sizing, twice_as_fast, 1, 0) == pytest.approx(decode / 2)
    prefill = step_seconds(shape, sizing, speed, 100_000, 0)
    assert prefill == pytest.approx(2 * shape.parameter_count() * 100_000 / (989e12 * 4))


def test_continuous_serves_more_than_static_than_a_naive_loop_and_replicas_meet_the_rate() -> None:
    shape = find_model("meta-llama/Llama-3.1-70B")
    assert shape is not None
    sizing, limits = _plan(4)
    result = estimate(shape, sizing, "H100-80GB", SEED, limits)
    assert result.naive.batch == 1 and result.continuous.batch == sizing.slots
    # Static batching reserves max_model_len per request (contiguous): fewer side by side.
    assert result.static.batch == sizing.kv_tokens // limits.max_model_len < sizing.slots
    assert result.naive.requests_per_s < result.static.requests_per_s < result.continuous.requests_per_s
    assert result.replicas == math.ceil(50 / result.continuous.requests_per_s)
    assert result.continuous.output_tokens_per_s == pytest.approx(result.continuous.requests_per_s * 256)
    assert result.constants["memory_bandwidth_gb_s"] == 3350
    assert "datasheet" in str(result.constants["gpu_source"])
    # A static batch lasts its longest output: equal outputs make it faster.
    even = Workload(prompt_tokens=512, output_tokens=256)
    even_sizing, even_limits = _plan(4, even)
    assert estimate(shape, even_sizing, "H100-80GB", even, even_limits).static.requests_per_s > (
        result.static.requests_per_s
    )


def test_a_gpu_without_speed_figures_or_a_plan_that_does_not_fit_is_refused() -> None:
    shape = find_model("meta-llama/Llama-3.1-70B")
    assert shape is not None
    sizing, limits = _plan(4)
    with pytest.raises(ValueError, match="no speed figures"):
        estimate(shape, sizing, "A10G", SEED, limits)
    small, small_limits = _plan(1)
    with pytest.raises(ValueError, match="does not fit"):
        estimate(shape, small, "H100-80GB", SEED, small_limits)


def test_size_cli_workload(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["size", "--model", "llama-3.1-70b", "--gpu", "H100-80GB", "--gpus", "4"]
    assert main([*args, "--workload", "prompt=512,output=256,max_output=1024,rate=50", "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    shape = find_model("llama-3.1-70b")
    assert shape is not None
    sizing, limits = _plan(4)
    assert body["slots"] == sizing.slots
    assert body["serving"] == estimate(shape, sizing, "H100-80GB", SEED, limits).model_dump()
    assert main([*args, "--workload", "prompt=512,output=256,rate=50"]) == 0
    out = capsys.readouterr().out
    assert "continuous:" in out and "replicas for the target rate" in out and "datasheet" in out
    for bad in ("prompt=0,output=2", "prompt=5", "tokens=5", "prompt=5,output=x"):
        assert main([*args, "--workload", bad]) == 2
        assert "--workload" in capsys.readouterr().err


def test_the_batch_formula_takes_a_calibrated_step_cost() -> None:
    """The CPU check (benchmarks/serving_model_check.py) prices the same formula with a fitted step cost."""
    cost = CostModel(fixed_s=0.01, per_token_s=0.001, source="test")
    workload = Workload(prompt_tokens=100, output_tokens=50)
    got = policy_estimate(lambda tokens, kv_read: cost.step_seconds(tokens), workload, batch=4, steps=50)
    batch_s = (0.01 + 0.001 * 4 * 100) + 50 * (0.01 + 0.001 * 4)
    assert got.requests_per_s == pytest.approx(4 / batch_s)
    assert got.output_tokens_per_s == pytest.approx(50 * 4 / batch_s)


def test_arrival_offsets_are_the_seeded_poisson_schedule() -> None:
    offsets = arrival_offsets(2000, 4.0, seed=3)
    assert offsets == arrival_offsets(2000, 4.0, seed=3) and offsets[0] == 0.0
    assert offsets[-1] / 1999 == pytest.approx(0.25, rel=0.1)  # mean gap 1 / rate
    assert arrival_offsets(3, math.inf, seed=3) == [0.0, 0.0, 0.0]
