"""Render the ModelServer CustomResourceDefinition from the pydantic models in `spec.py`.

The pydantic JSON Schema is turned into a Kubernetes *structural* schema: `$ref`s inlined, optional
fields (`anyOf [X, null]`) reduced to X, titles dropped, numeric `exclusiveMinimum` turned into the
OpenAPI v3.0 boolean form, `additionalProperties: false` dropped (the API server prunes unknown
fields instead), and the CEL rules of each model kept as `x-kubernetes-validations`.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from inflight.operator import spec

CRD_NAME = f"{spec.PLURAL}.{spec.GROUP}"

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
        "name": "KV Blocks",
        "type": "integer",
        "jsonPath": ".status.sizing.kvBlocks",
        "description": "KV-cache blocks per replica.",
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


def openapi_schema(model: type[spec.SpecModel]) -> dict[str, Any]:
    """The structural openAPIV3Schema of one pydantic model."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    result: dict[str, Any] = _structural(raw, defs)
    return result


def _add_list_map_keys(status: dict[str, Any]) -> None:
    conditions = status["properties"]["conditions"]
    conditions["x-kubernetes-list-type"] = "map"
    conditions["x-kubernetes-list-map-keys"] = ["type"]


def render_crd() -> dict[str, Any]:
    """The CustomResourceDefinition object for ModelServer."""
    status = openapi_schema(spec.ModelServerStatus)
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
            "spec": openapi_schema(spec.ModelServerSpec),
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
            "group": spec.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": spec.KIND,
                "listKind": f"{spec.KIND}List",
                "plural": spec.PLURAL,
                "singular": spec.SINGULAR,
                "shortNames": spec.SHORT_NAMES,
                "categories": spec.CATEGORIES,
            },
            "versions": [
                {
                    "name": spec.VERSION,
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


HEADER = "# Generated by `inflight crd` from inflight/operator/spec.py. Do not edit by hand.\n"


def render_crd_yaml() -> str:
    return HEADER + yaml.safe_dump(render_crd(), sort_keys=False, width=100)
