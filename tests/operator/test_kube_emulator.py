"""The emulator adapter behaves like an API server where kopf and the operator depend on it."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from kubernetes_asyncio.client import Configuration

from inflight.operator.api.crd import render_crd
from inflight.operator.kube import (
    OPERATOR_USER_AGENT,
    ROUTER_USER_AGENT,
    KubeClient,
    KubeError,
    configuration_for,
)

from support.emulated import DEPLOYMENTS, MODELSERVERS, emulated_cluster
from support.kube_emulator import merge_diff, merge_patch, parse_selector, selected

MS_URL = "/apis/inflight.dev/v1alpha1/namespaces/ns/modelservers"
MODEL = {"name": "m", "source": "builtin:tiny"}
MERGE = {"Content-Type": "application/merge-patch+json"}
JSON_PATCH = {"Content-Type": "application/json-patch+json"}


def test_merge_helpers() -> None:
    old = {"a": {"b": 1, "c": 2}, "d": [1]}
    new = {"a": {"b": 1, "e": 3}, "d": [2]}
    assert merge_diff(old, new) == {"a": {"c": None, "e": 3}, "d": [2]}
    assert merge_patch(old, merge_diff(old, new)) == new
    terms = parse_selector("app=x,tier!=db,owner,!legacy")
    assert selected({"metadata": {"labels": {"app": "x", "owner": "me"}}}, terms)
    assert not selected({"metadata": {"labels": {"app": "x", "owner": "me", "legacy": "1"}}}, terms)
    assert not selected({"metadata": {"labels": {"app": "y", "owner": "me"}}}, terms)


async def test_versions_generation_and_subresources() -> None:
    async with emulated_cluster() as cluster:
        body = {
            "apiVersion": "inflight.dev/v1alpha1",
            "kind": "ModelServer",
            "metadata": {"name": "a"},
            "spec": {"model": MODEL, "replicas": 1},
        }
        created = await (await cluster.post(MS_URL, json=body)).json()
        meta = created["metadata"]
        assert meta["uid"] and meta["generation"] == 1 and meta["namespace"] == "ns"
        rv1 = meta["resourceVersion"]
        resp = await cluster.patch(f"{MS_URL}/a", data=json.dumps({"spec": {"replicas": 2}}), headers=MERGE)
        after_spec = await resp.json()
        assert after_spec["metadata"]["generation"] == 2 and int(
            after_spec["metadata"]["resourceVersion"]
        ) > int(rv1)
        await cluster.patch(
            f"{MS_URL}/a/status",
            data=json.dumps({"status": {"replicas": 5}, "spec": {"replicas": 9}}),
            headers=MERGE,
        )
        await cluster.patch(f"{MS_URL}/a", data=json.dumps({"status": {"replicas": 7}}), headers=MERGE)
        stored = cluster.stored(MODELSERVERS, "ns", "a")
        assert stored is not None
        assert stored["status"] == {"replicas": 5} and stored["spec"]["replicas"] == 2  # each path its part
        assert stored["metadata"]["generation"] == 2  # status writes do not bump the generation
        await cluster.patch(f"{MS_URL}/a/scale", data=json.dumps({"spec": {"replicas": 3}}), headers=MERGE)
        assert cluster.stored(MODELSERVERS, "ns", "a")["spec"]["replicas"] == 3


async def test_failed_json_patch_test_is_422_and_stale_merge_patch_is_409() -> None:
    async with emulated_cluster() as cluster:
        body = {"metadata": {"name": "a"}, "spec": {"model": MODEL}}
        rv = (await (await cluster.post(MS_URL, json=body)).json())["metadata"]["resourceVersion"]
        await cluster.patch(f"{MS_URL}/a", data=json.dumps({"spec": {"replicas": 1}}), headers=MERGE)
        ops = [
            {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
            {"op": "add", "path": "/metadata/finalizers", "value": ["f"]},
        ]
        resp = await cluster.patch(f"{MS_URL}/a", data=json.dumps(ops), headers=JSON_PATCH)
        assert resp.status == 422
        resp = await cluster.patch(
            f"{MS_URL}/a",
            data=json.dumps({"metadata": {"resourceVersion": rv}, "spec": {"replicas": 2}}),
            headers=MERGE,
        )
        assert resp.status == 409
        current = cluster.stored(MODELSERVERS, "ns", "a")["metadata"]["resourceVersion"]
        ok = await cluster.patch(
            f"{MS_URL}/a",
            data=json.dumps({"metadata": {"resourceVersion": current}, "spec": {"replicas": 2}}),
            headers=MERGE,
        )
        assert ok.status == 200


async def test_list_filters_labels_and_watch_resumes_after_a_version() -> None:
    async with emulated_cluster() as cluster:
        for name, team in (("a", "x"), ("b", "y")):
            await cluster.post(
                MS_URL, json={"metadata": {"name": name, "labels": {"team": team}}, "spec": {"model": MODEL}}
            )
        listing = await (await cluster.get(MS_URL, params={"labelSelector": "team=x"})).json()
        assert [i["metadata"]["name"] for i in listing["items"]] == ["a"]
        assert listing["kind"] == "ModelServerList"
        since = listing["metadata"]["resourceVersion"]
        await cluster.patch(f"{MS_URL}/a", data=json.dumps({"spec": {"replicas": 1}}), headers=MERGE)
        await cluster.delete(f"{MS_URL}/b")
        resp = await cluster.get(
            MS_URL, params={"watch": "true", "resourceVersion": since, "timeoutSeconds": "1"}
        )
        lines = [json.loads(line) for line in (await resp.text()).splitlines() if line.strip()]
        assert [(e["type"], e["object"]["metadata"]["name"]) for e in lines] == [
            ("MODIFIED", "a"),
            ("DELETED", "b"),
        ]


async def test_owner_references_are_garbage_collected() -> None:
    async with emulated_cluster() as cluster:
        body = {"metadata": {"name": "a"}, "spec": {"model": MODEL}}
        owner = await (await cluster.post(MS_URL, json=body)).json()
        ref = {
            "apiVersion": "inflight.dev/v1alpha1",
            "kind": "ModelServer",
            "name": "a",
            "uid": owner["metadata"]["uid"],
            "controller": True,
        }
        await cluster.post(
            "/apis/apps/v1/namespaces/ns/deployments",
            json={"metadata": {"name": "a", "ownerReferences": [ref]}, "spec": {}},
        )
        await cluster.post(
            "/apis/apps/v1/namespaces/ns/deployments", json={"metadata": {"name": "other"}, "spec": {}}
        )
        await cluster.delete(f"{MS_URL}/a")
        await asyncio.sleep(0)
        assert cluster.stored(DEPLOYMENTS, "ns", "a") is None
        assert cluster.stored(DEPLOYMENTS, "ns", "other") is not None


async def test_a_dependent_created_after_its_owner_is_collected() -> None:
    async with emulated_cluster() as cluster:
        ref = {
            "apiVersion": "inflight.dev/v1alpha1",
            "kind": "ModelServer",
            "name": "a",
            "uid": "gone",
            "controller": True,
        }
        await cluster.post(
            "/apis/apps/v1/namespaces/ns/deployments",
            json={"metadata": {"name": "a", "ownerReferences": [ref]}, "spec": {}},
        )
        assert cluster.stored(DEPLOYMENTS, "ns", "a") is None


LEASES_URL = "/apis/coordination.k8s.io/v1/namespaces/ns/leases"
DEPLOYMENTS_URL = "/apis/apps/v1/namespaces/ns/deployments"


async def test_a_body_without_a_json_content_type_is_415_as_kube_apiserver_answers() -> None:
    """kube-apiserver v1.36's answer to the operator's first call (a Lease POSTed as text/plain)."""
    async with emulated_cluster() as cluster:
        lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": "l"}}
        resp = await cluster.post(LEASES_URL, data=json.dumps(lease))  # aiohttp: text/plain
        assert resp.status == 415
        assert (await resp.json())["message"] == (
            "the body of the request was in an unknown format - accepted media types include: "
            "application/json, application/yaml, application/vnd.kubernetes.protobuf, application/cbor"
        )
        assert cluster.stored("coordination.k8s.io/v1/leases", "ns", "l") is None
        resp = await cluster.patch(f"{MS_URL}/a", data=json.dumps({"spec": {}}))
        assert resp.status == 415
        assert "application/merge-patch+json" in (await resp.json())["message"]
        assert (await cluster.post(LEASES_URL, json=lease)).status == 201
        resp = await cluster.get(LEASES_URL, headers={"Accept": "text/html"})
        assert resp.status == 406
        assert (await resp.json())["message"] == (
            "only the following media types are accepted: "
            "application/json, application/yaml, application/vnd.kubernetes.protobuf, application/cbor"
        )


async def test_the_operators_client_sends_json_and_its_own_user_agent() -> None:
    """The defect behind the 415s: a client that set a content type only for PATCH. The operator's and
    the router's clients create through the same strict emulator, each naming itself."""
    async with emulated_cluster() as cluster:
        seen: list[str] = []
        for agent in (OPERATOR_USER_AGENT, ROUTER_USER_AGENT):
            client = KubeClient(configuration_for(str(cluster.url)), user_agent=agent)
            try:
                body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": agent}}
                created = await client.create(LEASES_URL, body)
                seen.append(cluster.audit[-1][0])
            finally:
                await client.close()
            assert created["metadata"]["name"] == agent
        assert seen == [OPERATOR_USER_AGENT, ROUTER_USER_AGENT]


