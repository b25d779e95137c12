"""ModelServer + placement -> the Deployment and Service manifests (pure functions, no API calls).

The Deployment runs `inflight serve` with the sizing plan as flags, probes `/health` (liveness and a
startup probe bounded by startupTimeoutSeconds) and `/ready` (readiness), rolls out with maxSurge 0 so a
rollout never needs a spare GPU, and runs non-root with a read-only root filesystem. Both objects carry
the Kubernetes recommended labels and a controller owner reference to the ModelServer, so deleting the
ModelServer garbage-collects them.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from typing import Any

from inflight import sizing
from inflight.operator.api.types import API_VERSION, BUILTIN_SOURCES, KIND, ModelServer
from inflight.operator.model_cache import cache_of, revision
from inflight.operator.placement import Placement

PORT = 8000
API_KEY_DIR = "/var/run/inflight"
API_KEY_FILE = f"{API_KEY_DIR}/api-key"
MODELS_DIR = "/models"
SERVER_UID = 10001  # the `inflight` user of server/Dockerfile
AWS_CLI_IMAGE = "public.ecr.aws/aws-cli/aws-cli:2.22.35"
DOWNLOAD_DIR = f"{MODELS_DIR}/download"
# emptyDir bound for a download without a cache: float32 weights (the widest checkpoint dtype) + 10% +
# 1 GiB for tokenizer and config files. A runaway download gets the pod evicted instead of filling the node.
DOWNLOAD_LIMIT_BYTES_PER_PARAMETER = sizing.DTYPE_BYTES["float32"] * 1.1
DOWNLOAD_LIMIT_EXTRA_BYTES = sizing.GIB
# /dev/shm per tensor-parallel rank (memory-backed; NCCL's intra-node buffers need far less).
SHM_GIB_PER_RANK = 1

LABEL_MODELSERVER = "inflight.dev/modelserver"
LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
ANNOTATION_TEMPLATE_HASH = "inflight.dev/template-hash"
MANAGED_BY = "inflight-operator"
SERVER_CONTAINER = "server"


# The label every server pod carries, whichever ModelServer it serves (the router and the operator watch it).
SERVER_POD_LABEL = {"app.kubernetes.io/name": "inflight-server"}


def selector_labels(ms: ModelServer) -> dict[str, str]:
    return {**SERVER_POD_LABEL, LABEL_MODELSERVER: ms.metadata.name}


def image_version(image: str) -> str | None:
    """The tag of `repo/name:tag` as a label value (None for digests, no tag, or an invalid value)."""
    if "@" in image:
        return None
    tag = image.rpartition("/")[2].partition(":")[2]
    return tag if tag and LABEL_VALUE.match(tag) else None


def labels(ms: ModelServer) -> dict[str, str]:
    result = {
        **selector_labels(ms),
        "app.kubernetes.io/instance": ms.metadata.name,
        "app.kubernetes.io/component": "model-server",
        "app.kubernetes.io/part-of": "inflight",
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }
    version = image_version(ms.spec.image)
    if version is not None:
        result["app.kubernetes.io/version"] = version
    return result


def selector_string(ms: ModelServer) -> str:
    """`status.selector` for the scale subresource (what `kubectl scale` and an HPA count pods by)."""
    return ",".join(f"{key}={value}" for key, value in sorted(selector_labels(ms).items()))


def endpoint(ms: ModelServer) -> str:
    return f"http://{ms.metadata.name}.{ms.metadata.namespace}.svc:{PORT}/v1"


def owner_reference(ms: ModelServer) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": ms.metadata.name,
        "uid": ms.metadata.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def shared_owner_reference(ms: ModelServer) -> dict[str, Any]:
    """An owner reference for an object several ModelServers share (the model cache): not a controller;
    the garbage collector removes the object when its last owner is gone."""
    return {**owner_reference(ms), "controller": False}


def _metadata(ms: ModelServer) -> dict[str, Any]:
    return {
        "name": ms.metadata.name,
        "namespace": ms.metadata.namespace,
        "labels": labels(ms),
        "ownerReferences": [owner_reference(ms)],
    }


def model_path(ms: ModelServer) -> str:
    """The `--model` argument: where the weights are inside the server container."""
    source = ms.spec.model.source
    if source in BUILTIN_SOURCES:  # made (or fetched) by the server itself
        return source
    if source.startswith("pvc://"):
        return f"{MODELS_DIR}/pvc/{source.removeprefix('pvc://').rstrip('/')}"
    if source.startswith("file://"):
        return source.removeprefix("file://")
    gguf = source.rstrip("/").rpartition("/")[2]
    if gguf.endswith(".gguf"):  # one named GGUF file of the repository or prefix
        return f"{DOWNLOAD_DIR}/{gguf}"
    return DOWNLOAD_DIR  # hf:// and s3://: fetched by the download Job (cache) or an init container


def server_args(ms: ModelServer, placement: Placement) -> list[str]:
    """The flags of `inflight serve`, with the sizing plan's KV blocks and slots."""
    spec, plan = ms.spec, placement.plan
    args = [
        "--model",
        model_path(ms),
        "--served-model-name",
        spec.model.name,
        "--host",
        "0.0.0.0",
        "--port",
        str(PORT),
        "--dtype",
        plan.dtype,
        "--max-slots",
        str(plan.slots),
        "--num-kv-blocks",
        str(plan.kv_blocks),
        "--block-size",
        str(spec.engine.block_size),
        "--max-model-len",
        str(spec.model.max_model_len),
        "--max-num-batched-tokens",
        str(spec.engine.max_batched_tokens),
        "--scheduler",
        spec.engine.scheduler.value,
        "--enable-prefix-caching" if spec.engine.prefix_caching else "--no-enable-prefix-caching",
        "--gpu-memory-utilization",
        f"{spec.engine.gpu_memory_utilization:g}",
    ]
    if spec.model.quantization is not None:
        args += ["--quantization", spec.model.quantization]
    if spec.engine.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", spec.engine.kv_cache_dtype]
    if plan.tensor_parallel > 1:
        # One rank per GPU of the plan (the pod asks for resources.gpu.count GPUs, the plan's degree).
        args += ["--tensor-parallel-size", str(plan.tensor_parallel)]
    if spec.auth is not None:
        args += ["--api-key-file", API_KEY_FILE]
    return args


