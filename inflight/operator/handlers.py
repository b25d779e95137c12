"""Kopf handlers (thin): every trigger hands over to the Controller, which does the work.

Only `on.event` handlers are used: they need no finalizers and no annotations on the ModelServer, so the
operator never writes to a ModelServer except its `status`, and deleting a ModelServer never waits for the
operator. The periodic resync (a task started at startup) repairs drift that no event reported and
re-checks specs that were Degraded (e.g. a Secret created later), without a retry storm.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import kopf

from inflight.operator import kube
from inflight.operator.api import types
from inflight.operator.children import server
from inflight.operator.controller import Controller
from inflight.operator.model_cache import LABEL_CACHE

log = logging.getLogger("inflight.operator")

CHILD_LABELS: dict[str, Any] = {
    "app.kubernetes.io/managed-by": server.MANAGED_BY,
    server.LABEL_MODELSERVER: kopf.PRESENT,
}
SERVER_POD_LABELS: dict[str, Any] = {**CHILD_LABELS, **server.SERVER_POD_LABEL}


async def resync_forever(controller: Controller, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            await controller.resync()
        except Exception:  # the API may be briefly unreachable; the next round tries again
            log.exception("resync failed")


def build_registry() -> kopf.OperatorRegistry:
    """The operator's handlers, in a registry of their own (tests run several operators in one process)."""
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kube.login()  # the same credentials as the controller's own client

    @kopf.on.startup(registry=registry)
    async def start_loops(memo: kopf.Memo, **_: Any) -> None:
        memo.resync_task = asyncio.create_task(resync_forever(memo.controller, memo.resync_seconds))
        memo.autoscaling_task = asyncio.create_task(memo.autoscaling.run_forever())

    @kopf.on.cleanup(registry=registry)
    async def stop(memo: kopf.Memo, **_: Any) -> None:
        memo.resync_task.cancel()
        memo.autoscaling_task.cancel()
        await memo.controller.close()

    @kopf.on.event(types.GROUP, types.VERSION, types.PLURAL, registry=registry)
    async def modelserver_changed(type: str, name: str, namespace: str | None, memo: Any, **_: Any) -> None:
        if type == "DELETED":
            memo.controller.forget(namespace or "", name)
            return
        await memo.controller.reconcile(namespace or "", name)

    # A child's creation (ADDED, or listed at start: type None) needs no reconcile: whoever created it
    # reconciled already, and the ModelServer's own events and the resync cover the rest. A change to or
    # the deletion of a child is drift: reconcile its ModelServer at once. (ScaledObjects are not watched:
    # KEDA may not be installed; the resync repairs their drift.)
    async def child_changed(
        type: str | None, labels: Mapping[str, str], namespace: str | None, memo: Any, **_: Any
    ) -> None:
        if type in ("MODIFIED", "DELETED"):
            await memo.controller.reconcile(namespace or "", labels[server.LABEL_MODELSERVER])

    for group, version, plural in (
        ("apps", "v1", "deployments"),
        ("", "v1", "services"),
        ("autoscaling", "v2", "horizontalpodautoscalers"),
    ):
        kopf.on.event(group, version, plural, labels=CHILD_LABELS, registry=registry)(child_changed)

    # A server pod that turns ready or unready, restarts or goes away changes the ModelServer's readiness
    # and what its replicas measure (SizingDrift): reconcile at once, not at the next resync.
    @kopf.on.event("", "v1", "pods", labels=SERVER_POD_LABELS, registry=registry)
    async def server_pod_changed(
        type: str | None, labels: Mapping[str, str], namespace: str | None, memo: Any, **_: Any
    ) -> None:
        if type in ("MODIFIED", "DELETED"):
            await memo.controller.reconcile(namespace or "", labels[server.LABEL_MODELSERVER])

    # A download Job is shared by the ModelServers of one model source: a change (it succeeded, failed)
    # reconciles all of them, so their Deployments start at once.
    @kopf.on.event(
        "batch",
        "v1",
        "jobs",
        labels={"app.kubernetes.io/managed-by": server.MANAGED_BY, LABEL_CACHE: kopf.PRESENT},
        registry=registry,
    )
    async def download_job_changed(
        type: str | None, labels: Mapping[str, str], namespace: str | None, memo: Any, **_: Any
    ) -> None:
        if type in ("MODIFIED", "DELETED"):
            await memo.controller.reconcile_cache_users(namespace or "", labels[LABEL_CACHE])

    return registry