async def test_strict_field_validation_refuses_unknown_fields_in_the_servers_words() -> None:
    async with emulated_cluster() as cluster:
        body = {
            "apiVersion": "inflight.dev/v1alpha1",
            "kind": "ModelServer",
            "metadata": {"name": "a"},
            "spec": {"model": MODEL, "replica": 2},
        }
        resp = await cluster.post(MS_URL, json=body, params={"fieldValidation": "Strict"})
        assert resp.status == 400
        assert (await resp.json())["message"] == (
            'ModelServer in version "v1alpha1" cannot be handled as a ModelServer: strict decoding error: '
            'unknown field "spec.replica"'
        )
        # Without Strict the API server prunes what the schema does not know, and defaults the rest.
        assert (await cluster.post(MS_URL, json=body)).status == 201
        stored = cluster.stored(MODELSERVERS, "ns", "a")
        assert "replica" not in stored["spec"] and stored["spec"]["engine"]["blockSize"] == 16
        patch = await cluster.patch(
            f"{MS_URL}/a",
            data=json.dumps({"spec": {"replica": 3}}),
            headers=MERGE,
            params={"fieldValidation": "Strict"},
        )
        assert patch.status == 422
        assert 'strict decoding error: unknown field "spec.replica"' in (await patch.json())["message"]
        deployment = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "d"},
            "spec": {"replica": 1, "selector": {}, "template": {}},
        }
        resp = await cluster.post(DEPLOYMENTS_URL, json=deployment, params={"fieldValidation": "Strict"})
        assert resp.status == 400
        assert (await resp.json())["message"] == (
            'Deployment in version "v1" cannot be handled as a Deployment: strict decoding error: '
            'unknown field "spec.replica"'
        )


