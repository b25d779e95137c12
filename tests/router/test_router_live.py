"""The router in front of three real `inflight serve` processes (tiny model, shared by the module).

Prefix affinity against round robin on a multi-turn chat workload, the load bound with one shared
prefix, streaming through the router equal to streaming direct, OpenAI errors, and failover when a
replica is killed mid-run (last: it takes a server away).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from inflight.router.app import RouterSettings
from inflight.router.balancer import HashRing
from inflight.router.routing_key import routing_key
from inflight.router.static import static_discovery
from inflight.router.workload import FIRST_WORDS, opening, run_conversations

from support.router_harness import MODEL, LiveRouter, ServerProcess, start_router

pytestmark = pytest.mark.timeout(240)

EPSILON = 0.25


@pytest.fixture(scope="module")
def router(servers: list[ServerProcess]) -> Iterator[LiveRouter]:
    live = start_router(
        static_discovery({MODEL: [s.url for s in servers]}, 5.0),
        RouterSettings(epsilon=EPSILON, scrape_interval_s=0.5),
    )
    yield live
    live.stop()


@pytest.fixture
def unscraped_router(servers: list[ServerProcess]) -> Iterator[LiveRouter]:
    """A router that never refines loads with the replicas' /metrics (scraped once at start): its choices
    then follow the policy and its own in-flight counts alone, not the replicas' queues, which depend on
    how fast this machine is (and on what earlier tests left running)."""
    live = start_router(
        static_discovery({MODEL: [s.url for s in servers]}, 5.0),
        RouterSettings(epsilon=EPSILON, scrape_interval_s=3600),
    )
    yield live
    live.stop()


def prefix_hits(servers: list[ServerProcess]) -> float:
    return sum(s.metric("inflight:prefix_cache_hits_total") for s in servers)


def test_models_and_openai_errors(router: LiveRouter) -> None:
    assert httpx.get(f"{router.url}/v1/models").json()["data"] == [
        {"id": MODEL, "object": "model", "created": 0, "owned_by": "inflight"}
    ]
    response = httpx.post(f"{router.url}/v1/completions", json={"model": "nope", "prompt": "x"})
    assert response.status_code == 404
    assert response.json() == {"error": {"message": "The model 'nope' does not exist; see /v1/models.",
                                         "type": "not_found_error", "param": "model",
                                         "code": "model_not_found"}}  # fmt: skip
    assert httpx.get(f"{router.url}/v1/models/nope").status_code == 404
    huge = httpx.post(f"{router.url}/v1/completions", json={"model": "m" * 1_000_000, "prompt": "x"}).json()
    assert len(huge["error"]["message"]) < 300 and "(1000000 characters)" in huge["error"]["message"]
    missing = httpx.post(f"{router.url}/v1/completions", json={"prompt": "x"})
    assert missing.status_code == 400 and missing.json()["error"]["code"] == "missing_model"
    bad = httpx.post(f"{router.url}/v1/completions", content=b"{not json")
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
    # the upstream's own validation errors pass through unchanged
    invalid = httpx.post(
        f"{router.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1}
    )
    assert invalid.status_code == 400 and invalid.json()["error"]["param"] == "max_tokens"
    assert (
        router.metric("inflight_router:requests_total", 'model="",outcome="unknown_model"') == 2
    )  # nope, m...


def test_servers_export_prefix_cache_counters_in_tokens(servers: list[ServerProcess]) -> None:
    server = servers[0]
    body = {"model": MODEL, "prompt": "prefix cache counter check " * 8, "max_tokens": 1}
    before_queries = server.metric("inflight:prefix_cache_queries_total")
    before_hits = server.metric("inflight:prefix_cache_hits_total")
    prompt_tokens = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["usage"][
        "prompt_tokens"
    ]
    full_blocks = (prompt_tokens - 1) // 16 * 16  # only full blocks are looked up; the last token never
    assert server.metric("inflight:prefix_cache_queries_total") - before_queries == full_blocks
    assert server.metric("inflight:prefix_cache_hits_total") - before_hits == 0
    httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert server.metric("inflight:prefix_cache_queries_total") - before_queries == 2 * full_blocks
    assert server.metric("inflight:prefix_cache_hits_total") - before_hits == full_blocks


def sse_events(url: str, path: str, body: dict[str, Any]) -> list[Any]:
    """The stream's events, ids and timestamps dropped (they differ per request)."""
    events: list[Any] = []
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                events.append("[DONE]")
                continue
            event = json.loads(line[6:])
            event.pop("id"), event.pop("created")
            events.append(event)
    return events


