"""Builders: every object valid for Kubernetes 1.32 (strict), the server contract, security, placement."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from inflight.checkpoints.builtin import BUILTIN_NAMES
from inflight.engine.quantization import QUANTIZATION_CHOICES
from inflight.operator.api.crd import render_crd
from inflight.operator.api.types import ModelServer, ModelServerStatus
from inflight.operator.children import server
from inflight.operator.placement import Placement, SizingError, parse_quantity, place
from inflight.operator.status import desired_replicas

from support.crd_check import admission_errors

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p for p in (REPO / "manifests").glob("*.yaml") if "\nkind: ModelServer\n" in p.read_text())
H100_NODE = {"nvidia.com/gpu.memory": "81559", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}


def example(name: str) -> ModelServer:
    (doc,) = [
        d for d in yaml.safe_load_all((REPO / "manifests" / name).read_text()) if d["kind"] == "ModelServer"
    ]
    doc["metadata"]["uid"] = "0000-1111"
    return ModelServer.model_validate(doc)


def tiny(**spec: Any) -> ModelServer:
    spec.setdefault("resources", {"gpu": {"count": 0}, "memory": "2Gi"})
    body = {
        "metadata": {"name": "t", "namespace": "ns", "uid": "u1"},
        "spec": {"model": {"name": "t", "source": "builtin:tiny"}, **spec},
    }
    return ModelServer.model_validate(body)


def built(
    ms: ModelServer, nodes: list[dict[str, str]] | None = None
) -> tuple[Placement, dict[str, Any], dict[str, Any]]:
    placement = place(ms.spec, nodes or [])
    return (
        placement,
        server.deployment(ms, placement, desired_replicas(ms.spec, ms.status)),
        server.service(ms),
    )


def flags(deployment: dict[str, Any]) -> dict[str, str]:
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    out, i = {}, 0
    while i < len(args):
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            out[args[i]] = args[i + 1]
            i += 2
        else:
            out[args[i]] = ""
            i += 1
    return out


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_built_objects_are_valid_kubernetes(path: Path) -> None:
    _, deployment, service = built(example(path.name))
    kubernetes_validate.validate(deployment, "1.32.0", strict=True)
    kubernetes_validate.validate(service, "1.32.0", strict=True)


def test_server_command_follows_the_contract() -> None:
    ms = example("llama-3.1-70b-h100.yaml")
    placement, deployment, _ = built(ms, [H100_NODE])
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["inflight", "serve"]
    assert flags(deployment) == {
        "--model": "/models/pvc/models/meta-llama/Llama-3.1-70B-Instruct",
        "--served-model-name": "llama-3.1-70b-instruct",
        "--host": "0.0.0.0",
        "--port": "8000",
        "--dtype": "bfloat16",
        "--max-slots": str(placement.plan.slots),
        "--num-kv-blocks": str(placement.plan.kv_blocks),
        "--block-size": "16",
        "--max-model-len": "16384",
        "--max-num-batched-tokens": "8192",
        "--scheduler": "continuous",
        "--enable-prefix-caching": "",
        "--gpu-memory-utilization": "0.9",
        "--tensor-parallel-size": "4",
    }
    assert placement.plan.fits and placement.plan.tensor_parallel == 4
    assert placement.gpu_memory_source == "node-labels"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}


def test_tensor_parallel_pod_gets_its_degree_gpus_and_shared_memory() -> None:
    """70B on 4 x H100: one rank per GPU of the plan, and a memory-backed /dev/shm for NCCL."""
    _, deployment, _ = built(example("llama-3.1-70b-h100.yaml"), [H100_NODE])
    kubernetes_validate.validate(deployment, "1.32.0", strict=True)
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert flags(deployment)["--tensor-parallel-size"] == "4"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "4Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    # One GPU (or CPU): no flag, no shared-memory volume.
    _, single, _ = built(example("tiny-cpu.yaml"))
    assert "--tensor-parallel-size" not in flags(single)
    assert all(v["name"] != "dshm" for v in single["spec"]["template"]["spec"]["volumes"])


def test_probes_rollout_and_security() -> None:
    _, deployment, _ = built(example("tiny-cpu.yaml"))
    spec = deployment["spec"]
    assert spec["strategy"]["rollingUpdate"]["maxSurge"] == 0
    pod = spec["template"]["spec"]
    container = pod["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    startup = container["startupProbe"]
    assert startup["httpGet"]["path"] == "/health"
    assert startup["periodSeconds"] * startup["failureThreshold"] == 120  # startupTimeoutSeconds
    security = container["securityContext"]
    assert security["runAsNonRoot"] and security["readOnlyRootFilesystem"]
    assert security["allowPrivilegeEscalation"] is False and security["capabilities"] == {"drop": ["ALL"]}
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert "nvidia.com/gpu" not in container["resources"]["limits"]
    assert flags(deployment)["--model"] == "builtin:tiny" and flags(deployment)["--dtype"] == "float32"


def test_labels_owner_and_service() -> None:
    ms = example("tiny-cpu.yaml")
    _, deployment, service = built(ms)
    for obj in (deployment, service):
        meta = obj["metadata"]
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "inflight-operator"
        assert meta["labels"]["app.kubernetes.io/instance"] == "tiny"
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "inflight.dev/v1alpha1",
                "kind": "ModelServer",
                "name": "tiny",
                "uid": "0000-1111",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    template_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= template_labels.items()
    assert (
        server.selector_string(ms) == "app.kubernetes.io/name=inflight-server,inflight.dev/modelserver=tiny"
    )
    assert server.endpoint(ms) == "http://tiny.default.svc:8000/v1"


def test_api_key_and_hf_download() -> None:
    ms = example("llama-3.1-8b-l4.yaml")
    _, deployment, _ = built(ms)
    pod = deployment["spec"]["template"]["spec"]
    assert flags(deployment)["--api-key-file"] == "/var/run/inflight/api-key"
    secret = next(v for v in pod["volumes"] if v["name"] == "api-key")["secret"]
    assert secret["secretName"] == "llama-api-key" and secret["items"] == [
        {"key": "api-key", "path": "api-key"}
    ]
    (init,) = pod["initContainers"]
    assert init["command"] == [
        "inflight",
        "download",
        "hf://meta-llama/Llama-3.1-8B-Instruct",
        "/models/download",
        "--revision",
        "main",
    ]
    from inflight.cli import build_parser

    assert build_parser().parse_args(init["command"][1:]).command == "download"
    token = next(e for e in init["env"] if e["name"] == "HF_TOKEN")
    assert token["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    assert flags(deployment)["--model"] == "/models/download"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-L4"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


def test_template_hash_follows_the_spec() -> None:
    first = server.template_hash(built(tiny())[1])
    assert first == server.template_hash(built(tiny())[1])
    assert first != server.template_hash(built(tiny(engine={"scheduler": "static"}))[1])
    assert built(tiny(replicas=3))[1]["spec"]["replicas"] == 3
    assert server.template_hash(built(tiny(replicas=3))[1]) == first  # replicas are not in the template


def test_gpu_memory_sources_in_priority_order() -> None:
    ms = tiny(resources={"gpu": {"count": 1, "type": "L4", "memoryMiB": 1000}}, nodeSelector={"pool": "gpu"})
    other_pool = {**H100_NODE, "pool": "cpu"}
    l40s = {"nvidia.com/gpu.memory": "46068", "nvidia.com/gpu.product": "NVIDIA-L40S", "pool": "gpu"}
    assert place(ms.spec, [other_pool, l40s]).gpu_type == "NVIDIA-L40S"  # node labels, nodeSelector applied
    assert place(ms.spec, [other_pool]).gpu_memory_source == "catalog"
    spec_only = tiny(resources={"gpu": {"count": 1, "memoryMiB": 1000}})
    assert place(spec_only.spec, []).gpu_memory_mib == 1000
    with pytest.raises(SizingError) as error:
        place(tiny(resources={"gpu": {"count": 1}}).spec, [])
    assert error.value.reason == "NoGPUInfo" and "resources.gpu.type" in error.value.message


def test_unknown_model_needs_catalog_name_or_shape() -> None:
    ms = ModelServer.model_validate(
        {"metadata": {"name": "x"}, "spec": {"model": {"name": "x", "source": "hf://acme/secret-model"}}}
    )
    with pytest.raises(SizingError, match="catalogName"):
        place(ms.spec, [H100_NODE])
    shaped = ModelServer.model_validate(
        {
            "metadata": {"name": "x"},
            "spec": {
                "model": {
                    "name": "x",
                    "source": "s3://bucket/model",
                    "shape": {
                        "numLayers": 2,
                        "hiddenSize": 64,
                        "numAttentionHeads": 4,
                        "numKeyValueHeads": 2,
                        "headDim": 16,
                        "intermediateSize": 128,
                        "vocabSize": 100,
                    },
                },
                "resources": {"gpu": {"type": "T4"}},
            },
        }
    )
    placement, deployment, _ = built(shaped)
    assert placement.plan.fits and placement.plan.dtype == "float16"
    assert deployment["spec"]["template"]["spec"]["initContainers"][0]["command"][:3] == ["aws", "s3", "sync"]


def test_replica_count_has_one_writer() -> None:
    status = ModelServerStatus.model_validate({"autoscaling": {"desiredReplicas": 7}})
    assert desired_replicas(tiny().spec, status) == 1
    assert desired_replicas(tiny(replicas=0).spec, status) == 0
    builtin = tiny(autoscaling={"minReplicas": 2, "maxReplicas": 5, "target": 4}).spec
    assert desired_replicas(builtin, ModelServerStatus()) == 2
    assert desired_replicas(builtin, status) == 5  # clamped to maxReplicas
    hpa = tiny(
        replicas=4, autoscaling={"minReplicas": 1, "maxReplicas": 5, "target": 4, "actuator": "hpa"}
    ).spec
    assert desired_replicas(hpa, status) == 4  # the HPA's write through the scale subresource


def test_parse_quantity() -> None:
    assert parse_quantity("2Gi") == 2 * 2**30
    assert parse_quantity("500M") == 500_000_000
    assert parse_quantity("1.5Gi") == 3 * 2**29
    assert parse_quantity("100m") == 1
    with pytest.raises(ValueError, match="not a Kubernetes quantity"):
        parse_quantity("lots")


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_the_server_cli_accepts_the_deployment_command(path: Path) -> None:
    from inflight.cli import build_parser

    _, deployment, _ = built(example(path.name), [H100_NODE])
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][0] == "inflight"
    parsed = build_parser().parse_args([*container["command"][1:], *container["args"]])
    assert parsed.command == "serve"
    assert parsed.max_slots == int(flags(deployment)["--max-slots"])
    assert parsed.num_kv_blocks == int(flags(deployment)["--num-kv-blocks"])


def test_nodes_with_too_few_gpus_are_not_counted_and_none_is_an_error() -> None:
    ms = tiny(resources={"gpu": {"count": 4}})
    small = {
        "nvidia.com/gpu.memory": "23034",
        "nvidia.com/gpu.product": "NVIDIA-L4",
        "nvidia.com/gpu.count": "1",
    }
    big = {**H100_NODE, "nvidia.com/gpu.count": "8"}
    assert place(ms.spec, [small, big]).gpu_memory_mib == 81559  # the 1-GPU L4 node cannot host 4 GPUs
    with pytest.raises(SizingError) as error:
        place(ms.spec, [small])
    assert error.value.reason == "NotEnoughGPUsPerNode" and "at most 1 GPUs" in error.value.message


def test_version_label_from_the_image_tag() -> None:
    assert server.image_version("ghcr.io/inflight-dev/inflight-server:0.1.0") == "0.1.0"
    assert server.image_version("registry:5000/inflight-server") is None  # a port is not a tag
    assert server.image_version("inflight@sha256:" + "a" * 64) is None
    _, deployment, _ = built(example("tiny-cpu.yaml"))
    assert deployment["metadata"]["labels"]["app.kubernetes.io/version"] == "0.1.0"


def test_a_mixture_of_experts_shape_is_refused_as_unsupported() -> None:
    shape = {
        "numLayers": 2, "hiddenSize": 64, "numAttentionHeads": 4, "numKeyValueHeads": 2, "headDim": 16,
        "intermediateSize": 128, "vocabSize": 100, "numExperts": 8,
    }  # fmt: skip
    ms = ModelServer.model_validate(
        {"metadata": {"name": "x"}, "spec": {"model": {"name": "x", "source": "s3://b/m", "shape": shape}}}
    )
    with pytest.raises(SizingError) as error:
        place(ms.spec, [H100_NODE])
    assert error.value.reason == "UnsupportedArchitecture"
    assert "architecture not supported by the server" in error.value.message


@pytest.mark.parametrize("name", BUILTIN_NAMES)
def test_every_builtin_model_the_server_makes_is_a_source_the_operator_serves(name: str) -> None:
    """One list: the server's built-in models are the CRD's allowed builtin sources, each sized from the
    catalog and passed to `inflight serve --model` as it is."""
    source = f"builtin:{name}"
    model = {"name": "t", "source": source, "maxModelLen": 512}
    spec = {"model": model, "resources": {"gpu": {"count": 0}, "memory": "16Gi"}}
    crd_schema = render_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    body = {
        "apiVersion": "inflight.dev/v1alpha1",
        "kind": "ModelServer",
        "metadata": {"name": "t"},
        "spec": spec,
    }
    assert admission_errors(crd_schema, body) == []
    placement, deployment, _ = built(tiny(**spec))
    assert placement.plan.fits and placement.plan.model == source
    assert flags(deployment)["--model"] == source


def test_the_server_cli_takes_the_kv_cache_dtype_of_the_deployment() -> None:
    from inflight.cli import build_parser
    from inflight.engine.cli_args import engine_config_from_args

    ms = tiny(engine={"kvCacheDtype": "fp8"})
    _, deployment, _ = built(ms)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    parsed = build_parser().parse_args([*container["command"][1:], *container["args"]])
    assert engine_config_from_args(parsed).kv_cache_dtype == "fp8"
    _, default, _ = built(tiny())
    assert "--kv-cache-dtype" not in default["spec"]["template"]["spec"]["containers"][0]["args"]  # auto


@pytest.mark.parametrize("quantization", QUANTIZATION_CHOICES)
def test_the_server_cli_takes_every_quantization_the_crd_allows(quantization: str) -> None:
    from inflight.cli import build_parser
    from inflight.engine.cli_args import engine_config_from_args

    _, deployment, _ = built(
        tiny(model={"name": "t", "source": "builtin:tiny", "quantization": quantization})
    )
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    parsed = build_parser().parse_args([*container["command"][1:], *container["args"]])
    assert engine_config_from_args(parsed).quantization == quantization