async def test_custom_resources_are_validated_by_their_crd_schema_and_cel_rules() -> None:
    async with emulated_cluster() as cluster:
        body = {
            "apiVersion": "inflight.dev/v1alpha1",
            "kind": "ModelServer",
            "metadata": {"name": "a"},
            "spec": {"model": MODEL, "engine": {"blockSize": 32, "maxBatchedTokens": 16}},
        }
        resp = await cluster.post(MS_URL, json=body)
        assert resp.status == 422
        assert (await resp.json())["message"] == (
            'ModelServer.inflight.dev "a" is invalid: spec.engine: Invalid value: "object": '
            "engine.maxBatchedTokens must be at least engine.blockSize"
        )
        assert cluster.stored(MODELSERVERS, "ns", "a") is None


async def test_a_stale_resource_version_is_409_in_the_servers_words() -> None:
    async with emulated_cluster() as cluster:
        lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": "l"}}
        created = await (await cluster.post(LEASES_URL, json=lease)).json()
        stale = created["metadata"]["resourceVersion"]
        await cluster.patch(
            f"{LEASES_URL}/l", data=json.dumps({"spec": {"holderIdentity": "a"}}), headers=MERGE
        )
        patch = {"metadata": {"resourceVersion": stale}, "spec": {"holderIdentity": "b"}}
        resp = await cluster.patch(f"{LEASES_URL}/l", data=json.dumps(patch), headers=MERGE)
        assert resp.status == 409
        assert (await resp.json())["message"] == (
            'Operation cannot be fulfilled on leases.coordination.k8s.io "l": the object has been modified; '
            "please apply your changes to the latest version and try again"
        )


