"""Every few seconds, each replica's `/metrics`: waiting requests and KV-cache use refine its load.

A replica that does not answer is marked unhealthy (passed over while others are usable) until a later
scrape succeeds; the proxy marks one unhealthy at once when a connection to it fails.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

import aiohttp

from inflight.operator.api.types import AutoscalingMetric
from inflight.operator.autoscaling.pod_metrics import MetricsFormatError, metric_value
from inflight.router.pool import ModelPool, Replica

log = logging.getLogger("inflight.router")


async def scrape_replica(session: aiohttp.ClientSession, replica: Replica, timeout_s: float) -> None:
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with session.get(f"{replica.url}/metrics", timeout=timeout, raise_for_status=True) as response:
            text = await response.text()
        replica.waiting = metric_value(text, AutoscalingMetric.QUEUE_DEPTH)
        replica.kv_usage = metric_value(text, AutoscalingMetric.KV_CACHE_USAGE)
    except (aiohttp.ClientError, TimeoutError, MetricsFormatError) as error:
        if replica.healthy:
            log.warning("replica %s (%s) is unhealthy: /metrics: %s", replica.id, replica.url, error)
        replica.healthy = False
        return
    if not replica.healthy:
        log.info("replica %s (%s) answers again", replica.id, replica.url)
    replica.healthy = True


async def scrape_forever(
    session: aiohttp.ClientSession, pools: Callable[[], Mapping[str, ModelPool]], interval_s: float
) -> None:
    while True:
        replicas = [r for pool in list(pools().values()) for r in list(pool.replicas.values())]
        await asyncio.gather(*(scrape_replica(session, r, min(interval_s, 5.0)) for r in replicas))
        await asyncio.sleep(interval_s)
