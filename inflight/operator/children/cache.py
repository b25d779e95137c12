"""The model cache's objects: its PersistentVolumeClaim and its download Job (pure functions).

Both are shared by every ModelServer of the same source and revision in the namespace: they carry one
non-controller owner reference per such ModelServer (the controller adds itself to an existing one), so
they are garbage-collected with the last of them. The Job is created once and never changed: its pod
runs `inflight download` into the folder `<key>` of the claim. Exit codes a retry cannot fix (auth, not
found, checksum, bad source) fail the Job at once through its podFailurePolicy; network errors and an
evicted pod are retried (the download resumes where it stopped).
"""

from __future__ import annotations

from typing import Any

from inflight.download.errors import PERMANENT
from inflight.operator.api.types import ModelServer
from inflight.operator.children.server import (
    MANAGED_BY,
    download_container,
    pod_security,
    scheduling,
    shared_owner_reference,
)
from inflight.operator.model_cache import ANNOTATION_SOURCE, DOWNLOAD_CONTAINER, LABEL_CACHE, Cache

CACHE_MOUNT = "/cache"
DOWNLOAD_BACKOFF_LIMIT = 6


def cache_labels(cache: Cache) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "inflight-model-cache",
        "app.kubernetes.io/component": "model-cache",
        "app.kubernetes.io/part-of": "inflight",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        LABEL_CACHE: cache.key,
    }


def cache_selector() -> dict[str, str]:
    """Labels every model cache's claim and Job carry (to list them)."""
    return {"app.kubernetes.io/component": "model-cache", "app.kubernetes.io/managed-by": MANAGED_BY}


def _metadata(ms: ModelServer, cache: Cache, name: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": ms.metadata.namespace,
        "labels": cache_labels(cache),
        "annotations": {ANNOTATION_SOURCE: cache.identity},
        "ownerReferences": [shared_owner_reference(ms)],
    }


def claim(ms: ModelServer, cache: Cache) -> dict[str, Any]:
    """The PersistentVolumeClaim of `model.cache.pvc`."""
    assert cache.pvc is not None
    spec: dict[str, Any] = {
        "accessModes": list(cache.pvc.access_modes),
        "resources": {"requests": {"storage": cache.pvc.size}},
        "volumeMode": "Filesystem",
    }
    if cache.pvc.storage_class_name is not None:
        spec["storageClassName"] = cache.pvc.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _metadata(ms, cache, cache.claim_name),
        "spec": spec,
    }


def download_job(ms: ModelServer, cache: Cache) -> dict[str, Any]:
    """The one Job that fills the cache; on the ModelServer's nodes (its volume binds where they are)."""
    mounts = [{"name": "cache", "mountPath": CACHE_MOUNT}, {"name": "tmp", "mountPath": "/tmp"}]
    container = download_container(ms, DOWNLOAD_CONTAINER, f"{CACHE_MOUNT}/{cache.key}", mounts)
    assert container is not None  # the CRD allows a cache only for hf:// and s3:// sources
    container["terminationMessagePolicy"] = "FallbackToLogsOnError"  # the downloader's error line
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [container],
        "volumes": [
            {"name": "cache", "persistentVolumeClaim": {"claimName": cache.claim_name}},
            {"name": "tmp", "emptyDir": {}},
        ],
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": pod_security(),
    }
    pod_spec.update(scheduling(ms))
    fail_at_once = {
        "action": "FailJob",
        "onExitCodes": {
            "containerName": DOWNLOAD_CONTAINER,
            "operator": "In",
            "values": sorted(int(code) for code in PERMANENT),
        },
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _metadata(ms, cache, cache.job_name),
        "spec": {
            "backoffLimit": DOWNLOAD_BACKOFF_LIMIT,
            "podFailurePolicy": {"rules": [fail_at_once]},
            "template": {"metadata": {"labels": cache_labels(cache)}, "spec": pod_spec},
        },
    }