async def test_a_watch_from_a_compacted_version_is_410_and_watches_end_with_a_bookmark() -> None:
    async with emulated_cluster() as cluster:
        client = KubeClient(configuration_for(str(cluster.url)), user_agent=OPERATOR_USER_AGENT)
        try:
            await client.create(MS_URL, {"metadata": {"name": "a"}, "spec": {"model": MODEL}})
            _, version = await client.list_with_version(MS_URL)
            events = [event async for event in client.watch(MS_URL, version, timeout_s=1)]
            assert [e["type"] for e in events] == ["BOOKMARK"]
            assert events[0]["object"]["metadata"]["resourceVersion"] == version
            await client.merge_patch(f"{MS_URL}/a", {"spec": {"replicas": 2}})
            cluster.compact()
            with pytest.raises(KubeError) as gone:
                async for _ in client.watch(MS_URL, version, timeout_s=1):
                    pass
            assert gone.value.status == 410
            assert f"too old resource version: {version} (" in str(gone.value)
        finally:
            await client.close()


async def test_a_401_loads_the_credentials_again_once() -> None:
    """Projected service-account tokens rotate: a 401 re-reads them and retries once; a second 401 is an
    error naming the call."""
    tokens: list[str] = []

    async def leases(request: web.Request) -> web.Response:
        tokens.append(request.headers.get("Authorization", ""))
        if request.headers.get("Authorization") != "Bearer fresh":
            return web.json_response({"kind": "Status", "code": 401, "message": "Unauthorized"}, status=401)
        return web.json_response({"kind": "LeaseList", "metadata": {"resourceVersion": "7"}, "items": []})

    app = web.Application()
    app.router.add_get(LEASES_URL, leases)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"

    def with_token(token: str) -> Configuration:
        return Configuration(
            host=url, api_key={"BearerToken": token}, api_key_prefix={"BearerToken": "Bearer"}
        )

    async def rotated() -> Configuration:
        return with_token("fresh")

    async def still_stale() -> Configuration:
        return with_token("stale")

    try:
        client = KubeClient(with_token("stale"), user_agent=OPERATOR_USER_AGENT, reload=rotated)
        try:
            assert await client.list_with_version(LEASES_URL) == ([], "7")
        finally:
            await client.close()
        assert tokens == ["Bearer stale", "Bearer fresh"]
        client = KubeClient(with_token("stale"), user_agent=OPERATOR_USER_AGENT, reload=still_stale)
        try:
            with pytest.raises(KubeError, match="HTTP 401: Unauthorized"):
                await client.list(LEASES_URL)
        finally:
            await client.close()
    finally:
        await runner.cleanup()


async def test_the_crd_kube_apiserver_refused_is_refused_in_its_words() -> None:
    """The first defect: the CRD as generated before object defaults were written out in full."""
    async with emulated_cluster() as cluster:
        crd = render_crd()
        crd["metadata"]["name"] = "modelservers.example.dev"
        crd["spec"]["group"] = "example.dev"
        spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
        spec["properties"]["engine"]["default"] = {}
        resp = await cluster.post("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", json=crd)
        assert resp.status == 422
        assert (await resp.json())["message"] == (
            'CustomResourceDefinition.apiextensions.k8s.io "modelservers.example.dev" is invalid: '
            "spec.validation.openAPIV3Schema.properties[spec].properties[engine].default: Invalid value: "
            '"object": no such key: maxBatchedTokens evaluating rule: engine.maxBatchedTokens must be at '
            "least engine.blockSize"
        )
