"""The reconcile loop of one ModelServer: read, size, write children, write status (level-based).

Every trigger (a ModelServer event, an event of one of its children, the periodic resync) runs the same
idempotent `reconcile`: it reads the ModelServer, the nodes' GPU labels, the Secrets it references and the
live children, then creates what is missing, merge-patches what drifted, and merge-patches `status` when
it changed. It never writes `spec` and never PUTs; the children carry owner references, so the garbage
collector removes them with the ModelServer. The deletions: an HPA or ScaledObject of an actuator no
longer in use (it would be a second writer of replicas), and a model cache's claim and Job whose last
ModelServer moved to another source, revision or cache. With a model cache the Deployment is created or
changed only after the cache's download Job succeeded. Reconciles of one ModelServer never overlap.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import httpx
from pydantic import ValidationError

from inflight.operator import kube
from inflight.operator.api import resources
from inflight.operator.api.types import HFTokenSecretRef, ModelServer, SecretKeyRef
from inflight.operator.autoscaling.pod_metrics import PodSizing, ready_pod_endpoints, scrape_sizing
from inflight.operator.children import server
from inflight.operator.children.autoscalers import autoscaler_object
from inflight.operator.children.cache import cache_selector, claim, download_job
from inflight.operator.metrics import OperatorMetrics
from inflight.operator.model_cache import (
    DOWNLOAD_CONTAINER,
    JOB_POD_LABEL,
    LABEL_CACHE,
    Cache,
    Download,
    cache_of,
    download_state,
    newest_pod,
)
from inflight.operator.placement import Placement, SizingError, place
from inflight.operator.status import (
    Observed,
    Problem,
    build_status,
    condition_of,
    desired_replicas,
    not_fitting,
    status_patch,
    woken,
)
from inflight.operator.target import decide

log = logging.getLogger("inflight.operator")

# (body, type, reason, message) -> None; kopf.event in the operator.
EventPoster = Callable[[Mapping[str, Any], str, str, str], None]

NODE_CACHE_SECONDS = 10.0
DOWNLOAD_LOG_LINES = 20


def child_patch(desired: Mapping[str, Any], live: Mapping[str, Any]) -> dict[str, Any]:
    """Merge patch making `live` carry `desired`: our fields replaced, removed nodeSelector keys nulled."""
    patch: dict[str, Any] = {"metadata": {k: desired["metadata"][k] for k in ("labels", "ownerReferences")}}
    patch["spec"] = dict(desired["spec"])
    live_pod = live.get("spec", {}).get("template", {}).get("spec", {})
    if "template" in desired["spec"] and live_pod.get("nodeSelector"):
        wanted = desired["spec"]["template"]["spec"].get("nodeSelector") or {}
        removed = {key: None for key in live_pod["nodeSelector"] if key not in wanted}
        if removed:
            template = dict(desired["spec"]["template"])
            template["spec"] = {**template["spec"], "nodeSelector": {**wanted, **removed}}
            patch["spec"]["template"] = template
    return patch


class Controller:
    """Reconciles ModelServers through a KubeClient; posts Kubernetes Events through `post_event`.

    It also reads what each ready replica of the current template runs with from its /metrics (once per
    pod: a pod's pool never changes) and records every outcome in `metrics`.
    """

    # While a model downloads, reconcile this often to refresh status.modelCache's bytes.
    download_poll_seconds = 10.0

    def __init__(
        self,
        client: kube.KubeClient,
        post_event: EventPoster,
        metrics: OperatorMetrics | None = None,
        scrape_timeout_s: float = 2.0,
    ) -> None:
        self.kube = client
        self.post_event = post_event
        self.metrics = metrics or OperatorMetrics()
        self.scrape_timeout_s = scrape_timeout_s
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._nodes: tuple[float, list[dict[str, str]]] | None = None
        self._measured: dict[tuple[str, str], dict[str, tuple[str, PodSizing]]] = {}  # pod -> (uid, sizing)
        self._http: httpx.AsyncClient | None = None
        self._download_polls: dict[tuple[str, str], asyncio.Task[None]] = {}  # pending, by ModelServer
        self._poll_tasks: set[asyncio.Task[None]] = set()  # every poll not finished, reconciling ones too

    def forget(self, namespace: str, name: str) -> None:
        self._locks.pop((namespace, name), None)
        self._measured.pop((namespace, name), None)
        self.metrics.forget(namespace, name)

    async def close(self) -> None:
        await self.stop_download_polls()
        if self._http is not None:
            await self._http.aclose()
        await self.kube.close()

    async def resync(self) -> None:
        """Reconcile every ModelServer once (repairs drift no watch event reported)."""
        for body in await self.kube.list(resources.MODELSERVERS.path()):
            meta = body.get("metadata", {})
            try:
                await self.reconcile(meta.get("namespace", "default"), meta["name"])
            except Exception:  # one broken object must not stop the others
                log.exception("resync of %s/%s failed", meta.get("namespace"), meta.get("name"))

    async def reconcile(self, namespace: str, name: str) -> None:
        """Reconcile the ModelServer `namespace/name` as it is now (read fresh: triggers may be stale)."""
        key = (namespace, name)
        async with self._locks.setdefault(key, asyncio.Lock()):
            started = time.perf_counter()
            try:
                result = await self._read_and_reconcile(namespace, name)
            except Exception:
                self.metrics.reconciles.labels(result="error").inc()
                raise
            finally:
                self.metrics.reconcile_duration.observe(time.perf_counter() - started)
            if result is not None:
                self.metrics.reconciles.labels(result=result).inc()

    async def _read_and_reconcile(self, namespace: str, name: str) -> str | None:
        body = await self.kube.get(resources.MODELSERVERS.path(namespace, name))
        if body is None or body.get("metadata", {}).get("deletionTimestamp"):
            self.metrics.forget(namespace, name)
            return None
        return await self._reconcile(body)

    async def reconcile_cache_users(self, namespace: str, key: str) -> None:
        """Reconcile the ModelServers whose model cache is `key` (its download Job changed)."""
        for body in await self.kube.list(resources.MODELSERVERS.path(namespace)):
            try:
                cache = cache_of(ModelServer.model_validate(body))
            except ValidationError:
                continue
            if cache is not None and cache.key == key:
                await self.reconcile(namespace, body["metadata"]["name"])

    def _poll_download(self, namespace: str, name: str) -> None:
        """Reconcile again in download_poll_seconds (once: a poll already pending is kept)."""
        key = (namespace, name)
        if key in self._download_polls:
            return

        async def later() -> None:
            await asyncio.sleep(self.download_poll_seconds)
            del self._download_polls[key]  # from here on, the reconcile may schedule the next poll
            try:
                await self.reconcile(namespace, name)
            except Exception:  # the API may be briefly unreachable; the resync tries again
                log.exception("download poll of %s/%s failed", namespace, name)

        task = asyncio.create_task(later())
        self._download_polls[key] = task
        self._poll_tasks.add(task)
        task.add_done_callback(self._poll_tasks.discard)

    async def stop_download_polls(self) -> None:
        """Cancel every poll, pending or reconciling, and wait until they are gone (before the client
        they use is closed)."""
        tasks = list(self._poll_tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._download_polls.clear()

    async def _read_or_create(
        self, resource: resources.Resource, namespace: str, path: str, desired: dict[str, Any]
    ) -> tuple[dict[str, Any], bool]:
        """The live object at `path`, created from `desired` when there is none, and whether this call
        created it. A 409 (another writer created it first) reads it again."""
        live = await self.kube.get(path)
        if live is not None:
            return live, False
        try:
            created = await self.kube.create(resource.path(namespace), desired)
        except kube.KubeError as error:
            if error.status != 409:
                raise
            live = await self.kube.get(path)
            if live is None:
                raise
            return live, False
        log.info("created %s %s/%s", desired["kind"], namespace, desired["metadata"]["name"])
        return created, True

    async def _ensure_shared(
        self, ms: ModelServer, resource: resources.Resource, desired: dict[str, Any]
    ) -> dict[str, Any]:
        """Create a shared cache object, or add this ModelServer to the owners of the existing one."""
        path = resource.path(ms.metadata.namespace, desired["metadata"]["name"])
        live, created = await self._read_or_create(resource, ms.metadata.namespace, path, desired)
        if created:
            return live
        owners = live.get("metadata", {}).get("ownerReferences") or []
        if not any(ref.get("uid") == ms.metadata.uid for ref in owners):
            # resourceVersion: a concurrent owner change makes this a 409, retried by the next reconcile.
            meta = {
                "resourceVersion": live["metadata"].get("resourceVersion"),
                "ownerReferences": [*owners, server.shared_owner_reference(ms)],
            }
            try:
                live = await self.kube.merge_patch(path, {"metadata": meta}) or live
            except kube.KubeError as error:
                if error.status != 409:
                    raise
        return live

    async def _download(self, ms: ModelServer, cache: Cache) -> tuple[Download | None, Problem | None]:
        """The cache's claim and Job, created or shared, and the download's state."""
        namespace = ms.metadata.namespace
        if cache.pvc is not None:
            await self._ensure_shared(ms, resources.PERSISTENT_VOLUME_CLAIMS, claim(ms, cache))
        elif (
            await self.kube.get(resources.PERSISTENT_VOLUME_CLAIMS.path(namespace, cache.claim_name)) is None
        ):
            return None, Problem(
                "CacheClaimNotFound",
                f"spec.model.cache.claimName: PersistentVolumeClaim {namespace}/{cache.claim_name} does not "
                "exist; create it, or set model.cache.pvc to let the operator create one",
            )
        job = await self._ensure_shared(ms, resources.JOBS, download_job(ms, cache))
        pods = await self.kube.list(resources.PODS.path(namespace), {JOB_POD_LABEL: cache.job_name})
        state = download_state(cache, job, pods, None)
        if state.phase == "Downloading" and (pod := newest_pod(pods)) is not None:
            try:
                text = await self.kube.log(
                    resources.PODS.path(namespace, pod["metadata"]["name"]),
                    DOWNLOAD_CONTAINER,
                    DOWNLOAD_LOG_LINES,
                )
            except kube.KubeError as error:  # progress is for people; the phase does not depend on it
                log.warning("reading the download log of %s/%s: %s", namespace, cache.job_name, error)
                text = None
            state = download_state(cache, job, pods, text)
        if state.phase == "Failed":
            return state, Problem(
                "DownloadFailed",
                f"{state.message}; fix the cause, then delete the Job (kubectl delete job -n {namespace} "
                f"{cache.job_name}) to download again",
            )
        return state, None

    async def _release_caches(self, ms: ModelServer, keep: Cache | None) -> None:
        """Leave the model caches this ModelServer no longer uses (its source, revision or cache changed):
        drop it from their owners, and delete a claim or Job it was the last owner of. A claim still
        mounted by the old pods stays until they are gone (the API server's PVC protection)."""
        selector = cache_selector()
        for resource in (resources.JOBS, resources.PERSISTENT_VOLUME_CLAIMS):
            for obj in await self.kube.list(resource.path(ms.metadata.namespace), selector):
                meta = obj.get("metadata", {})
                owners = meta.get("ownerReferences") or []
                others = [ref for ref in owners if ref.get("uid") != ms.metadata.uid]
                if len(others) == len(owners) or (
                    keep is not None and (meta.get("labels") or {}).get(LABEL_CACHE) == keep.key
                ):
                    continue
                path = resource.path(ms.metadata.namespace, meta["name"])
                try:
                    if others:
                        patch = {"resourceVersion": meta.get("resourceVersion"), "ownerReferences": others}
                        await self.kube.merge_patch(path, {"metadata": patch})
                    else:
                        await self.kube.delete(path)
                        log.info(
                            "deleted %s %s/%s (no longer used)",
                            obj.get("kind"),
                            ms.metadata.namespace,
                            meta["name"],
                        )
                except kube.KubeError as error:
                    if error.status != 409:  # a concurrent owner change: the next spec change retries
                        raise

    async def _node_labels(self) -> list[dict[str, str]]:
        if self._nodes is None or time.monotonic() - self._nodes[0] > NODE_CACHE_SECONDS:
            nodes = await self.kube.list(resources.NODES.path())
            self._nodes = (time.monotonic(), [n.get("metadata", {}).get("labels") or {} for n in nodes])
        return self._nodes[1]

    async def _size(self, ms: ModelServer) -> tuple[Placement | None, Problem | None]:
        try:
            nodes = await self._node_labels() if ms.spec.resources.gpu.count > 0 else []
            placement = place(ms.spec, nodes)
        except SizingError as error:
            return None, Problem(error.reason, error.message)
        if not placement.plan.fits:
            return placement, not_fitting(placement.plan)
        return placement, await self._secrets_problem(ms)

    async def _secrets_problem(self, ms: ModelServer) -> Problem | None:
        refs: list[tuple[str, SecretKeyRef | HFTokenSecretRef]] = []
        if ms.spec.auth is not None:
            refs.append(("auth.apiKeySecretRef", ms.spec.auth.api_key_secret_ref))
        if ms.spec.model.hf_token_secret_ref is not None:
            refs.append(("model.hfTokenSecretRef", ms.spec.model.hf_token_secret_ref))
        for field, ref in refs:
            secret = await self.kube.get(resources.SECRETS.path(ms.metadata.namespace, ref.name))
            if secret is None:
                return Problem(
                    "SecretNotFound",
                    f"spec.{field}: Secret {ms.metadata.namespace}/{ref.name} does not exist; create it with "
                    f"key {ref.key!r} or fix the name",
                )
            if ref.key not in (secret.get("data") or {}) and ref.key not in (secret.get("stringData") or {}):
                return Problem(
                    "SecretKeyNotFound",
                    f"spec.{field}: Secret {ms.metadata.namespace}/{ref.name} has no key {ref.key!r}",
                )
        return None

    async def _ensure(
        self, ms: ModelServer, resource: resources.Resource, desired: dict[str, Any]
    ) -> tuple[dict[str, Any] | None, Problem | None]:
        """Create the child or patch it back to `desired`; a same-named object we do not own is a problem."""
        path = resource.path(ms.metadata.namespace, ms.metadata.name)
        live, created = await self._read_or_create(resource, ms.metadata.namespace, path, desired)
        if created:
            return live, None
        if not kube.controlled_by(live, ms.metadata.uid):
            return live, Problem(
                "NameConflict",
                f"a {desired['kind']} named {ms.metadata.name} exists in {ms.metadata.namespace} and is not "
                "owned by this ModelServer; delete it or rename the ModelServer",
            )
        drifted = server.template_hash(desired) != server.template_hash(live) or not kube.is_subset(
            {k: desired[k] for k in ("metadata", "spec")}, live
        )
        if drifted:
            patched = await self.kube.merge_patch(path, child_patch(desired, live))
            log.info("patched %s %s/%s", desired["kind"], ms.metadata.namespace, ms.metadata.name)
            return patched, None
        return live, None

    async def _ensure_autoscaler(self, ms: ModelServer) -> Problem | None:
        """The HPA (actuator hpa) or KEDA ScaledObject (actuator keda): then it alone writes spec.replicas."""
        try:
            desired = autoscaler_object(ms)
        except ValueError as error:
            return Problem("InvalidAutoscaling", str(error))
        keda = desired is not None and desired["kind"] == "ScaledObject"
        resource = resources.SCALED_OBJECTS if keda else resources.HORIZONTAL_POD_AUTOSCALERS
        if ms.status.observed_generation != ms.metadata.generation:  # the spec changed: the actuator may have
            await self._remove_autoscalers(ms, keep=resource if desired is not None else None)
        if desired is None:
            return None
        try:
            _, problem = await self._ensure(ms, resource, desired)
        except kube.KubeError as error:
            if error.status != 404:
                raise
            api = f"{resource.group}/{resource.version} {resource.plural}"
            return Problem(
                "AutoscalerAPIMissing",
                f"autoscaling.actuator needs {api}, which this cluster does not serve; "
                + ("install KEDA or " if keda else "")
                + "use actuator builtin",
            )
        return problem

    async def _remove_autoscalers(self, ms: ModelServer, keep: resources.Resource | None) -> None:
        """Delete our HPA / ScaledObject but `keep`: one left from an earlier actuator would scale on."""
        for resource in (resources.HORIZONTAL_POD_AUTOSCALERS, resources.SCALED_OBJECTS):
            path = resource.path(ms.metadata.namespace, ms.metadata.name)
            if resource == keep:
                continue
            live = await self.kube.get(path)
            if live is not None and kube.controlled_by(live, ms.metadata.uid):
                await self.kube.delete(path)
                log.info(
                    "deleted %s %s/%s (actuator changed)",
                    live.get("kind"),
                    ms.metadata.namespace,
                    ms.metadata.name,
                )

    async def server_pods(self, ms: ModelServer) -> list[dict[str, Any]]:
        return await kube.pods_of(self.kube, ms.metadata.namespace, server.selector_labels(ms))

    async def _measure(
        self, ms: ModelServer, deployment: Mapping[str, Any] | None, template_hash: str | None
    ) -> dict[str, PodSizing]:
        """What each ready pod of the current template runs with (pods already measured are not re-read)."""
        key = (ms.metadata.namespace, ms.metadata.name)
        ready = ((deployment or {}).get("status") or {}).get("readyReplicas", 0)
        if template_hash is None or not ready:
            self._measured.pop(key, None)
            return {}
        pods = [
            pod
            for pod in await self.server_pods(ms)
            if (pod.get("metadata", {}).get("annotations") or {}).get(server.ANNOTATION_TEMPLATE_HASH)
            == template_hash
        ]
        endpoints = ready_pod_endpoints(pods, server.SERVER_CONTAINER)
        uids = {str(pod["metadata"].get("name")): str(pod["metadata"].get("uid", "")) for pod in pods}
        known = self._measured.get(key, {})
        kept = {
            e.name: known[e.name] for e in endpoints if e.name in known and known[e.name][0] == uids[e.name]
        }
        missing = [e for e in endpoints if e.name not in kept]
        if missing:
            if self._http is None:
                self._http = httpx.AsyncClient()
            for name, sizing in (await scrape_sizing(self._http, missing, self.scrape_timeout_s)).items():
                kept[name] = (uids[name], sizing)
        self._measured[key] = kept
        return {name: sizing for name, (_, sizing) in kept.items()}

    async def _reconcile(self, body: dict[str, Any]) -> str:
        """One reconcile; returns its result for the metrics: ok, or degraded (a Problem in the status)."""
        meta = body["metadata"]
        try:
            ms = ModelServer.model_validate(body)
        except ValidationError as error:
            # The CRD schema admits nothing the model rejects; this only happens with an outdated CRD.
            message = f"spec does not match this operator's ModelServer schema (upgrade the CRD): {error}"
            log.error("%s/%s: %s", meta.get("namespace"), meta["name"], message)
            self.post_event(body, "Warning", "InvalidSpec", message[:1000])
            return "degraded"

        placement, problem = await self._size(ms)
        target = decide(ms.spec, placement)
        replicas = desired_replicas(ms.spec, ms.status, woken(ms), target)
        deployment: dict[str, Any] | None = None
        template_hash = None
        download: Download | None = None
        cache = cache_of(ms)
        # The spec changed: the model cache may have moved. (A new ModelServer holds no cache yet.)
        if ms.status.observed_generation not in (None, ms.metadata.generation):
            await self._release_caches(ms, keep=cache)
        if problem is None and cache is not None:
            download, problem = await self._download(ms, cache)
            if download is not None and download.phase == "Downloading":
                self._poll_download(ms.metadata.namespace, ms.metadata.name)
        # With a cache, the Deployment is created (or changed) only once the download Job has succeeded.
        if problem is None and placement is not None and (download is None or download.phase == "Ready"):
            desired = server.deployment(ms, placement, replicas)
            template_hash = server.template_hash(desired)
            deployment, problem = await self._ensure(ms, resources.DEPLOYMENTS, desired)
        else:
            # Leave a running Deployment as it is: the previous, working spec keeps serving.
            deployment = await self.kube.get(
                resources.DEPLOYMENTS.path(ms.metadata.namespace, ms.metadata.name)
            )
        _, service_problem = await self._ensure(ms, resources.SERVICES, server.service(ms))
        problem = problem or service_problem or await self._ensure_autoscaler(ms)

        measured = await self._measure(ms, deployment, template_hash) if problem is None else {}
        observed = Observed(
            placement, problem, deployment, replicas, template_hash, measured, download, target
        )
        status = build_status(ms, observed, kube.rfc3339(time.time()))
        self.metrics.record_status(ms.metadata.namespace, ms.metadata.name, status, replicas)
        current = body.get("status") or {}
        patch = status_patch(current, status)
        if patch:
            await self.kube.merge_patch(
                resources.MODELSERVERS.path(ms.metadata.namespace, ms.metadata.name, "status"),
                {"status": patch},
            )
        self._post_transitions(body, current.get("conditions"), status["conditions"])
        return "degraded" if problem is not None else "ok"

    def _post_transitions(
        self, body: Mapping[str, Any], before: list[dict[str, Any]] | None, after: list[dict[str, Any]]
    ) -> None:
        """Events for sizing decisions and failures, once per change (never on every resync).

        Sizing plans are Normal `Fits` Events; every failure (including a plan that does not fit) is one
        Warning from the Degraded condition; becoming Ready is a Normal `Ready` Event; a replica running
        short of the plan is a Warning `SizingDrift` Event (with the condition's message); the replicas
        spec.target takes are a Normal `TargetReplicas` Event, or a Warning with the reason when they are
        clipped by maxReplicas or cannot be computed.
        """
        for kind in ("Sized", "Degraded", "Ready", "SizingDrift", "TargetMet"):
            old, new = condition_of(before, kind), condition_of(after, kind)
            if new is None:
                continue
            if old is not None and (old.get("status"), old.get("reason"), old.get("message")) == (
                new["status"],
                new["reason"],
                new["message"],
            ):
                continue
            if kind == "Sized" and new["status"] == "True":  # a failed sizing is reported once, as Degraded
                self.post_event(body, "Normal", new["reason"], new["message"])
            elif kind == "Degraded" and new["status"] == "True":
                self.post_event(body, "Warning", new["reason"], new["message"])
            elif kind == "Ready" and new["status"] == "True" and (old is None or old.get("status") != "True"):
                self.post_event(body, "Normal", "Ready", new["message"])
            elif kind == "SizingDrift":
                self.post_event(body, "Warning", "SizingDrift", new["message"])
            elif kind == "TargetMet" and new["status"] == "True":
                self.post_event(body, "Normal", "TargetReplicas", new["message"])
            elif kind == "TargetMet":
                self.post_event(body, "Warning", new["reason"], new["message"])
