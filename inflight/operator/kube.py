"""A small Kubernetes API client for the operator's own calls: get, list, create, merge-patch, delete.

Kopf watches and posts Events with its own client; this one reads and writes the ModelServer's children
and status. It never PUTs; children go away through owner references; it deletes an HPA or ScaledObject
left from an autoscaling actuator no longer in use and an unused model cache's claim and Job. Credentials come
from `kopf.login_with_service_account()` in a pod, else `kopf.login_with_kubeconfig()`; a 401 logs in again
once (projected service-account tokens rotate).

The resources it is called on are defined once in `api/resources.py`; beside the client live the helpers
every caller shares: Kubernetes timestamps (`rfc3339`), `is_subset` and `controlled_by`.
"""

from __future__ import annotations

import asyncio
import builtins
import json
from collections.abc import AsyncIterator, Callable, Mapping
from datetime import UTC, datetime
from typing import Any

import aiohttp
import kopf

from inflight.operator.api.resources import PODS

MERGE_PATCH = "application/merge-patch+json"


def rfc3339(moment: float | datetime, *, micro: bool = False) -> str:
    """A Kubernetes timestamp in UTC of `moment` (a datetime or seconds since the epoch): a `Time`
    (whole seconds) or, with `micro`, a `MicroTime` (microseconds, as Leases carry)."""
    if not isinstance(moment, datetime):
        moment = datetime.fromtimestamp(moment, UTC)
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ" if micro else "%Y-%m-%dT%H:%M:%SZ")


def parse_rfc3339(stamp: str | None) -> datetime | None:
    """The moment a Kubernetes timestamp names; None when there is none; ValueError when it is malformed."""
    if not stamp:
        return None
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def is_subset(desired: Any, live: Any) -> bool:
    """Whether every field we set is present and equal in the live object (server defaults are extra)."""
    if isinstance(desired, Mapping):
        return isinstance(live, Mapping) and all(
            k in live and is_subset(v, live[k]) for k, v in desired.items()
        )
    if isinstance(desired, list):
        return isinstance(live, list) and len(desired) == len(live) and all(map(is_subset, desired, live))
    return bool(desired == live)


def controlled_by(obj: Mapping[str, Any], uid: str) -> bool:
    """Whether `obj` has an owner reference with `controller: true` to the object with this uid."""
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return any(ref.get("controller") and ref.get("uid") == uid for ref in refs)


class KubeError(Exception):
    """An API error with the server's status code and message."""

    def __init__(self, status: int, method: str, path: str, message: str) -> None:
        super().__init__(f"{method} {path}: HTTP {status}: {message}")
        self.status = status


def login() -> kopf.ConnectionInfo:
    """The credentials kopf would use: the pod's service account, else KUBECONFIG / ~/.kube/config."""
    settings = kopf.OperatorSettings()
    info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(settings=settings)
    if info is None:
        raise kopf.LoginError(
            "no Kubernetes credentials: run in a pod with a service account, or set KUBECONFIG"
        )
    return info


