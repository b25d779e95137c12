"""kmock's KubernetesEmulator plus what Kopf and the operator need from a real API server.

kmock 0.8 keeps objects and serves discovery, list, watch, create, merge/JSON patch and delete, but has no
resourceVersion, uid or generation, ignores label selectors, replays every object on each watch and
has no garbage collector. This adapter supplies, over the same real HTTP:

- `metadata.uid`, `creationTimestamp`, `generation` (bumped when `spec` changes) and a cluster-wide
  `resourceVersion` bumped on every write, delete included; `generateName`;
- the status subresource (`/status` writes only `status`, the main resource ignores `status`) and the
  scale subresource (`/scale` writes `spec.replicas`);
- 422 when a JSON patch's `test` op fails, 409 when a merge patch carries a stale `resourceVersion`;
- what the real API server refuses before it stores a write (support/api_strictness.py): 415 for a body
  that is not JSON/YAML/protobuf/CBOR or an unknown patch type, strict field validation
  (`fieldValidation=Strict`) against the Kubernetes schemas and the CRDs given to `declare`, custom
  resources defaulted and validated (schema + CEL) as the CRD says;
- `compact()`: the watch history before the current version is gone, so a watch from an older version
  gets the API server's `410 Expired` ERROR event (`too old resource version`); a watch that asked for
  bookmarks gets a BOOKMARK with the current version before it ends;
- list with `labelSelector`, `kind` and the current `resourceVersion`; watch that resumes after the
  `resourceVersion` it is given (from an event log) and ends after `timeoutSeconds`;
- garbage collection of objects whose owner references all point at deleted objects (cascading), also
  when such an object is created after its owners were deleted;
- `pods/NAME/log` from `pod_logs[(namespace, name)]` (text; `tailLines` honoured);
- constant time per request: kmock's log of served requests is cut to the current one.
Writes are serialized, so the event log has one order, as etcd gives.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock
from kmock._internal import k8s_dicts, rendering  # types of the handler hooks we override
from kmock._internal.enums import action

from support import api_strictness as strict

STATUS_SUBRESOURCE = {"modelservers", "deployments", "jobs"}


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def merge_diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The merge patch that turns `old` into `new` (nulls for removed keys)."""
    diff: dict[str, Any] = {key: None for key in old if key not in new}
    for key, value in new.items():
        if isinstance(value, Mapping) and isinstance(old.get(key), Mapping):
            sub = merge_diff(old[key], value)
            if sub:
                diff[key] = sub
        elif old.get(key, object()) != value:
            diff[key] = copy.deepcopy(value)
    return diff


def parse_selector(text: str | None) -> list[tuple[str, str, str | None]]:
    """`a=b,c!=d,e,!f` -> [(key, op, value)] with op one of =, !=, exists, !exists."""
    terms: list[tuple[str, str, str | None]] = []
    for raw in filter(None, (part.strip() for part in (text or "").split(","))):
        if "!=" in raw:
            key, value = raw.split("!=", 1)
            terms.append((key, "!=", value))
        elif "=" in raw:
            key, value = raw.replace("==", "=").split("=", 1)
            terms.append((key, "=", value))
        elif raw.startswith("!"):
            terms.append((raw[1:], "!exists", None))
        else:
            terms.append((raw, "exists", None))
    return terms


def selected(obj: Mapping[str, Any], terms: list[tuple[str, str, str | None]]) -> bool:
    labels = obj.get("metadata", {}).get("labels") or {}
    for key, op, value in terms:
        ok = {
            "=": labels.get(key) == value,
            "!=": labels.get(key) != value,
            "exists": key in labels,
            "!exists": key not in labels,
        }[op]
        if not ok:
            return False
    return True


@dataclass(frozen=True)
class LoggedEvent:
    resource_version: int
    resource: kmock.resource
    namespace: str | None
    event: dict[str, Any]


