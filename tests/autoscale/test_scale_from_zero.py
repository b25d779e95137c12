"""The router's wake request as the operator reads it: one replica for a ModelServer scaled to zero."""

from __future__ import annotations

from inflight.operator.api.types import ModelServer, ModelServerSpec, ModelServerStatus
from inflight.operator.status import (
    WAKE_ANNOTATION,
    desired_replicas,
    wake_pending,
    wake_requested_at,
    woken,
)

SPEC = ModelServerSpec.model_validate(
    {"model": {"name": "m", "source": "builtin:tiny"},
     "autoscaling": {"minReplicas": 0, "maxReplicas": 3, "target": 4}}
)  # fmt: skip


def status(desired: int, last_scale: str | None) -> ModelServerStatus:
    return ModelServerStatus.model_validate(
        {"autoscaling": {"desiredReplicas": desired, "lastScaleTime": last_scale}}
    )


def test_a_wake_request_after_the_scale_to_zero_runs_one_replica() -> None:
    at_zero = status(0, "2026-12-01T10:00:00Z")
    assert desired_replicas(SPEC, at_zero) == 0
    later = {WAKE_ANNOTATION: wake_requested_at(1796119200.5)}  # 2026-12-01T10:00:00.5Z
    earlier = {WAKE_ANNOTATION: "2026-12-01T09:59:59.000000Z"}
    assert wake_pending(later, at_zero) and not wake_pending(earlier, at_zero)
    assert not wake_pending(None, at_zero) and not wake_pending({WAKE_ANNOTATION: "garbage"}, at_zero)
    assert desired_replicas(SPEC, at_zero, woken=True) == 1
    assert desired_replicas(SPEC, status(2, "2026-12-01T10:00:00Z"), woken=True) == 2  # only from zero
    body = {"metadata": {"name": "m", "annotations": later}, "spec": SPEC.model_dump(by_alias=True)}
    assert woken(ModelServer.model_validate({**body, "status": at_zero.model_dump(by_alias=True)}))


def test_a_wake_request_before_the_first_autoscaling_round_counts_too() -> None:
    assert desired_replicas(SPEC, ModelServerStatus(), woken=True) == 1
    assert desired_replicas(SPEC, ModelServerStatus()) == 0
