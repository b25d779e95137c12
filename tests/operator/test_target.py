"""spec.target -> replicas (operator/target.py): the cost model's answer, its bounds, where it has none."""

from __future__ import annotations

import math
from typing import Any

from inflight.operator.api.types import ModelServerSpec
from inflight.operator.placement import engine_limits, model_shape, place
from inflight.operator.status import status_patch
from inflight.operator.target import decide
from inflight.sim import serving


def spec(gpu: str | None = "H100-80GB", count: int = 4, **target: Any) -> ModelServerSpec:
    return ModelServerSpec.model_validate(
        {
            "model": {"name": "llama", "source": "hf://meta-llama/Llama-3.1-70B-Instruct"},
            "resources": {"gpu": {"count": count, "type": gpu}}
            if gpu
            else {"gpu": {"count": 0}, "memory": "1024Gi"},
            "target": {"maxReplicas": 10, **target},
        }
    )


def test_the_replicas_are_the_cost_model_s_for_the_plan_the_deployment_runs() -> None:
    s = spec(requestsPerSecond=50)
    placement = place(s, [])
    decision = decide(s, placement)
    assert decision is not None and decision.met and decision.reason == "Computed"
    workload = serving.Workload(prompt_tokens=512, output_tokens=256, requests_per_s=50)
    each = serving.estimate(model_shape(s), placement.plan, "H100-80GB", workload, engine_limits(s))
    assert decision.replicas == decision.needed_replicas == math.ceil(50 / each.continuous.requests_per_s)
    assert decision.per_replica_requests_per_second == round(each.continuous.requests_per_s, 4)


def test_min_and_max_replicas_bound_it() -> None:
    low = decide(s := spec(requestsPerSecond=1, minReplicas=3), place(s, []))
    assert low is not None and (low.replicas, low.needed_replicas, low.met, low.reason) == (
        3,
        1,
        True,
        "AtMinReplicas",
    )
    high = decide(s := spec(requestsPerSecond=1000, maxReplicas=2), place(s, []))
    assert high is not None and high.replicas == 2 and high.needed_replicas is not None
    assert high.needed_replicas > 2 and not high.met and high.reason == "MaxReplicasTooLow"


def test_without_figures_or_a_plan_min_replicas_run_and_the_status_says_why() -> None:
    for s in (
        spec("A10G", 8, requestsPerSecond=5, minReplicas=2),
        spec(None, requestsPerSecond=5, minReplicas=2),
    ):
        decision = decide(s, place(s, []))
        assert decision is not None and (decision.replicas, decision.met) == (2, False)
        assert decision.reason == "NoSpeedFigures" and "no speed figures" in decision.message
        assert "neededReplicas" not in decision.status()
    one_gpu = spec("H100-80GB", 1, requestsPerSecond=5)  # 70B does not fit one H100
    decision = decide(one_gpu, place(one_gpu, []))
    assert decision is not None and (decision.replicas, decision.reason) == (1, "NotSized")
    assert decide(one_gpu, None) == decision
    assert (
        decide(ModelServerSpec.model_validate({"model": {"name": "m", "source": "builtin:tiny"}}), None)
        is None
    )


def test_status_patch_nulls_figures_the_new_decision_no_longer_has() -> None:
    computed = {"target": {"replicas": 2, "neededReplicas": 2, "gpuType": "H100-80GB", "message": "a"}}
    fallback = {"target": {"replicas": 1, "gpuType": "A10G", "message": "b"}}
    assert status_patch(computed, fallback)["target"] == {
        "replicas": 1,
        "neededReplicas": None,
        "gpuType": "A10G",
        "message": "b",
    }
    assert status_patch(computed, {})["target"] is None  # spec.target removed
