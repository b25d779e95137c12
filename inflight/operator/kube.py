"""The Kubernetes API calls of the operator and the router: get, list, watch, create, merge-patch, delete.

Kopf watches ModelServers and their children with its own client; this one, on kubernetes_asyncio's
ApiClient, reads and writes the ModelServer's children and status, and the router's discovery lists and
watches through it. It never PUTs; children go away through owner references; it deletes an HPA or
ScaledObject left from an autoscaling actuator no longer in use and an unused model cache's claim and Job.
Credentials come from kubernetes_asyncio's loaders (service account, else kubeconfig); a 401 loads them
again once (projected service-account tokens rotate). Writes carry a JSON content type and ask for
strict field validation; each component sends its own User-Agent.

The resources it is called on are defined once in `api/resources.py`; beside the client live the helpers
every caller shares: Kubernetes timestamps (`rfc3339`), `is_subset` and `controlled_by`.
"""

from __future__ import annotations

import asyncio
import builtins
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from datetime import UTC, datetime
from typing import Any

import aiohttp
import kopf
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.client import ApiClient, Configuration

from inflight.operator.api.resources import PODS

MERGE_PATCH = "application/merge-patch+json"
# Every write asks the API server to refuse fields it does not know (kubectl's default), so a misspelt
# field in a builder fails loudly instead of being dropped.
STRICT = {"fieldValidation": "Strict"}
REQUEST_TIMEOUT_S = 30.0
# Each component names itself, so audit logs tell the operator's calls from the router's.
OPERATOR_USER_AGENT = "inflight-operator"
ROUTER_USER_AGENT = "inflight-router"
NO_CREDENTIALS = "no Kubernetes credentials: run in a pod with a service account, or set KUBECONFIG"


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
    """Kopf's own credentials (for its watches and Events): the pod's service account, else KUBECONFIG."""
    settings = kopf.OperatorSettings()
    info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(settings=settings)
    if info is None:
        raise kopf.LoginError(NO_CREDENTIALS)
    return info


async def load_configuration() -> Configuration:
    """The pod's service account (its projected token re-read as it rotates), else $KUBECONFIG or
    ~/.kube/config (client certificates, tokens, exec plugins): kubernetes_asyncio's loaders."""
    configuration = Configuration()
    try:
        k8s_config.load_incluster_config(client_configuration=configuration)
        return configuration
    except k8s_config.ConfigException:
        pass
    # $KUBECONFIG is read now, not when kubernetes_asyncio was imported (its default location is fixed then).
    kubeconfig = os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
    try:
        await k8s_config.load_kube_config(
            kubeconfig, client_configuration=configuration, persist_config=False
        )
    except (k8s_config.ConfigException, OSError) as error:
        raise kopf.LoginError(f"{NO_CREDENTIALS} ({error})") from error
    return configuration


def configuration_for(server: str) -> Configuration:
    """A configuration for an API server that needs no credentials (a local proxy, an emulator)."""
    return Configuration(host=server.rstrip("/"))


