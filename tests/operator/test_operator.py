"""A real kopf operator against the emulator over real HTTP: the reconcile scenarios end to end."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from inflight.operator.autoscaling.pod_metrics import KV_BLOCKS, SLOTS

from support.autoscale_harness import mark_ready, pod_from_template, report_deployment_status
from support.emulated import (
    DEPLOYMENTS,
    MODELSERVERS,
    SERVICES,
    eventually,
    kubeconfig_cluster,
    posted_events,
    running_operator,
)
from support.kube_emulator import KubeEmulator

NS = "ns"
MS_URL = f"/apis/inflight.dev/v1alpha1/namespaces/{NS}/modelservers"
DEP_URL = f"/apis/apps/v1/namespaces/{NS}/deployments"
MERGE = {"Content-Type": "application/merge-patch+json"}
H100 = {
    "nvidia.com/gpu.memory": "81559",
    "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
    "nvidia.com/gpu.count": "8",
}


@pytest.fixture
async def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[KubeEmulator]:
    async with kubeconfig_cluster(tmp_path, monkeypatch) as emulator:
        yield emulator


def tiny(name: str = "tiny", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "inflight.dev/v1alpha1",
        "kind": "ModelServer",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": name, "source": "builtin:tiny", "maxModelLen": 512},
            "resources": {"gpu": {"count": 0}, "cpu": "1", "memory": "2Gi"},
            **spec,
        },
    }


async def patch(cluster: KubeEmulator, url: str, body: dict[str, Any]) -> None:
    resp = await cluster.patch(url, data=json.dumps(body), headers=MERGE)
    assert resp.status == 200, await resp.text()


def condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    for c in (obj or {}).get("status", {}).get("conditions") or []:
        if c["type"] == kind:
            return dict(c)
    return {}


async def complete_rollout(cluster: KubeEmulator, name: str) -> None:
    """Play the Deployment controller and kubelet: every replica on the current template and ready."""
    dep = cluster.stored(DEPLOYMENTS, NS, name)
    assert dep is not None
    n = dep["spec"]["replicas"]
    status = {
        "observedGeneration": dep["metadata"]["generation"],
        "replicas": n,
        "updatedReplicas": n,
        "readyReplicas": n,
        "availableReplicas": n,
    }
    await patch(cluster, f"{DEP_URL}/{name}/status", {"status": status})


def args_of(dep: dict[str, Any] | None) -> list[str]:
    assert dep is not None
    return list(dep["spec"]["template"]["spec"]["containers"][0]["args"])


async def test_lifecycle_create_ready_scale_update_repair_delete(cluster: KubeEmulator) -> None:
    async with running_operator():
        created = await (await cluster.post(MS_URL, json=tiny())).json()
        uid = created["metadata"]["uid"]

        # create -> children with owner references, status Sized and Progressing
        dep = await eventually(lambda: cluster.stored(DEPLOYMENTS, NS, "tiny"), what="the Deployment")
        svc = await eventually(lambda: cluster.stored(SERVICES, NS, "tiny"), what="the Service")
        for child in (dep, svc):
            assert child["metadata"]["ownerReferences"][0]["uid"] == uid
        ms = await eventually(
            lambda: (m := cluster.stored(MODELSERVERS, NS, "tiny")) and m.get("status") and m, what="status"
        )
        assert condition(ms, "Sized")["status"] == "True"
        assert (
            condition(ms, "Progressing")["status"] == "True" and condition(ms, "Ready")["status"] == "False"
        )
        assert (
            ms["status"]["sizing"]["kvBlocks"]
            == int(args_of(dep)[args_of(dep).index("--num-kv-blocks") + 1])
            > 0
        )
        assert (
            ms["status"]["selector"] == "app.kubernetes.io/name=inflight-server,inflight.dev/modelserver=tiny"
        )
        assert (
            ms["metadata"]["generation"] == 1 and "finalizers" not in ms["metadata"]
        )  # the operator never writes spec/metadata

        # the rollout completes -> Ready, replicas reported
        await complete_rollout(cluster, "tiny")
        ms = await eventually(
            lambda: (
                condition(m := cluster.stored(MODELSERVERS, NS, "tiny"), "Ready").get("status") == "True"
                and m
            ),
            what="Ready",
        )
        assert ms["status"]["readyReplicas"] == 1 and ms["status"]["observedGeneration"] == 1
        assert (
            condition(ms, "Progressing")["status"] == "False"
            and condition(ms, "Degraded")["status"] == "False"
        )

        # scale through the scale subresource -> Deployment replicas, same template
        template = dep["spec"]["template"]
        await patch(cluster, f"{MS_URL}/tiny/scale", {"spec": {"replicas": 3}})
        dep = await eventually(
            lambda: (d := cluster.stored(DEPLOYMENTS, NS, "tiny")) and d["spec"]["replicas"] == 3 and d,
            what="3 replicas",
        )
        assert dep["spec"]["template"] == template
        await eventually(
            lambda: condition(cluster.stored(MODELSERVERS, NS, "tiny"), "Ready").get("status") == "False",
            what="not Ready while scaling",
        )
        await complete_rollout(cluster, "tiny")
        await eventually(
            lambda: (
                (cluster.stored(MODELSERVERS, NS, "tiny") or {}).get("status", {}).get("readyReplicas") == 3
            ),
            what="3 ready",
        )

        # spec change -> new template, Ready only after the new template rolled out
        await patch(cluster, f"{MS_URL}/tiny", {"spec": {"engine": {"scheduler": "static"}}})
        dep = await eventually(
            lambda: "static" in args_of(d := cluster.stored(DEPLOYMENTS, NS, "tiny")) and d,
            what="the new template",
        )
        generation = cluster.stored(MODELSERVERS, NS, "tiny")["metadata"]["generation"]
        assert generation == 3  # 1: created, 2: scaled (spec.replicas), 3: scheduler changed
        ms = await eventually(
            lambda: (
                (m := cluster.stored(MODELSERVERS, NS, "tiny"))["status"]["observedGeneration"] == 3 and m
            ),
            what="status for generation 3",
        )
        assert (
            condition(ms, "Ready")["status"] == "False"
            and condition(ms, "Progressing")["reason"] == "RollingOut"
        )
        await complete_rollout(cluster, "tiny")
        await eventually(
            lambda: condition(cluster.stored(MODELSERVERS, NS, "tiny"), "Ready").get("status") == "True",
            what="Ready on generation 3",
        )

        # a child edited by hand is repaired; a deleted child is recreated
        await patch(cluster, f"{DEP_URL}/tiny", {"spec": {"replicas": 1}})
        await eventually(
            lambda: cluster.stored(DEPLOYMENTS, NS, "tiny")["spec"]["replicas"] == 3, what="replicas repaired"
        )
        old_uid = cluster.stored(DEPLOYMENTS, NS, "tiny")["metadata"]["uid"]
        assert (await cluster.delete(f"{DEP_URL}/tiny")).status == 200
        restored = await eventually(
            lambda: (d := cluster.stored(DEPLOYMENTS, NS, "tiny")) and d["metadata"]["uid"] != old_uid and d,
            what="the Deployment restored",
        )
        assert "static" in args_of(restored)
        assert (await cluster.delete(f"/api/v1/namespaces/{NS}/services/tiny")).status == 200
        await eventually(lambda: cluster.stored(SERVICES, NS, "tiny"), what="the Service restored")

        # deleting the ModelServer leaves nothing behind (owner references + garbage collection)
        assert (await cluster.delete(f"{MS_URL}/tiny")).status == 200
        await eventually(
            lambda: (
                cluster.stored(DEPLOYMENTS, NS, "tiny") is None
                and cluster.stored(SERVICES, NS, "tiny") is None
            ),
            what="cleanup",
        )
        await asyncio.sleep(0.5)
        assert cluster.stored(DEPLOYMENTS, NS, "tiny") is None  # not recreated

        events = posted_events(cluster)
        reasons = {(e["type"], e["reason"]) for e in events}
        assert ("Normal", "Fits") in reasons and ("Normal", "Ready") in reasons


async def test_impossible_spec_is_degraded_until_fixed(cluster: KubeEmulator) -> None:
    await cluster.post("/api/v1/nodes", json={"metadata": {"name": "gpu-1", "labels": H100}})
    body = {
        "apiVersion": "inflight.dev/v1alpha1",
        "kind": "ModelServer",
        "metadata": {"name": "big"},
        "spec": {
            "model": {"name": "llama", "source": "hf://meta-llama/Llama-3.1-70B-Instruct"},
            "resources": {"gpu": {"count": 1}},
        },
    }
    async with running_operator(resync_seconds=0.5):
        await cluster.post(MS_URL, json=body)
        ms = await eventually(
            lambda: (
                condition(m := cluster.stored(MODELSERVERS, NS, "big"), "Degraded").get("status") == "True"
                and m
            ),
            what="Degraded",
        )
        degraded = condition(ms, "Degraded")
        assert degraded["reason"] == "DoesNotFit" and "use 2 GPUs of this type" in degraded["message"]
        assert condition(ms, "Sized")["status"] == "False" and condition(ms, "Ready")["status"] == "False"
        assert condition(ms, "Progressing")["status"] == "False"
        assert (
            ms["status"]["sizing"]["minGPUs"] == 2
            and ms["status"]["sizing"]["gpuMemorySource"] == "node-labels"
        )
        assert cluster.stored(DEPLOYMENTS, NS, "big") is None  # nothing that would crash-loop on OOM
        warning = await eventually(
            lambda: [e for e in posted_events(cluster) if e["reason"] == "DoesNotFit"], what="a Warning Event"
        )
        assert warning[0]["type"] == "Warning" and warning[0]["involvedObject"]["name"] == "big"
        await asyncio.sleep(1.5)  # three resyncs later: still one Event and one status write, no retry storm
        assert len([e for e in posted_events(cluster) if e["reason"] == "DoesNotFit"]) == 1

        await patch(cluster, f"{MS_URL}/big", {"spec": {"resources": {"gpu": {"count": 4}}}})
        dep = await eventually(
            lambda: cluster.stored(DEPLOYMENTS, NS, "big"), what="the Deployment for 4 GPUs"
        )
        assert (
            dep["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
        )
        await eventually(
            lambda: condition(cluster.stored(MODELSERVERS, NS, "big"), "Degraded").get("status") == "False",
            what="not Degraded",
        )


async def test_missing_secret_is_degraded_and_heals_on_resync(cluster: KubeEmulator) -> None:
    async with running_operator(resync_seconds=0.5):
        await cluster.post(MS_URL, json=tiny("secured", auth={"apiKeySecretRef": {"name": "api"}}))
        ms = await eventually(
            lambda: (
                condition(m := cluster.stored(MODELSERVERS, NS, "secured"), "Degraded").get("status")
                == "True"
                and m
            ),
            what="Degraded",
        )
        assert (
            condition(ms, "Degraded")["reason"] == "SecretNotFound"
            and "ns/api" in condition(ms, "Degraded")["message"]
        )
        await cluster.post(
            f"/api/v1/namespaces/{NS}/secrets",
            json={"metadata": {"name": "api"}, "data": {"api-key": "c2VjcmV0"}},
        )
        dep = await eventually(
            lambda: cluster.stored(DEPLOYMENTS, NS, "secured"),
            what="the Deployment after the Secret appeared",
        )
        assert "--api-key-file" in args_of(dep)


def settled(cluster: KubeEmulator) -> bool:
    """Whether the operator listed the pods after its last status write (the reconcile that wrote nothing)."""
    status_path = f"{MS_URL}/tiny/status"
    writes = [
        i for i, (_, method, path) in enumerate(cluster.audit) if method == "PATCH" and path == status_path
    ]
    pods_path = f"/api/v1/namespaces/{NS}/pods"
    return bool(writes) and any(
        method == "GET" and path == pods_path for _, method, path in cluster.audit[writes[-1] + 1 :]
    )


async def test_a_replica_short_of_its_kv_plan_is_noticed_from_the_pod_watch(cluster: KubeEmulator) -> None:
    """Pods are watched: a server pod turning ready reconciles its ModelServer at once, so SizingDrift
    follows within seconds (the resync is an hour away here)."""
    metrics = f"{KV_BLOCKS} 1\n{SLOTS} 1\n"
    app = web.Application()

    async def serve_metrics(_: web.Request) -> web.Response:
        return web.Response(text=metrics)

    app.router.add_get("/metrics", serve_metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with running_operator(resync_seconds=3600):
            await cluster.post(MS_URL, json=tiny())
            dep = await eventually(lambda: cluster.stored(DEPLOYMENTS, NS, "tiny"), what="the Deployment")
            pod = pod_from_template(dep, "tiny-0", port)
            assert (await cluster.post(f"/api/v1/namespaces/{NS}/pods", json=pod)).status == 201
            ready_pod = {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
            await report_deployment_status(cluster, dep, {"tiny-0": ready_pod}, {})
            # The Deployment says ready before the pod is. That reconcile writes the status, whose own event
            # reconciles once more, writing nothing; once that one has looked at the pods (the audit shows
            # it), nothing but the pod's own event can bring the measurement.
            await eventually(lambda: settled(cluster), what="the reconciles after the Deployment's status")
            pod_url = f"/api/v1/namespaces/{NS}/pods/tiny-0"
            await mark_ready(cluster, pod_url)
            drift = await eventually(
                lambda: condition(cluster.stored(MODELSERVERS, NS, "tiny"), "SizingDrift") or None,
                what="the SizingDrift condition",
            )
            assert drift["status"] == "True" and "1 KV" in drift["message"], drift
    finally:
        await runner.cleanup()


def seventy_b(name: str, model: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    """A ModelServer serving Llama-3.1-70B: `model` adds to spec.model, `spec` to the rest of the spec."""
    return {
        "apiVersion": "inflight.dev/v1alpha1",
        "kind": "ModelServer",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": "llama", "source": "hf://meta-llama/Llama-3.1-70B-Instruct", **(model or {})},
            **spec,
        },
    }


def seventy_b_target(name: str, gpu: str, **target: Any) -> dict[str, Any]:
    """Llama-3.1-70B on 4 GPUs of `gpu`, slots planned for 512 + 256 tokens, serving spec.target."""
    return seventy_b(
        name,
        engine={"expectedTokensPerRequest": 768},
        resources={"gpu": {"count": 4, "type": gpu}},
        target={"promptTokens": 512, "outputTokens": 256, "maxReplicas": 5, **target},
    )


def replicas_of(cluster: KubeEmulator, name: str, wanted: int) -> dict[str, Any] | None:
    dep = cluster.stored(DEPLOYMENTS, NS, name)
    ms = cluster.stored(MODELSERVERS, NS, name)
    target = ((ms or {}).get("status") or {}).get("target") or {}
    done = dep is not None and dep["spec"]["replicas"] == wanted and target.get("replicas") == wanted
    return ms if done else None


async def test_a_target_rate_sets_the_replicas_the_cost_model_computes(cluster: KubeEmulator) -> None:
    """spec.target.requestsPerSecond -> the replicas `inflight size --workload` answers for the same
    model, GPUs and workload; a new target changes them; maxReplicas clips them (TargetMet False); a GPU
    type without speed figures and a CPU ModelServer run minReplicas and say why."""
    from inflight.sim.serving import Workload, answer

    def size_workload(rate: float) -> int:  # what `inflight size --workload` says
        workload = Workload(prompt_tokens=512, output_tokens=256, requests_per_s=rate)
        estimate = answer("meta-llama/Llama-3.1-70B", "H100-80GB", 4, workload).estimate
        assert estimate is not None and estimate.replicas is not None
        return estimate.replicas

    assert (size_workload(50), size_workload(100), size_workload(200)) == (2, 4, 7)
    async with running_operator():
        await cluster.post(MS_URL, json=seventy_b_target("llama", "H100-80GB", requestsPerSecond=50))
        ms = await eventually(lambda: replicas_of(cluster, "llama", 2), what="2 replicas for 50 req/s")
        target = ms["status"]["target"]
        assert target["neededReplicas"] == 2 and target["gpuType"] == "H100-80GB"
        assert 25 < target["perReplicaRequestsPerSecond"] < 50
        assert ms["status"]["sizing"]["tensorParallel"] == 4
        met = condition(ms, "TargetMet")
        assert (met["status"], met["reason"]) == ("True", "Computed") and "takes 2 replicas" in met["message"]

        await patch(cluster, f"{MS_URL}/llama", {"spec": {"target": {"requestsPerSecond": 100}}})
        await eventually(lambda: replicas_of(cluster, "llama", 4), what="4 replicas for 100 req/s")

        await patch(cluster, f"{MS_URL}/llama", {"spec": {"target": {"requestsPerSecond": 200}}})
        ms = await eventually(lambda: replicas_of(cluster, "llama", 5), what="maxReplicas for 200 req/s")
        assert ms["status"]["target"]["neededReplicas"] == 7
        met = condition(ms, "TargetMet")
        assert (met["status"], met["reason"]) == ("False", "MaxReplicasTooLow")
        assert "target.maxReplicas is 5" in met["message"]
        assert condition(ms, "Degraded")["status"] == "False"  # it serves, with fewer replicas than needed
        clipped = await eventually(
            lambda: [e for e in posted_events(cluster) if e["reason"] == "MaxReplicasTooLow"],
            what="a Warning Event",
        )
        assert clipped[0]["type"] == "Warning"

        await cluster.post(
            MS_URL, json=seventy_b_target("blackwell", "B200", requestsPerSecond=50, minReplicas=2)
        )
        cpu = tiny(
            "cpu", target={"requestsPerSecond": 5, "promptTokens": 64, "outputTokens": 64, "maxReplicas": 3}
        )
        await cluster.post(MS_URL, json=cpu)
        for name, gpu in (("blackwell", "B200"), ("cpu", "cpu")):
            ms = await eventually(
                lambda name=name: replicas_of(cluster, name, 2 if name == "blackwell" else 1),
                what=f"minReplicas on {gpu}",
            )
            met = condition(ms, "TargetMet")
            assert (met["status"], met["reason"]) == ("False", "NoSpeedFigures")
            assert (
                f"no speed figures for {gpu}" in met["message"]
                and "neededReplicas" not in ms["status"]["target"]
            )


def seventy_b_fp8(name: str, gpus: int, **model: Any) -> dict[str, Any]:
    """Llama-3.1-70B with an FP8 KV cache on `gpus` GPUs of the node's type."""
    return seventy_b(name, model, engine={"kvCacheDtype": "fp8"}, resources={"gpu": {"count": gpus}})


