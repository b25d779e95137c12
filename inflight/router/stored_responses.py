"""GET / DELETE /v1/responses/{id} through the router. A response is stored (in memory) on the replica
that answered it, and its id does not say which: the router asks each replica in turn until one has it.
No replica has it: the OpenAI 404 body, as a replica answers."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import aiohttp

from inflight.openai_errors import APIError, echoed
from inflight.router.pool import ModelPool
from inflight.router.proxy import forwarded_headers

STORED_RESPONSES_PREFIX = "/v1/responses/"
STORED_RESPONSE_METHODS = ("GET", "DELETE")


@dataclass(frozen=True)
class Answer:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


async def ask_replicas(
    session: aiohttp.ClientSession,
    pools: Mapping[str, ModelPool],
    method: str,
    path: str,
    headers: Iterable[tuple[bytes, bytes]],
) -> Answer:
    """The first answer other than 404 from any replica (an unreachable one is skipped)."""
    request_headers = [(name.decode("latin-1"), value.decode("latin-1")) for name, value in headers]
    for pool in list(pools.values()):
        for replica in list(pool.replicas.values()):
            try:
                async with session.request(
                    method, f"{replica.url}{path}", headers=request_headers
                ) as upstream:
                    body = await upstream.read()
            except aiohttp.ClientError:
                continue
            if upstream.status != 404:
                return Answer(upstream.status, forwarded_headers(upstream.raw_headers), body)
    response_id = path.removeprefix(STORED_RESPONSES_PREFIX)
    raise APIError(
        404,
        f"No response with id {echoed(response_id)} is stored on any replica (responses are kept in "
        "memory, per replica, for a bounded number of responses, and only with store: true).",
        param="response_id",
        code="response_not_found",
    )
