"""The emulator adapter behaves like an API server where kopf and the operator depend on it."""

from __future__ import annotations

import asyncio
import json

from support.emulated import DEPLOYMENTS, MODELSERVERS, emulated_cluster
from support.kube_emulator import merge_diff, merge_patch, parse_selector, selected

MS_URL = "/apis/inflight.dev/v1alpha1/namespaces/ns/modelservers"
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
            "spec": {"x": 1},
        }
        created = await (await cluster.post(MS_URL, json=body)).json()
        meta = created["metadata"]
        assert meta["uid"] and meta["generation"] == 1 and meta["namespace"] == "ns"
        rv1 = meta["resourceVersion"]
        resp = await cluster.patch(f"{MS_URL}/a", data=json.dumps({"spec": {"x": 2}}), headers=MERGE)
        after_spec = await resp.json()
        assert after_spec["metadata"]["generation"] == 2 and int(
            after_spec["metadata"]["resourceVersion"]
        ) > int(rv1)
        await cluster.patch(
            f"{MS_URL}/a/status",
            data=json.dumps({"status": {"ready": True}, "spec": {"x": 9}}),
            headers=MERGE,
        )
        await cluster.patch(f"{MS_URL}/a", data=json.dumps({"status": {"ready": False}}), headers=MERGE)
        stored = cluster.stored(MODELSERVERS, "ns", "a")
        assert stored is not None
        assert stored["status"] == {"ready": True} and stored["spec"] == {"x": 2}  # each path writes its part
        assert stored["metadata"]["generation"] == 2  # status writes do not bump the generation
        await cluster.patch(f"{MS_URL}/a/scale", data=json.dumps({"spec": {"replicas": 3}}), headers=MERGE)
        assert cluster.stored(MODELSERVERS, "ns", "a")["spec"] == {"x": 2, "replicas": 3}


async def test_failed_json_patch_test_is_422_and_stale_merge_patch_is_409() -> None:
    async with emulated_cluster() as cluster:
        body = {"metadata": {"name": "a"}, "spec": {}}
        rv = (await (await cluster.post(MS_URL, json=body)).json())["metadata"]["resourceVersion"]
        await cluster.patch(f"{MS_URL}/a", data=json.dumps({"spec": {"y": 1}}), headers=MERGE)
        ops = [
            {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
            {"op": "add", "path": "/metadata/finalizers", "value": ["f"]},
        ]
        resp = await cluster.patch(f"{MS_URL}/a", data=json.dumps(ops), headers=JSON_PATCH)
        assert resp.status == 422
        resp = await cluster.patch(
            f"{MS_URL}/a",
            data=json.dumps({"metadata": {"resourceVersion": rv}, "spec": {"y": 2}}),
            headers=MERGE,
        )
        assert resp.status == 409
        current = cluster.stored(MODELSERVERS, "ns", "a")["metadata"]["resourceVersion"]
        ok = await cluster.patch(
            f"{MS_URL}/a",
            data=json.dumps({"metadata": {"resourceVersion": current}, "spec": {"y": 2}}),
            headers=MERGE,
        )
        assert ok.status == 200


async def test_list_filters_labels_and_watch_resumes_after_a_version() -> None:
    async with emulated_cluster() as cluster:
        for name, team in (("a", "x"), ("b", "y")):
            await cluster.post(
                MS_URL, json={"metadata": {"name": name, "labels": {"team": team}}, "spec": {}}
            )
        listing = await (await cluster.get(MS_URL, params={"labelSelector": "team=x"})).json()
        assert [i["metadata"]["name"] for i in listing["items"]] == ["a"]
        assert listing["kind"] == "ModelServerList"
        since = listing["metadata"]["resourceVersion"]
        await cluster.patch(f"{MS_URL}/a", data=json.dumps({"spec": {"v": 1}}), headers=MERGE)
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
        owner = await (await cluster.post(MS_URL, json={"metadata": {"name": "a"}, "spec": {}})).json()
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
