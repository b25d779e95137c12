"""Forwarding one request: choose a replica, send the body as read, relay the answer chunk by chunk.

The body is read once and sent as is. The answer is relayed as raw bytes the moment they arrive (SSE
events included), after the first chunk: until then nothing has reached the client, so a replica that
refuses the connection, drops it, or answers 503 is left for another one (once). After the first chunk
an upstream failure cuts the client's connection: the error passes through, the stream is never
spliced from two replicas.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import httpx
from starlette.background import BackgroundTask
from starlette.responses import Response, StreamingResponse

from inflight.router.metrics import Decision, Outcome, RouterMetrics
from inflight.router.pool import ModelPool, Replica
from inflight.server.errors import APIError

log = logging.getLogger("inflight.router")

ATTEMPTS = 2  # the first replica, then one other
HOP_BY_HOP = frozenset(
    ("connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
     "transfer-encoding", "upgrade", "host", "content-length", "date", "server")
)  # fmt: skip
RETRYABLE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError)


@dataclass(frozen=True)
class Policy:
    prefix_affinity: bool  # False: round robin
    epsilon: float


def forwarded_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {name: value for name, value in headers.items() if name.lower() not in HOP_BY_HOP}


async def forward(
    client: httpx.AsyncClient,
    pool: ModelPool,
    path: str,
    body: bytes,
    headers: Mapping[str, str],
    key: str | None,
    policy: Policy,
    metrics: RouterMetrics,
) -> Response:
    """Send to a replica of `pool` (failing over once) and relay its answer."""
    model = pool.model
    tried: set[str] = set()
    for attempt in range(ATTEMPTS):
        last = attempt == ATTEMPTS - 1
        exclude = frozenset(tried)
        if policy.prefix_affinity:
            choice = pool.choose(key, policy.epsilon, exclude)
            decision = (
                Decision.LEAST_LOADED if key is None else Decision.AFFINITY if choice and choice.affinity
                else Decision.SPILL
            )  # fmt: skip
        else:
            choice, decision = pool.next_in_turn(exclude), Decision.ROUND_ROBIN
        if choice is None:
            break
        replica = pool.replicas[choice.replica]
        tried.add(replica.id)
        metrics.routing_decisions.labels(model=model, decision=decision).inc()
        lease = _Lease(replica)
        started = time.perf_counter()
        try:
            request = client.build_request("POST", f"{replica.url}{path}", content=body, headers=headers)
            upstream = lease.upstream = await client.send(request, stream=True)
            if upstream.status_code == 503 and not last and len(pool.replicas) > len(tried):
                log.info("replica %s answered 503; trying another one", replica.id)
                await lease.release()
                metrics.failovers.labels(model=model).inc()
                continue
            chunks = upstream.aiter_raw()
            first = await anext(chunks, b"")
        except RETRYABLE as error:
            await lease.release()
            if isinstance(error, httpx.ConnectError | httpx.ConnectTimeout):
                replica.healthy = False  # until a scrape reaches it again
            log.warning("replica %s failed before answering (%s); %s", replica.id, error,
                        "giving up" if last else "trying another one")  # fmt: skip
            if not last:
                metrics.failovers.labels(model=model).inc()
            continue
        except BaseException:
            await lease.release()
            raise
        metrics.upstream_latency.labels(model=model).observe(time.perf_counter() - started)
        return StreamingResponse(
            _relay(lease, upstream.status_code, first, chunks, metrics, model),
            status_code=upstream.status_code,
            headers=forwarded_headers(upstream.headers),
            background=BackgroundTask(lease.release),
        )
    metrics.requests.labels(model=model, outcome=Outcome.UNREACHABLE).inc()
    raise APIError(
        502, f"No replica of model {model!r} could be reached; retry shortly.", code="upstream_unreachable"
    )


class _Lease:
    """One request on one replica: counted in its in-flight load until released (once)."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self.upstream: httpx.Response | None = None
        self._released = False
        replica.in_flight += 1

    async def release(self) -> None:
        if not self._released:
            self._released = True
            self.replica.in_flight -= 1
        if self.upstream is not None:
            await self.upstream.aclose()


async def _relay(
    lease: _Lease,
    status: int,
    first: bytes,
    chunks: AsyncIterator[bytes],
    metrics: RouterMetrics,
    model: str,
) -> AsyncIterator[bytes]:
    outcome = (
        Outcome.SUCCESS if status < 400 else Outcome.CLIENT_ERROR if status < 500 else Outcome.UPSTREAM_ERROR
    )
    try:
        if first:
            yield first
        async for chunk in chunks:
            yield chunk
    except httpx.HTTPError as error:
        outcome = Outcome.UPSTREAM_ERROR
        log.warning(
            "replica %s failed mid-answer (%s); cutting the client's connection", lease.replica.id, error
        )
        raise
    finally:
        metrics.requests.labels(model=model, outcome=outcome).inc()
        await lease.release()
