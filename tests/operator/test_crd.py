"""The generated CRD: current, valid, structural; examples accepted and negative examples rejected."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from inflight.cli import main
from inflight.operator.api.crd import render_crd, render_crd_yaml, render_reference_markdown
from inflight.operator.api.types import ModelServerSpec

from support.crd_check import (
    admission_errors,
    apply_defaults,
    cel_errors,
    default_errors,
    structural_errors,
)

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p for p in (REPO / "manifests").glob("*.yaml") if "\nkind: ModelServer\n" in p.read_text())
INVALID = sorted((Path(__file__).parent / "data" / "invalid").glob("*.yaml"))


def schema() -> dict[str, Any]:
    result: dict[str, Any] = render_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return result


def model_servers(paths: list[Path]) -> list[dict[str, Any]]:
    return [
        doc for path in paths for doc in yaml.safe_load_all(path.read_text()) if doc["kind"] == "ModelServer"
    ]


def test_crd_file_is_current() -> None:
    committed = (REPO / "crds" / "modelserver.yaml").read_text()
    assert committed == render_crd_yaml(), (
        "crds/modelserver.yaml is stale: run `inflight crd --out crds/modelserver.yaml`"
    )
    assert main(["crd", "--check", str(REPO / "crds" / "modelserver.yaml")]) == 0


def test_crd_check_reports_stale_file(tmp_path: Path) -> None:
    stale = tmp_path / "crd.yaml"
    stale.write_text("kind: CustomResourceDefinition\n")
    assert main(["crd", "--check", str(stale)]) == 1


def test_crd_is_a_valid_strict_custom_resource_definition() -> None:
    kubernetes_validate.validate(render_crd(), "1.32.0", strict=True)


def test_crd_schema_is_structural_and_documented() -> None:
    assert structural_errors(schema()) == []
    undocumented: list[str] = []

    def visit(node: dict[str, Any], path: str) -> None:
        for name, prop in node.get("properties", {}).items():
            if "description" not in prop and f"{path}.{name}" not in (".apiVersion", ".kind", ".metadata"):
                undocumented.append(f"{path}.{name}")
            visit(prop, f"{path}.{name}")
        if isinstance(node.get("items"), dict):
            visit(node["items"], f"{path}[]")

    visit(schema(), "")
    assert undocumented == []


def test_list_map_rules_are_checked_as_the_api_server_does() -> None:
    conditions = copy.deepcopy(render_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    conditions = conditions["properties"]["status"]["properties"]["conditions"]
    assert structural_errors(conditions, ".status.conditions") == []
    conditions["items"]["required"].remove("type")
    assert structural_errors(conditions, ".status.conditions") == [
        ".status.conditions.x-kubernetes-list-map-keys: all map keys must be required or have a default"
    ]
    del conditions["x-kubernetes-list-type"]
    assert structural_errors(conditions, ".status.conditions") == [
        ".status.conditions.x-kubernetes-list-map-keys: must only be used if x-kubernetes-list-type == map"
    ]


def test_crd_has_scale_and_status_subresources_and_printer_columns() -> None:
    version = render_crd()["spec"]["versions"][0]
    assert version["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    }
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns[:7] == ["Model", "GPUs", "GPU", "Slots", "KV Planned", "KV Measured", "Ready"]
    assert columns[-1] == "Age"


def test_every_default_passes_the_api_servers_checks_as_written() -> None:
    """kube-apiserver validates each `default` of a CRD, before nested defaults apply, against the schema
    and the CEL rules of its level; a CRD failing this is refused whole (the engine's `{}` default was)."""
    assert default_errors(render_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]) == []


