"""Generated install artifacts are current; the chart's CRD copy admits the examples, rejects bad specs.

The admission check (schema with unknown fields rejected, API-server defaulting, then the CRD's CEL rules)
is `tests/support/crd_check.py` (the operator tests use it too), run here against the chart's copy of the CRD.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from support import crd_check

ROOT = Path(__file__).resolve().parents[2]
CHART_CRD = ROOT / "charts" / "inflight" / "crds" / "modelserver.yaml"
INSTALL_YAML = ROOT / "manifests" / "install.yaml"


def chart_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CHART_CRD.read_text())
    (version,) = crd["spec"]["versions"]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


def example_model_servers() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted((ROOT / "manifests").glob("*.yaml")):
        if path == INSTALL_YAML:
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "ModelServer":
                found.append((path.name, doc))
    return found


def tiny() -> dict[str, Any]:
    (obj,) = [doc for name, doc in example_model_servers() if name == "tiny-cpu.yaml"]
    return copy.deepcopy(obj)


def test_chart_crd_is_the_generated_crd() -> None:
    assert CHART_CRD.read_bytes() == (ROOT / "crds" / "modelserver.yaml").read_bytes(), (
        "charts/inflight/crds/modelserver.yaml differs from crds/modelserver.yaml: "
        "run `make install-yaml` (copies it, renders install.yaml)"
    )


def test_install_yaml_is_current() -> None:
    result = subprocess.run(
        [sys.executable, "scripts/render_install_yaml.py", "--check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


def test_install_yaml_is_a_complete_restricted_install() -> None:
    objects = [doc for doc in yaml.safe_load_all(INSTALL_YAML.read_text()) if doc]
    kinds = [obj["kind"] for obj in objects]
    assert kinds[:2] == ["Namespace", "CustomResourceDefinition"], "namespace and CRD must come first"
    assert {
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "Deployment",
        "PodDisruptionBudget",
    } <= set(kinds)
    namespace = objects[0]
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for obj in objects:
        kubernetes_validate.validate(obj, "1.32.0", strict=True)
        if obj["kind"] in ("ServiceAccount", "Deployment", "Role", "RoleBinding", "PodDisruptionBudget"):
            assert obj["metadata"]["namespace"] == namespace["metadata"]["name"]


def test_there_are_examples_for_cpu_gpu_multi_gpu_and_autoscaling() -> None:
    names = {name for name, _ in example_model_servers()}
    assert {"tiny-cpu.yaml", "llama-3.1-8b-l4.yaml", "llama-3.1-70b-h100.yaml", "autoscaling.yaml"} <= names


@pytest.mark.parametrize(
    ("name", "obj"),
    [
        pytest.param(name, obj, id=f"{name}:{obj['metadata']['name']}")
        for name, obj in example_model_servers()
    ],
)
def test_examples_are_admitted_by_the_chart_crd(name: str, obj: dict[str, Any]) -> None:
    assert crd_check.admission_errors(chart_schema(), obj) == [], name


def with_change(path: str, value: Any) -> dict[str, Any]:
    obj = tiny()
    *parents, leaf = path.split(".")
    node = obj
    for key in parents:
        node = node.setdefault(key, {})
    if value is None:
        del node[leaf]
    else:
        node[leaf] = value
    return obj


@pytest.mark.parametrize(
    ("obj", "complaint"),
    [
        pytest.param(with_change("spec.model", None), "spec.model: Required value", id="no-model"),
        pytest.param(
            with_change("spec.engine.maxSlots", "many"),
            "spec.engine.maxSlots in body must be of type integer",
            id="wrong-type",
        ),
        pytest.param(with_change("spec.engine.speed", "fast"), "speed", id="unknown-field"),
        pytest.param(
            with_change("spec.model.source", "ftp://models/llama"),
            "model.source must start with",
            id="bad-scheme",
        ),
        pytest.param(
            with_change("spec.autoscaling", {"minReplicas": 3, "maxReplicas": 2, "target": 8}),
            "autoscaling.minReplicas must be <= maxReplicas",
            id="min-above-max",
        ),
    ],
)
def test_bad_model_servers_are_rejected_by_the_chart_crd(obj: dict[str, Any], complaint: str) -> None:
    errors = crd_check.admission_errors(chart_schema(), obj)
    assert errors, "the chart's CRD admitted an invalid ModelServer"
    assert any(complaint in error for error in errors), errors
