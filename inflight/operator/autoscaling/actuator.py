"""The builtin actuator's pieces: per-ModelServer scrape history, one evaluation round, its status.

The kopf handler that drives them (every ``interval``) stays thin: it hands over the ModelServer's pods
and the Deployment's replica count, writes the decided count through the operator's replicas writer,
and records the decision in ``status.autoscaling`` and, when replicas change, as an Event.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from inflight.operator.api.types import AutoscalingMetric, AutoscalingSpec
from inflight.operator.autoscaling.decision import (
    Decision,
    Direction,
    Observation,
    ScalingPolicy,
    decide,
    policy_of,
)
from inflight.operator.autoscaling.pod_metrics import ready_pod_endpoints, scrape
from inflight.operator.kube import parse_rfc3339


@dataclass
class AutoscalerState:
    """What the builtin autoscaler remembers about one ModelServer between rounds (kept in memory)."""

    metric: AutoscalingMetric | None = None
    history: deque[Observation] = field(default_factory=deque)
    last_scale_time: str | None = None

    def record(self, observation: Observation, metric: AutoscalingMetric, policy: ScalingPolicy) -> None:
        """Add a round; forget rounds no window needs (keeping one older, which proves the delay passed)."""
        if metric != self.metric:
            self.metric = metric
            self.history.clear()
        self.history.append(observation)
        horizon = observation.time - max(policy.scale_up_stabilization_s, policy.scale_down_delay_s)
        while len(self.history) > 1 and self.history[1].time <= horizon:
            self.history.popleft()


def starting_replicas(
    pods: Iterable[Mapping[str, Any]], replicas: int, startup_timeout_s: float, now: float
) -> int:
    """Replicas asked for but not serving yet: pods not created yet plus young pods not ready yet.

    A pod older than the startup timeout that is still not ready is broken, not starting: it does not hold
    back a scale-up (its startup probe restarts it).
    """
    alive = [pod for pod in pods if not pod.get("metadata", {}).get("deletionTimestamp")]
    young_unready = sum(
        1 for pod in alive if not _is_ready(pod) and now - _created(pod, now) < startup_timeout_s
    )
    return max(0, replicas - len(alive)) + young_unready


async def evaluate(
    state: AutoscalerState,
    autoscaling: AutoscalingSpec,
    pods: Sequence[Mapping[str, Any]],
    container: str,
    replicas: int,
    startup_timeout_s: float,
    client: httpx.AsyncClient,
    timeout_s: float,
    now: float,
) -> Decision:
    """One round: scrape the ready pods, remember the values, decide."""
    metric = autoscaling.metric
    policy = policy_of(autoscaling)
    values = await scrape(client, ready_pod_endpoints(pods, container), metric, timeout_s)
    state.record(Observation(now, values), metric, policy)
    starting = starting_replicas(pods, replicas, startup_timeout_s, now)
    return decide(list(state.history), replicas, starting, policy, now)


def autoscaling_status(decision: Decision, last_scale_time: str | None) -> dict[str, Any]:
    """``status.autoscaling`` for a decision (camelCase, as in the CRD)."""
    value = None if decision.metric_value is None else round(decision.metric_value, 4)
    return {
        "desiredReplicas": decision.desired,
        "currentValue": value,
        "lastScaleTime": last_scale_time,
        "reason": decision.reason,
    }


def scaled(decision: Decision, replicas: int) -> bool:
    return decision.direction is not Direction.HOLD and decision.desired != replicas


def _is_ready(pod: Mapping[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _created(pod: Mapping[str, Any], now: float) -> float:
    stamp = pod.get("metadata", {}).get("creationTimestamp")
    if not isinstance(stamp, str):
        return now
    created = parse_rfc3339(stamp)
    return now if created is None else created.timestamp()
