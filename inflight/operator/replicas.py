"""The one function that decides how many replicas a ModelServer's Deployment runs (pure).

- no autoscaling: `spec.replicas` (absent: 1);
- builtin autoscaling: the operator's own decision, kept in `status.autoscaling.desiredReplicas`
  (absent: `minReplicas`); `spec.replicas` must be left out (a CEL rule says so). A ModelServer the
  autoscaler scaled to zero runs one replica again as soon as the router asks for one (`woken`);
- hpa / keda: the HPA writes `spec.replicas` through the scale subresource (absent: `minReplicas`).
With autoscaling the result is always clamped to [minReplicas, maxReplicas].

The router asks by setting the annotation `WAKE_ANNOTATION` to the time of its request (a merge patch
on the ModelServer, which is a ModelServer event, so the reconcile scales the Deployment at once). A
request newer than the autoscaler's last scale (`status.autoscaling.lastScaleTime`) is pending.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime

from inflight.operator.api.types import Actuator, ModelServer, ModelServerSpec, ModelServerStatus

WAKE_ANNOTATION = "inflight.dev/wake-requested-at"


def wake_requested_at(now: float) -> str:
    """The annotation's value for a request at `now` (RFC 3339 with microseconds)."""
    return datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def wake_pending(annotations: Mapping[str, str] | None, status: ModelServerStatus) -> bool:
    """Whether the router asked for a replica after the autoscaler's last scale."""
    requested = _parse((annotations or {}).get(WAKE_ANNOTATION))
    if requested is None:
        return False
    last_scale = _parse(status.autoscaling.last_scale_time if status.autoscaling else None)
    return last_scale is None or requested > last_scale


def woken(ms: ModelServer) -> bool:
    """`wake_pending` for a ModelServer as read from the API."""
    annotations = (ms.metadata.model_extra or {}).get("annotations")
    return wake_pending(annotations if isinstance(annotations, Mapping) else None, ms.status)


def desired_replicas(spec: ModelServerSpec, status: ModelServerStatus, woken: bool = False) -> int:
    autoscaling = spec.autoscaling
    if autoscaling is None:
        return 1 if spec.replicas is None else spec.replicas
    if autoscaling.actuator is Actuator.BUILTIN:
        decided = status.autoscaling.desired_replicas if status.autoscaling is not None else None
    else:
        decided = spec.replicas
    wanted = autoscaling.min_replicas if decided is None else decided
    if wanted == 0 and woken and autoscaling.actuator is Actuator.BUILTIN:
        wanted = 1
    return max(autoscaling.min_replicas, min(autoscaling.max_replicas, wanted))


def _parse(stamp: str | None) -> datetime | None:
    if not stamp:
        return None
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return None