class KubeClient:
    """get / list / create / merge-patch against one API server."""

    def __init__(
        self,
        info: kopf.ConnectionInfo,
        relogin: Callable[[], kopf.ConnectionInfo] = login,
        on_error: Callable[[str, str], None] | None = None,
    ) -> None:
        self._relogin = relogin
        self._on_error = on_error  # (method, HTTP status or "connection") of each failed call
        self._info = info
        self._session: aiohttp.ClientSession | None = None
        self._lock = asyncio.Lock()

    @classmethod
    def from_environment(cls, on_error: Callable[[str, str], None] | None = None) -> KubeClient:
        return cls(login(), on_error=on_error)

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(ssl=self._info.as_ssl_context(), limit=32)
            headers = {"User-Agent": "inflight-operator", **self._info.as_http_headers()}
            self._session = aiohttp.ClientSession(
                base_url=self._info.server.rstrip("/") + "/",
                connector=connector,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=30),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _request(
        self, method: str, path: str, *, body: Any = None, params: Mapping[str, str] | None = None
    ) -> dict[str, Any] | None:
        try:
            return await self._send(method, path, body, params)
        except KubeError as error:
            if self._on_error is not None:
                self._on_error(method, str(error.status))
            raise
        except (aiohttp.ClientError, TimeoutError):
            if self._on_error is not None:
                self._on_error(method, "connection")
            raise

    async def _send(
        self, method: str, path: str, body: Any, params: Mapping[str, str] | None
    ) -> dict[str, Any] | None:
        for attempt in range(2):
            session = self._open()
            headers = {"Content-Type": MERGE_PATCH} if method == "PATCH" else {}
            data = None if body is None else json.dumps(body)
            async with session.request(
                method, path.lstrip("/"), data=data, params=params, headers=headers
            ) as resp:
                if resp.status == 401 and attempt == 0:
                    async with self._lock:
                        self._info = self._relogin()
                        await self.close()
                    continue
                if resp.status == 404 and method in ("GET", "PATCH", "DELETE"):
                    return None
                text = await resp.text()
                if resp.status >= 400:
                    try:
                        message = json.loads(text).get("message", text)
                    except ValueError:
                        message = text
                    raise KubeError(resp.status, method, path, message)
                parsed: dict[str, Any] = json.loads(text) if text else {}
                return parsed
        raise KubeError(401, method, path, "unauthorized after logging in again")

    async def get(self, path: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        return await self._request("GET", path)

    async def list(self, path: str, label_selector: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
        result = await self._request("GET", path, params=_selector_params(label_selector) or None) or {}
        items: list[dict[str, Any]] = result.get("items") or []
        return items

    async def list_with_version(
        self, path: str, label_selector: Mapping[str, str] | None = None
    ) -> tuple[builtins.list[dict[str, Any]], str]:
        """The items and the list's resourceVersion (where a watch of the same path starts)."""
        result = await self._request("GET", path, params=_selector_params(label_selector)) or {}
        return list(result.get("items") or []), str(result.get("metadata", {}).get("resourceVersion", ""))

    async def watch(
        self,
        path: str,
        resource_version: str,
        label_selector: Mapping[str, str] | None = None,
        timeout_s: int = 300,
    ) -> AsyncIterator[dict[str, Any]]:
        """The watch events (`{"type", "object"}`) after `resource_version`, until the server ends the
        watch (after about `timeout_s`). A 410 Gone (the version is too old) raises KubeError: list again."""
        params = {
            **_selector_params(label_selector),
            "watch": "true",
            "resourceVersion": resource_version,
            "timeoutSeconds": str(timeout_s),
            "allowWatchBookmarks": "true",
        }
        session = self._open()
        timeout = aiohttp.ClientTimeout(total=None, sock_read=timeout_s + 30)
        async with session.get(path.lstrip("/"), params=params, timeout=timeout) as resp:
            if resp.status >= 400:
                raise KubeError(resp.status, "WATCH", path, await resp.text())
            async for line in resp.content:
                if line.strip():
                    event: dict[str, Any] = json.loads(line)
                    if event.get("type") == "ERROR":
                        status = event.get("object", {})
                        code, message = int(status.get("code", 500)), str(status.get("message"))
                        raise KubeError(code, "WATCH", path, message)
                    yield event

    async def create(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """POST; raises KubeError 409 when the object exists."""
        created = await self._request("POST", path, body=body)
        return created or {}

    async def merge_patch(self, path: str, patch: Mapping[str, Any]) -> dict[str, Any] | None:
        """JSON merge patch (RFC 7386); None when the object does not exist."""
        return await self._request("PATCH", path, body=patch)

    async def log(self, path: str, container: str, tail_lines: int) -> str | None:
        """The last lines of a container's log (`path` is the pod's); None when the pod is gone."""
        session = self._open()
        params = {"container": container, "tailLines": str(tail_lines)}
        async with session.get(f"{path.lstrip('/')}/log", params=params) as resp:
            if resp.status in (400, 404):  # no such pod, or its container has not started yet
                return None
            text = await resp.text()
            if resp.status >= 400:
                raise KubeError(resp.status, "GET", f"{path}/log", text)
            return text

    async def delete(self, path: str) -> None:
        """DELETE with background propagation (a Job's pods go too); an object already gone is fine."""
        await self._request("DELETE", path, body={"propagationPolicy": "Background"})


async def pods_of(client: KubeClient, namespace: str, selector: Mapping[str, str]) -> list[dict[str, Any]]:
    """The pods that carry every label of `selector` (checked again here: a client may ignore it)."""
    return [
        pod
        for pod in await client.list(PODS.path(namespace), label_selector=selector)
        if is_subset(selector, pod.get("metadata", {}).get("labels") or {})
    ]


def _selector_params(label_selector: Mapping[str, str] | None) -> dict[str, str]:
    if not label_selector:
        return {}
    return {"labelSelector": ",".join(f"{k}={v}" for k, v in sorted(label_selector.items()))}


def event_body(
    involved: Mapping[str, Any], type: str, reason: str, message: str, time: str
) -> dict[str, Any]:
    """A core/v1 Event about `involved` (an object as read from the API), for `create` on EVENTS."""
    metadata = involved.get("metadata", {})
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{metadata.get('name')}.", "namespace": metadata.get("namespace")},
        "involvedObject": {
            "apiVersion": involved.get("apiVersion"),
            "kind": involved.get("kind"),
            "name": metadata.get("name"),
            "namespace": metadata.get("namespace"),
            "uid": metadata.get("uid"),
        },
        "type": type,
        "reason": reason,
        "message": message[:1024],
        "source": {"component": "inflight-operator"},
        "reportingComponent": "inflight-operator",
        "firstTimestamp": time,
        "lastTimestamp": time,
        "count": 1,
    }
