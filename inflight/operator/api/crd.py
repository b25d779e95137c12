"""Render the ModelServer CustomResourceDefinition from the pydantic models in `types.py`.

The pydantic JSON Schema is turned into a Kubernetes *structural* schema: `$ref`s inlined, optional
fields (`anyOf [X, null]`) reduced to X, titles dropped, numeric `exclusiveMinimum` turned into the
OpenAPI v3.0 boolean form, `additionalProperties: false` dropped (the API server prunes unknown
fields instead), object defaults written out with the defaults nested in them (the API server checks a
default as written), and the CEL rules of each model kept as `x-kubernetes-validations`.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import yaml

from inflight.operator.api import types

CRD_NAME = f"{types.PLURAL}.{types.GROUP}"

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.name", "description": "Served model name."},
    {
        "name": "GPUs",
        "type": "integer",
        "jsonPath": ".spec.resources.gpu.count",
        "description": "GPUs per replica.",
    },
    {"name": "GPU", "type": "string", "jsonPath": ".status.sizing.gpuType", "description": "GPU sized for."},
    {
        "name": "Slots",
        "type": "integer",
        "jsonPath": ".status.sizing.slots",
        "description": "Slots per replica.",
    },
    {
        "name": "KV Planned",
        "type": "integer",
        "jsonPath": ".status.sizing.kvBlocks",
        "description": "KV-cache blocks per replica in the plan.",
    },
    {
        "name": "KV Measured",
        "type": "integer",
        "jsonPath": ".status.sizing.measured.kvBlocksMin",
        "description": "Fewest KV-cache blocks a ready replica reports (its /metrics).",
    },
    {
        "name": "Ready",
        "type": "integer",
        "jsonPath": ".status.readyReplicas",
        "description": "Ready replicas.",
    },
    {"name": "Replicas", "type": "integer", "jsonPath": ".status.replicas", "description": "Replicas."},
    {
        "name": "Status",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="Ready")].reason',
        "description": "Reason of the Ready condition.",
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

_DROPPED_KEYS = ("title", "additionalProperties")


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    """Recursively rewrite one pydantic JSON Schema node into structural OpenAPI v3.0."""
    if isinstance(node, list):
        return [_structural(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "anyOf" in node:
        variants = [v for v in node.pop("anyOf") if v != {"type": "null"}]
        if len(variants) != 1:
            raise ValueError(f"only Optional[X] unions can be rendered into a structural schema: {variants}")
        node = {**variants[0], **node}
        if node.get("default", ...) is None:
            del node["default"]
    if "$ref" in node:
        target = copy.deepcopy(defs[node.pop("$ref").rsplit("/", 1)[-1]])
        node = {**target, **node}  # the field's own description and default win over the model's
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROPPED_KEYS and not (key == "additionalProperties" and isinstance(value, dict)):
            continue
        if key == "exclusiveMinimum":
            out["minimum"] = value
            out["exclusiveMinimum"] = True
        elif key == "properties":
            out[key] = {name: _structural(prop, defs) for name, prop in value.items()}
        else:
            out[key] = _structural(value, defs)
    return out


def _fill_object_defaults(node: dict[str, Any]) -> None:
    """Write the nested defaults into every object-valued `default` (`{}` becomes `{"blockSize": 16, ...}`).

    The API server checks a `default` as written, against the schema and the CEL rules of its level,
    before the defaults nested inside it apply (apiextensions-apiserver, schema/defaulting/validation.go):
    a `{}` default under a rule that reads `self.maxBatchedTokens` makes it refuse the whole CRD. Objects
    defaulted here come out of the API server the same either way."""
    for child in node.get("properties", {}).values():
        _fill_object_defaults(child)
    if isinstance(node.get("items"), dict):
        _fill_object_defaults(node["items"])
    if isinstance(node.get("default"), dict) and "properties" in node:
        nested = {
            name: copy.deepcopy(prop["default"])
            for name, prop in node["properties"].items()
            if "default" in prop
        }
        node["default"] = {**nested, **node["default"]}


def openapi_schema(model: type[types.SpecModel]) -> dict[str, Any]:
    """The structural openAPIV3Schema of one pydantic model."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    result: dict[str, Any] = _structural(raw, defs)
    _fill_object_defaults(result)
    return result


def _add_list_map_keys(status: dict[str, Any]) -> None:
    conditions = status["properties"]["conditions"]
    conditions["x-kubernetes-list-type"] = "map"
    conditions["x-kubernetes-list-map-keys"] = ["type"]


