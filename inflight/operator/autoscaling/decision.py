"""The autoscaling decision: metric history in, desired replica count and a reason out (pure).

Every scrape round yields one recommendation, ``ceil(sum of the ready pods' metric / target)``:
``target`` is what one replica should carry, so the sum over pods divided by it is the number of
replicas that would carry today's load at the target. The decision then looks at the rounds in two
windows, like the HPA's stabilization windows:

- up: the *lowest* recommendation of the last ``scale_up_stabilization_s`` seconds (0 = the latest
  round), so a burst scales up on the next round, while a longer window asks for sustained load;
- down: the *highest* recommendation of the last ``scale_down_delay_s`` seconds, and only once the
  history covers that whole delay, so replicas go away only after sustained low demand, and input
  that flaps between high and low keeps the high count instead of flapping the output.

A pod whose metrics could not be read is unknown, never idle: while any round in the scale-down window
has an unknown pod, the decision does not scale down. While new replicas are still starting it does
not scale up further (their capacity is not in the metrics yet). ``min_replicas``/``max_replicas``
bound every outcome.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from inflight.operator.api.types import AutoscalingSpec


@dataclass(frozen=True)
class ScalingPolicy:
    """The knobs of one ModelServer's autoscaling, in plain numbers (seconds, metric units)."""

    min_replicas: int
    max_replicas: int
    target: float
    scale_up_stabilization_s: float = 0.0
    scale_down_delay_s: float = 300.0

    def __post_init__(self) -> None:
        if self.min_replicas < 0:
            raise ValueError(f"min_replicas must be >= 0, got {self.min_replicas}")
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas})"
            )
        if not self.target > 0:
            raise ValueError(f"target must be > 0 (what one replica should carry), got {self.target}")
        if self.scale_up_stabilization_s < 0 or self.scale_down_delay_s < 0:
            raise ValueError("scale_up_stabilization_s and scale_down_delay_s must be >= 0")

    def clamp(self, replicas: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, replicas))


@dataclass(frozen=True)
class Observation:
    """One scrape round: the metric value of every ready pod at ``time``; None = could not be read."""

    time: float
    values: Mapping[str, float | None]

    @property
    def known(self) -> list[float]:
        return [value for value in self.values.values() if value is not None]

    @property
    def unknown_pods(self) -> list[str]:
        return sorted(pod for pod, value in self.values.items() if value is None)


class Direction(StrEnum):
    UP = "up"
    DOWN = "down"
    HOLD = "hold"


@dataclass(frozen=True)
class Decision:
    desired: int
    direction: Direction
    reason: str
    metric_value: float | None
    """Latest round's average per readable pod, in the metric's unit (comparable with ``target``)."""


def recommend(observation: Observation, policy: ScalingPolicy) -> int | None:
    """Replicas that would carry this round's load at the target; None when no pod could be read."""
    known = observation.known
    if not known:
        return None
    return policy.clamp(math.ceil(sum(known) / policy.target - 1e-9))


def decide(
    history: Sequence[Observation],
    current_replicas: int,
    starting_replicas: int,
    policy: ScalingPolicy,
    now: float,
) -> Decision:
    """Desired replicas from the scrape history (oldest first), the current and still-starting counts."""
    latest = history[-1] if history else None
    metric_value = sum(latest.known) / len(latest.known) if latest and latest.known else None

    def hold(reason: str) -> Decision:
        return Decision(current_replicas, Direction.HOLD, reason, metric_value)

    if current_replicas < policy.min_replicas:
        return Decision(
            policy.min_replicas,
            Direction.UP,
            f"{current_replicas} replicas is below minReplicas {policy.min_replicas}",
            metric_value,
        )
    if current_replicas > policy.max_replicas:
        return Decision(
            policy.max_replicas,
            Direction.DOWN,
            f"{current_replicas} replicas is above maxReplicas {policy.max_replicas}",
            metric_value,
        )
    if latest is None or metric_value is None:
        return hold("no pod metrics could be read yet; holding the replica count")

    up_window = _window(history, now, policy.scale_up_stabilization_s)
    up_recommendations = [r for r in (recommend(o, policy) for o in up_window) if r is not None]
    up_to = min(up_recommendations) if up_recommendations else current_replicas
    load = _describe_load(latest, policy)
    if up_to > current_replicas:
        if starting_replicas > 0:
            return hold(
                f"{load} asks for {up_to} replicas, but {starting_replicas} new replica(s) are "
                "still starting; not scaling up further until they are ready"
            )
        return Decision(up_to, Direction.UP, f"{load} needs {up_to} replicas", metric_value)

    fits_now = recommend(latest, policy)
    fits_now = current_replicas if fits_now is None else fits_now
    if fits_now >= current_replicas:
        return hold(f"{load} fits {current_replicas} replicas")
    delay = f"{policy.scale_down_delay_s:g}s"
    down_window = _window(history, now, policy.scale_down_delay_s)
    down_recommendations = [recommend(o, policy) for o in down_window]
    down_to = max((r for r in down_recommendations if r is not None), default=current_replicas)
    if down_to >= current_replicas:
        return hold(
            f"{load} would fit {fits_now} replicas, but demand within the last {delay} needed "
            f"{down_to}; waiting for {delay} of low demand before scaling down"
        )
    unknown = sorted({pod for o in down_window for pod in o.unknown_pods})
    if unknown:
        return hold(
            f"{load} would fit {down_to} replicas, but the metrics of {', '.join(unknown)} could not "
            f"be read within the last {delay}; not scaling down on unknown load"
        )
    if history[0].time > now - policy.scale_down_delay_s:
        return hold(
            f"{load} would fit {down_to} replicas; waiting for {delay} of low demand before scaling down"
        )
    return Decision(
        down_to,
        Direction.DOWN,
        f"demand stayed at or below {down_to} replicas' worth for {delay} ({load})",
        metric_value,
    )


def _window(history: Sequence[Observation], now: float, seconds: float) -> list[Observation]:
    """The rounds of the last ``seconds`` seconds, and always at least the latest one."""
    inside = [o for o in history if o.time >= now - seconds]
    return inside or [history[-1]]


def _describe_load(observation: Observation, policy: ScalingPolicy) -> str:
    known = observation.known
    average = sum(known) / len(known)
    return f"load {sum(known):g} over {len(known)} pod(s) ({average:.3g} per pod, target {policy.target:g})"


def policy_of(autoscaling: AutoscalingSpec) -> ScalingPolicy:
    """The decision knobs of a ModelServer's ``spec.autoscaling``."""
    return ScalingPolicy(
        min_replicas=autoscaling.min_replicas,
        max_replicas=autoscaling.max_replicas,
        target=autoscaling.target,
        scale_up_stabilization_s=autoscaling.scale_up_stabilization_seconds,
        scale_down_delay_s=autoscaling.scale_down_delay_seconds,
    )
