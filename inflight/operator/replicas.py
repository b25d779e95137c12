"""The one function that decides how many replicas a ModelServer's Deployment runs (pure).

- no autoscaling: `spec.replicas` (absent: 1);
- builtin autoscaling: the operator's own decision, kept in `status.autoscaling.desiredReplicas`
  (absent: `minReplicas`); `spec.replicas` must be left out (a CEL rule says so);
- hpa / keda: the HPA writes `spec.replicas` through the scale subresource (absent: `minReplicas`).
With autoscaling the result is always clamped to [minReplicas, maxReplicas].
"""

from __future__ import annotations

from inflight.operator.spec import Actuator, ModelServerSpec, ModelServerStatus


def desired_replicas(spec: ModelServerSpec, status: ModelServerStatus) -> int:
    autoscaling = spec.autoscaling
    if autoscaling is None:
        return 1 if spec.replicas is None else spec.replicas
    if autoscaling.actuator is Actuator.BUILTIN:
        decided = status.autoscaling.desired_replicas if status.autoscaling is not None else None
    else:
        decided = spec.replicas
    wanted = autoscaling.min_replicas if decided is None else decided
    return max(autoscaling.min_replicas, min(autoscaling.max_replicas, wanted))
