"""spec.target -> replicas (pure): the serving cost model of `inflight size --workload` on the replica's plan.

What one replica serves is inflight/sim/serving.py's continuous-batching estimate for the sizing plan the
Deployment runs with (its slots, its KV pool, its GPU type) and the target's prompt and output lengths;
the replicas needed are `ceil(requestsPerSecond / that)`, then bounded by target.minReplicas and
maxReplicas. Where the model cannot answer (a GPU type without speed figures, a spec that cannot be
sized), the ModelServer runs target.minReplicas and the status says why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from inflight import sizing
from inflight.operator.api.types import ModelServerSpec, TargetSpec
from inflight.operator.placement import Placement, engine_limits, model_shape
from inflight.sim import serving

# TargetMet condition reasons: the target is served (True) or not, and why.
COMPUTED = "Computed"
AT_MIN_REPLICAS = "AtMinReplicas"
MAX_REPLICAS_TOO_LOW = "MaxReplicasTooLow"
NO_SPEED_FIGURES = "NoSpeedFigures"
NOT_SIZED = "NotSized"


@dataclass(frozen=True)
class TargetDecision:
    """The replicas spec.target takes and why; `met` is the TargetMet condition's status."""

    requests_per_second: float
    replicas: int
    met: bool
    reason: str
    message: str
    needed_replicas: int | None = None
    per_replica_requests_per_second: float | None = None
    gpu_type: str | None = None

    def status(self) -> dict[str, Any]:
        """`status.target` (camelCase; absent figures left out)."""
        values = {
            "requestsPerSecond": self.requests_per_second,
            "replicas": self.replicas,
            "neededReplicas": self.needed_replicas,
            "perReplicaRequestsPerSecond": self.per_replica_requests_per_second,
            "gpuType": self.gpu_type,
            "message": self.message,
        }
        return {key: value for key, value in values.items() if value is not None}


def _fallback(target: TargetSpec, reason: str, why: str, gpu_type: str | None = None) -> TargetDecision:
    return TargetDecision(
        requests_per_second=target.requests_per_second,
        replicas=target.min_replicas,
        met=False,
        reason=reason,
        message=f"{why}: running target.minReplicas ({target.min_replicas})",
        gpu_type=gpu_type,
    )


def decide(spec: ModelServerSpec, placement: Placement | None) -> TargetDecision | None:
    """The replicas for spec.target on `placement` (None without a target)."""
    target = spec.target
    if target is None:
        return None
    if placement is None or not placement.plan.fits:
        return _fallback(target, NOT_SIZED, "the spec cannot be sized (see the Sized condition)")
    catalog_gpu = sizing.find_gpu(placement.gpu_type) if placement.gpu_type != "cpu" else None
    gpu = catalog_gpu.name if catalog_gpu is not None else placement.gpu_type
    if gpu not in serving.GPU_SPEED:
        return _fallback(
            target,
            NO_SPEED_FIGURES,
            f"the serving cost model has no speed figures for {gpu} (it has {', '.join(serving.GPU_SPEED)}); "
            "set target.minReplicas to the replicas you need, or use spec.replicas instead of spec.target",
            gpu,
        )
    workload = serving.Workload(
        prompt_tokens=target.prompt_tokens,
        output_tokens=target.output_tokens,
        requests_per_s=target.requests_per_second,
    )
    estimate = serving.estimate(model_shape(spec), placement.plan, gpu, workload, engine_limits(spec))
    assert estimate.replicas is not None  # the workload carries a rate
    needed, each = estimate.replicas, estimate.continuous.requests_per_s
    replicas = max(target.min_replicas, min(target.max_replicas, needed))
    said = (
        f"{target.requests_per_second:g} req/s of {target.prompt_tokens}+{target.output_tokens} tokens takes "
        f"{needed} replicas by the cost model ({each:.3g} req/s each on {placement.plan.tensor_parallel} x "
        f"{gpu}, a datasheet-peak estimate)"
    )
    if needed > target.max_replicas:
        met, reason = False, MAX_REPLICAS_TOO_LOW
        message = (
            f"{said}, but target.maxReplicas is {target.max_replicas}: they serve about "
            f"{target.max_replicas * each:.3g} req/s; raise target.maxReplicas or give each replica more GPUs"
        )
    elif needed < target.min_replicas:
        met, reason = True, AT_MIN_REPLICAS
        message = f"{said}; running target.minReplicas ({target.min_replicas})"
    else:
        met, reason, message = True, COMPUTED, f"{said}; running {replicas}"
    return TargetDecision(
        requests_per_second=target.requests_per_second,
        replicas=replicas,
        met=met,
        reason=reason,
        message=message,
        needed_replicas=needed,
        per_replica_requests_per_second=round(each, 4),
        gpu_type=gpu,
    )
