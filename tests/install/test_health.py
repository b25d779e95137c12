"""The GitOps health checks shipped with the chart, executed on sample ModelServers.

Argo CD runs `charts/inflight/health/modelserver.lua` in gopher-lua (Lua 5.1); here it runs in
Lua 5.1 through lupa. The Flux `healthCheckExprs` (CEL) run through cel-python, in the order
kustomize-controller evaluates them (inProgress, failed, current; none true -> InProgress).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import celpy
import lupa.lua51
import pytest
import yaml

HEALTH_DIR = Path(__file__).resolve().parents[2] / "charts" / "inflight" / "health"
INSTALL_DOC = Path(__file__).resolve().parents[2] / "docs" / "install.md"


def condition(
    kind: str, status: str, reason: str, message: str = "", observed_generation: int | None = None
) -> dict[str, Any]:
    found: dict[str, Any] = {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": "2026-01-01T00:00:00Z",
    }
    if observed_generation is not None:
        found["observedGeneration"] = observed_generation
    return found


def model_server(generation: int, status: dict[str, Any] | None) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "inflight.dev/v1alpha1",
        "kind": "ModelServer",
        "metadata": {"name": "llama", "namespace": "default", "generation": generation},
        "spec": {"model": {"name": "llama", "source": "builtin:tiny"}},
    }
    if status is not None:
        obj["status"] = status
    return obj


def status(observed_generation: int, *conditions: dict[str, Any]) -> dict[str, Any]:
    return {
        "observedGeneration": observed_generation,
        "conditions": list(conditions),
        "replicas": 1,
        "readyReplicas": 1,
    }


READY = model_server(
    3,
    status(
        3,
        condition("Sized", "True", "Planned", "412 KV blocks, 24 slots", 3),
        condition("Ready", "True", "AllReplicasReady", "1/1 replicas ready", 3),
        condition("Progressing", "False", "RolloutComplete", "", 3),
        condition("Degraded", "False", "AsExpected", "", 3),
    ),
)
ROLLING_OUT = model_server(
    3,
    status(
        3,
        condition("Sized", "True", "Planned", "412 KV blocks, 24 slots", 3),
        condition("Ready", "False", "RolloutInProgress", "0/1 replicas run the current template", 3),
        condition("Progressing", "True", "RollingOut", "0/1 replicas updated", 3),
        condition("Degraded", "False", "AsExpected", "", 3),
    ),
)
DOES_NOT_FIT = model_server(
    2,
    status(
        2,
        condition("Sized", "False", "WeightsDoNotFit", "needs 4 x H100-80GB", 2),
        condition("Ready", "False", "NotSized", "", 2),
        condition("Progressing", "False", "NotSized", "", 2),
        condition(
            "Degraded",
            "True",
            "WeightsDoNotFit",
            "141 GB of weights do not fit 1 x H100-80GB: set resources.gpu.count to 4",
            2,
        ),
    ),
)
STALE_READY = model_server(
    4,
    status(
        3,
        condition("Ready", "True", "AllReplicasReady", "1/1 replicas ready", 3),
        condition("Degraded", "False", "AsExpected", "", 3),
    ),
)
STALE_DEGRADED = model_server(
    5,
    status(
        4,
        condition("Ready", "False", "NotSized", "", 4),
        condition("Degraded", "True", "WeightsDoNotFit", "set resources.gpu.count to 4", 4),
    ),
)
STALE_CONDITION = model_server(
    6,
    status(
        6,
        condition("Ready", "True", "AllReplicasReady", "1/1 replicas ready", 5),
        condition("Degraded", "False", "AsExpected", "", 6),
    ),
)
CONDITIONS_WITHOUT_GENERATION = model_server(
    2,
    status(
        2,
        condition("Ready", "True", "AllReplicasReady", "2/2 replicas ready"),
        condition("Degraded", "False", "AsExpected", ""),
    ),
)

CASES = [
    pytest.param(READY, "Healthy", "AllReplicasReady: 1/1 replicas ready", id="ready"),
    pytest.param(ROLLING_OUT, "Progressing", "RollingOut: 0/1 replicas updated", id="rolling-out"),
    pytest.param(
        DOES_NOT_FIT,
        "Degraded",
        "WeightsDoNotFit: 141 GB of weights do not fit 1 x H100-80GB: set resources.gpu.count to 4",
        id="degraded",
    ),
    pytest.param(STALE_READY, "Progressing", "observe generation 4", id="stale-observed-generation"),
    pytest.param(STALE_DEGRADED, "Progressing", "observe generation 5", id="stale-degraded"),
    pytest.param(STALE_CONDITION, "Progressing", "Ready condition of generation 6", id="stale-condition"),
    pytest.param(CONDITIONS_WITHOUT_GENERATION, "Healthy", "2/2 replicas ready", id="no-condition-gen"),
]


def argocd_health(obj: dict[str, Any]) -> dict[str, str]:
    lua = lupa.lua51.LuaRuntime()
    assert lua.execute("return _VERSION") == "Lua 5.1"
    lua.globals().obj = lua.table_from(obj, recursive=True)
    result = lua.execute((HEALTH_DIR / "modelserver.lua").read_text())
    return {"status": result["status"], "message": result["message"]}


@pytest.mark.parametrize(("obj", "expected_status", "message_part"), CASES)
def test_argocd_health(obj: dict[str, Any], expected_status: str, message_part: str) -> None:
    health = argocd_health(obj)
    assert health["status"] == expected_status
    assert message_part in health["message"]


def test_argocd_health_before_first_reconcile() -> None:
    health = argocd_health(model_server(1, None))
    assert health == {
        "status": "Progressing",
        "message": "Waiting for the inflight operator to reconcile this ModelServer",
    }


def flux_checks() -> dict[str, str]:
    entries = yaml.safe_load((HEALTH_DIR / "flux-healthcheckexprs.yaml").read_text())
    assert isinstance(entries, list)
    assert len(entries) == 1
    entry: dict[str, str] = entries[0]
    assert (entry["apiVersion"], entry["kind"]) == ("inflight.dev/v1alpha1", "ModelServer")
    return entry


def flux_health(obj: dict[str, Any]) -> str:
    env = celpy.Environment()
    activation = {key: celpy.json_to_cel(value) for key, value in obj.items()}
    checks = flux_checks()
    for field, result in (("inProgress", "InProgress"), ("failed", "Failed"), ("current", "Current")):
        program = env.program(env.compile(checks[field]))
        if bool(program.evaluate(activation)):
            return result
    return "InProgress"


ARGO_TO_FLUX = {"Healthy": "Current", "Progressing": "InProgress", "Degraded": "Failed"}


@pytest.mark.parametrize(("obj", "expected_status", "message_part"), CASES)
def test_flux_health_agrees_with_argocd(obj: dict[str, Any], expected_status: str, message_part: str) -> None:
    assert flux_health(obj) == ARGO_TO_FLUX[expected_status]


def test_install_doc_shows_the_tested_flux_snippet() -> None:
    doc = INSTALL_DOC.read_text()
    body = "\n".join(
        line
        for line in (HEALTH_DIR / "flux-healthcheckexprs.yaml").read_text().splitlines()
        if not line.startswith("#")
    )
    indented = "\n".join(f"    {line}" if line else "" for line in body.splitlines())
    assert indented in doc, "docs/install.md's Flux healthCheckExprs snippet differs from the tested file"