def render_crd() -> dict[str, Any]:
    """The CustomResourceDefinition object for ModelServer."""
    status = openapi_schema(types.ModelServerStatus)
    _add_list_map_keys(status)
    schema = {
        "type": "object",
        "description": "ModelServer serves one model over an OpenAI-compatible API on GPU Deployments "
        "the operator sizes from the GPU memory of the nodes the pods land on.",
        "required": ["spec"],
        "x-kubernetes-validations": [
            {
                "rule": "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$') && "
                "size(self.metadata.name) <= 63",
                "message": "ModelServer names must be DNS-1035 labels (lowercase letters, digits and '-', "
                "starting with a letter, at most 63 characters): the Service is named after them",
            }
        ],
        "properties": {
            "apiVersion": {"type": "string", "description": "inflight.dev/v1alpha1"},
            "kind": {"type": "string", "description": "ModelServer"},
            "metadata": {"type": "object"},
            "spec": openapi_schema(types.ModelServerSpec),
            "status": status,
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "labels": {"app.kubernetes.io/name": "inflight", "app.kubernetes.io/part-of": "inflight"},
        },
        "spec": {
            "group": types.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": types.KIND,
                "listKind": f"{types.KIND}List",
                "plural": types.PLURAL,
                "singular": types.SINGULAR,
                "shortNames": types.SHORT_NAMES,
                "categories": types.CATEGORIES,
            },
            "versions": [
                {
                    "name": types.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                }
            ],
        },
    }


HEADER = "# Generated by `inflight crd` from inflight/operator/api/types.py. Do not edit by hand.\n"


def render_crd_yaml() -> str:
    return HEADER + yaml.safe_dump(render_crd(), sort_keys=False, width=100)


def _type_of(node: dict[str, Any]) -> str:
    if "enum" in node:
        return " \\| ".join(f"`{value}`" for value in node["enum"])
    kind = str(node.get("type", "object"))
    if kind == "array":
        return f"array of {_type_of(node.get('items', {}))}"
    if kind == "object" and isinstance(node.get("additionalProperties"), dict):
        return f"map of {_type_of(node['additionalProperties'])}"
    return kind


def _bounds(node: dict[str, Any]) -> str:
    parts = []
    if "minimum" in node:
        parts.append(f"{'>' if node.get('exclusiveMinimum') else '>='} {node['minimum']}")
    if "maximum" in node:
        parts.append(f"<= {node['maximum']}")
    if "maxLength" in node:
        parts.append(f"at most {node['maxLength']} chars")
    return ", ".join(parts)


def _rows(node: dict[str, Any], path: str, required: bool) -> list[str]:
    rows = []
    if path:
        default = node.get("default")
        object_of_defaults = isinstance(default, dict) and "properties" in node  # its fields show theirs
        shown = "" if default is None or object_of_defaults else f"`{json.dumps(default)}`"
        name = f"`{path}`" + (" (required)" if required else "")
        description = " ".join(str(node.get("description", "")).split()).replace("|", "\\|")
        bounds = _bounds(node)
        if bounds:
            description = f"{description} ({bounds})"
        rows.append(f"| {name} | {_type_of(node)} | {shown} | {description} |")
    children = node.get("properties", {})
    if node.get("type") == "array" and isinstance(node.get("items"), dict):
        children = node["items"].get("properties", {})
        path = f"{path}[]"
    needed = set(
        node.get("items", {}).get("required", []) if node.get("type") == "array" else node.get("required", [])
    )
    for name, child in children.items():
        rows += _rows(child, f"{path}.{name}" if path else name, name in needed)
    return rows


def _rules(node: dict[str, Any], path: str) -> list[str]:
    found = [f"| `{path or '.'}` | {r['message']} |" for r in node.get("x-kubernetes-validations", [])]
    for name, child in node.get("properties", {}).items():
        found += _rules(child, f"{path}.{name}" if path else name)
    return found


def render_reference_markdown() -> str:
    """docs/reference/modelserver.md's tables: every field (type, default, meaning), CEL rules, columns."""
    schema = render_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    header = "| Field | Type | Default | Meaning |\n|---|---|---|---|"
    spec_rows = "\n".join(_rows(schema["properties"]["spec"], "spec", True)[1:])
    status_rows = "\n".join(_rows(schema["properties"]["status"], "status", False)[1:])
    rules = "\n".join(_rules(schema, ""))
    columns = "\n".join(f"| {c['name']} | `{c['jsonPath']}` |" for c in PRINTER_COLUMNS)
    return (
        f"#### spec\n\n{header}\n{spec_rows}\n\n"
        f"#### status (written by the operator only)\n\n{header}\n{status_rows}\n\n"
        "#### Validation rules (CEL, checked by the API server)\n\n"
        f"| Where | Rule |\n|---|---|\n{rules}\n\n"
        f"#### Printer columns (`kubectl get modelservers`)\n\n| Column | From |\n|---|---|\n{columns}\n"
    )
