"""Tools as users declare them: OpenAI-style function schemas, and the check of a call.

Every chat template's `tools` argument takes a list of function schemas:

    {"type": "function", "function": {
        "name": "lookup_stock", "description": "Units of an item in a warehouse.",
        "parameters": {"type": "object",
                       "properties": {"item": {"type": "string", "description": ...},
                                      "warehouse": {"type": "integer"}},
                       "required": ["item", "warehouse"]}}}

`check_tool_schema` refuses a malformed one in one line (at construction, naming the
tool); `schema_of_function` writes one from a Python function's signature and docstring
(`str`, `int`, `float`, `bool`, `list[...]`, `dict`, `typing.Literal[...]` for an enum;
a parameter with a default is optional; the docstring's first paragraph is the
description, its "Args:" section the parameters'). `call_error` checks a parsed call's
arguments against the schema, the subset of JSON Schema function schemas use: `type`
(string, number, integer, boolean, array, object, null, or a list of them), `enum`,
`required`, `properties`, `items`, `additionalProperties` (unknown arguments are
refused unless it is true or a schema), and returns the text the model reads back as
the tool's error, or None. `number` takes integers; `integer` takes whole floats (2.0) as
JSON does, never booleans.
"""

from __future__ import annotations

import collections.abc
import inspect
import re
import types
import typing
from typing import Any, Callable, Mapping

_JSON_TYPES = ("string", "number", "integer", "boolean", "array", "object", "null")
_PYTHON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean",
                 list: "array", tuple: "array", dict: "object", type(None): "null"}


class ToolSchemaError(ValueError):
    """A tool declaration that is not a usable function schema."""


def check_tool_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """`schema` as a plain dict, checked: {"type": "function", "function": {"name",
    "description"?, "parameters": an object schema}}. Raises ToolSchemaError."""
    function = schema.get("function") if isinstance(schema, Mapping) else None
    if not isinstance(schema, Mapping) or schema.get("type") != "function" or not isinstance(
            function, Mapping):
        raise ToolSchemaError(f"a tool must be {{'type': 'function', 'function': {{...}}}}, "
                              f"got {schema!r}")
    name = function.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*", name):
        raise ToolSchemaError(f"tool name {name!r} must be a string of letters, digits, "
                              "'_', '.', '-'")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, Mapping) or parameters.get("type") != "object":
        raise ToolSchemaError(f"tool {name!r}: parameters must be an object schema "
                              f"({{'type': 'object', 'properties': ...}}), got {parameters!r}")
    _check_subschema(parameters, f"tool {name!r}: parameters")
    properties = parameters.get("properties", {})
    missing = [r for r in parameters.get("required", ()) if r not in properties]
    if missing:
        raise ToolSchemaError(f"tool {name!r}: required {missing} are not in its properties")
    return {"type": "function", "function": {**dict(function), "parameters": dict(parameters)}}


def _check_subschema(schema, where: str) -> None:
    if not isinstance(schema, Mapping):
        raise ToolSchemaError(f"{where} must be a JSON schema (a dict), got {schema!r}")
    kinds = schema.get("type")
    for kind in (kinds if isinstance(kinds, (list, tuple)) else [kinds]):
        if kind is not None and kind not in _JSON_TYPES:
            raise ToolSchemaError(f"{where}: type {kind!r} is not one of {_JSON_TYPES}")
    if "enum" in schema and not isinstance(schema["enum"], (list, tuple)):
        raise ToolSchemaError(f"{where}: enum must be a list, got {schema['enum']!r}")
    properties = schema.get("properties", {})
    if not isinstance(properties, Mapping):
        raise ToolSchemaError(f"{where}: properties must be a dict, got {properties!r}")
    for key, sub in properties.items():
        _check_subschema(sub, f"{where}.{key}")
    required = schema.get("required", [])
    if not isinstance(required, (list, tuple)) or not all(isinstance(r, str) for r in required):
        raise ToolSchemaError(f"{where}: required must be a list of names, got {required!r}")
    if isinstance(schema.get("items"), Mapping):
        _check_subschema(schema["items"], f"{where}[]")
    if isinstance(schema.get("additionalProperties"), Mapping):
        _check_subschema(schema["additionalProperties"], f"{where}.*")


def _is_type(value, kind: str) -> bool:
    if kind == "string":
        return isinstance(value, str)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer())
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "array":
        return isinstance(value, list)
    if kind == "object":
        return isinstance(value, dict)
    return value is None  # "null"


def _value_error(value, schema: Mapping[str, Any], where: str) -> str | None:
    kinds = schema.get("type")
    if kinds is not None:
        kinds = list(kinds) if isinstance(kinds, (list, tuple)) else [kinds]
        if not any(_is_type(value, kind) for kind in kinds):
            return f"{where} must be {' or '.join(_article(k) for k in kinds)}, got " \
                   f"{_json_name(value)}"
    if "enum" in schema and value not in list(schema["enum"]):
        return f"{where} must be one of {list(schema['enum'])!r}, got {value!r}"
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for i, item in enumerate(value):
            error = _value_error(item, schema["items"], f"{where}[{i}]")
            if error:
                return error
    if isinstance(value, dict) and ("properties" in schema or "required" in schema or
                                    "additionalProperties" in schema):
        return _object_error(value, schema, where)
    return None


