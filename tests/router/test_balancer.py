"""Consistent hashing with bounded loads, the routing key, the pools and `--upstream` parsing (pure)."""

from __future__ import annotations

import math

import pytest

from inflight.router.balancer import HashRing, load_bound
from inflight.router.pool import ModelPool
from inflight.router.routing_key import routing_key
from inflight.router.static import parse_upstreams

REPLICAS = ["a", "b", "c"]


def test_a_key_keeps_its_replica_while_it_has_room() -> None:
    ring = HashRing(REPLICAS)
    owners = {ring.choose(f"conversation {i}", {}, 0.25).replica for i in range(200)}
    assert owners == set(REPLICAS)  # keys spread over all replicas
    for i in range(50):
        first = ring.choose(f"conversation {i}", {}, 0.25)
        assert first.affinity
        assert ring.choose(f"conversation {i}", {r: 1 for r in REPLICAS}, 0.25) == first


@pytest.mark.parametrize("epsilon", [0.0, 0.25, 1.0])
def test_one_hot_key_never_puts_more_than_the_bound_on_a_replica(epsilon: float) -> None:
    ring = HashRing(REPLICAS)
    loads = dict.fromkeys(REPLICAS, 0)
    spilled = 0
    for placed in range(60):
        choice = ring.choose("the same system prompt", loads, epsilon)
        loads[choice.replica] += 1
        spilled += not choice.affinity
        assert max(loads.values()) <= math.ceil((1 + epsilon) * (placed + 1) / len(REPLICAS))
    assert spilled > 0
    owner = ring.order("the same system prompt")[0]
    assert loads[owner] == max(loads.values())  # the key's own replica is filled to the bound first


def test_removing_a_replica_moves_only_its_keys() -> None:
    before, after = HashRing(REPLICAS), HashRing(["a", "b"])
    for i in range(300):
        key = f"prompt {i}"
        owner = before.choose(key, {}, 0.25).replica
        if owner != "c":
            assert after.choose(key, {}, 0.25).replica == owner


def test_load_bound_counts_the_new_request() -> None:
    assert load_bound(0, 3, 0.25) == 1
    assert load_bound(12, 3, 0.25) == math.ceil(1.25 * 13 / 3)


def test_chat_key_is_the_same_for_every_turn_of_a_conversation() -> None:
    turn1 = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    turn2 = {"messages": [*turn1["messages"], {"role": "assistant", "content": "hello"},
                          {"role": "user", "content": "more"}]}  # fmt: skip
    other = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "yo"}]}
    assert routing_key(turn1) == routing_key(turn2) == "system: be brief\nuser: hi"
    assert routing_key(other) != routing_key(turn1)
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert routing_key(parts) == "user: hi"


def test_completion_key_is_the_prompt_start() -> None:
    assert routing_key({"prompt": "x" * 5000}, max_chars=100) == "x" * 100
    assert routing_key({"prompt": ["first", "second"]}) == "first"
    assert routing_key({"prompt": [1, 2, 3]}) == "1 2 3"
    assert routing_key({"prompt": ""}) is None
    assert routing_key({}) is None


def test_pool_passes_over_unhealthy_and_full_replicas_while_others_are_usable() -> None:
    pool = ModelPool("m", hold_timeout_s=1)
    pool.set_replicas({"a": "http://a", "b": "http://b"})
    pool.replicas["a"].healthy = False
    assert {pool.choose(f"k{i}", 0.25).replica for i in range(30)} == {"b"}  # type: ignore[union-attr]
    pool.replicas["b"].kv_usage = 0.99
    assert pool.choose("k", 0.25) is not None  # nothing usable: all are candidates again
    assert pool.choose("k", 0.25, exclude=frozenset({"a", "b"})) is None
    kept = pool.replicas["b"]
    kept.in_flight = 3
    pool.set_replicas({"b": "http://b", "c": "http://c"})
    assert pool.replicas["b"] is kept and "a" not in pool.replicas


def test_round_robin_takes_turns() -> None:
    pool = ModelPool("m", hold_timeout_s=1)
    pool.set_replicas({"a": "http://a", "b": "http://b", "c": "http://c"})
    picks = [pool.next_in_turn().replica for _ in range(6)]  # type: ignore[union-attr]
    assert sorted(picks) == ["a", "a", "b", "b", "c", "c"]


def test_upstreams_parse_and_errors_say_what_is_expected() -> None:
    parsed = parse_upstreams(["m=http://h:1/", "m=http://h:2", "n=https://x", "m=http://h:1"])
    assert parsed == {"m": ["http://h:1", "http://h:2"], "n": ["https://x"]}
    for bad in ("http://h:1", "m=", "m=h:1", "=http://h"):
        with pytest.raises(ValueError, match="expected MODEL=URL"):
            parse_upstreams([bad])
