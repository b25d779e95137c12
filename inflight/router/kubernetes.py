"""Kubernetes discovery: the namespace's ModelServers and their ready pods, watched through the API.

Two list-then-watch loops keep the pools current: ModelServers (served name, hold timeout, whether it
scales from zero) and the server pods (label `app.kubernetes.io/name=inflight-server`). A pod is a
replica while it is Ready, has an IP and is not being deleted: a pod that starts draining
(deletionTimestamp set, or Ready turning False) leaves its pool with that watch event. ModelServers
that share a served name share one pool.

Scale from zero: a request for a ModelServer with `autoscaling.minReplicas: 0` and no ready replica
sets the annotation `inflight.dev/wake-requested-at` on it (a merge patch; RBAC `patch` on
modelservers). The operator reads it and runs one replica (see `inflight.operator.status`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from pydantic import ValidationError

from inflight.operator import kube
from inflight.operator.api import resources
from inflight.operator.api.types import Actuator, ModelServer
from inflight.operator.autoscaling.pod_metrics import ready_pod_endpoints
from inflight.operator.children.server import LABEL_MODELSERVER, SERVER_CONTAINER, SERVER_POD_LABEL
from inflight.operator.status import WAKE_ANNOTATION, wake_requested_at
from inflight.router.app import Discovery, Router
from inflight.router.pool import ModelPool

log = logging.getLogger("inflight.router")

WAKE_INTERVAL_S = 10.0  # one wake request per ModelServer per this many seconds
RETRY_S = 1.0


@dataclass(frozen=True)
class Served:
    """What the router needs from one ModelServer."""

    name: str
    model: str
    hold_timeout_s: float
    scales_from_zero: bool


def served(body: dict[str, Any], default_hold_timeout_s: float) -> Served | None:
    try:
        ms = ModelServer.model_validate(body)
    except ValidationError:
        return None  # the operator reports it
    autoscaling = ms.spec.autoscaling
    timeout = default_hold_timeout_s if autoscaling is None else autoscaling.scale_from_zero_timeout_seconds
    zero = (
        autoscaling is not None and autoscaling.min_replicas == 0 and autoscaling.actuator is Actuator.BUILTIN
    )
    return Served(ms.metadata.name, ms.spec.model.name, float(timeout), zero)


class KubernetesDiscovery:
    def __init__(self, client: kube.KubeClient, namespace: str, default_hold_timeout_s: float) -> None:
        self.client = client
        self.namespace = namespace
        self.default_hold_timeout_s = default_hold_timeout_s
        self.modelservers: dict[str, Served] = {}
        self.pods: dict[str, tuple[str, str | None]] = {}  # pod -> (ModelServer, base URL when ready)
        self._woken_at: dict[str, float] = {}

    async def run(self, router: Router) -> None:
        listed = [asyncio.Event(), asyncio.Event()]

        async def when_listed() -> None:
            await asyncio.gather(*(event.wait() for event in listed))
            router.ready.set()

        def on_modelserver(kind: str, body: dict[str, Any]) -> None:
            name = body.get("metadata", {}).get("name", "")
            found = served(body, self.default_hold_timeout_s) if kind != "DELETED" else None
            if found is None:
                self.modelservers.pop(name, None)
            else:
                self.modelservers[name] = found
            self.apply(router)

        def on_pod(kind: str, body: dict[str, Any]) -> None:
            metadata = body.get("metadata", {})
            name, owner = metadata.get("name", ""), (metadata.get("labels") or {}).get(LABEL_MODELSERVER)
            if kind == "DELETED" or owner is None:
                self.pods.pop(name, None)
            else:
                endpoints = ready_pod_endpoints([body], SERVER_CONTAINER)
                self.pods[name] = (owner, endpoints[0].url if endpoints else None)
            self.apply(router)

        await asyncio.gather(
            when_listed(),
            self._informer(resources.MODELSERVERS.path(self.namespace), None, on_modelserver, listed[0]),
            self._informer(resources.PODS.path(self.namespace), SERVER_POD_LABEL, on_pod, listed[1]),
        )

    def apply(self, router: Router) -> None:
        """Rebuild the pools from what the watches last said."""
        models: dict[str, list[Served]] = {}
        for ms in self.modelservers.values():
            models.setdefault(ms.model, []).append(ms)
        for model in set(router.pools) - set(models):
            router.pools[model].set_replicas({})
            del router.pools[model]
        for model, owners in models.items():
            names = {ms.name for ms in owners}
            urls = {pod: url for pod, (owner, url) in self.pods.items() if owner in names and url is not None}
            pool = router.pools.get(model)
            waking = [ms.name for ms in owners if ms.scales_from_zero]
            if pool is None:
                pool = router.pools[model] = ModelPool(model, hold_timeout_s=0)
            pool.hold_timeout_s = max(ms.hold_timeout_s for ms in owners)
            pool.wake = self._waker(waking) if waking else None
            if urls != {rid: r.url for rid, r in pool.replicas.items()}:
                pool.set_replicas(urls)

    def _waker(self, names: list[str]) -> Callable[[], Awaitable[None]]:
        async def wake() -> None:
            for name in names:
                now = time.time()
                if now - self._woken_at.get(name, 0.0) < WAKE_INTERVAL_S:
                    continue
                self._woken_at[name] = now
                patch = {"metadata": {"annotations": {WAKE_ANNOTATION: wake_requested_at(now)}}}
                try:
                    await self.client.merge_patch(resources.MODELSERVERS.path(self.namespace, name), patch)
                    log.info("asked the operator for a replica of ModelServer %s/%s", self.namespace, name)
                except (kube.KubeError, aiohttp.ClientError, OSError, TimeoutError) as error:
                    log.warning("could not wake ModelServer %s/%s: %s", self.namespace, name, error)

        return wake

    async def _informer(
        self,
        path: str,
        selector: dict[str, str] | None,
        handle: Callable[[str, dict[str, Any]], None],
        listed: asyncio.Event,
    ) -> None:
        """List, then watch from the list's version; on any failure list again (after a pause)."""
        while True:
            try:
                items, version = await self.client.list_with_version(path, selector)
                seen = set()
                for item in items:
                    seen.add(item.get("metadata", {}).get("name"))
                    handle("ADDED", item)
                self._forget_unlisted(path, seen, handle)
                listed.set()
                while True:
                    async for event in self.client.watch(path, version, selector):
                        obj = event.get("object") or {}
                        version = obj.get("metadata", {}).get("resourceVersion", version)
                        if event.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                            handle(str(event["type"]), obj)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # API unreachable, 410 Gone, ...: start over from a fresh list
                log.warning("watch of %s failed (%s); listing again", path, error)
                await asyncio.sleep(RETRY_S)

    def _forget_unlisted(
        self, path: str, seen: set[Any], handle: Callable[[str, dict[str, Any]], None]
    ) -> None:
        known = self.pods if path.endswith("/pods") else self.modelservers
        for name in set(known) - seen:
            handle("DELETED", {"metadata": {"name": name}})


def kubernetes_discovery(namespace: str, default_hold_timeout_s: float) -> Discovery:
    async def discover(router: Router) -> None:
        client = await kube.KubeClient.from_environment(kube.ROUTER_USER_AGENT)
        try:
            await KubernetesDiscovery(client, namespace, default_hold_timeout_s).run(router)
        finally:
            await client.close()

    return discover
