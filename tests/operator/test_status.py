"""Status conditions from what a reconcile observed (pure)."""

from __future__ import annotations

from typing import Any

from inflight.operator.api.types import ModelServer
from inflight.operator.autoscaling.pod_metrics import PodSizing
from inflight.operator.placement import place
from inflight.operator.status import Observed, Problem, build_status, status_patch

NOW = "2026-01-01T00:00:00Z"
LATER = "2026-01-01T00:05:00Z"


def ms(generation: int = 2, conditions: list[dict[str, Any]] | None = None) -> ModelServer:
    return ModelServer.model_validate(
        {
            "metadata": {"name": "m", "namespace": "ns", "generation": generation},
            "spec": {
                "model": {"name": "m", "source": "builtin:tiny"},
                "resources": {"gpu": {"count": 0}, "memory": "2Gi"},
            },
            "status": {"conditions": conditions} if conditions else {},
        }
    )


def deployment(hash_: str, generation: int, observed: int, **status: Any) -> dict[str, Any]:
    return {
        "metadata": {"generation": generation},
        "spec": {"template": {"metadata": {"annotations": {"inflight.dev/template-hash": hash_}}}},
        "status": {"observedGeneration": observed, **status},
    }


def conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def observed(dep: dict[str, Any] | None, problem: Problem | None = None, replicas: int = 2) -> Observed:
    return Observed(place(ms().spec, []), problem, dep, replicas, "h2")


def test_ready_needs_the_current_template_observed_and_every_replica_ready() -> None:
    done = deployment("h2", 3, 3, replicas=2, updatedReplicas=2, readyReplicas=2)
    assert conditions(build_status(ms(), observed(done), NOW))["Ready"] == ("True", "Ready")
    cases = {
        "old template": deployment("h1", 3, 3, replicas=2, updatedReplicas=2, readyReplicas=2),
        "not observed": deployment("h2", 4, 3, replicas=2, updatedReplicas=2, readyReplicas=2),
        "half updated": deployment("h2", 3, 3, replicas=2, updatedReplicas=1, readyReplicas=2),
        "old pod left": deployment("h2", 3, 3, replicas=3, updatedReplicas=2, readyReplicas=2),
        "loading": deployment("h2", 3, 3, replicas=2, updatedReplicas=2, readyReplicas=1),
    }
    for what, dep in cases.items():
        status = conditions(build_status(ms(), observed(dep), NOW))
        assert status["Ready"][0] == "False", what
        assert status["Progressing"][0] == "True", what
        assert status["Degraded"] == ("False", "AsExpected"), what


def test_problems_degrade_and_block_progress() -> None:
    problem = Problem("SecretNotFound", "create the Secret")
    status = conditions(build_status(ms(), observed(None, problem), NOW))
    assert status["Degraded"] == ("True", "SecretNotFound")
    assert status["Ready"] == ("False", "SecretNotFound")
    assert status["Progressing"] == ("False", "Blocked")
    stuck = deployment(
        "h2",
        3,
        3,
        replicas=2,
        conditions=[
            {
                "type": "Progressing",
                "status": "False",
                "reason": "ProgressDeadlineExceeded",
                "message": "timed out",
            }
        ],
    )
    assert conditions(build_status(ms(), observed(stuck), NOW))["Degraded"] == ("True", "RolloutStuck")


def test_transition_time_moves_only_when_the_status_changes() -> None:
    first = build_status(ms(), observed(None), NOW)
    again = build_status(ms(conditions=first["conditions"]), observed(None), LATER)
    assert all(c["lastTransitionTime"] == NOW for c in again["conditions"])
    assert all(c["observedGeneration"] == 2 for c in again["conditions"])
    done = deployment("h2", 3, 3, replicas=2, updatedReplicas=2, readyReplicas=2)
    ready = {
        c["type"]: c
        for c in build_status(ms(conditions=first["conditions"]), observed(done), LATER)["conditions"]
    }
    assert ready["Ready"]["lastTransitionTime"] == LATER and ready["Sized"]["lastTransitionTime"] == NOW