async def test_fp8_weights_and_kv_are_planned_on_two_h100_as_inflight_size_plans_them(
    cluster: KubeEmulator,
) -> None:
    from inflight import sizing

    await cluster.post("/api/v1/nodes", json={"metadata": {"name": "gpu-1", "labels": H100}})
    shape, h100 = sizing.find_model("meta-llama/Llama-3.1-70B"), sizing.find_gpu("H100-80GB")
    assert shape is not None and h100 is not None
    expected = sizing.plan(
        shape,
        gpu_memory_bytes=h100.memory_mib * sizing.MIB,
        gpus=2,
        gpu_type=h100,
        quantization="fp8",
        kv_cache_dtype="fp8",
    )
    async with running_operator(resync_seconds=0.5):
        await cluster.post(MS_URL, json=seventy_b_fp8("fp8", 2, quantization="fp8"))
        dep = await eventually(lambda: cluster.stored(DEPLOYMENTS, NS, "fp8"), what="the Deployment")
        args = args_of(dep)
        flags = dict(zip(args[::2], args[1::2], strict=False))
        assert "--quantization" in args and args[args.index("--quantization") + 1] == "fp8"
        assert args[args.index("--kv-cache-dtype") + 1] == "fp8"
        assert args[args.index("--tensor-parallel-size") + 1] == "2"
        assert args[args.index("--num-kv-blocks") + 1] == str(expected.kv_blocks) == "29727"
        assert args[args.index("--max-slots") + 1] == str(expected.slots) == "256"
        assert flags["--dtype"] == "bfloat16"
        ms = await eventually(
            lambda: (
                (m := cluster.stored(MODELSERVERS, NS, "fp8")) and m.get("status", {}).get("sizing") and m
            ),
            what="status.sizing",
        )
        planned = ms["status"]["sizing"]
        assert planned["kvCacheDtype"] == "float8_e4m3fn" and planned["quantization"] == "fp8"
        assert planned["maxSlotsGPUs"] == 2 and planned["kvBlocks"] == 29727 and planned["slots"] == 256
        assert planned["weightBytesPerGPU"] == expected.weight_bytes_per_gpu


async def test_fp8_on_a_gpu_without_fp8_is_degraded_with_the_fix(cluster: KubeEmulator) -> None:
    a100 = {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB", "nvidia.com/gpu.memory": "81920"}
    await cluster.post("/api/v1/nodes", json={"metadata": {"name": "gpu-1", "labels": a100}})
    async with running_operator(resync_seconds=0.5):
        await cluster.post(MS_URL, json=seventy_b_fp8("old-gpus", 4))
        ms = await eventually(
            lambda: (
                condition(m := cluster.stored(MODELSERVERS, NS, "old-gpus"), "Degraded").get("status")
                == "True"
                and m
            ),
            what="Degraded",
        )
        degraded = condition(ms, "Degraded")
        assert degraded["reason"] == "NoFP8Support"
        assert (
            "A100-80GB has no FP8 support" in degraded["message"]
            and "kv-cache-dtype auto" in degraded["message"]
        )
        assert cluster.stored(DEPLOYMENTS, NS, "old-gpus") is None
