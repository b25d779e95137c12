"""What the API server would do with a ModelServer, without an API server.

- `structural_errors`: the structural-schema rules of apiextensions.k8s.io/v1.
- `schema_errors`: the openAPIV3Schema via jsonschema, with unknown fields rejected as
  `kubectl apply` (server-side field validation, Strict by default since 1.27) does.
- `apply_defaults`: the API server's defaulting (a default applies when the parent object exists).
- `cel_errors`: every `x-kubernetes-validations` rule evaluated with cel-python on the defaulted object;
  a rule that cannot be evaluated (a missing key) is an error worded as cel-go's, as the API server does.
- `default_errors`: what the API server checks of every `default` when it admits the CRD
  (apiextensions-apiserver, schema/defaulting/validation.go): the default value, as written, must
  validate against the schema of its level and pass the CEL rules of its level and below. Nested
  defaults inside it are NOT applied first, so a rule reading a field that only a nested default fills
  fails there with `no such key`.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterable, Iterator
from typing import Any

import celpy
import jsonschema

ALLOWED_KEYS = {
    "type",
    "description",
    "default",
    "properties",
    "required",
    "items",
    "enum",
    "format",
    "pattern",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "additionalProperties",
    "nullable",
    "x-kubernetes-validations",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
}


SCALAR_TYPES = {"string", "integer", "number", "boolean"}


def _list_type_errors(schema: dict[str, Any], path: str) -> list[str]:
    """The API server's rules for `x-kubernetes-list-type` and `x-kubernetes-list-map-keys`
    (apiextensions-apiserver, validation of the CRD's schema)."""
    errors: list[str] = []
    list_type = schema.get("x-kubernetes-list-type")
    keys = schema.get("x-kubernetes-list-map-keys")
    if keys is not None and list_type != "map":
        errors.append(
            f"{path}.x-kubernetes-list-map-keys: must only be used if x-kubernetes-list-type == map"
        )
    if list_type is None:
        return errors
    if schema.get("type") != "array":
        errors.append(f"{path}.x-kubernetes-list-type: must only be used on arrays")
    if list_type not in ("atomic", "set", "map"):
        errors.append(f'{path}.x-kubernetes-list-type: Unsupported value: "{list_type}"')
    items = schema.get("items") if isinstance(schema.get("items"), dict) else {}
    if list_type == "set" and items.get("type") not in SCALAR_TYPES:
        errors.append(f"{path}.items: sets must have scalar items (x-kubernetes-list-type: set)")
    if list_type == "map":
        if items.get("type") != "object":
            errors.append(
                f"{path}.items.type: must be object if parent array's x-kubernetes-list-type is map"
            )
        if not keys:
            errors.append(
                f"{path}.x-kubernetes-list-map-keys: Required value: must not be empty if "
                "x-kubernetes-list-type is map"
            )
        properties = items.get("properties", {})
        for key in keys or []:
            prop = properties.get(key)
            if prop is None:
                errors.append(
                    f"{path}.x-kubernetes-list-map-keys: entries must all be names of item properties"
                )
            elif key not in items.get("required", []) and "default" not in prop:
                errors.append(
                    f"{path}.x-kubernetes-list-map-keys: all map keys must be required or have a default"
                )
            elif prop.get("type") not in SCALAR_TYPES:
                errors.append(f"{path}.x-kubernetes-list-map-keys: map keys must be scalar typed")
    return errors


def structural_errors(schema: dict[str, Any], path: str = "") -> list[str]:
    """Every node has a type; no $ref/anyOf/oneOf; properties and additionalProperties never together."""
    errors: list[str] = []
    unknown = set(schema) - ALLOWED_KEYS
    if unknown:
        errors.append(f"{path or '.'}: keys a structural schema does not allow: {sorted(unknown)}")
    if "type" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
        errors.append(f"{path or '.'}: no type")
    if "properties" in schema and "additionalProperties" in schema:
        errors.append(f"{path or '.'}: properties and additionalProperties together")
    if schema.get("type") == "object" and "items" in schema:
        errors.append(f"{path or '.'}: items on an object")
    errors += _list_type_errors(schema, path or ".")
    for name, prop in schema.get("properties", {}).items():
        errors += structural_errors(prop, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        errors += structural_errors(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        errors += structural_errors(schema["additionalProperties"], f"{path}{{}}")
    return errors


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    schema = copy.deepcopy(schema)

    def visit(node: dict[str, Any]) -> None:
        if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
        if node.get("exclusiveMinimum") is True:  # OpenAPI v3.0 boolean form -> JSON Schema 2020 number form
            node["exclusiveMinimum"] = node.pop("minimum")
        for child in node.get("properties", {}).values():
            visit(child)
        if isinstance(node.get("items"), dict):
            visit(node["items"])
        if isinstance(node.get("additionalProperties"), dict):
            visit(node["additionalProperties"])

    visit(schema)
    return schema


def _field_path(parts: Iterable[Any]) -> str:
    path = ""
    for part in parts:
        path = f"{path}[{part}]" if isinstance(part, int) else f"{path}.{part}" if path else str(part)
    return path


# kube-openapi's words for a value out of bounds (`<path> in body should ...`), by JSON Schema keyword.
_BOUNDS = {
    "maximum": "should be less than or equal to {}",
    "exclusiveMaximum": "should be less than {}",
    "minimum": "should be greater than or equal to {}",
    "exclusiveMinimum": "should be greater than {}",
    "pattern": "should match '{}'",
    "minLength": "should be at least {} chars long",
    "maxLength": "should be at most {} chars long",
    "minItems": "should have at least {} items",
    "maxItems": "should have at most {} items",
}


def _api_server_wording(error: jsonschema.ValidationError, root: str) -> list[str]:
    """One jsonschema error in the API server's words (apiextensions-apiserver / kube-openapi); field
    paths start at `root`."""
    parts = [root, *error.absolute_path] if root else list(error.absolute_path)
    where = _field_path(parts)
    value = json.dumps(error.instance)
    if error.validator == "required":
        missing = [name for name in error.validator_value if name not in error.instance]
        return [f"{_field_path([*parts, name])}: Required value" for name in missing]
    if error.validator == "additionalProperties":  # strict decoding (kubectl's default field validation)
        known = set(error.schema.get("properties", {}))
        return [
            f'unknown field "{_field_path([*error.absolute_path, k])}"'
            for k in error.instance
            if k not in known
        ]
    if error.validator == "enum":
        supported = ", ".join(json.dumps(v) for v in error.validator_value)
        return [f"{where}: Unsupported value: {value}: supported values: {supported}"]
    if error.validator in _BOUNDS:
        bound = _BOUNDS[str(error.validator)].format(error.validator_value)
        return [f"{where}: Invalid value: {value}: {where} in body {bound}"]
    if error.validator == "type":
        actual = _schema_type(error.instance)
        expected = f"{where} in body must be of type {error.validator_value}"
        return [f'{where}: Invalid value: "{actual}": {expected}: "{actual}"']
    return [f"{where}: Invalid value: {value}: {error.message}"]


def schema_errors(schema: dict[str, Any], obj: Any, root: str = "") -> list[str]:
    """The openAPIV3Schema's errors, worded as the API server words them (paths from `root`)."""
    validator = jsonschema.Draft202012Validator(_strict(schema))
    return [line for error in validator.iter_errors(obj) for line in _api_server_wording(error, root)]


def apply_defaults(schema: dict[str, Any], obj: Any) -> Any:
    if isinstance(obj, dict) and "properties" in schema:
        obj = dict(obj)
        for name, prop in schema["properties"].items():
            if name not in obj and "default" in prop:
                obj[name] = copy.deepcopy(prop["default"])
            if name in obj:
                obj[name] = apply_defaults(prop, obj[name])
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        obj = [apply_defaults(schema["items"], item) for item in obj]
    return obj


def _rules(schema: dict[str, Any], obj: Any, path: str) -> Iterator[tuple[str, dict[str, str], Any]]:
    for rule in schema.get("x-kubernetes-validations", []):
        yield path, rule, obj
    if isinstance(obj, dict):
        for name, prop in schema.get("properties", {}).items():
            if name in obj:
                yield from _rules(prop, obj[name], f"{path}.{name}")
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(obj):
            yield from _rules(schema["items"], item, f"{path}[{i}]")


def _cel_go_wording(error: celpy.CELEvalError) -> str:
    """cel-python's evaluation error in the words cel-go (the API server's CEL) uses."""
    text = str(error.args[0]) if error.args else str(error)
    missing = re.fullmatch(r"no such member in mapping: '(.+)'", text)
    return f"no such key: {missing.group(1)}" if missing else text


def _schema_type(value: Any) -> str:
    """The schema type the API server names in a CEL error (`Invalid value: "object"`)."""
    return {
        dict: "object",
        list: "array",
        str: "string",
        bool: "boolean",
        int: "integer",
        float: "number",
    }.get(type(value), "object")


def cel_errors(schema: dict[str, Any], obj: Any, root: str = "") -> list[str]:
    """The API server's CEL errors: `<path>: Invalid value: "<type>": <rule's message>`, and for a rule
    that cannot be evaluated `<path>: Invalid value: "<type>": <error> evaluating rule: <message>`."""
    env = celpy.Environment()
    errors = []
    for path, rule, value in _rules(schema, obj, root):
        where = path.lstrip(".")
        program = env.program(env.compile(rule["rule"]))
        try:
            result = program.evaluate({"self": celpy.json_to_cel(value)})
        except celpy.CELEvalError as error:
            result = error
        kind = _schema_type(value)
        if isinstance(result, celpy.CELEvalError):
            reason = f"{_cel_go_wording(result)} evaluating rule: {rule['message']}"
            errors.append(f'{where or "<nil>"}: Invalid value: "{kind}": {reason}')
        elif not bool(result):
            errors.append(f'{where or "<nil>"}: Invalid value: "{kind}": {rule["message"]}')
    return errors


def default_errors(schema: dict[str, Any], path: str = "spec.validation.openAPIV3Schema") -> list[str]:
    """The CRD's defaults as the API server checks them when it admits the CRD (module docstring)."""
    errors: list[str] = []
    if "default" in schema:
        where = f"{path}.default"
        value = schema["default"]
        errors += schema_errors(schema, value, where) or cel_errors(schema, value, where)
    for name, prop in schema.get("properties", {}).items():
        errors += default_errors(prop, f"{path}.properties[{name}]")
    if isinstance(schema.get("items"), dict):
        errors += default_errors(schema["items"], f"{path}.items")
    if isinstance(schema.get("additionalProperties"), dict):
        errors += default_errors(schema["additionalProperties"], f"{path}.additionalProperties")
    return errors


def admission_errors(schema: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    """What `kubectl apply` would report: schema errors first; CEL runs only on schema-valid objects."""
    errors = schema_errors(schema, obj)
    if errors:
        return errors
    return cel_errors(schema, apply_defaults(schema, obj))
