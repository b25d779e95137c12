"""The model cache (spec.model.cache): one PVC and one download Job per model source and revision.

Pure builder tests (every object strict-valid for Kubernetes 1.32, names shared by source and revision,
the emptyDir bound without a cache), and the real operator against the emulated API server: two
ModelServers and a restart with one Job, the Deployment waiting for it, the phases in order, and a failed
Job reported as Degraded with the downloader's message.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from inflight import sizing
from inflight.operator.api.types import ModelServer
from inflight.operator.children import cache as cache_builders
from inflight.operator.children import server as builders
from inflight.operator.controller import Controller
from inflight.operator.model_cache import cache_of
from inflight.operator.placement import place

from support.emulated import (
    DEPLOYMENTS,
    JOBS,
    MODELSERVERS,
    PVCS,
    eventually,
    kubeconfig_cluster,
    posted_events,
    running_operator,
)
from support.kube_emulator import KubeEmulator

NS = "ns"
MS_URL = f"/apis/inflight.dev/v1alpha1/namespaces/{NS}/modelservers"
MERGE = {"Content-Type": "application/merge-patch+json"}
SOURCE = "hf://Qwen/Qwen2.5-0.5B-Instruct"
CPU = {"gpu": {"count": 0}, "cpu": "2", "memory": "8Gi"}


def body(name: str, cache: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    model: dict[str, Any] = {"name": name, "source": SOURCE, "maxModelLen": 512}
    if cache is not None:
        model["cache"] = cache
    return {
        "apiVersion": "inflight.dev/v1alpha1",
        "kind": "ModelServer",
        "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}"},
        "spec": {"model": model, "resources": CPU, **spec},
    }


def parsed(name: str, cache: dict[str, Any] | None = None, **spec: Any) -> ModelServer:
    return ModelServer.model_validate(body(name, cache, **spec))


def validate(obj: dict[str, Any]) -> None:
    kubernetes_validate.validate(obj, "1.32.0", strict=True)


# -- builders ----------------------------------------------------------------------------------------


def test_cache_objects_are_valid_and_shared_by_source_and_revision() -> None:
    pvc = {"pvc": {"size": "5Gi", "storageClassName": "fast"}}
    a, b = parsed("a", pvc), parsed("b", pvc, replicas=3)
    cache = cache_of(a)
    assert cache is not None and cache == cache_of(b)  # same source and revision: one claim, one Job
    assert (
        cache.job_name == f"inflight-download-{cache.key}"
        and cache.claim_name == f"inflight-model-{cache.key}"
    )
    other_revision = body("d", pvc)
    other_revision["spec"]["model"]["revision"] = "v2"
    main_revision = body("d", pvc)
    main_revision["spec"]["model"]["revision"] = "main"
    assert cache_of(ModelServer.model_validate(main_revision)) == cache  # absent revision = main
    assert cache_of(ModelServer.model_validate(other_revision)).key != cache.key  # type: ignore[union-attr]
    existing = cache_of(parsed("e", {"claimName": "models"}))
    assert existing is not None and existing.claim_name == "models" and existing.key != cache.key

    claim = cache_builders.claim(a, cache)
    job = cache_builders.download_job(a, cache)
    for obj in (claim, job):
        validate(obj)
        assert obj["metadata"]["ownerReferences"][0]["controller"] is False  # shared: no single controller
    assert claim["spec"] == {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": "5Gi"}},
        "volumeMode": "Filesystem",
        "storageClassName": "fast",
    }
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == [
        "inflight",
        "download",
        SOURCE,
        f"/cache/{cache.key}",
        "--revision",
        "main",
    ]
    from inflight.cli import build_parser

    assert build_parser().parse_args(container["command"][1:]).command == "download"
    assert (
        pod["restartPolicy"] == "Never" and container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    )
    rule = job["spec"]["podFailurePolicy"]["rules"][0]
    assert rule["action"] == "FailJob" and rule["onExitCodes"]["values"] == [2, 3, 4, 6, 8]

    placement = place(a.spec, [])
    deployment = builders.deployment(a, placement, 2)
    validate(deployment)
    pod = deployment["spec"]["template"]["spec"]
    assert "initContainers" not in pod  # the Job downloaded; pods never do
    volume = next(v for v in pod["volumes"] if v["name"] == "model")
    assert volume == {
        "name": "model",
        "persistentVolumeClaim": {"claimName": cache.claim_name, "readOnly": True},
    }
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "model")
    assert mount == {"name": "model", "mountPath": "/models/download", "subPath": cache.key, "readOnly": True}


def test_without_a_cache_the_download_emptydir_is_bounded() -> None:
    ms = parsed("a")
    placement = place(ms.spec, [])
    deployment = builders.deployment(ms, placement, 1)
    validate(deployment)
    pod = deployment["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "model")
    limit = volume["emptyDir"]["sizeLimit"]
    params = sizing.find_model("Qwen/Qwen2.5-0.5B").parameter_count()  # type: ignore[union-attr]
    assert limit == f"{math.ceil((params * 4 * 1.1 + sizing.GIB) / sizing.MIB)}Mi"
    # The bound holds a float32 checkpoint (the widest) and is far from unbounded.
    assert params * 4 < int(limit.removesuffix("Mi")) * sizing.MIB < params * 4 * 1.1 + 2 * sizing.GIB
    assert pod["initContainers"][0]["command"][:3] == ["inflight", "download", SOURCE]
    gguf = body("g")
    gguf["spec"]["model"]["source"] = SOURCE + "/m.Q4_1.gguf"
    assert builders.model_path(ModelServer.model_validate(gguf)) == "/models/download/m.Q4_1.gguf"


# -- the running operator ------------------------------------------------------------------------------


@pytest.fixture
async def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[KubeEmulator]:
    monkeypatch.setattr(Controller, "download_poll_seconds", 0.2)
    async with kubeconfig_cluster(tmp_path, monkeypatch) as emulator:
        yield emulator


def created(name: str, cache: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    obj = body(name, cache, **spec)
    obj["metadata"] = {"name": name}
    return obj


def stored_all(cluster: KubeEmulator, resource: str) -> list[dict[str, Any]]:
    return [
        obj.raw
        for (res, _, _), obj in cluster.objects.items()
        if f"{res.group + '/' if res.group else ''}{res.version}/{res.plural}" == resource and not obj.deleted
    ]


def model_cache(cluster: KubeEmulator, name: str) -> dict[str, Any]:
    return dict(((cluster.stored(MODELSERVERS, NS, name) or {}).get("status") or {}).get("modelCache") or {})


def condition(cluster: KubeEmulator, name: str, kind: str) -> dict[str, Any]:
    for c in ((cluster.stored(MODELSERVERS, NS, name) or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == kind:
            return dict(c)
    return {}


def phases(cluster: KubeEmulator, name: str) -> list[str]:
    """status.modelCache.phase of every write of the ModelServer, consecutive repeats dropped."""
    seen: list[str] = []
    for logged in cluster._log:
        obj = logged.event["object"]
        if logged.resource.plural == "modelservers" and obj["metadata"]["name"] == name:
            phase = ((obj.get("status") or {}).get("modelCache") or {}).get("phase")
            if phase and (not seen or seen[-1] != phase):
                seen.append(phase)
    return seen


async def patch(cluster: KubeEmulator, url: str, patch_body: dict[str, Any]) -> None:
    resp = await cluster.patch(url, data=json.dumps(patch_body), headers=MERGE)
    assert resp.status == 200, await resp.text()


async def job_pod(cluster: KubeEmulator, job: str, name: str, status: dict[str, Any] | None = None) -> None:
    """Play the Job controller: a pod of `job` (with the labels it sets)."""
    pod = {
        "metadata": {"name": name, "labels": {"batch.kubernetes.io/job-name": job, "job-name": job}},
        "spec": {"containers": [{"name": "download", "image": "x"}]},
        "status": status or {"phase": "Running"},
    }
    resp = await cluster.post(f"/api/v1/namespaces/{NS}/pods", json=pod)
    assert resp.status in (200, 201), await resp.text()


async def test_one_job_for_two_modelservers_replicas_and_a_restart(cluster: KubeEmulator) -> None:
    cache = {"pvc": {"size": "5Gi"}}
    async with running_operator():
        await cluster.post(MS_URL, json=created("a", cache, replicas=2))
        job = await eventually(lambda: stored_all(cluster, JOBS), what="the download Job")
        job_name = job[0]["metadata"]["name"]
        claim = await eventually(lambda: stored_all(cluster, PVCS), what="the cache's PVC")
        assert claim[0]["spec"]["resources"]["requests"]["storage"] == "5Gi"
        await eventually(lambda: model_cache(cluster, "a").get("phase") == "Downloading", what="Downloading")
        assert condition(cluster, "a", "Ready")["reason"] == "Downloading"
        assert model_cache(cluster, "a")["message"].endswith("waiting for the Job's pod")
        assert condition(cluster, "a", "Progressing")["status"] == "True"
        assert cluster.stored(DEPLOYMENTS, NS, "a") is None  # the pods wait for the download

        # The Job's pod logs progress: status follows with bytes done / total.
        await job_pod(cluster, job_name, f"{job_name}-x1")
        cluster.pod_logs[(NS, f"{job_name}-x1")] = (
            "downloading hf://Qwen/Qwen2.5-0.5B-Instruct@main: 7 files, 3.8 KiB into /cache/k\n"
            "progress 1000/4000 bytes 25.0% (1000 B of 3.9 KiB) | model.safetensors 900/3800 | 1.0 KiB/s\n"
        )
        await eventually(
            lambda: (
                (model_cache(cluster, "a").get("bytesDone"), model_cache(cluster, "a").get("bytesTotal"))
                == (1000, 4000)
            ),
            what="bytes in status",
        )
        assert "1000 B of 3.9 KiB (25%)" in model_cache(cluster, "a")["message"]

        # A second ModelServer of the same source shares the claim and the Job.
        await cluster.post(MS_URL, json=created("b", cache))
        await eventually(
            lambda: len(stored_all(cluster, JOBS)[0]["metadata"]["ownerReferences"]) == 2, what="shared Job"
        )
        assert len(stored_all(cluster, JOBS)) == 1 and len(stored_all(cluster, PVCS)) == 1
        assert len(stored_all(cluster, PVCS)[0]["metadata"]["ownerReferences"]) == 2
        assert cluster.stored(DEPLOYMENTS, NS, "b") is None

        # The Job succeeds: both Deployments start, mounting the cache read-only, without downloading.
        complete = {"conditions": [{"type": "Complete", "status": "True"}], "succeeded": 1}
        await patch(cluster, f"/apis/batch/v1/namespaces/{NS}/jobs/{job_name}/status", {"status": complete})
        for name in ("a", "b"):
            dep = await eventually(
                lambda n=name: cluster.stored(DEPLOYMENTS, NS, n), what=f"Deployment {name}"
            )
            pod = dep["spec"]["template"]["spec"]
            assert "initContainers" not in pod
            assert {
                "name": "model",
                "persistentVolumeClaim": {"claimName": claim[0]["metadata"]["name"], "readOnly": True},
            } in pod["volumes"]
        await eventually(lambda: model_cache(cluster, "a").get("phase") == "Ready", what="Ready")
        assert cluster.stored(DEPLOYMENTS, NS, "a")["spec"]["replicas"] == 2

        # Scaling up changes replicas only.
        await patch(cluster, f"{MS_URL}/a/scale", {"spec": {"replicas": 3}})
        await eventually(
            lambda: cluster.stored(DEPLOYMENTS, NS, "a")["spec"]["replicas"] == 3, what="3 replicas"
        )
    job_uid = stored_all(cluster, JOBS)[0]["metadata"]["uid"]
    template = cluster.stored(DEPLOYMENTS, NS, "a")["spec"]["template"]

    async with running_operator():  # an operator restart, then scale-ups: nothing downloads again
        await patch(cluster, f"{MS_URL}/a/scale", {"spec": {"replicas": 4}})
        await patch(cluster, f"{MS_URL}/b/scale", {"spec": {"replicas": 2}})
        for name, replicas in (("a", 4), ("b", 2)):
            await eventually(
                lambda n=name, r=replicas: cluster.stored(DEPLOYMENTS, NS, n)["spec"]["replicas"] == r,
                what=f"{name} scaled by the restarted operator",
            )
    jobs = stored_all(cluster, JOBS)
    assert [j["metadata"]["uid"] for j in jobs] == [job_uid]  # exactly one Job, ever
    assert cluster.stored(DEPLOYMENTS, NS, "a")["spec"]["template"] == template
    assert phases(cluster, "a") == ["Downloading", "Ready"]
    assert phases(cluster, "b") == ["Downloading", "Ready"]
    for obj in (*jobs, *stored_all(cluster, PVCS)):
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "inflight-operator"

    # Deleting one ModelServer keeps the shared cache; deleting the last one removes it.
    assert (await cluster.delete(f"{MS_URL}/a")).status == 200
    assert len(stored_all(cluster, JOBS)) == 1 and len(stored_all(cluster, PVCS)) == 1
    assert (await cluster.delete(f"{MS_URL}/b")).status == 200
    assert stored_all(cluster, JOBS) == [] and stored_all(cluster, PVCS) == []


async def test_a_failed_download_is_degraded_with_the_downloaders_message(cluster: KubeEmulator) -> None:
    async with running_operator():
        await cluster.post(MS_URL, json=created("a", {"pvc": {"size": "5Gi"}}))
        job = await eventually(lambda: stored_all(cluster, JOBS), what="the download Job")
        job_name = job[0]["metadata"]["name"]
        error = (
            "inflight download: authentication (exit 3): HTTP 401 for the metadata of "
            "Qwen/Qwen2.5-0.5B-Instruct@main (GatedRepo): set HF_TOKEN or --token-file\n"
        )
        terminated = {"exitCode": 3, "reason": "Error", "message": "progress 0/0 bytes\n" + error}
        await job_pod(
            cluster,
            job_name,
            f"{job_name}-x1",
            {
                "phase": "Failed",
                "containerStatuses": [{"name": "download", "state": {"terminated": terminated}}],
            },
        )
        failed = {
            "type": "Failed",
            "status": "True",
            "reason": "PodFailurePolicy",
            "message": f"Container download for pod {NS}/{job_name}-x1 failed with exit code 3 matching "
            "FailJob rule at index 0",
        }
        await patch(
            cluster,
            f"/apis/batch/v1/namespaces/{NS}/jobs/{job_name}/status",
            {"status": {"conditions": [failed], "failed": 1}},
        )
        degraded = await eventually(
            lambda: (c := condition(cluster, "a", "Degraded")).get("status") == "True" and c, what="Degraded"
        )
        assert degraded["reason"] == "DownloadFailed"
        assert (
            "exit code 3 (authentication): inflight download: authentication (exit 3): HTTP 401"
            in degraded["message"]
        )
        assert f"kubectl delete job -n {NS} {job_name}" in degraded["message"]
        assert model_cache(cluster, "a")["phase"] == "Failed"
        assert condition(cluster, "a", "Ready")["status"] == "False"
        assert cluster.stored(DEPLOYMENTS, NS, "a") is None
        warning = await eventually(
            lambda: [e for e in posted_events(cluster) if e["reason"] == "DownloadFailed"], what="a Warning"
        )
        assert warning[0]["type"] == "Warning"
    assert phases(cluster, "a") == ["Downloading", "Failed"]


async def test_a_missing_existing_claim_is_degraded(cluster: KubeEmulator) -> None:
    async with running_operator():
        await cluster.post(MS_URL, json=created("a", {"claimName": "models"}))
        degraded = await eventually(
            lambda: (c := condition(cluster, "a", "Degraded")).get("status") == "True" and c, what="Degraded"
        )
        assert (
            degraded["reason"] == "CacheClaimNotFound"
            and f"{NS}/models does not exist" in degraded["message"]
        )
        assert stored_all(cluster, JOBS) == []
        await cluster.post(
            f"/api/v1/namespaces/{NS}/persistentvolumeclaims",
            json={"metadata": {"name": "models"}, "spec": {}},
        )
        await patch(cluster, f"{MS_URL}/a", {"spec": {"replicas": 1}})  # any event: the next reconcile
        job = await eventually(lambda: stored_all(cluster, JOBS), what="the Job in the existing claim")
        assert job[0]["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"] == {
            "claimName": "models"
        }


async def test_a_cache_no_modelserver_uses_any_more_is_released(cluster: KubeEmulator) -> None:
    cache = {"pvc": {"size": "5Gi"}}
    async with running_operator():
        await cluster.post(MS_URL, json=created("a", cache))
        await cluster.post(MS_URL, json=created("b", cache))
        await eventually(
            lambda: [len(j["metadata"]["ownerReferences"]) for j in stored_all(cluster, JOBS)] == [2],
            what="one Job shared by a and b",
        )
        (main_job,) = stored_all(cluster, JOBS)
        (main_claim,) = stored_all(cluster, PVCS)
        uid_b = cluster.stored(MODELSERVERS, NS, "b")["metadata"]["uid"]

        # a moves to another revision: a second cache; the first one stays for b alone.
        await patch(cluster, f"{MS_URL}/a", {"spec": {"model": {"revision": "v2"}}})
        await eventually(lambda: len(stored_all(cluster, JOBS)) == 2, what="the Job of revision v2")
        first = lambda: cluster.stored(JOBS, NS, main_job["metadata"]["name"])  # noqa: E731
        await eventually(
            lambda: [r["uid"] for r in first()["metadata"]["ownerReferences"]] == [uid_b], what="a released"
        )
        claim = cluster.stored(PVCS, NS, main_claim["metadata"]["name"])
        assert [r["uid"] for r in claim["metadata"]["ownerReferences"]] == [uid_b]

        # b drops its cache: it was the last user of the first cache, which goes.
        await patch(cluster, f"{MS_URL}/b", {"spec": {"model": {"cache": None}}})
        await eventually(lambda: first() is None, what="the unused Job deleted")
        await eventually(
            lambda: cluster.stored(PVCS, NS, main_claim["metadata"]["name"]) is None,
            what="the unused PVC deleted",
        )
        assert len(stored_all(cluster, JOBS)) == 1 and len(stored_all(cluster, PVCS)) == 1  # a's v2 cache
        dep = await eventually(lambda: cluster.stored(DEPLOYMENTS, NS, "b"), what="b without a cache")
        assert dep["spec"]["template"]["spec"]["initContainers"][0]["name"] == "fetch-model"