def _object_error(value: dict, schema: Mapping[str, Any], where: str) -> str | None:
    properties = schema.get("properties", {})
    missing = [r for r in schema.get("required", ()) if r not in value]
    if missing:
        return f"{where} needs {', '.join(repr(m) for m in missing)}"
    extra = schema.get("additionalProperties", False)
    for key, item in value.items():
        if key in properties:
            error = _value_error(item, properties[key], f"{where}.{key}" if where else key)
        elif isinstance(extra, Mapping):
            error = _value_error(item, extra, f"{where}.{key}" if where else key)
        elif extra is True:
            error = None
        else:
            allowed = ", ".join(repr(p) for p in properties) or "none"
            error = f"unknown argument {key!r} (the arguments are {allowed})"
        if error:
            return error
    return None


def _article(kind: str) -> str:
    return {"integer": "an integer", "array": "an array", "object": "an object",
            "null": "null"}.get(kind, f"a {kind}")


def _json_name(value) -> str:
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"the string {value!r}" if len(value) <= 40 else "a string"
    return {list: "an array", dict: "an object", type(None): "null"}.get(type(value),
                                                                        type(value).__name__)


def call_error(schema: Mapping[str, Any], arguments: Any) -> str | None:
    """Why `arguments` (the parsed call's) do not fit the checked function `schema`
    ("tool 'f': missing argument 'x'"-style text the model reads), or None."""
    function = schema["function"]
    name, parameters = function["name"], function.get("parameters", {})
    if not isinstance(arguments, dict):
        return f"{name}: the arguments must be an object, got {_json_name(arguments)}"
    missing = [r for r in parameters.get("required", ()) if r not in arguments]
    if missing:
        return f"{name}: missing argument {', '.join(repr(m) for m in missing)}"
    error = _object_error(arguments, parameters, "")
    return None if error is None else f"{name}: {error}"


# ------------------------------------------------------------ schemas from functions


def _annotation_schema(annotation, where: str) -> dict[str, Any]:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation in _PYTHON_TYPES:
        return {"type": _PYTHON_TYPES[annotation]}
    if origin is typing.Literal:
        kinds = {_PYTHON_TYPES.get(type(a)) for a in args}
        return ({"type": kinds.pop()} if len(kinds) == 1 and None not in kinds else {}) | {
            "enum": list(args)}
    if origin in (list, tuple, collections.abc.Sequence):
        item = args[0] if args else None
        return {"type": "array", **({"items": _annotation_schema(item, where)} if item
                                    is not None and item is not Ellipsis else {})}
    if origin is dict:
        return {"type": "object"}
    if origin in (typing.Union, types.UnionType):
        subs = [_annotation_schema(a, where) for a in args]
        if all(isinstance(s.get("type"), str) for s in subs):
            merged = {k: v for s in subs for k, v in s.items() if k != "type"}
            return {"type": [s["type"] for s in subs], **merged}
    raise ToolSchemaError(f"{where}: annotation {annotation!r} has no JSON schema type "
                          "(use str, int, float, bool, list[...], dict or Literal[...])")


def _docstring_parts(doc: str) -> tuple[str, dict[str, str]]:
    """(description, {parameter: description}) of a Google-style docstring."""
    doc = inspect.cleandoc(doc or "")
    head, _, rest = doc.partition("\nArgs:")
    description = " ".join(head.split("\n\n")[0].split())
    params: dict[str, str] = {}
    current, current_indent = None, 0
    for line in rest.split("\n"):
        if line.strip() and not line.startswith((" ", "\t")):
            break  # the next section (Returns:, ...)
        match = re.match(r"\s+(\w+)(?:\s*\([^)]*\))?\s*:\s*(.*)", line)
        indent = len(line) - len(line.lstrip())
        if match and (current is None or indent <= current_indent):
            current, current_indent = match.group(1), indent
            params[current] = match.group(2).strip()
        elif current is not None and line.strip():
            params[current] = f"{params[current]} {line.strip()}"
    return description, params


def schema_of_function(function: Callable, *, skip: int = 0,
                       name: str | None = None) -> dict[str, Any]:
    """The function schema of `function` (module docstring); its first `skip` parameters
    (e.g. self, episode) are not arguments."""
    name = name or function.__name__
    description, docs = _docstring_parts(function.__doc__ or "")
    try:
        hints = typing.get_type_hints(function)
    except Exception as error:  # an annotation that does not resolve
        raise ToolSchemaError(f"tool {name!r}: annotations do not resolve: {error}") from error
    properties, required = {}, []
    for parameter in list(inspect.signature(function).parameters.values())[skip:]:
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise ToolSchemaError(f"tool {name!r}: *{parameter.name} cannot be declared; "
                                  "name each argument")
        if parameter.name not in hints:
            raise ToolSchemaError(f"tool {name!r}: argument {parameter.name!r} needs a type "
                                  "annotation")
        schema = _annotation_schema(hints[parameter.name], f"tool {name!r}: {parameter.name}")
        if parameter.name in docs:
            schema["description"] = docs[parameter.name]
        properties[parameter.name] = schema
        if parameter.default is inspect.Parameter.empty:
            required.append(parameter.name)
    return check_tool_schema({"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required}}})
