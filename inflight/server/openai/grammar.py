"""A request's grammar (response_format, guided_*), compiled before it is submitted: off the event loop,
within a time limit, and a 400 naming the field when the grammar library refuses it."""

from __future__ import annotations

import asyncio

from inflight.engine.errors import GrammarError
from inflight.engine.sequence import GuidedDecoding
from inflight.openai_errors import bad_request
from inflight.server.context import ServerContext
from inflight.server.openai.protocol import SamplingFields

# Seconds a grammar may take to compile before the request is refused (llguidance's own limits bound the
# work; this bounds the wait). The compile goes on in its thread and lands in the cache.
COMPILE_TIMEOUT_S = 10.0


async def check_grammar(ctx: ServerContext, field: str, guided: GuidedDecoding) -> float:
    """Compile `guided` (asked for by the request field `field`) into the engine's grammar cache; the
    seconds it took (counted and timed in the metrics). 400 naming `field` when it cannot be used or does
    not compile in time."""
    ctx.metrics.constrained_requests.labels(field=field).inc()
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        await asyncio.wait_for(ctx.off_loop(ctx.engine.compile_grammar, guided), COMPILE_TIMEOUT_S)
    except GrammarError as error:
        raise bad_request(f"{field}: this {guided.kind} cannot be used: {error}", param=field) from error
    except TimeoutError as error:
        raise bad_request(
            f"{field}: the {guided.kind} did not compile within {COMPILE_TIMEOUT_S:g} s; simplify it.",
            param=field,
        ) from error
    elapsed = loop.time() - start
    ctx.metrics.grammar_compile_time.observe(elapsed)
    return elapsed


async def check_request_grammar(ctx: ServerContext, body: SamplingFields) -> None:
    """The grammar a request's response_format / guided_* field asks for, if any (check_sampling made sure
    there is at most one)."""
    for field, guided in body.guided_requests():
        await check_grammar(ctx, field, guided)