def shm_size_limit(tensor_parallel: int) -> str:
    """The memory-backed /dev/shm of a tensor-parallel pod: NCCL's shared-memory transport between the
    GPUs of one node uses it (the container runtime's 64 MiB default is too small for it)."""
    return f"{SHM_GIB_PER_RANK * tensor_parallel}Gi"


def _container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "runAsUser": SERVER_UID,
        "runAsGroup": SERVER_UID,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def pod_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": SERVER_UID,
        "runAsGroup": SERVER_UID,
        "fsGroup": SERVER_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def download_container(
    ms: ModelServer, name: str, dest: str, mounts: list[dict[str, Any]]
) -> dict[str, Any] | None:
    """A container fetching hf:// weights (`inflight download`) or s3:// ones (`aws s3 sync`) to `dest`."""
    source = ms.spec.model.source
    env: list[dict[str, Any]] = [{"name": "HOME", "value": "/tmp"}]
    if source.startswith("hf://"):
        token = ms.spec.model.hf_token_secret_ref
        if token is not None:
            secret = {"secretKeyRef": {"name": token.name, "key": token.key}}
            env.append({"name": "HF_TOKEN", "valueFrom": secret})
        command = ["inflight", "download", source, dest, "--revision", revision(ms.spec.model) or "main"]
        image = ms.spec.image
    elif source.startswith("s3://"):
        # The server image carries no boto3; the AWS CLI image syncs with the pod's credentials.
        command = ["aws", "s3", "sync", "--only-show-errors", source, dest]
        image = AWS_CLI_IMAGE
    else:
        return None
    return {
        "name": name,
        "image": image,
        "imagePullPolicy": ms.spec.image_pull_policy,
        "command": command,
        "env": env,
        "volumeMounts": mounts,
        "securityContext": _container_security(),
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "4Gi"}},
    }


def _download_init_container(ms: ModelServer) -> dict[str, Any] | None:
    """Without a cache: an init container fetches hf:// or s3:// weights into the pod's `model` emptyDir."""
    if cache_of(ms) is not None:
        return None  # the download Job filled the cache before the Deployment was created
    mounts = [{"name": "model", "mountPath": MODELS_DIR}, {"name": "tmp", "mountPath": "/tmp"}]
    return download_container(ms, "fetch-model", DOWNLOAD_DIR, mounts)


def download_size_limit(placement: Placement) -> str:
    """The model emptyDir's sizeLimit: the checkpoint at its widest plus a margin, in MiB."""
    limit = placement.plan.parameter_count * DOWNLOAD_LIMIT_BYTES_PER_PARAMETER + DOWNLOAD_LIMIT_EXTRA_BYTES
    return f"{math.ceil(limit / sizing.MIB)}Mi"


