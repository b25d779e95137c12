"""What kube-apiserver refuses before it stores a write, in its own words, for the emulator.

Each rule here is one the real server applies (Kubernetes sources, staging/src/k8s.io/apiserver and
apiextensions-apiserver) and a lenient fake once let through:

- content negotiation: an Accept header naming none of the object media types is `406 only the
  following media types are accepted: ...` (pod logs are text and exempt);
- request bodies: a POST body must be JSON, YAML, protobuf or CBOR (custom resources: no protobuf), a
  PATCH one of the patch types; anything else is `415 the body of the request was in an unknown format
  - accepted media types include: ...` (handlers/negotiation, handlers/patch.go). A client that sets no
  Content-Type (aiohttp then sends text/plain) gets that 415 on every create;
- strict field validation (`?fieldValidation=Strict`, kubectl's default): a field the schema does not
  know is `400 <Kind> in version "<v>" cannot be handled as a <Kind>: strict decoding error: unknown
  field "<path>"` on create and `422 ... patch: Invalid value: ...: strict decoding error: ...` on patch;
  without it, a custom resource's unknown fields are pruned (dropped);
- custom resources are defaulted and validated against their CRD's schema and CEL rules: `422
  <Kind>.<group> "<name>" is invalid: <errors>`;
- a CustomResourceDefinition is admitted only with a structural schema whose every `default` passes
  the schema and CEL rules of its level as written: `422 CustomResourceDefinition.apiextensions.k8s.io
  "<name>" is invalid: spec.validation.openAPIV3Schema.properties[spec]...default: Invalid value: ...`;
- optimistic concurrency: a write carrying a stale `metadata.resourceVersion` is `409 Operation cannot
  be fulfilled on <plural>.<group> "<name>": the object has been modified; please apply your changes to
  the latest version and try again`.

Built-in kinds are checked against the Kubernetes OpenAPI schemas that kubernetes-validate ships.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import jsonschema
import kmock
import referencing
from kubernetes_validate import utils as k8s_schemas

from support.crd_check import admission_errors, apply_defaults, default_errors, structural_errors

BODY_TYPES = (
    "application/json",
    "application/yaml",
    "application/vnd.kubernetes.protobuf",
    "application/cbor",
)
CUSTOM_BODY_TYPES = ("application/json", "application/yaml", "application/cbor")
PATCH_TYPES = (
    "application/json-patch+json",
    "application/merge-patch+json",
    "application/strategic-merge-patch+json",
    "application/apply-patch+yaml",
)
CUSTOM_PATCH_TYPES = (
    "application/json-patch+json",
    "application/merge-patch+json",
    "application/apply-patch+yaml",
)
# What the emulator itself implements of the patch types the API server accepts.
EMULATED_PATCH_TYPES = ("application/json-patch+json", "application/merge-patch+json")
SCHEMA_VERSION = "1.36.0"
TOP_LEVEL = ("apiVersion", "kind", "metadata")


def media_type(header: str | None) -> str:
    """The media type of a Content-Type header, without parameters (`; charset=utf-8`)."""
    return (header or "").split(";", 1)[0].strip().lower()


def unsupported_media_type(accepted: tuple[str, ...]) -> kmock.KubernetesError:
    return kmock.KubernetesError(
        415,
        "UnsupportedMediaType",
        "the body of the request was in an unknown format - accepted media types include: "
        + ", ".join(accepted),
    )


def check_accept(accept: str | None) -> None:
    """406 for an Accept header that names none of the media types the API server serves objects in."""
    if not accept:
        return
    offered = {media_type(part) for part in accept.split(",")}
    if not offered & {"*/*", "application/*", *BODY_TYPES}:
        raise kmock.KubernetesError(
            406,
            "NotAcceptable",
            "only the following media types are accepted: " + ", ".join(BODY_TYPES),
        )


def check_body_type(method: str, content_type: str | None, custom: bool) -> None:
    """415 for a body type the API server does not decode; 400 for a patch type the emulator lacks."""
    given = media_type(content_type)
    if method == "POST":
        accepted = CUSTOM_BODY_TYPES if custom else BODY_TYPES
        if given not in accepted:
            raise unsupported_media_type(accepted)
    elif method == "PATCH":
        accepted = CUSTOM_PATCH_TYPES if custom else PATCH_TYPES
        if given not in accepted:
            raise unsupported_media_type(accepted)
        if given not in EMULATED_PATCH_TYPES:
            raise kmock.KubernetesError(
                400, "BadRequest", f"the emulated API server does not implement {given} patches"
            )


def _path(parent: str, key: str) -> str:
    return f"{parent}.{key}" if parent else key


def custom_unknown_fields(
    schema: dict[str, Any], obj: Any, path: str = "", *, prune: bool = False
) -> list[str]:
    """The paths of fields a structural schema does not know (apiVersion, kind and metadata are the
    API server's); with `prune`, they are also removed from `obj`, as the API server does."""
    found: list[str] = []
    if isinstance(obj, dict):
        if schema.get("x-kubernetes-preserve-unknown-fields"):
            return found
        properties = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key in list(obj):
            if not path and key in TOP_LEVEL:
                continue
            if properties is not None and key in properties:
                found += custom_unknown_fields(properties[key], obj[key], _path(path, key), prune=prune)
            elif isinstance(extra, dict):
                found += custom_unknown_fields(extra, obj[key], _path(path, key), prune=prune)
            elif properties is not None or extra is False:
                found.append(_path(path, key))
                if prune:
                    del obj[key]
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(obj):
            found += custom_unknown_fields(schema["items"], item, f"{path}[{i}]", prune=prune)
    return found


@functools.cache
def _builtin_validator(api_version: str, kind: str) -> jsonschema.Draft202012Validator | None:
    """A validator of the strict (no unknown fields) Kubernetes schema of a built-in kind, or None."""
    folder = f"kubernetes-json-schema/v{SCHEMA_VERSION[:4]}.0-local-strict"
    group = api_version.split("/", 1)[0].split(".", 1)[0] + "-" if "/" in api_version else ""
    name = f"{folder}/{kind.lower()}-{group}{api_version.rsplit('/', 1)[-1]}.json"
    try:
        schema = k8s_schemas.schema_contents(name, SCHEMA_VERSION)
    except FileNotFoundError:
        return None
    definitions = k8s_schemas.schema_contents(f"{folder}/_definitions.json", SCHEMA_VERSION)
    registry = referencing.Resource.from_contents(definitions) @ (
        referencing.Resource.from_contents(schema) @ referencing.Registry()
    )
    return jsonschema.Draft202012Validator(schema, registry=registry)


def builtin_unknown_fields(obj: dict[str, Any]) -> list[str]:
    """The paths of fields a built-in kind's schema does not know."""
    validator = _builtin_validator(str(obj.get("apiVersion")), str(obj.get("kind")))
    if validator is None:
        return []
    found = []
    for error in validator.iter_errors(obj):
        if error.validator != "additionalProperties" or not isinstance(error.instance, dict):
            continue
        known = set(error.schema.get("properties", {}))
        parent = ""
        for part in error.absolute_path:
            parent = f"{parent}[{part}]" if isinstance(part, int) else _path(parent, str(part))
        found += [_path(parent, key) for key in error.instance if key not in known]
    return sorted(found)


def strict_decoding_error(unknown: list[str]) -> str:
    return "strict decoding error: " + ", ".join(f'unknown field "{field}"' for field in unknown)


def refuse_unknown_fields_on_create(kind: str, api_version: str, unknown: list[str]) -> None:
    if unknown:
        version = api_version.rsplit("/", 1)[-1]
        raise kmock.KubernetesError(
            400,
            "BadRequest",
            f'{kind} in version "{version}" cannot be handled as a {kind}: {strict_decoding_error(unknown)}',
        )


def refuse_unknown_fields_on_patch(patched: dict[str, Any], unknown: list[str]) -> None:
    if unknown:
        text = json.dumps(patched, separators=(",", ":"))
        raise kmock.KubernetesError(
            422,
            "Invalid",
            f' "" is invalid: patch: Invalid value: "{text}": {strict_decoding_error(unknown)}',
        )


def admit_custom_resource(schema: dict[str, Any], obj: dict[str, Any], group: str) -> dict[str, Any]:
    """The object defaulted by its CRD's schema; 422 with the API server's wording when it is invalid."""
    defaulted: dict[str, Any] = apply_defaults(schema, obj)
    errors = admission_errors(schema, defaulted)
    if errors:
        raise invalid(
            f"{defaulted.get('kind')}.{group}", defaulted.get("metadata", {}).get("name", ""), errors
        )
    return defaulted


def invalid(qualified_kind: str, name: str, errors: list[str]) -> kmock.KubernetesError:
    """422 Invalid, worded as the API server words it (one error alone, several in brackets)."""
    listed = errors[0] if len(errors) == 1 else "[" + ", ".join(errors) + "]"
    return kmock.KubernetesError(422, "Invalid", f'{qualified_kind} "{name}" is invalid: {listed}')


def conflict(plural: str, group: str, name: str) -> kmock.KubernetesError:
    resource = f"{plural}.{group}" if group else plural
    return kmock.KubernetesError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {resource} "{name}": the object has been modified; please apply '
        "your changes to the latest version and try again",
    )


def admit_crd(crd: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The openAPIV3Schema of each served version of an admitted CRD; 422 as the API server words it when
    the schema is not structural or a default fails its level's schema or CEL rules."""
    schemas = {}
    errors: list[str] = []
    for version in crd.get("spec", {}).get("versions", []):
        schema = version.get("schema", {}).get("openAPIV3Schema", {})
        errors += structural_errors(schema) + default_errors(schema)
        schemas[version.get("name", "")] = schema
    if errors:
        raise invalid(
            "CustomResourceDefinition.apiextensions.k8s.io", crd.get("metadata", {}).get("name", ""), errors
        )
    return schemas