def test_status_patch_is_empty_when_nothing_changed() -> None:
    status = build_status(ms(), observed(None), NOW)
    assert status_patch(status, status) == {}
    assert status_patch({**status, "autoscaling": {"desiredReplicas": 3}}, status) == {}  # not ours to touch
    assert (
        status_patch({"sizing": {"fits": True}}, {k: v for k, v in status.items() if k != "sizing"})["sizing"]
        is None
    )


def measured_observed(*blocks: int, dtype: str = "float32") -> Observed:
    placement = place(ms().spec, [])
    pods = {f"m-{i}": PodSizing(b, placement.plan.slots, dtype, None) for i, b in enumerate(blocks)}
    return Observed(placement, None, None, 2, "h", pods)


def test_measured_sizing_is_min_max_over_replicas_and_the_ratio_to_the_plan() -> None:
    plan = place(ms().spec, []).plan
    assert "measured" not in build_status(ms(), measured_observed(), NOW)["sizing"]  # none ready yet
    full = build_status(ms(), measured_observed(plan.kv_blocks, plan.kv_blocks), NOW)
    assert full["sizing"]["measured"] == {
        "replicas": 2,
        "kvBlocksMin": plan.kv_blocks,
        "kvBlocksMax": plan.kv_blocks,
        "kvBlocksRatio": 1.0,
        "slotsMin": plan.slots,
        "slotsMax": plan.slots,
        "dtype": "float32",
    }
    assert "SizingDrift" not in conditions(full)
    at_threshold = build_status(ms(), measured_observed(plan.kv_blocks, -(-plan.kv_blocks * 9 // 10)), NOW)
    assert "SizingDrift" not in conditions(at_threshold)


def test_a_replica_below_90_percent_of_the_plan_is_sizing_drift_naming_both_numbers() -> None:
    plan = place(ms().spec, []).plan
    short = plan.kv_blocks * 9 // 10 - 1
    status = build_status(ms(), measured_observed(plan.kv_blocks, short, dtype="bfloat16"), NOW)
    (drift,) = [c for c in status["conditions"] if c["type"] == "SizingDrift"]
    assert (drift["status"], drift["reason"]) == ("True", "FewerKVBlocksThanPlanned")
    assert f"pod m-1 runs with {short} KV blocks, the plan has {plan.kv_blocks}" in drift["message"]
    assert "the pod also runs bfloat16, the plan assumed float32" in drift["message"]
    assert status["sizing"]["measured"]["kvBlocksRatio"] == round(short / plan.kv_blocks, 3)
    assert conditions(status)["Degraded"] == ("False", "AsExpected")  # it serves, with less cache


def test_status_patch_deletes_a_stale_measurement() -> None:
    measured = build_status(ms(), measured_observed(10), NOW)
    unmeasured = build_status(ms(), measured_observed(), NOW)
    assert status_patch(measured, unmeasured)["sizing"]["measured"] is None
    assert status_patch(measured, measured) == {}


def test_sizing_drift_covers_the_kv_cache_dtype() -> None:
    """A plan made for an FP8 KV cache and a pod that runs its dtype's cache: half the blocks, and the
    drift says which KV cache each side has."""
    fp8 = ms()
    fp8.spec.engine.kv_cache_dtype = "fp8"
    placement = place(fp8.spec, [])
    assert placement.plan.kv_cache_dtype == "float8_e4m3fn"
    half = placement.plan.kv_blocks // 2
    pods = {
        "m-0": PodSizing(placement.plan.kv_blocks, placement.plan.slots, "float32", None, "float8_e4m3fn"),
        "m-1": PodSizing(half, placement.plan.slots, "float32", None, "float32"),
    }
    status = build_status(fp8, Observed(placement, None, None, 2, "h", pods), NOW)
    assert status["sizing"]["kvCacheDtype"] == "float8_e4m3fn"
    assert status["sizing"]["measured"]["kvCacheDtype"] == "float32,float8_e4m3fn"
    (drift,) = [c for c in status["conditions"] if c["type"] == "SizingDrift"]
    assert "the pod's KV cache is float32, the plan assumed float8_e4m3fn" in drift["message"]