def stream_summary(events: list[Any]) -> dict[str, Any]:
    """What a stream says, independent of how the server grouped tokens into events (a reader that lags
    gets several steps' tokens in one event): per choice its role, text and finish reason, plus usage."""
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    for event in events[:-1]:
        usage = event.get("usage") or usage
        for choice in event["choices"]:
            seen = choices.setdefault(choice["index"], {"role": None, "text": "", "finish_reason": None})
            delta = choice.get("delta", {})
            seen["role"] = delta.get("role") or seen["role"]
            seen["text"] += choice.get("text") or delta.get("content") or ""
            seen["finish_reason"] = choice.get("finish_reason") or seen["finish_reason"]
    kinds = {event["object"] for event in events[:-1]}
    return {"choices": choices, "usage": usage, "object": kinds, "end": events[-1]}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streaming_through_the_router_equals_streaming_direct(
    router: LiveRouter, servers: list[ServerProcess], path: str
) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 12, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}}  # fmt: skip
    if path == "/v1/completions":
        body["prompt"] = "def fibonacci(n):"
    else:
        body["messages"] = [{"role": "user", "content": "Write a haiku about caches."}]
    through = sse_events(router.url, path, body)
    direct = sse_events(servers[0].url, path, body)
    assert stream_summary(through) == stream_summary(direct)
    assert stream_summary(through)["choices"][0]["text"]
    assert through[-1] == "[DONE]" and through[-2]["usage"]["completion_tokens"] == 12


TOOL = {
    "type": "function",
    "function": {
        "name": "pick",
        "parameters": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                       "required": ["n"], "additionalProperties": False},
    },
}  # fmt: skip


PER_REQUEST = r'"(id|call_id|created|created_at)": ?("[^"]*"|[0-9.]+)'  # differ per request
TEXT_KEYS = ("content", "arguments", "delta", "text", "name", "finish_reason", "status")


def stream_text(url: str, path: str, body: dict[str, Any]) -> str:
    """What a stream says, whatever its chunking (chunks merge steps when the reader falls behind): its
    text-bearing fields in order, concatenated."""
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=60) as response:
        assert response.status_code == 200
        payloads = [line[6:] for line in response.iter_lines() if line.startswith("data: {")]
    pieces: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                if key in TEXT_KEYS and isinstance(item, str):
                    pieces.append(item)
                else:
                    walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    for payload in payloads:
        walk(json.loads(payload))
    return "".join(pieces)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "JSON please"}],
                                  "response_format": {"type": "json_schema", "json_schema": {
                                      "name": "n", "schema": TOOL["function"]["parameters"]}}}),  # type: ignore[index]
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Pick"}], "tools": [TOOL],
                                  "tool_choice": {"type": "function", "function": {"name": "pick"}}}),
        ("/v1/responses", {"input": "Say hi", "instructions": "Be brief."}),
        ("/v1/responses", {"input": "Pick", "tools": [{"type": "function", **TOOL["function"]}],  # type: ignore[dict-item]
                           "tool_choice": "required"}),
    ],
    ids=["response_format", "tool_choice", "responses", "responses-tools"],
)  # fmt: skip
def test_structured_output_tools_and_responses_pass_through_unchanged(
    router: LiveRouter, servers: list[ServerProcess], path: str, body: dict[str, Any]
) -> None:
    limit = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
    body = {"model": MODEL, "temperature": 0, limit: 40, **body}
    for stream in (False, True):
        request = {**body, "stream": stream}
        if stream:
            assert stream_text(router.url, path, request) == stream_text(servers[0].url, path, request)
            continue
        through = httpx.post(f"{router.url}{path}", json=request, timeout=60)
        direct = httpx.post(f"{servers[0].url}{path}", json=request, timeout=60)
        assert through.status_code == direct.status_code == 200, through.text
        assert re.sub(PER_REQUEST, "", through.text) == re.sub(PER_REQUEST, "", direct.text)


