"""Forwarding one request: choose a replica, send the body as read, relay the answer chunk by chunk.

The body is read once and sent as is. The answer is relayed to the client's ASGI `send` as raw bytes the
moment they arrive (SSE events included), after the first chunk: until then nothing has reached the
client, so a replica that refuses the connection, drops it, or answers 503 is left for another one
(once). After the first chunk an upstream failure cuts the client's connection: the error passes
through, the stream is never spliced from two replicas.

The upstream client is aiohttp (C-accelerated HTTP/1.1 parsing, pooled keep-alive connections), chosen
for the hot path: per request it costs a fraction of what httpx does (see docs/router.md, "Measured").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import aiohttp
from starlette.types import Send

from inflight.openai_errors import APIError
from inflight.router.metrics import Decision, Outcome, RouterMetrics
from inflight.router.pool import ModelPool, Replica

log = logging.getLogger("inflight.router")

ATTEMPTS = 2  # the first replica, then one other
HOP_BY_HOP = frozenset(
    (b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer",
     b"transfer-encoding", b"upgrade", b"host", b"content-length", b"date", b"server")
)  # fmt: skip
# Idle upstream connections are closed before uvicorn's default keep-alive (5 s) closes them on the
# server side, so a request is never sent on a connection the replica is about to drop.
KEEPALIVE_S = 4.0
CONNECT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
# Before any byte reached the client, these leave the request for another replica.
RETRYABLE = (
    *CONNECT_ERRORS,
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientOSError,
    aiohttp.ClientPayloadError,
)


@dataclass(frozen=True)
class Policy:
    prefix_affinity: bool  # False: round robin
    epsilon: float


def upstream_session(connect_timeout_s: float) -> aiohttp.ClientSession:
    """The pooled client every forwarded request shares (create it inside the running event loop)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s),
        auto_decompress=False,  # the bytes pass through as the replica encoded them
        cookie_jar=aiohttp.DummyCookieJar(),
        skip_auto_headers=("Content-Type", "Accept-Encoding"),  # as the client sent them, or none
    )


def forwarded_headers(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The end-to-end headers (hop-by-hop ones dropped), as ASGI and aiohttp raw headers carry them."""
    return [(name, value) for name, value in headers if name.lower() not in HOP_BY_HOP]


async def forward(
    session: aiohttp.ClientSession,
    pool: ModelPool,
    path: str,
    body: bytes,
    headers: Iterable[tuple[bytes, bytes]],
    key: str | None,
    policy: Policy,
    metrics: RouterMetrics,
    send: Send,
) -> None:
    """Send to a replica of `pool` (failing over once) and relay its answer to `send`.

    APIError 502 when no replica could be reached (nothing was sent to the client then).
    """
    model = pool.model
    request_headers = [(name.decode("latin-1"), value.decode("latin-1")) for name, value in headers]
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
            upstream = lease.upstream = await session.post(
                f"{replica.url}{path}", data=body, headers=request_headers
            )
            if upstream.status == 503 and not last and len(pool.replicas) > len(tried):
                log.info("replica %s answered 503; trying another one", replica.id)
                lease.release()
                metrics.failovers.labels(model=model).inc()
                continue
            first = await upstream.content.readany()
        except RETRYABLE as error:
            lease.release()
            if isinstance(error, CONNECT_ERRORS):
                replica.healthy = False  # until a scrape reaches it again
            log.warning("replica %s failed before answering (%s); %s", replica.id, error,
                        "giving up" if last else "trying another one")  # fmt: skip
            if not last:
                metrics.failovers.labels(model=model).inc()
            continue
        except BaseException:
            lease.release()
            raise
        metrics.upstream_latency.labels(model=model).observe(time.perf_counter() - started)
        try:
            await _relay(lease, upstream, first, send, metrics, model)
        finally:
            lease.release()
        return
    metrics.requests.labels(model=model, outcome=Outcome.UNREACHABLE).inc()
    raise APIError(
        502, f"No replica of model {model!r} could be reached; retry shortly.", code="upstream_unreachable"
    )


class _Lease:
    """One request on one replica: counted in its in-flight load until released (once)."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self.upstream: aiohttp.ClientResponse | None = None
        self._released = False
        replica.in_flight += 1

    def release(self) -> None:
        """Ends the count; an upstream answer not read to its end closes its connection."""
        if not self._released:
            self._released = True
            self.replica.in_flight -= 1
        if self.upstream is not None:
            self.upstream.release()  # back to the pool when read to the end, else closed


async def _relay(
    lease: _Lease,
    upstream: aiohttp.ClientResponse,
    first: bytes,
    send: Send,
    metrics: RouterMetrics,
    model: str,
) -> None:
    status = upstream.status
    outcome = (
        Outcome.SUCCESS if status < 400 else Outcome.CLIENT_ERROR if status < 500 else Outcome.UPSTREAM_ERROR
    )
    try:
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": forwarded_headers(upstream.raw_headers),
            }
        )
        content = upstream.content
        chunk = first
        while chunk:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            chunk = await content.readany()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    except aiohttp.ClientError as error:
        outcome = Outcome.UPSTREAM_ERROR
        # Returning without the final body message makes the server cut the client's connection.
        log.warning(
            "replica %s failed mid-answer (%s); cutting the client's connection", lease.replica.id, error
        )
    finally:
        metrics.requests.labels(model=model, outcome=outcome).inc()