def _resources(ms: ModelServer) -> dict[str, Any]:
    spec = ms.spec.resources
    amounts: dict[str, str] = {"cpu": spec.cpu, "memory": spec.memory}
    if spec.gpu.count > 0:
        amounts[spec.gpu.resource_name] = str(spec.gpu.count)
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _volumes_and_mounts(
    ms: ModelServer, placement: Placement
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes: list[dict[str, Any]] = [{"name": "tmp", "emptyDir": {}}]
    mounts: list[dict[str, Any]] = [{"name": "tmp", "mountPath": "/tmp"}]
    tensor_parallel = placement.plan.tensor_parallel
    if tensor_parallel > 1:
        shm = {"medium": "Memory", "sizeLimit": shm_size_limit(tensor_parallel)}
        volumes.append({"name": "dshm", "emptyDir": shm})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    source = ms.spec.model.source
    if source.startswith("pvc://"):
        claim = source.removeprefix("pvc://").split("/", 1)[0]
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": "model", "mountPath": f"{MODELS_DIR}/pvc/{claim}", "readOnly": True})
    elif (cache := cache_of(ms)) is not None:  # the download Job's folder in the cache volume
        volumes.append(
            {"name": "model", "persistentVolumeClaim": {"claimName": cache.claim_name, "readOnly": True}}
        )
        mounts.append({"name": "model", "mountPath": DOWNLOAD_DIR, "subPath": cache.key, "readOnly": True})
    elif source.startswith(("hf://", "s3://")):
        volumes.append({"name": "model", "emptyDir": {"sizeLimit": download_size_limit(placement)}})
        mounts.append({"name": "model", "mountPath": MODELS_DIR, "readOnly": True})
    if ms.spec.auth is not None:
        ref = ms.spec.auth.api_key_secret_ref
        secret = {
            "secretName": ref.name,
            "items": [{"key": ref.key, "path": "api-key"}],
            "defaultMode": 0o440,
        }
        volumes.append({"name": "api-key", "secret": secret})
        mounts.append({"name": "api-key", "mountPath": API_KEY_DIR, "readOnly": True})
    return volumes, mounts


def scheduling(ms: ModelServer) -> dict[str, Any]:
    """The pod fields that say who a ModelServer's pods run as and where: its service account (s3:// through
    workload identity, too), node selector and tolerations; the ones the spec leaves out are absent."""
    spec = ms.spec
    fields: dict[str, Any] = {}
    if spec.service_account_name:
        fields["serviceAccountName"] = spec.service_account_name
    if spec.node_selector:
        fields["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        fields["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in spec.tolerations]
    return fields


def pod_template(ms: ModelServer, placement: Placement) -> dict[str, Any]:
    spec = ms.spec
    volumes, mounts = _volumes_and_mounts(ms, placement)
    http_get = {"port": "http", "scheme": "HTTP"}
    container = {
        "name": SERVER_CONTAINER,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["inflight", "serve"],
        "args": server_args(ms, placement),
        "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"}],
        "resources": _resources(ms),
        "volumeMounts": mounts,
        "startupProbe": {
            "httpGet": {**http_get, "path": "/health"},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": math.ceil(spec.startup_timeout_seconds / 10),
        },
        "livenessProbe": {
            "httpGet": {**http_get, "path": "/health"},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
        "readinessProbe": {
            "httpGet": {**http_get, "path": "/ready"},
            "periodSeconds": 5,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
        "securityContext": _container_security(),
    }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 60,
        "securityContext": pod_security(),
    }
    init = _download_init_container(ms)
    if init is not None:
        pod_spec["initContainers"] = [init]
    pod_spec.update(scheduling(ms))
    annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(PORT),
        "prometheus.io/path": "/metrics",
    }
    template = {"metadata": {"labels": labels(ms), "annotations": annotations}, "spec": pod_spec}
    digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:16]
    annotations[ANNOTATION_TEMPLATE_HASH] = digest
    return template


def template_hash(deployment: dict[str, Any]) -> str | None:
    annotations = deployment.get("spec", {}).get("template", {}).get("metadata", {}).get("annotations") or {}
    value = annotations.get(ANNOTATION_TEMPLATE_HASH)
    return str(value) if value is not None else None


def deployment(ms: ModelServer, placement: Placement, replicas: int) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(ms),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector_labels(ms)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "revisionHistoryLimit": 5,
            "progressDeadlineSeconds": ms.spec.startup_timeout_seconds + 300,
            "template": pod_template(ms, placement),
        },
    }


def service(ms: ModelServer) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(ms),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(ms),
            "ports": [{"name": "http", "port": PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }
