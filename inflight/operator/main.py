"""`inflight operator`: leader election, then kopf with the operator's handlers, until stopped or deposed."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kopf
from aiohttp import web

from inflight.operator.api.resources import EVENTS
from inflight.operator.builtin_autoscaler import BuiltinAutoscaling
from inflight.operator.controller import Controller
from inflight.operator.handlers import build_registry
from inflight.operator.kube import OPERATOR_USER_AGENT, KubeClient, event_body, rfc3339
from inflight.operator.leader import LeaderElector, default_identity
from inflight.operator.metrics import OperatorMetrics, serve_metrics

log = logging.getLogger("inflight.operator")

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


@dataclass(frozen=True)
class OperatorOptions:
    namespaces: tuple[str, ...] = ()  # empty: all namespaces
    leader_election: bool = True
    lease_namespace: str | None = None
    liveness: str | None = "http://0.0.0.0:8080/healthz"
    resync_seconds: float = 60.0
    autoscale_seconds: float = 15.0  # builtin autoscaling: scrape and decide this often
    scrape_timeout_seconds: float = 2.0  # a pod slower than this to answer /metrics counts as unknown
    metrics_address: str | None = "0.0.0.0:8081"  # host:port of the operator's own /metrics; None: off
    verbose: bool = False


def operator_namespace(explicit: str | None) -> str:
    """Where the Lease lives: --lease-namespace, $POD_NAMESPACE, the pod's own namespace, else default."""
    if explicit:
        return explicit
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    if SERVICE_ACCOUNT_NAMESPACE.exists():
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    return "default"


def operator_settings() -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    settings.scanning.disabled = (
        True  # no CRD/namespace scanning: fewer permissions, a fixed set of resources
    )
    settings.posting.level = logging.WARNING  # Events come from the controller's decisions, not from logs
    settings.posting.reporting_component = "inflight-operator"
    settings.watching.server_timeout = 300  # reconnect watches every 5 minutes
    settings.networking.request_timeout = 60
    return settings


def event_poster(client: KubeClient) -> Callable[[Mapping[str, Any], str, str, str], None]:
    """Events through kopf inside its handlers; elsewhere (the periodic resync, which kopf's poster does not
    serve: it raises LookupError there) created through the operator's own client in the background."""
    posting: set[asyncio.Task[Any]] = set()

    def post_event(body: Mapping[str, Any], type: str, reason: str, message: str) -> None:
        try:
            kopf.event(dict(body), type=type, reason=reason, message=message)  # type: ignore[arg-type]
        except LookupError:
            namespace = body.get("metadata", {}).get("namespace")
            event = event_body(body, type, reason, message, rfc3339(datetime.now(UTC)))
            task = asyncio.get_running_loop().create_task(client.create(EVENTS.path(namespace), event))
            posting.add(task)
            task.add_done_callback(posted)

    def posted(task: asyncio.Task[Any]) -> None:
        posting.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("could not post the Event: %s", task.exception())

    return post_event


async def serve_standby_health(url: str) -> web.AppRunner:
    """Answer the liveness URL while this replica waits for the Lease (kopf serves it once leading).

    Without it a standby replica fails its probes: kubelet restarts it, and a rolling update never
    completes because the new pod never becomes Ready behind the old leader.
    """
    parts = urllib.parse.urlsplit(url)

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"leader": False, "status": "standing by for the Lease"})

    app = web.Application()
    app.router.add_get(parts.path or "/", healthz)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, parts.hostname, parts.port or 80).start()
    return runner


async def run(
    options: OperatorOptions,
    client: KubeClient | None = None,
    stop_flag: asyncio.Event | threading.Event | None = None,
) -> int:
    """Run until `stop_flag` is set (0) or leadership is lost (1); a threading.Event works across threads."""
    metrics = OperatorMetrics()
    client = client or await KubeClient.from_environment(OPERATOR_USER_AGENT, on_error=metrics.api_error)
    stop_flag = stop_flag or asyncio.Event()
    controller = Controller(client, event_poster(client), metrics, options.scrape_timeout_seconds)
    metrics_server = None
    if options.metrics_address:
        host, _, port = options.metrics_address.rpartition(":")
        metrics_server = await serve_metrics(metrics, host.strip("[]") or "0.0.0.0", int(port))
    try:
        return await _lead_and_operate(options, client, controller, stop_flag)
    finally:
        await client.close()
        if metrics_server is not None:
            await metrics_server.cleanup()


async def _lead_and_operate(
    options: OperatorOptions,
    client: KubeClient,
    controller: Controller,
    stop_flag: asyncio.Event | threading.Event,
) -> int:
    elector = None
    if options.leader_election:
        elector = LeaderElector(client, operator_namespace(options.lease_namespace), default_identity())
        standby = await serve_standby_health(options.liveness) if options.liveness else None
        try:
            await elector.acquire()
        finally:
            if standby is not None:
                await standby.cleanup()  # frees the port for kopf's liveness endpoint
    operator = asyncio.create_task(
        kopf.operator(
            registry=build_registry(),
            settings=operator_settings(),
            standalone=True,  # the Lease, not kopf peering, keeps replicas from fighting
            clusterwide=not options.namespaces,
            namespaces=list(options.namespaces),
            memo=kopf.Memo(
                controller=controller,
                resync_seconds=options.resync_seconds,
                autoscaling=BuiltinAutoscaling(
                    controller.kube,
                    controller.metrics,
                    options.autoscale_seconds,
                    options.scrape_timeout_seconds,
                ),
            ),
            liveness_endpoint=options.liveness,
            stop_flag=stop_flag,
        )
    )
    if elector is None:
        await operator
        return 0
    holding = asyncio.create_task(elector.hold())
    done, _ = await asyncio.wait({operator, holding}, return_when=asyncio.FIRST_COMPLETED)
    if holding in done:
        stop_flag.set()
        await operator
        return 1
    holding.cancel()
    return 0


def run_operator(options: OperatorOptions) -> int:
    logging.basicConfig(
        level=logging.DEBUG if options.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return asyncio.run(run(options))
    except kopf.LoginError as error:
        log.error("%s", error)
        return 2
    except KeyboardInterrupt:
        return 0
