"""The builtin actuator's pieces: history keeping, starting replicas, one evaluation round, status."""

from __future__ import annotations

from typing import Any

import httpx

from inflight.operator.api.types import AutoscalingMetric, AutoscalingSpec
from inflight.operator.autoscaling.actuator import (
    AutoscalerState,
    autoscaling_status,
    evaluate,
    scaled,
    starting_replicas,
)
from inflight.operator.autoscaling.decision import Direction, Observation, ScalingPolicy
from inflight.operator.kube import rfc3339

POLICY = ScalingPolicy(min_replicas=1, max_replicas=4, target=2.0, scale_down_delay_s=5.0)
NOW = 1_800_000_000.0


def autoscaling() -> AutoscalingSpec:
    return AutoscalingSpec.model_validate(
        {
            "minReplicas": 1,
            "maxReplicas": 4,
            "target": 2,
            "metric": "requestsInFlight",
            "scaleDownDelaySeconds": 5,
        }
    )


def pod(name: str, port: int, ready: bool = True, age_s: float = 600.0) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "creationTimestamp": rfc3339(NOW - age_s)},
        "spec": {"containers": [{"name": "server", "ports": [{"name": "http", "containerPort": port}]}]},
        "status": {
            "podIP": "10.1.0.1",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def test_history_keeps_the_windows_and_one_older_round() -> None:
    state = AutoscalerState()
    for t in range(20):
        state.record(Observation(float(t), {"a": 0.0}), AutoscalingMetric.QUEUE_DEPTH, POLICY)
    assert [o.time for o in state.history] == [14.0, 15.0, 16.0, 17.0, 18.0, 19.0]


def test_history_is_forgotten_when_the_metric_changes() -> None:
    state = AutoscalerState()
    state.record(Observation(0.0, {"a": 50.0}), AutoscalingMetric.QUEUE_DEPTH, POLICY)
    state.record(Observation(1.0, {"a": 0.5}), AutoscalingMetric.KV_CACHE_USAGE, POLICY)
    assert [o.values["a"] for o in state.history] == [0.5]


def test_starting_replicas_counts_missing_and_young_unready_pods() -> None:
    pods = [pod("ready", 1), pod("young", 2, ready=False, age_s=30), pod("stuck", 3, ready=False, age_s=900)]
    # 5 asked for, 3 exist: 2 not created yet + 1 young unready; the stuck one is broken, not starting
    assert starting_replicas(pods, replicas=5, startup_timeout_s=600, now=NOW) == 3
    assert starting_replicas(pods, replicas=3, startup_timeout_s=600, now=NOW) == 1


async def test_evaluate_scrapes_ready_pods_and_decides() -> None:
    loads = {8001: (3, 2), 8002: (1, 0)}

    def respond(request: httpx.Request) -> httpx.Response:
        running, waiting = loads[request.url.port or 0]
        body = f"inflight:num_requests_running {running}\ninflight:num_requests_waiting {waiting}\n"
        return httpx.Response(200, text=body)

    client = httpx.AsyncClient(transport=httpx.MockTransport(respond))
    state = AutoscalerState()
    pods = [pod("a", 8001), pod("b", 8002), pod("c", 8003, ready=False, age_s=900)]
    decision = await evaluate(state, autoscaling(), pods, "server", 3, 600, client, 1.0, NOW)
    # 6 requests in flight at 2 per replica -> 3 replicas; pod c is not ready, so it is not scraped
    assert state.history[-1].values == {"a": 5.0, "b": 1.0}
    assert (decision.desired, decision.direction) == (3, Direction.HOLD)
    assert decision.metric_value == 3.0

    loads.update({8001: (9, 9), 8002: (9, 9)})
    decision = await evaluate(state, autoscaling(), pods, "server", 3, 600, client, 1.0, NOW + 1)
    assert (decision.desired, decision.direction) == (4, Direction.UP)
    assert scaled(decision, 3)
    status = autoscaling_status(decision, rfc3339(NOW + 1))
    assert status["desiredReplicas"] == 4
    assert status["currentValue"] == 18.0
    assert status["lastScaleTime"] == "2027-01-15T08:00:01Z"
    assert "needs 4 replicas" in status["reason"]