class KubeClient:
    """get / list / watch / create / merge-patch / delete against one API server, on kubernetes_asyncio's
    ApiClient: its credential loaders, TLS and JSON request bodies (`Content-Type: application/json`, or
    the patch type a call names). Paths are the API's own (`api/resources.py` builds them); answers are
    plain dicts, as read from the API."""

    def __init__(
        self,
        configuration: Configuration,
        *,
        user_agent: str,
        reload: Callable[[], Awaitable[Configuration]] = load_configuration,
        on_error: Callable[[str, str], None] | None = None,
    ) -> None:
        self._configuration = configuration
        self._user_agent = user_agent
        self._reload = reload  # after a 401: projected service-account tokens rotate
        self._on_error = on_error  # (method, HTTP status or "connection") of each failed call
        self._api: ApiClient | None = None
        self._lock = asyncio.Lock()

    @classmethod
    async def from_environment(
        cls, user_agent: str, on_error: Callable[[str, str], None] | None = None
    ) -> KubeClient:
        return cls(await load_configuration(), user_agent=user_agent, on_error=on_error)

    def _open(self) -> ApiClient:
        if self._api is None:
            self._api = ApiClient(self._configuration)
            self._api.user_agent = self._user_agent
        return self._api

    async def close(self) -> None:
        """Close the HTTP session (its connections); the next call opens a new one."""
        if self._api is not None:
            api, self._api = self._api, None
            await api.close()

    async def _call(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, str] | None = None,
        content_type: str | None = None,
        accept: str = "application/json",
        timeout: float | aiohttp.ClientTimeout = REQUEST_TIMEOUT_S,
    ) -> aiohttp.ClientResponse:
        """The response, unread (the caller reads and releases it); after a 401, credentials are loaded
        again once."""
        headers = {"Accept": accept}
        if content_type is not None:
            headers["Content-Type"] = content_type
        for attempt in range(2):
            response: aiohttp.ClientResponse = await self._open().call_api(
                "/" + path.lstrip("/"),
                method,
                query_params=list((params or {}).items()),
                header_params=dict(headers),
                body=body,
                auth_settings=["BearerToken"],
                _preload_content=False,
                _request_timeout=timeout,
            )
            if response.status != 401 or attempt == 1:
                return response
            response.release()
            async with self._lock:
                self._configuration = await self._reload()
                await self.close()
        raise AssertionError("unreachable: the second attempt returns")

    async def _request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, str] | None = None,
        content_type: str | None = None,
    ) -> dict[str, Any] | None:
        try:
            async with await self._call(
                method, path, body=body, params=params, content_type=content_type
            ) as response:
                if response.status == 404 and method in ("GET", "PATCH", "DELETE"):
                    return None
                text = await response.text()
                if response.status >= 400:
                    raise KubeError(response.status, method, path, _status_message(text))
                parsed: dict[str, Any] = json.loads(text) if text else {}
                return parsed
        except KubeError as error:
            if self._on_error is not None:
                self._on_error(method, str(error.status))
            raise
        except (aiohttp.ClientError, TimeoutError):
            if self._on_error is not None:
                self._on_error(method, "connection")
            raise

    async def get(self, path: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        return await self._request("GET", path)

    async def list(self, path: str, label_selector: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
        items, _ = await self.list_with_version(path, label_selector)
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
        """The watch events (`{"type", "object"}`, BOOKMARKs included) after `resource_version`, until the
        server ends the watch (after about `timeout_s`). A 410 Gone (the version is too old), as an answer
        or as an ERROR event, raises KubeError: list again."""
        params = {
            **_selector_params(label_selector),
            "watch": "true",
            "resourceVersion": resource_version,
            "timeoutSeconds": str(timeout_s),
            "allowWatchBookmarks": "true",
        }
        timeout = aiohttp.ClientTimeout(total=None, sock_read=timeout_s + 30)
        async with await self._call("GET", path, params=params, timeout=timeout) as response:
            if response.status >= 400:
                raise KubeError(response.status, "WATCH", path, _status_message(await response.text()))
            async for line in response.content:
                if line.strip():
                    event: dict[str, Any] = json.loads(line)
                    if event.get("type") == "ERROR":
                        status = event.get("object", {})
                        code, message = int(status.get("code", 500)), str(status.get("message"))
                        raise KubeError(code, "WATCH", path, message)
                    yield event

    async def create(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """POST (`fieldValidation=Strict`: a field the API does not know is a 400, not dropped); raises
        KubeError 409 when the object exists."""
        created = await self._request("POST", path, body=body, params=STRICT)
        return created or {}

    async def merge_patch(self, path: str, patch: Mapping[str, Any]) -> dict[str, Any] | None:
        """JSON merge patch (RFC 7386, `fieldValidation=Strict`); None when the object does not exist. A
        `metadata.resourceVersion` in the patch makes it conditional: 409 when the object changed since."""
        return await self._request("PATCH", path, body=patch, params=STRICT, content_type=MERGE_PATCH)

    async def log(self, path: str, container: str, tail_lines: int) -> str | None:
        """The last lines of a container's log (`path` is the pod's); None when the pod is gone."""
        params = {"container": container, "tailLines": str(tail_lines)}
        async with await self._call("GET", f"{path}/log", params=params, accept="text/plain") as response:
            if response.status in (400, 404):  # no such pod, or its container has not started yet
                return None
            text = await response.text()
            if response.status >= 400:
                raise KubeError(response.status, "GET", f"{path}/log", _status_message(text))
            return text

    async def delete(self, path: str) -> None:
        """DELETE with background propagation (a Job's pods go too); an object already gone is fine."""
        await self._request("DELETE", path, body={"propagationPolicy": "Background"})


def _status_message(text: str) -> str:
    """The message of a Kubernetes Status body; the text itself when it is not one."""
    try:
        status = json.loads(text)
    except ValueError:
        return text
    return str(status.get("message", text)) if isinstance(status, dict) else text


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
