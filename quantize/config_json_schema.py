"""The JSON Schema of a config dataclass (``policy-bundle config schema``), made from the same field metadata the YAML
reader enforces (``quantize/config_schema.py``): keys, types, limits, choices and defaults, for editors and CI checks
of a config file."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any, Dict

from policy_bundle.quantize.config_schema import CHOICES, LOW_OPEN, RANGE, READ, FieldError, _hints, _keys, read_field


JSON_TYPES = {int: "integer", float: "number", bool: "boolean", str: "string", Path: "string"}


def json_schema(cls: type, title: str = "") -> dict:
    """A JSON Schema (draft 2020-12) of the YAML that ``from_mapping(cls, ...)`` reads: every key with its type, its
    limit (``minimum``/``maximum``, ``enum``), its default where it has a plain one, nested sections, no unknown key.
    A field with its own reader (``read_as``) accepts what the reader accepts: the schema names no type for it."""
    schema = _object_schema(cls)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **({"title": title} if title else {}), **schema}


def _object_schema(cls: type) -> dict:
    props: Dict[str, Any] = {}
    for key, (holder, owner) in _keys(cls).items():
        f = next(f for f in dataclasses.fields(owner) if f.name == key)
        props[key] = _field_schema(owner, f)
    return {"type": "object", "properties": props, "additionalProperties": False}


def _field_schema(cls: type, f: dataclasses.Field) -> dict:
    tp = _hints(cls)[f.name]
    if f.metadata.get(READ):
        out: dict = {"description": "read by its own reader (see docs/build.md)"}
    else:
        out = _type_schema(tp, f.metadata)
    default = f.default if f.default is not dataclasses.MISSING else (
        f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
    if default is not dataclasses.MISSING and not dataclasses.is_dataclass(default):
        plain = _plain(default)
        if plain is not dataclasses.MISSING:
            out["default"] = plain
    return out


def _plain(value: Any) -> Any:
    """``value`` as JSON, or MISSING where it has no plain JSON form."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (tuple, list)):
        items = [_plain(v) for v in value]
        return dataclasses.MISSING if dataclasses.MISSING in items else items
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        items = {k: _plain(v) for k, v in value.items()}
        return dataclasses.MISSING if dataclasses.MISSING in items.values() else items
    return dataclasses.MISSING


def _limits(meta: Any) -> dict:
    out: dict = {}
    if RANGE in meta:
        lo, hi = meta[RANGE]
        out["exclusiveMinimum" if meta.get(LOW_OPEN) else "minimum"] = lo
        if hi is not None:
            out["maximum"] = hi
    if CHOICES in meta:
        out["enum"] = [_plain(c) for c in meta[CHOICES]]
    return out


def _type_schema(tp: Any, meta: Any = None) -> dict:
    meta = meta or {}
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:
        inner = [a for a in args if a is not type(None)]
        return {"anyOf": [_type_schema(inner[0], meta), {"type": "null"}]} if len(inner) == 1 else {}
    if dataclasses.is_dataclass(tp):
        return _object_schema(tp)
    if origin is dict:
        return {"type": "object", "additionalProperties": _type_schema(args[1])}
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return {"type": "array", "items": {**_type_schema(args[0]), **_limits(meta)}}
        return {"type": "array", "prefixItems": [_type_schema(a) for a in args], "minItems": len(args),
                "maxItems": len(args)}
    if tp in JSON_TYPES:
        return {"type": JSON_TYPES[tp], **_limits(meta)}
    return {}


def defaults_yaml(cls: type, header: str) -> str:
    """Every key of ``cls``'s YAML with its default, each with its type and limit as a comment: a config file that
    ``from_mapping(cls, ...)`` reads back to ``cls()`` (a test checks both). ``header``: the comment lines on top."""
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    _defaults_lines(cls, "", lines)
    return "\n".join(lines) + "\n"


def _defaults_lines(cls: type, indent: str, lines: list) -> None:
    for key, (holder, owner) in _keys(cls).items():
        f = next(f for f in dataclasses.fields(owner) if f.name == key)
        tp = _hints(owner)[key]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if dataclasses.is_dataclass(tp) and dataclasses.is_dataclass(default):
            lines.append(f"{indent}{key}:")
            _defaults_lines(tp, indent + "  ", lines)
            continue
        plain = _yaml_form(default)
        value = "{}" if plain == {} else _flow(plain)
        comment = _comment(tp, f.metadata)
        line = f"{key}: {value}" + (f"  # {comment}" if comment else "")
        try:  # a default that cannot be written as a value (keys configured to none are refused): left unset
            read_field(owner, key, plain, key)
        except FieldError:
            line = f"# {key}: unset by default  # {comment or 'see its reader'}"
        lines.append(indent + line)


def _yaml_form(value: Any) -> Any:
    """``value`` as its YAML reads back: a dataclass as its mapping, a path as a string, tuples as lists."""
    from policy_bundle.quantize.config_schema import to_mapping

    if dataclasses.is_dataclass(value):
        return {k: _yaml_form(v) for k, v in to_mapping(value).items()}
    if isinstance(value, (tuple, list)):
        return [_yaml_form(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _yaml_form(v) for k, v in value.items()}
    return str(value) if isinstance(value, Path) else value


def _flow(value: Any) -> str:
    import yaml

    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("\n...").strip()


def _comment(tp: Any, meta: Any) -> str:
    """The field's type and limit in words: ``integer in [1, 4096], or null``."""
    schema = _type_schema(tp, meta) if not meta.get(READ) else _limits(meta)
    optional = "anyOf" in schema
    if optional:
        schema = schema["anyOf"][0]
    kind = schema.get("type", "")
    if "enum" in schema:
        text = " | ".join(str(v) for v in schema["enum"])
    elif "minimum" in schema or "exclusiveMinimum" in schema:
        lo = schema.get("minimum", schema.get("exclusiveMinimum"))
        bracket = "(" if "exclusiveMinimum" in schema else "["
        text = f"{kind} in {bracket}{lo}, {schema['maximum']}]" if "maximum" in schema else \
            f"{kind} {'>' if bracket == '(' else '>='} {lo}"
    elif kind == "array" and "items" in schema:
        text = f"list of {schema['items'].get('type', 'values')}"
    else:
        text = kind
    return f"{text}, or null" if optional and text else text