def test_default_check_refuses_what_kube_apiserver_refused() -> None:
    """The real server's answer (v1.36) to the CRD whose `spec.engine` default was `{}`, word for word."""
    engine = copy.deepcopy(schema()["properties"]["spec"]["properties"]["engine"])
    engine["default"] = {}
    crd_schema = {
        "type": "object",
        "properties": {"spec": {"type": "object", "properties": {"engine": engine}}},
    }
    assert default_errors(crd_schema) == [
        "spec.validation.openAPIV3Schema.properties[spec].properties[engine].default: Invalid value: "
        '"object": no such key: maxBatchedTokens evaluating rule: engine.maxBatchedTokens must be at least '
        "engine.blockSize"
    ]
    engine["default"] = {"maxBatchedTokens": 8, "blockSize": 16}
    assert default_errors(crd_schema) == [
        "spec.validation.openAPIV3Schema.properties[spec].properties[engine].default: Invalid value: "
        '"object": engine.maxBatchedTokens must be at least engine.blockSize'
    ]
    engine["default"] = {"blockSize": 0, "maxBatchedTokens": 8}
    default = "spec.validation.openAPIV3Schema.properties[spec].properties[engine].default"
    assert default_errors(crd_schema) == [
        f"{default}.blockSize: Invalid value: 0: {default}.blockSize in body should be greater than or equal "
        "to 1"
    ]


def test_defaults_live_in_the_schema() -> None:
    minimal = {"model": {"name": "m", "source": "builtin:tiny"}}
    defaulted = apply_defaults(schema()["properties"]["spec"], minimal)
    assert defaulted["engine"]["blockSize"] == 16
    assert defaulted["engine"]["gpuMemoryUtilization"] == 0.9
    assert defaulted["resources"]["gpu"] == {"count": 1, "resourceName": "nvidia.com/gpu"}
    assert defaulted["startupTimeoutSeconds"] == 1800
    assert "replicas" not in defaulted  # no default: it would collide with builtin autoscaling
    # The schema's defaults are the pydantic model's defaults.
    parsed = ModelServerSpec.model_validate(minimal).model_dump(by_alias=True, exclude_none=True, mode="json")
    assert parsed == defaulted


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_are_accepted(path: Path) -> None:
    for obj in model_servers([path]):
        assert admission_errors(schema(), obj) == []
        ModelServerSpec.model_validate(obj["spec"])


def test_all_required_examples_exist() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"tiny-cpu.yaml", "llama-3.1-8b-l4.yaml", "llama-3.1-70b-h100.yaml", "autoscaling.yaml"} <= names
    seventy = model_servers([REPO / "manifests" / "llama-3.1-70b-h100.yaml"])[0]
    assert seventy["spec"]["resources"]["gpu"]["count"] == 4
    assert (
        model_servers([REPO / "manifests" / "autoscaling.yaml"])[0]["spec"]["autoscaling"]["actuator"]
        == "builtin"
    )


@pytest.mark.parametrize("path", INVALID, ids=[p.name for p in INVALID])
def test_invalid_examples_are_rejected_with_a_clear_message(path: Path) -> None:
    expected = path.read_text().splitlines()[0].removeprefix("# expect: ")
    (obj,) = model_servers([path])
    errors = admission_errors(schema(), obj)
    assert errors, f"{path.name} was accepted"
    assert any(expected in error for error in errors), errors


def test_cel_rules_accept_the_boundaries() -> None:
    spec_schema = schema()["properties"]["spec"]
    equal = {
        "model": {"name": "m", "source": "builtin:tiny"},
        "autoscaling": {"minReplicas": 2, "maxReplicas": 2, "target": 1},
    }
    assert cel_errors(spec_schema, apply_defaults(spec_schema, equal)) == []
    hpa_with_replicas = {
        "model": {"name": "m", "source": "hf://Qwen/Qwen2.5-7B"},
        "replicas": 3,
        "autoscaling": {"maxReplicas": 4, "target": 8, "actuator": "hpa"},
    }
    assert cel_errors(spec_schema, apply_defaults(spec_schema, hpa_with_replicas)) == []


def test_docs_reference_is_current() -> None:
    page = (REPO / "docs" / "reference" / "modelserver.md").read_text()
    assert render_reference_markdown() in page, (
        "docs/reference/modelserver.md is stale: run `make docs-reference`"
    )


def test_operator_command_is_registered(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["operator", "--help"])
    assert exit_info.value.code == 0
    assert "--no-leader-election" in capsys.readouterr().out