def test_stored_responses_are_fetched_and_deleted_through_the_router(
    router: LiveRouter, servers: list[ServerProcess]
) -> None:
    """Each replica keeps its own responses: the router finds the one that has it."""
    body = {"model": MODEL, "input": "Say hi", "max_output_tokens": 4}
    for server in servers:
        answered = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60).json()
        url = f"{router.url}/v1/responses/{answered['id']}"
        assert httpx.get(url, timeout=60).json() == answered
        deleted = httpx.delete(url, timeout=60)
        assert deleted.status_code == 200 and deleted.json()["deleted"] is True
        for method in ("GET", "DELETE"):
            missing = httpx.request(method, url, timeout=60)
            assert missing.status_code == 404
            assert missing.json()["error"]["code"] == "response_not_found"


def evenly_hashed_seed(urls: list[str], conversations: int, avoid: int) -> int:
    """The first workload seed (not `avoid`) whose conversations the hash ring spreads over the replicas as
    evenly as they divide. The replicas' ports are random, so the ring differs per run: on an uneven one
    (11 to 20 of 32 conversations on one replica) the busiest replica's conversations outgrow its KV pool
    and evict each other's prefixes (49,500 hits at 7/11/14 vs 61,600 at 10/11/11), which measures the
    hash's luck rather than the policy; the load bound has its own test below."""
    ring = HashRing(sorted(urls))
    fair = -(-conversations // len(urls))
    for seed in range(1, 10_000):
        owners = [
            ring.order(routing_key({"messages": [opening(seed, i, FIRST_WORDS)[0]]}) or "")[0]
            for i in range(conversations)
        ]
        if seed != avoid and max(owners.count(url) for url in urls) <= fair:
            return seed
    raise AssertionError("no seed spreads the conversations evenly")


def test_prefix_affinity_nearly_doubles_prefix_cache_hits_over_round_robin(
    servers: list[ServerProcess],
) -> None:
    conversations, turns = 32, 6
    discovery = static_discovery({MODEL: [s.url for s in servers]}, 5.0)
    round_robin = start_router(discovery, RouterSettings(prefix_affinity=False))
    try:
        before = prefix_hits(servers)
        # different seeds: neither run finds the other's conversations in the caches
        asyncio.run(run_conversations(round_robin.url, MODEL, conversations, turns, seed=1))
        round_robin_hits = prefix_hits(servers) - before
    finally:
        round_robin.stop()
    # Affinity alone: with epsilon = replicas - 1 the load bound is the whole load plus one, never reached,
    # so no turn spills off its replica because of how the turns happened to overlap in time on this
    # machine (spills cost 1.7-1.9x instead of 2x+ under load; the bound has its own test below). Replica
    # loads from the router's own in-flight counts, never scraped.
    affinity = start_router(discovery, RouterSettings(epsilon=len(servers) - 1.0, scrape_interval_s=3600))
    try:
        before = prefix_hits(servers)
        seed = evenly_hashed_seed([s.url for s in servers], conversations, avoid=1)
        asyncio.run(run_conversations(affinity.url, MODEL, conversations, turns, seed=seed))
        affinity_hits = prefix_hits(servers) - before
        decisions = affinity.metric(
            "inflight_router:routing_decisions_total", f'decision="affinity",model="{MODEL}"'
        )
    finally:
        affinity.stop()
    # Round robin's hits depend on how the turns interleave (18,000-23,000 tokens in nine runs; affinity
    # 61,600 on an evenly spread ring, 4 December): 1.8x leaves room for its lucky runs, not for affinity
    # failing.
    assert affinity_hits >= 1.8 * round_robin_hits, (affinity_hits, round_robin_hits)
    assert decisions > 0


def test_one_shared_prefix_is_spread_within_the_load_bound(unscraped_router: LiveRouter) -> None:
    router = unscraped_router
    concurrent = 12
    bound = math.ceil((1 + EPSILON) * concurrent / 3)
    body = {"model": MODEL, "prompt": "one system prompt for everybody", "max_tokens": 600,
            "ignore_eos": True, "stream": True}  # fmt: skip
    pool = router.router.pools[MODEL]
    seen: list[dict[str, int]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.append({rid: r.in_flight for rid, r in list(pool.replicas.items())})
            time.sleep(0.005)

    async def send_all() -> None:
        async with httpx.AsyncClient(timeout=120) as client:

            async def one() -> None:
                async with client.stream("POST", f"{router.url}/v1/completions", json=body) as response:
                    assert response.status_code == 200
                    async for _ in response.aiter_bytes():
                        pass

            await asyncio.gather(*(one() for _ in range(concurrent)))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        asyncio.run(send_all())
    finally:
        done.set()
        watcher.join()
    assert max(max(sample.values()) for sample in seen) <= bound
    assert any(sum(sample.values()) == concurrent for sample in seen), "the requests never overlapped"
    full = next(sample for sample in seen if sum(sample.values()) == concurrent)
    assert max(full.values()) == bound  # the prefix's own replica took its share, the rest spilled


def test_a_client_that_leaves_mid_stream_aborts_the_generation_on_the_replica(
    router: LiveRouter, servers: list[ServerProcess]
) -> None:
    def total(name: str) -> float:
        return sum(s.metric(name) for s in servers)

    generated = total("inflight:generation_tokens_total")
    body = {"model": MODEL, "prompt": "a long story:", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=60) as response:
        next(line for line in response.iter_lines() if line.startswith("data: "))
    # the client left after its first event: the router closes the upstream request, the replica aborts
    deadline = time.monotonic() + 60
    while total("inflight:num_requests_running") > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert total("inflight:num_requests_running") == 0
    assert total("inflight:generation_tokens_total") - generated < 1000  # stopped long before the end
    pool = router.router.pools[MODEL]
    assert sum(r.in_flight for r in pool.replicas.values()) == 0


def test_a_replica_killed_mid_run_costs_no_request_that_had_not_started(
    unscraped_router: LiveRouter, servers: list[ServerProcess]
) -> None:
    """Non-streaming requests from several clients; one replica is killed while they run. The router does
    not scrape the replicas, so it learns of the death from the requests it sends there (a failover each)
    and not, depending on this machine's speed, from a scrape before any request was routed there."""
    router = unscraped_router
    victim = servers[2]
    statuses: list[int] = []
    before = router.metric("inflight_router:failovers_total", f'model="{MODEL}"')

    async def clients() -> None:
        async with httpx.AsyncClient(timeout=120) as client:

            async def loop(k: int) -> None:
                for i in range(8):
                    body = {"model": MODEL, "prompt": f"client {k} request {i}: " + "word " * 20,
                            "max_tokens": 64, "ignore_eos": True}  # fmt: skip
                    response = await client.post(f"{router.url}/v1/completions", json=body)
                    statuses.append(response.status_code)
                    if k == 0 and i == 2:
                        victim.process.send_signal(signal.SIGKILL)

            await asyncio.gather(*(loop(k) for k in range(6)))

    asyncio.run(clients())
    victim.process.wait(10)
    assert statuses == [200] * 48
    assert router.metric("inflight_router:failovers_total", f'model="{MODEL}"') > before
