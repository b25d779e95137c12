"""ModelServer status from what the reconcile found (pure): kstatus-style conditions GitOps tools read.

- `Sized`: the plan fits (True) or why it cannot be sized or does not fit (False).
- `Degraded`: True when the spec cannot work as written (does not fit, no GPU information, missing API-key
  Secret) or the rollout failed (the Deployment's ProgressDeadlineExceeded / ReplicaFailure). The message
  says what to change. The operator then leaves the running Deployment as it is and does not retry in a loop.
- `Ready`: True only when every replica runs the current template: the Deployment has observed its
  latest generation, carries this generation's template, and replicas == updated == ready == desired.
- `Progressing`: True while a rollout or scaling is under way; False when Ready or Degraded.
- `SizingDrift`: present (True) only while a ready replica runs with fewer than 90% of the planned KV
  blocks (`status.sizing.measured`, read from the replicas' /metrics); the message names both numbers and
  the likely cause. The replica serves, with less cache than planned, so this is not Degraded.
- `TargetMet`: present only with `spec.target`: True when the replicas the cost model computes for the
  target run (or minReplicas, more than needed); False when maxReplicas clips them, or the model cannot
  answer (no speed figures for the GPU type, a spec that cannot be sized) and minReplicas run
  (operator/target.py). It serves either way, so this is not Degraded.

Replicas: `desired_replicas` is the one function that decides how many replicas a ModelServer's Deployment
runs, from its spec and status:

- spec.target: what the serving cost model computes for it (operator/target.py), within
  [target.minReplicas, target.maxReplicas]; a CEL rule keeps spec.replicas and autoscaling out;
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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from inflight import sizing
from inflight.operator import kube
from inflight.operator.api.types import Actuator, ModelServer, ModelServerSpec, ModelServerStatus
from inflight.operator.autoscaling.pod_metrics import PodSizing
from inflight.operator.children import server
from inflight.operator.model_cache import Download
from inflight.operator.placement import Placement
from inflight.operator.target import TargetDecision

CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "Sized", "SizingDrift", "TargetMet")
DRIFT_RATIO = 0.9  # a replica with fewer than this share of the planned KV blocks is SizingDrift
WAKE_ANNOTATION = "inflight.dev/wake-requested-at"


@dataclass(frozen=True)
class Problem:
    """Why the spec cannot work: a CamelCase reason and a message that says what to change."""

    reason: str
    message: str


@dataclass(frozen=True)
class Observed:
    """What one reconcile saw and decided."""

    placement: Placement | None
    problem: Problem | None
    deployment: Mapping[str, Any] | None  # the live Deployment after this reconcile's writes
    desired_replicas: int
    desired_template_hash: str | None
    measured: Mapping[str, PodSizing] = field(default_factory=dict)  # pod name -> what it runs with
    download: Download | None = None  # the model cache's download (spec.model.cache)
    target: TargetDecision | None = None  # the replicas spec.target takes


def _condition(
    kind: str, status: bool, reason: str, message: str, generation: int, previous: Mapping[str, Any], now: str
) -> dict[str, Any]:
    value = "True" if status else "False"
    old = previous.get(kind)
    since = now if old is None or old.get("status") != value else old.get("lastTransitionTime", now)
    return {
        "type": kind,
        "status": value,
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
        "lastTransitionTime": since,
    }


def _rollout(
    deployment: Mapping[str, Any] | None, replicas: int, template_hash: str | None
) -> tuple[bool, str, str]:
    """(ready, reason, message) for the Deployment against what this generation wants."""
    if deployment is None:
        return False, "Creating", "creating the Deployment"
    status = deployment.get("status") or {}
    generation = deployment.get("metadata", {}).get("generation", 0)
    if server.template_hash(dict(deployment)) != template_hash:
        return False, "RollingOut", "updating the Deployment to this generation's template"
    if status.get("observedGeneration", 0) < generation:
        return False, "RollingOut", "waiting for the Deployment controller to observe the new template"
    current = status.get("replicas", 0)
    updated = status.get("updatedReplicas", 0)
    ready = status.get("readyReplicas", 0)
    if updated < replicas:
        return False, "RollingOut", f"{updated} of {replicas} replicas run the current template"
    if current > replicas:
        return False, "RollingOut", f"{current - replicas} old replicas are still terminating"
    if ready < replicas:
        return False, "WaitingForReady", f"{ready} of {replicas} replicas are ready (model loading)"
    return True, "Ready", f"{ready} of {replicas} replicas ready, all on the current template"


def _deployment_failure(deployment: Mapping[str, Any] | None) -> Problem | None:
    for condition in (deployment or {}).get("status", {}).get("conditions") or []:
        if condition.get("type") == "Progressing" and condition.get("reason") == "ProgressDeadlineExceeded":
            return Problem(
                "RolloutStuck",
                f"the rollout made no progress: {condition.get('message', '')}; check the pods' events "
                "(image pull, scheduling, OOM) and raise startupTimeoutSeconds if the model loads slowly",
            )
        if condition.get("type") == "ReplicaFailure" and condition.get("status") == "True":
            return Problem("ReplicaFailure", f"pods cannot be created: {condition.get('message', '')}")
    return None


def sizing_status(placement: Placement) -> dict[str, Any]:
    plan = placement.plan
    values = {
        "fits": plan.fits,
        "gpuType": placement.gpu_type,
        "gpuMemoryMiB": placement.gpu_memory_mib,
        "gpuMemorySource": placement.gpu_memory_source,
        "tensorParallel": plan.tensor_parallel,
        "dtype": plan.dtype,
        "quantization": plan.quantization,
        "kvCacheDtype": plan.kv_cache_dtype,
        "weightBytesPerGPU": plan.weight_bytes_per_gpu,
        "kvBlocks": plan.kv_blocks,
        "kvTokens": plan.kv_tokens,
        "slots": plan.slots,
        "minGPUs": plan.min_gpus,
        "maxSlotsGPUs": plan.max_slots_gpus,
        "message": plan.reason,
    }
    return {key: value for key, value in values.items() if value is not None}  # merge patch: null = delete


def measured_sizing(plan: sizing.SizingPlan, measured: Mapping[str, PodSizing]) -> dict[str, Any] | None:
    """`status.sizing.measured`: min/max over the measured replicas and the ratio to the plan."""
    if not measured:
        return None
    pods = list(measured.values())
    blocks = [pod.kv_blocks for pod in pods]
    slots = [pod.slots for pod in pods]
    dtypes = sorted({pod.dtype for pod in pods if pod.dtype})
    kv_dtypes = sorted({pod.kv_cache_dtype for pod in pods if pod.kv_cache_dtype})
    degrees = {pod.tensor_parallel for pod in pods if pod.tensor_parallel is not None}
    values: dict[str, Any] = {
        "replicas": len(pods),
        "kvBlocksMin": min(blocks),
        "kvBlocksMax": max(blocks),
        "kvBlocksRatio": round(min(blocks) / plan.kv_blocks, 3) if plan.kv_blocks else None,
        "slotsMin": min(slots),
        "slotsMax": max(slots),
        "dtype": ",".join(dtypes) or None,
        "tensorParallel": min(degrees) if len(degrees) == 1 else None,
        "kvCacheDtype": ",".join(kv_dtypes) or None,
    }
    return {key: value for key, value in values.items() if value is not None}


def sizing_drift(placement: Placement, measured: Mapping[str, PodSizing]) -> Problem | None:
    """Why the replica with the fewest KV blocks runs short of the plan, or None when all are >= 90%."""
    plan = placement.plan
    if not measured or not plan.kv_blocks:
        return None
    name, pod = min(measured.items(), key=lambda item: (item[1].kv_blocks, item[0]))
    if pod.kv_blocks >= DRIFT_RATIO * plan.kv_blocks:
        return None
    if placement.gpu_type == "cpu":
        cause = (
            "the server's memory budget held fewer blocks than planned (less free memory in the pod "
            "than resources.memory promised, e.g. a limit lowered by a LimitRange)"
        )
    else:
        cause = (
            f"the server found less free GPU memory than the plan's {placement.gpu_memory_mib} MiB "
            f"({placement.gpu_type}, from {placement.gpu_memory_source}) left after the weights: another "
            "process on the GPU, a smaller GPU than planned, or more activation memory; set "
            "resources.gpu.type or memoryMiB to what the node has, or lower engine.gpuMemoryUtilization"
        )
    if pod.dtype and pod.dtype != plan.dtype:
        cause += f"; the pod also runs {pod.dtype}, the plan assumed {plan.dtype}"
    if pod.kv_cache_dtype and pod.kv_cache_dtype != plan.kv_cache_dtype:
        cause += (
            f"; the pod's KV cache is {pod.kv_cache_dtype}, the plan assumed {plan.kv_cache_dtype} "
            "(engine.kvCacheDtype)"
        )
    return Problem(
        "FewerKVBlocksThanPlanned",
        f"pod {name} runs with {pod.kv_blocks} KV blocks, the plan has {plan.kv_blocks} "
        f"({pod.kv_blocks / plan.kv_blocks:.0%}, below {DRIFT_RATIO:.0%}): {cause}; the pod's log says how "
        "many blocks fit",
    )


def not_fitting(plan: sizing.SizingPlan) -> Problem:
    return Problem("DoesNotFit", f"{plan.model} does not fit: {plan.reason}")


def build_status(ms: ModelServer, observed: Observed, now: str) -> dict[str, Any]:
    """The whole `status` (camelCase) for this reconcile; conditions keep their lastTransitionTime."""
    generation = ms.metadata.generation
    previous = {c.type: c.model_dump(by_alias=True) for c in ms.status.conditions or []}
    problem = observed.problem or _deployment_failure(observed.deployment)
    placement = observed.placement

    if placement is None:
        assert observed.problem is not None
        sized = (False, observed.problem.reason, observed.problem.message)
    elif not placement.plan.fits:
        sized = (False, "DoesNotFit", placement.plan.reason)
    else:
        sized = (True, "Fits", placement.plan.reason)

    if problem is not None:
        ready, ready_reason, ready_message = False, problem.reason, problem.message
        progressing = (False, "Blocked", "the spec cannot be rolled out as written; see Degraded")
    else:
        ready, ready_reason, ready_message = _rollout(
            observed.deployment, observed.desired_replicas, observed.desired_template_hash
        )
        progressing = (False, "Complete", ready_message) if ready else (True, ready_reason, ready_message)
        if observed.download is not None and observed.download.phase == "Downloading":
            ready, ready_reason, ready_message = False, "Downloading", observed.download.message
            progressing = (True, "Downloading", observed.download.message)
    degraded = (True, problem.reason, problem.message) if problem else (False, "AsExpected", "no problems")

    conditions = [
        _condition("Ready", ready, ready_reason, ready_message, generation, previous, now),
        _condition("Progressing", *progressing, generation, previous, now),
        _condition("Degraded", *degraded, generation, previous, now),
        _condition("Sized", *sized, generation, previous, now),
    ]
    drift = sizing_drift(placement, observed.measured) if placement is not None else None
    if drift is not None:
        conditions.append(
            _condition("SizingDrift", True, drift.reason, drift.message, generation, previous, now)
        )
    live = (observed.deployment or {}).get("status") or {}
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "conditions": conditions,
        "replicas": live.get("replicas", 0),
        "readyReplicas": live.get("readyReplicas", 0),
        "updatedReplicas": live.get("updatedReplicas", 0),
        "selector": server.selector_string(ms),
        "endpoint": server.endpoint(ms),
    }
    if placement is not None:
        status["sizing"] = sizing_status(placement)
        measured = measured_sizing(placement.plan, observed.measured)
        if measured is not None:
            status["sizing"]["measured"] = measured
    if observed.download is not None:
        status["modelCache"] = observed.download.status()
    if observed.target is not None:
        status["target"] = observed.target.status()
        decision = observed.target
        conditions.append(
            _condition(
                "TargetMet", decision.met, decision.reason, decision.message, generation, previous, now
            )
        )
    return status


# Status keys the operator writes whole, and removes when the reconcile no longer has them.
OWNED_OBJECTS = ("sizing", "modelCache", "target")


def _replacing(current: Any, desired: Any) -> Any:
    """`desired` as a merge patch over `current`: keys `current` has and `desired` lacks are nulled (a
    merge patch keeps the keys it does not name), in nested objects too."""
    if not isinstance(desired, Mapping) or not isinstance(current, Mapping):
        return desired
    gone = {key: None for key in current if key not in desired}
    return {**gone, **{key: _replacing(current.get(key), value) for key, value in desired.items()}}


def status_patch(current: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[str, Any]:
    """The merge patch from the current status to the desired one (keys it owns only); {} when equal."""
    patch: dict[str, Any] = {}
    for key, value in desired.items():
        if current.get(key) != value:
            patch[key] = _replacing(current.get(key), value)
    for key in OWNED_OBJECTS:
        if key not in desired and current.get(key) is not None:
            patch[key] = None
    return patch


def condition_of(conditions: Sequence[Mapping[str, Any]] | None, kind: str) -> Mapping[str, Any] | None:
    return next((c for c in conditions or [] if c.get("type") == kind), None)


def wake_requested_at(now: float) -> str:
    """The annotation's value for a request at `now` (RFC 3339 with microseconds)."""
    return kube.rfc3339(now, micro=True)


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


def desired_replicas(
    spec: ModelServerSpec,
    status: ModelServerStatus,
    woken: bool = False,
    target: TargetDecision | None = None,
) -> int:
    """The Deployment's replicas; `target` is operator/target.py's decision for spec.target."""
    if spec.target is not None:
        return spec.target.min_replicas if target is None else target.replicas
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
    try:
        return kube.parse_rfc3339(stamp)
    except ValueError:
        return None
