"""The model cache (spec.model.cache): which volume and Job hold a model, and what the Job's state means.

One PersistentVolumeClaim and ONE download Job per model source and revision in a namespace, named from a
hash of them (and of the claim, for an existing claim), so ModelServers that serve the same model share
both. The weights lie in the folder `<key>` of the volume; server pods mount it read-only. Pure: the
controller reads the objects, this module interprets them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from inflight.download.errors import ExitCode
from inflight.download.progress import human, parse_progress
from inflight.operator.api.types import ModelServer, ModelSpec, PVCSpec

LABEL_CACHE = "inflight.dev/model-cache"
ANNOTATION_SOURCE = "inflight.dev/model-source"
JOB_POD_LABEL = "batch.kubernetes.io/job-name"  # set by the Job controller on its pods
DOWNLOAD_CONTAINER = "download"


def revision(model: ModelSpec) -> str | None:
    """The revision downloaded: hf:// sources default to main; s3:// has none."""
    if model.source.startswith("hf://"):
        return model.revision or "main"
    return None


def identity(model: ModelSpec) -> str:
    """`SOURCE@REVISION` (hf://) or `SOURCE` (s3://): what a cache holds."""
    rev = revision(model)
    return f"{model.source}@{rev}" if rev else model.source


@dataclass(frozen=True)
class Cache:
    key: str  # names the Job, the created claim and the folder in the volume
    claim_name: str
    job_name: str
    identity: str
    pvc: PVCSpec | None  # the claim to create; None: an existing claim


def cache_of(ms: ModelServer) -> Cache | None:
    spec = ms.spec.model.cache
    if spec is None:
        return None
    what = identity(ms.spec.model)
    if spec.pvc is not None:
        key = hashlib.sha256(what.encode()).hexdigest()[:12]
        return Cache(key, f"inflight-model-{key}", f"inflight-download-{key}", what, spec.pvc)
    assert spec.claim_name is not None  # the CRD's CEL rule: exactly one of pvc and claimName
    key = hashlib.sha256(f"{spec.claim_name}\n{what}".encode()).hexdigest()[:12]
    return Cache(key, spec.claim_name, f"inflight-download-{key}", what, None)


@dataclass(frozen=True)
class Download:
    """The cache's state for status: phase Downloading, Ready or Failed."""

    cache: Cache
    phase: str
    message: str
    bytes_done: int | None = None
    bytes_total: int | None = None

    def status(self) -> dict[str, Any]:
        values = {
            "phase": self.phase,
            "claimName": self.cache.claim_name,
            "job": self.cache.job_name,
            "bytesDone": self.bytes_done,
            "bytesTotal": self.bytes_total,
            "message": self.message,
        }
        return {key: value for key, value in values.items() if value is not None}


def _condition(job: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    for condition in (job.get("status") or {}).get("conditions") or []:
        if condition.get("type") == kind and condition.get("status") == "True":
            return dict(condition)
    return None


def newest_pod(pods: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    return max(pods, key=lambda p: p.get("metadata", {}).get("creationTimestamp") or "", default=None)


def exit_meaning(code: int) -> str:
    try:
        return ExitCode(code).kind
    except ValueError:
        return "killed or crashed" if code > 128 else "unknown"


def _failure_detail(pods: Sequence[Mapping[str, Any]]) -> str:
    """The downloader's own error line (its termination message) and exit code, from the newest pod."""
    for pod in sorted(pods, key=lambda p: p.get("metadata", {}).get("creationTimestamp") or "", reverse=True):
        for status in (pod.get("status") or {}).get("containerStatuses") or []:
            terminated = (status.get("state") or {}).get("terminated") or {}
            if status.get("name") != DOWNLOAD_CONTAINER or not terminated or terminated.get("exitCode") == 0:
                continue
            code = int(terminated.get("exitCode", 1))
            lines = [line for line in str(terminated.get("message") or "").splitlines() if line.strip()]
            said = next((line for line in reversed(lines) if line.startswith("inflight download:")), None)
            said = said or (lines[-1] if lines else terminated.get("reason", ""))
            return f"exit code {code} ({exit_meaning(code)}): {said}"
    return ""


def download_state(
    cache: Cache, job: Mapping[str, Any], pods: Sequence[Mapping[str, Any]], log: str | None
) -> Download:
    """Ready when the Job completed, Failed when it failed (with the downloader's message), else Downloading
    (with the bytes of the last progress line of the running pod's log)."""
    where = f"{cache.identity} into PersistentVolumeClaim {cache.claim_name} (Job {cache.job_name})"
    if _condition(job, "Complete") is not None:
        return Download(cache, "Ready", f"downloaded {where}")
    failed = _condition(job, "Failed")
    if failed is not None:
        detail = _failure_detail(pods)
        reason = f"{failed.get('reason', 'Failed')}: {failed.get('message', '')}".rstrip(": ")
        message = f"downloading {where} failed: {detail or reason}"
        return Download(cache, "Failed", message + (f" [{reason}]" if detail else ""))
    progress = parse_progress(log or "")
    if progress is None:
        waiting = "the Job's pod runs, no progress line yet" if pods else "waiting for the Job's pod"
        return Download(cache, "Downloading", f"downloading {where}: {waiting}")
    done, total = progress
    percent = f" ({100 * done / total:.0f}%)" if total else ""
    return Download(
        cache, "Downloading", f"downloading {where}: {human(done)} of {human(total)}{percent}", done, total
    )
