"""The builtin actuator's loop: every interval, each builtin-autoscaled ModelServer is scraped and decided.

One round per ModelServer: read its Deployment and pods, scrape the ready pods' ``/metrics`` (with a
timeout), decide, and record the decision in ``status.autoscaling``. ``desiredReplicas`` there is what the
operator's one replica-count function (``status.desired_replicas``) carries to the Deployment: the
status write is a ModelServer event, so a scale goes through the same reconcile as every other change
(with the periodic resync as the backstop). Scale-ups and scale-downs are also posted as
Events, through the API (kopf's ``kopf.event`` works only inside its handlers, not in this loop).
ModelServers without builtin autoscaling get their stale ``status.autoscaling`` removed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

import httpx
from pydantic import ValidationError

from inflight.operator import kube
from inflight.operator.api import resources
from inflight.operator.api.types import Actuator, ModelServer
from inflight.operator.autoscaling.actuator import AutoscalerState, autoscaling_status, evaluate, scaled
from inflight.operator.autoscaling.decision import Direction
from inflight.operator.children import server
from inflight.operator.metrics import OperatorMetrics
from inflight.operator.status import desired_replicas, woken

log = logging.getLogger("inflight.operator.autoscaling")


class BuiltinAutoscaling:
    """Scrapes, decides and records for every ModelServer whose ``spec.autoscaling.actuator`` is builtin."""

    def __init__(
        self,
        client: kube.KubeClient,
        metrics: OperatorMetrics,
        interval_s: float,
        scrape_timeout_s: float,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        self.kube = client
        self.metrics = metrics
        self.interval_s = interval_s
        self.scrape_timeout_s = scrape_timeout_s
        self.states: dict[tuple[str, str], AutoscalerState] = {}
        self.http = http or httpx.AsyncClient()

    async def run_forever(self) -> None:
        try:
            while True:
                await asyncio.sleep(self.interval_s)
                try:
                    await self.round()
                except Exception:  # the API may be briefly unreachable; the next round tries again
                    log.exception("autoscaling round failed")
        finally:
            await self.http.aclose()

    async def round(self) -> None:
        """One decision for each builtin-autoscaled ModelServer (concurrently)."""
        bodies = await self.kube.list(resources.MODELSERVERS.path())
        active: list[tuple[dict[str, Any], ModelServer]] = []
        for body in bodies:
            try:
                ms = ModelServer.model_validate(body)
            except ValidationError:
                continue  # the reconcile reports it as an outdated CRD
            autoscaling = ms.spec.autoscaling
            if autoscaling is not None and autoscaling.actuator is Actuator.BUILTIN:
                active.append((body, ms))
            elif ms.status.autoscaling is not None:
                await self._patch_status(ms, None)
        keys = {(ms.metadata.namespace, ms.metadata.name) for _, ms in active}
        for key in set(self.states) - keys:
            del self.states[key]
        results = await asyncio.gather(*(self.autoscale(*pair) for pair in active), return_exceptions=True)
        for (_, ms), result in zip(active, results, strict=True):
            if isinstance(result, Exception):
                log.error("autoscaling %s/%s failed: %s", ms.metadata.namespace, ms.metadata.name, result)

    async def autoscale(self, body: Mapping[str, Any], ms: ModelServer) -> None:
        autoscaling = ms.spec.autoscaling
        assert autoscaling is not None
        namespace, name = ms.metadata.namespace, ms.metadata.name
        deployment = await self.kube.get(resources.DEPLOYMENTS.path(namespace, name))
        if deployment is None:
            return  # not created yet (or the spec is Degraded): nothing to scale
        woken_from_zero = woken(ms) and desired_replicas(ms.spec, ms.status) == 0
        # what the reconcile holds the Deployment at (one replica at once when the router asked for it)
        replicas = desired_replicas(ms.spec, ms.status, woken(ms))
        pods = await kube.pods_of(self.kube, namespace, server.selector_labels(ms))
        state = self.states.get((namespace, name))
        if state is None:
            last = ms.status.autoscaling.last_scale_time if ms.status.autoscaling else None
            state = self.states[(namespace, name)] = AutoscalerState(last_scale_time=last)
        now = time.time()
        if woken_from_zero:
            # The rounds at zero replicas say nothing about demand: the scale-down delay starts now.
            state.history.clear()
            state.last_scale_time = kube.rfc3339(now)
            message = f"0 -> {replicas} replicas: a request is waiting in the router (scale from zero)"
            log.info("%s/%s: %s", namespace, name, message)
            event = kube.event_body(body, "Normal", "ScaledUp", message, state.last_scale_time)
            await self.kube.create(resources.EVENTS.path(namespace), event)
        decision = await evaluate(
            state,
            autoscaling,
            pods,
            server.SERVER_CONTAINER,
            replicas,
            ms.spec.startup_timeout_seconds,
            self.http,
            self.scrape_timeout_s,
            now,
        )
        changed = scaled(decision, replicas)
        self.metrics.autoscaling_decisions.labels(direction=decision.direction.value).inc()
        if changed:
            state.last_scale_time = kube.rfc3339(now)
            log.info(
                "%s/%s: %d -> %d replicas: %s", namespace, name, replicas, decision.desired, decision.reason
            )
            reason = "ScaledUp" if decision.direction is Direction.UP else "ScaledDown"
            message = f"{replicas} -> {decision.desired} replicas: {decision.reason}"
            event = kube.event_body(body, "Normal", reason, message, state.last_scale_time)
            await self.kube.create(resources.EVENTS.path(namespace), event)
        await self._patch_status(ms, autoscaling_status(decision, state.last_scale_time))

    async def _patch_status(self, ms: ModelServer, status: Mapping[str, Any] | None) -> None:
        current = ms.status.autoscaling.model_dump(by_alias=True) if ms.status.autoscaling else None
        if current == status:
            return
        path = resources.MODELSERVERS.path(ms.metadata.namespace, ms.metadata.name, "status")
        await self.kube.merge_patch(path, {"status": {"autoscaling": status}})