@attrs.define(kw_only=True)
class KubeEmulator(kmock.KubernetesEmulator):
    _write_lock: asyncio.Lock = attrs.field(factory=asyncio.Lock, init=False)
    _appended: asyncio.Event = attrs.field(factory=asyncio.Event, init=False)  # replaced on every append
    _log: list[LoggedEvent] = attrs.field(factory=list, init=False)
    _counter: itertools.count[int] = attrs.field(factory=lambda: itertools.count(1), init=False)
    resource_version: int = attrs.field(default=0, init=False)
    # time.perf_counter() of every create, by (resource, namespace, name): for latency measurements.
    created_at: dict[tuple[Any, ...], float] = attrs.field(factory=dict, init=False)
    _alive_uids: set[str] = attrs.field(factory=set, init=False)
    pod_logs: dict[tuple[str, str], str] = attrs.field(factory=dict, init=False)
    # (User-Agent, method, path) of every request served, as an audit log records them.
    audit: list[tuple[str, str, str]] = attrs.field(factory=list, init=False)
    # The openAPIV3Schema of each custom resource (by plural), from its CRD.
    _custom_schemas: dict[str, dict[str, Any]] = attrs.field(factory=dict, init=False)
    # Watches from a resourceVersion below this get 410 Expired (see `compact`).
    _oldest_watchable: int = attrs.field(default=0, init=False)

    def declare(
        self,
        key: str,
        kind: str,
        namespaced: bool = True,
        subresources: tuple[str, ...] = (),
        schema: dict[str, Any] | None = None,
    ) -> None:
        """Serve a resource; `schema` (a CRD's openAPIV3Schema) makes it a custom resource that is
        defaulted and validated as its CRD says."""
        verbs = {"get", "list", "watch", "create", "patch", "delete"}
        self.resources[key] = kmock.ResourceInfo(
            kind=kind, namespaced=namespaced, verbs=verbs, subresources=set(subresources)
        )
        if schema is not None:
            self._custom_schemas[key.rsplit("/", 1)[-1]] = schema

    def compact(self) -> None:
        """Forget the watch history up to now, as etcd compaction and the watch cache's window do."""
        self._oldest_watchable = self.resource_version
        self._log.clear()

    def _find(self, key: tuple[Any, ...]) -> kmock.Object | None:
        if key not in self.objects:
            return None
        return self.objects[key]

    def _next_version(self) -> int:
        self.resource_version = next(self._counter)
        return self.resource_version

    # -- writes --------------------------------------------------------------------------------------

    async def _handle(self, request: rendering.Request) -> Any:
        # kmock decides which reaction serves a request by scanning its log of every request served so
        # far (O(n) per request); the tests assert on stored objects instead, so only the current one is kept.
        del self._requests[:-1]
        self.audit.append((request.headers.get("User-Agent", ""), request.method, request.url.path))
        if request.resource is not None and (request.resource.plural, request.subresource) == ("pods", "log"):
            return self._serve_log(request)
        if request.resource is not None:
            strict.check_accept(request.headers.get("Accept"))
        if request.resource is None or request.action not in (action.CREATE, action.UPDATE, action.DELETE):
            return await super()._handle(request)
        plural = request.resource.plural
        if request.action in (action.CREATE, action.UPDATE):
            custom = plural in self._custom_schemas
            strict.check_body_type(request.method, request.headers.get("Content-Type"), custom)
        async with self._write_lock:
            key = (request.resource, request.namespace, request.name)
            # kmock matches reactions against the very request object it recorded, so the body it is
            # about to store is replaced in place (the request class is frozen).
            if request.action == action.CREATE:
                object.__setattr__(request, "data", self._prepare_create(request))
                key = (request.resource, request.namespace, request.data["metadata"]["name"])
            elif request.action == action.UPDATE:
                object.__setattr__(request, "data", self._prepare_update(request, key))
            response = await super()._handle(request)
            await self._record(request, key)
            if request.action == action.CREATE and response.status == 200 and not response.prepared:
                response.set_status(201)  # Created, as the API server answers a create
            return response

    def _serve_log(self, request: rendering.Request) -> aiohttp.web.Response:
        key = (request.namespace or "", request.name or "")
        if self._find((request.resource, *key)) is None:
            return aiohttp.web.json_response({"kind": "Status", "code": 404}, status=404)
        lines = self.pod_logs.get(key, "").splitlines(keepends=True)
        tail = request.params.get("tailLines")
        return aiohttp.web.Response(text="".join(lines[-int(tail) :] if tail else lines))

    def _prepare_create(self, request: rendering.Request) -> dict[str, Any]:
        body = copy.deepcopy(request.data or {})
        meta = body.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = f"{meta['generateName']}{uuid.uuid4().hex[:5]}"
        if not meta.get("name"):
            raise kmock.KubernetesError(422, "Invalid", "metadata.name or generateName is required")
        if request.namespace:
            meta["namespace"] = request.namespace
        body = self._admit(request, body, created=True)
        if request.resource is not None and request.resource.plural == "customresourcedefinitions":
            self._serve_custom_resource(body)
        meta = body["metadata"]
        meta.update(
            uid=str(uuid.uuid4()),
            generation=1,
            resourceVersion=str(self._next_version()),
            creationTimestamp=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        )
        return body

    def _serve_custom_resource(self, crd: dict[str, Any]) -> None:
        """Admit a CRD (422 when the API server would refuse it); its resource is then defaulted and
        validated by its schema."""
        schemas = strict.admit_crd(crd)
        spec = crd["spec"]
        for version, schema in schemas.items():
            key = f"{spec['group']}/{version}/{spec['names']['plural']}"
            self.declare(
                key, spec["names"]["kind"], spec.get("scope") == "Namespaced", ("status", "scale"), schema
            )

    def _admit(self, request: rendering.Request, obj: dict[str, Any], *, created: bool) -> dict[str, Any]:
        """The object as the API server would store it (custom resources pruned and defaulted), or the
        API server's refusal: unknown fields under `fieldValidation=Strict`, an invalid custom resource."""
        plural = request.resource.plural if request.resource is not None else ""
        is_strict = request.params.get("fieldValidation") == "Strict"
        schema = self._custom_schemas.get(plural)
        if schema is None:
            unknown = strict.builtin_unknown_fields(obj) if is_strict else []
        else:
            obj = copy.deepcopy(obj)
            unknown = strict.custom_unknown_fields(schema, obj, prune=not is_strict)
        if is_strict and created:
            strict.refuse_unknown_fields_on_create(obj.get("kind", ""), obj.get("apiVersion", ""), unknown)
        elif is_strict:
            strict.refuse_unknown_fields_on_patch(obj, unknown)
        if schema is None:
            return obj
        group = request.resource.group if request.resource is not None else ""
        return strict.admit_custom_resource(schema, obj, group or "")

    def _prepare_update(self, request: rendering.Request, key: tuple[Any, ...]) -> dict[str, Any]:
        stored = self._find(key)
        if stored is None or stored.deleted:
            raise kmock.KubernetesObjectNotFoundError()
        old = copy.deepcopy(stored.raw)
        patch = request.data or {}
        if "json-patch" in request.headers.get("Content-Type", ""):
            try:
                patched = jsonpatch.apply_patch(old, patch, in_place=False)
            except jsonpatch.JsonPatchTestFailed as error:
                raise kmock.KubernetesError(422, "Invalid", f"the patch's test failed: {error}") from error
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as error:
                raise kmock.KubernetesError(
                    422, "Invalid", f"the patch cannot be applied: {error}"
                ) from error
        else:
            expected = patch.get("metadata", {}).get("resourceVersion")
            if expected is not None and expected != old["metadata"].get("resourceVersion"):
                resource = request.resource
                raise strict.conflict(resource.plural or "", resource.group or "", old["metadata"]["name"])
            patched = merge_patch(old, patch)
        plural = request.resource.plural if request.resource is not None else None
        if request.subresource == "status":  # only status changes
            new = {key: value for key, value in old.items() if key != "status"}
            if patched.get("status") is not None:
                new["status"] = patched["status"]
        elif request.subresource == "scale":  # only spec.replicas changes
            new = merge_patch(old, {"spec": {"replicas": patch.get("spec", {}).get("replicas")}})
        elif plural in STATUS_SUBRESOURCE:  # everything but status changes
            new = {key: value for key, value in patched.items() if key != "status"}
            if "status" in old:
                new["status"] = old["status"]
        else:
            new = patched
        new["metadata"] = {**new.get("metadata", {})}
        for field in ("uid", "creationTimestamp", "name", "namespace", "generation", "resourceVersion"):
            if field in old["metadata"]:
                new["metadata"][field] = old["metadata"][field]
        new = self._admit(request, new, created=False)
        if new.get("spec") != old.get("spec"):
            new["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
        if new != old:
            new["metadata"]["resourceVersion"] = str(self._next_version())
        return merge_diff(old, new)

    async def _record(self, request: rendering.Request, key: tuple[Any, ...]) -> None:
        """Log the write as a watch event; collect the garbage a deletion leaves."""
        stored = self._find(key)
        if stored is None:
            return
        if stored.deleted:
            await self._log_deleted(key, dict(stored.last.raw))
            await self._collect_garbage(stored.last.raw["metadata"]["uid"])
            return
        raw = stored.raw
        if request.action == action.DELETE:  # finalizers keep it: deletionTimestamp was set
            raw["metadata"]["resourceVersion"] = str(self._next_version())
        if request.action == action.CREATE:
            self.created_at[key] = time.perf_counter()
            self._alive_uids.add(raw["metadata"]["uid"])
        kind = "ADDED" if request.action == action.CREATE else "MODIFIED"
        await self._append(
            int(raw["metadata"]["resourceVersion"]), key, {"type": kind, "object": copy.deepcopy(raw)}
        )
        if request.action == action.CREATE and self._owner_gone(raw):
            # The garbage collector deletes dependents whose owner no longer exists (a create that raced
            # with the owner's deletion).
            stored.delete()
            await self._log_deleted(key, raw)

    async def _log_deleted(self, key: tuple[Any, ...], raw: dict[str, Any]) -> None:
        self._alive_uids.discard(raw["metadata"].get("uid"))
        raw = copy.deepcopy(raw)
        raw["metadata"]["resourceVersion"] = str(self._next_version())
        await self._append(int(raw["metadata"]["resourceVersion"]), key, {"type": "DELETED", "object": raw})

    def _owner_gone(self, raw: Mapping[str, Any]) -> bool:
        owners = {ref.get("uid") for ref in raw.get("metadata", {}).get("ownerReferences") or []}
        return bool(owners) and not owners & self._alive_uids

    async def _collect_garbage(self, owner_uid: str) -> None:
        for key, obj in list(self.objects.items()):
            if obj.deleted:
                continue
            refs = obj.raw.get("metadata", {}).get("ownerReferences") or []
            owners = {ref.get("uid") for ref in refs}
            if owner_uid in owners and not owners & self._alive_uids:  # the last owner went
                raw = dict(obj.raw)
                obj.delete()
                await self._log_deleted(key, raw)
                await self._collect_garbage(raw["metadata"]["uid"])

    async def _append(self, resource_version: int, key: tuple[Any, ...], event: dict[str, Any]) -> None:
        self._log.append(LoggedEvent(resource_version, key[0], key[1], event))
        self._appended.set()
        self._appended = asyncio.Event()

    # -- reads ---------------------------------------------------------------------------------------

    def _visible(self, request: rendering.Request, obj: Mapping[str, Any], namespace: str | None) -> bool:
        if request.namespace is not None and namespace != request.namespace:
            return False
        return selected(obj, parse_selector(request.params.get("labelSelector")))

    # kmock finds the object of a fetch/create/patch/delete response by scanning all objects (O(n)); the
    # key is known, so look it up.
    def _current(self, request: rendering.Request) -> k8s_dicts.Object:
        name = request.name or (request.data or {}).get("metadata", {}).get("name")
        namespace = request.namespace or (request.data or {}).get("metadata", {}).get("namespace")
        found = self._find((request.resource, namespace, name))
        if found is None:
            raise kmock.KubernetesObjectNotFoundError()
        return found

    async def _serve_fetch(self, request: rendering.Request) -> rendering.Payload:
        found = self._current(request)
        if found.deleted:
            raise kmock.KubernetesObjectNotFoundError()
        return found.raw

    async def _serve_create(self, request: rendering.Request) -> rendering.Payload:
        return self._current(request).last.raw

    async def _serve_update(self, request: rendering.Request) -> rendering.Payload:
        return self._current(request).last.raw

    async def _serve_delete(self, request: rendering.Request) -> rendering.Payload:
        return self._current(request).last.raw

    async def _serve_list(self, request: rendering.Request) -> rendering.Payload:
        if request.resource not in self._get_resources():
            raise kmock.KubernetesResourceNotFoundError()
        items = [
            obj.raw
            for (resource, namespace, _), obj in self.objects.items()
            if resource == request.resource and not obj.deleted and self._visible(request, obj.raw, namespace)
        ]
        info = self.resources.get(request.resource)
        kind = f"{info.kind}List" if info is not None and info.kind else "List"
        return {"kind": kind, "metadata": {"resourceVersion": str(self.resource_version)}, "items": items}

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[rendering.Payload]:
        yield b""  # send the headers at once
        since = request.params.get("resourceVersion") or ""
        timeout = float(request.params.get("timeoutSeconds") or 3600)
        deadline = asyncio.get_running_loop().time() + timeout
        # No await between reading the log's length and the objects: the snapshot is consistent.
        if not since.isdigit() or since == "0":
            position = len(self._log)
            initial = [
                {"type": "ADDED", "object": copy.deepcopy(obj.raw)}
                for (resource, namespace, _), obj in self.objects.items()
                if resource == request.resource
                and not obj.deleted
                and self._visible(request, obj.raw, namespace)
            ]
        elif int(since) < self._oldest_watchable:
            yield {"type": "ERROR", "object": self._expired(int(since))}
            return
        else:
            position = next(
                (i for i, e in enumerate(self._log) if e.resource_version > int(since)), len(self._log)
            )
            initial = []
        for event in initial:
            yield event
        raw = request._raw_request  # to notice a client that went away: aiohttp does not cancel handlers
        while True:
            while position >= len(self._log):
                remaining = deadline - asyncio.get_running_loop().time()
                gone = raw is None or raw.transport is None or raw.transport.is_closing()
                if gone:
                    return
                if remaining <= 0:
                    if request.params.get("allowWatchBookmarks") == "true":
                        yield self._bookmark(request)
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._appended.wait(), min(remaining, 0.1))
            batch = self._log[position:]
            position = len(self._log)
            for logged in batch:
                if logged.resource == request.resource and self._visible(
                    request, logged.event["object"], logged.namespace
                ):
                    yield logged.event

    def _expired(self, since: int) -> dict[str, Any]:
        """The Status of a watch from a compacted version, as the API server words it."""
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": f"too old resource version: {since} ({self._oldest_watchable})",
            "reason": "Expired",
            "code": 410,
        }

    def _bookmark(self, request: rendering.Request) -> dict[str, Any]:
        """A BOOKMARK event: an object of the watched kind with only the current resourceVersion."""
        resource = request.resource
        info = self.resources.get(resource) if resource is not None else None
        if resource is not None and resource.group:
            api_version = f"{resource.group}/{resource.version}"
        else:
            api_version = (resource.version if resource is not None else None) or "v1"
        return {
            "type": "BOOKMARK",
            "object": {
                "kind": info.kind if info is not None else "",
                "apiVersion": api_version,
                "metadata": {"resourceVersion": str(self.resource_version)},
            },
        }

    # -- test helpers ----------------------------------------------------------------------------------

    def stored(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The stored object (a copy), or None."""
        key = (kmock.resource(resource), namespace, name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return copy.deepcopy(self.objects[key].raw)
