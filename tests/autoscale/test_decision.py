"""The pure decision function on metric sequences (one scrape round per second)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inflight.operator.autoscaling.decision import Decision, Direction, Observation, ScalingPolicy, decide

POLICY = ScalingPolicy(min_replicas=1, max_replicas=4, target=4.0, scale_down_delay_s=10.0)


def run(
    per_pod_loads: Sequence[Sequence[float | None]],
    policy: ScalingPolicy = POLICY,
    replicas: int = 1,
    ready_after_s: int = 0,
) -> list[Decision]:
    """Feed one round per second; apply every decision; new replicas become ready after `ready_after_s`.

    Each round lists one value per pod (None = that pod's metrics could not be read).
    """
    history: list[Observation] = []
    decisions = []
    ready_at: list[float] = []
    for t, loads in enumerate(per_pod_loads):
        now = float(t)
        history.append(Observation(now, {f"pod-{i}": v for i, v in enumerate(loads)}))
        starting = sum(1 for ready in ready_at if ready > now)
        decision = decide(history, replicas, starting, policy, now)
        decisions.append(decision)
        if decision.desired > replicas:
            ready_at += [now + ready_after_s] * (decision.desired - replicas)
        replicas = decision.desired
    return decisions


def replicas_over_time(decisions: Sequence[Decision]) -> list[int]:
    return [d.desired for d in decisions]


def test_burst_scales_up_on_the_next_round() -> None:
    decisions = run([[1.0]] * 3 + [[13.0]])
    assert replicas_over_time(decisions) == [1, 1, 1, 4]
    assert decisions[-1].direction is Direction.UP
    assert "needs 4 replicas" in decisions[-1].reason


def test_scale_up_is_sized_by_load_over_target() -> None:
    # 9 requests in flight at 4 per replica -> ceil(9 / 4) = 3 replicas
    assert run([[9.0]])[-1].desired == 3
    # exactly at target: no extra replica
    assert run([[4.0, 4.0]], replicas=2)[-1].desired == 2


def test_quiet_scales_down_only_after_the_delay() -> None:
    loads: list[list[float | None]] = [[4.0, 4.0, 4.0, 4.0]] + [[0.0, 0.0, 0.0, 0.0]] * 15
    decisions = run(loads, replicas=4)
    # the busy round at t=0 stays in the 10 s window until t=10; the first scale-down is at t=11
    assert replicas_over_time(decisions)[:11] == [4] * 11
    assert decisions[11].desired == 1
    assert decisions[11].direction is Direction.DOWN
    assert "waiting for 10s of low demand" in decisions[5].reason


def test_no_scale_down_before_the_history_covers_the_delay() -> None:
    # an operator that just (re)started has seen only quiet rounds: it still waits the full delay
    decisions = run([[0.0, 0.0, 0.0]] * 12, replicas=3)
    assert replicas_over_time(decisions) == [3] * 10 + [1, 1]


def test_scale_down_goes_to_the_peak_of_the_window() -> None:
    # 2 replicas' worth of load lingers for a while, then it is quiet: down to 2 first, then to 1
    loads = [[4.0] * 4] + [[2.0] * 4] * 5 + [[0.0] * 4] * 20
    counts = replicas_over_time(run(loads, replicas=4))
    assert counts[10] == 4
    assert counts[11] == 2
    assert counts[16] == 1
    assert sorted(set(counts), reverse=True) == [4, 2, 1]


def test_flapping_input_does_not_flap_the_output() -> None:
    # load alternates between 3 replicas' worth and nothing every 2 s for 40 s, then stops
    loads = [[12.0] if (t // 2) % 2 == 0 else [0.0] for t in range(40)] + [[0.0]] * 15
    counts = replicas_over_time(run(loads))
    assert counts[:40] == [3] * 40
    assert counts[-1] == 1
    changes = sum(1 for a, b in itertools.pairwise(counts) if a != b)
    assert changes == 1, counts


def test_unreadable_pods_block_scale_down() -> None:
    loads: list[list[float | None]] = [[0.0, None, 0.0]] * 30
    decisions = run(loads, replicas=3)
    assert replicas_over_time(decisions) == [3] * 30
    assert "pod-1" in decisions[-1].reason
    assert "unknown" in decisions[-1].reason


def test_a_pod_unreadable_once_delays_scale_down_by_the_window() -> None:
    loads: list[list[float | None]] = [[0.0, 0.0]] * 5 + [[0.0, None]] + [[0.0, 0.0]] * 12
    counts = replicas_over_time(run(loads, replicas=2))
    # quiet from t=0 would scale down at t=10; the unreadable round at t=5 stays in the window until t=15
    assert counts[:16] == [2] * 16
    assert counts[16] == 1


def test_unreadable_pods_do_not_hide_a_burst_on_the_others() -> None:
    decisions = run([[None, 11.0]], replicas=2)
    assert decisions[-1].desired == 3


def test_no_pod_readable_holds() -> None:
    decision = run([[None, None]], replicas=2)[-1]
    assert decision.desired == 2
    assert decision.direction is Direction.HOLD
    assert decision.metric_value is None


def test_max_replicas_caps_a_huge_burst() -> None:
    assert run([[1000.0]])[-1].desired == POLICY.max_replicas


def test_min_replicas_floors_scale_down() -> None:
    policy = ScalingPolicy(min_replicas=2, max_replicas=4, target=4.0, scale_down_delay_s=3.0)
    counts = replicas_over_time(run([[0.0] * 4] * 10, policy=policy, replicas=4))
    assert min(counts) == 2
    assert counts[-1] == 2


def test_counts_outside_min_max_are_brought_inside_at_once() -> None:
    policy = ScalingPolicy(min_replicas=2, max_replicas=3, target=4.0)
    below = decide([Observation(0.0, {"a": None})], 1, 0, policy, 0.0)
    above = decide([Observation(0.0, {"a": None})], 5, 0, policy, 0.0)
    assert (below.desired, below.direction) == (2, Direction.UP)
    assert (above.desired, above.direction) == (3, Direction.DOWN)
    assert "maxReplicas 3" in above.reason


def test_starting_replicas_block_further_scale_up() -> None:
    # the burst asks for 2, then grows to ask for 4 while the second replica is still starting (5 s)
    loads = [[5.0]] + [[9.0]] * 3 + [[9.0, 7.0]] * 4
    decisions = run(loads, ready_after_s=5)
    counts = replicas_over_time(decisions)
    assert counts[:5] == [2, 2, 2, 2, 2]
    assert "still starting" in decisions[1].reason
    assert counts[5] == 4  # the new replica is ready at t=5: the next scale-up goes through


def test_scale_up_stabilization_needs_sustained_load() -> None:
    policy = ScalingPolicy(
        min_replicas=1, max_replicas=4, target=4.0, scale_up_stabilization_s=3.0, scale_down_delay_s=10.0
    )
    # a one-round spike does not scale up; load sustained for 3 s does
    spike = replicas_over_time(run([[1.0]] * 5 + [[12.0]] + [[1.0]] * 5, policy=policy))
    assert max(spike) == 1
    sustained = replicas_over_time(run([[1.0]] * 5 + [[12.0]] * 5, policy=policy))
    assert sustained[7] == 1
    assert sustained[8] == 3


def test_metric_value_is_the_average_per_readable_pod() -> None:
    decision = decide([Observation(0.0, {"a": 3.0, "b": 5.0, "c": None})], 3, 0, POLICY, 0.0)
    assert decision.metric_value == pytest.approx(4.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_replicas": -1, "max_replicas": 2, "target": 1.0}, "min_replicas must be >= 0"),
        ({"min_replicas": 3, "max_replicas": 2, "target": 1.0}, "max_replicas (2) must be >= min"),
        ({"min_replicas": 1, "max_replicas": 2, "target": 0.0}, "target must be > 0"),
    ],
)
def test_policy_rejects_impossible_settings(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ScalingPolicy(**kwargs)  # type: ignore[arg-type]


rounds = st.lists(
    st.lists(st.one_of(st.none(), st.floats(min_value=0, max_value=100)), min_size=1, max_size=4),
    min_size=1,
    max_size=30,
)


@settings(max_examples=200, deadline=None)
@given(
    loads=rounds,
    replicas=st.integers(min_value=1, max_value=6),
    starting=st.integers(min_value=0, max_value=2),
    delay=st.integers(min_value=0, max_value=10),
)
def test_invariants_on_any_input(
    loads: list[list[float | None]], replicas: int, starting: int, delay: int
) -> None:
    policy = ScalingPolicy(min_replicas=2, max_replicas=5, target=4.0, scale_down_delay_s=float(delay))
    history = [Observation(float(t), {f"p{i}": v for i, v in enumerate(r)}) for t, r in enumerate(loads)]
    now = float(len(loads) - 1)
    decision = decide(history, replicas, starting, policy, now)
    assert policy.min_replicas <= decision.desired <= policy.max_replicas
    inside = policy.min_replicas <= replicas <= policy.max_replicas
    if inside and decision.desired < replicas:  # a scale-down saw only readable pods for the whole delay
        window = [o for o in history if o.time >= now - delay] or history[-1:]
        assert not any(o.unknown_pods for o in window)
        assert history[0].time <= now - delay
    if inside and decision.desired > replicas:  # a scale-up never happens while replicas are starting
        assert starting == 0


ZERO = ScalingPolicy(min_replicas=0, max_replicas=2, target=4.0, scale_down_delay_s=10.0)


def test_idle_scales_to_zero_after_the_delay_and_zero_replicas_hold() -> None:
    decisions = run([[0.0]] * 12 + [[]] * 5, policy=ZERO)
    assert replicas_over_time(decisions) == [1] * 10 + [0] * 7
    assert decisions[10].direction is Direction.DOWN
    # at zero there are no pods to read: the count holds (the router wakes it, not the metrics)
    assert all(d.direction is Direction.HOLD for d in decisions[11:])
