"""The JSON Schema of a config model (``policy-bundle config schema``) and its defaults file (``policy-bundle config
defaults``), both made by pydantic from the models the readers validate with (``quantize/config/schema.py``): keys,
types, limits, choices, defaults and each field's help, for editors, CI checks of a config file and people."""

from __future__ import annotations

import copy
import dataclasses
import textwrap
from pathlib import Path
from typing import Any, Dict

from pydantic import TypeAdapter

from policy_bundle.quantize.config.schema import FieldError, _hints, _keys, _unwrap_optional, read_field

WIDTH = 118  # a defaults file's comment lines wrap here


def json_schema(cls: type, title: str = "") -> dict:
    """A JSON Schema (draft 2020-12) of the YAML that ``from_mapping(cls, ...)`` reads: every key with its type, its
    limit (``minimum``/``maximum``, ``enum``), its default where it has a plain one, its help (``description``),
    nested sections written out (no ``$ref``), inline sections' keys as their section's own, no unknown key. A field
    with its own reader (``read_as``) accepts what the reader accepts: the schema names no type for it."""
    raw = TypeAdapter(cls).json_schema(mode="validation")
    defs = raw.pop("$defs", {})
    schema = _flatten(_resolved(raw, defs), cls)
    schema.pop("title", None)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **({"title": title} if title else {}), **schema}


def _resolved(node: Any, defs: Dict[str, Any]) -> Any:
    """``node`` with every ``{"$ref": "#/$defs/X"}`` replaced by a copy of X (a ref's own keys kept beside it)."""
    if isinstance(node, list):
        return [_resolved(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[-1]])
        return _resolved({**target, **{k: v for k, v in node.items() if k != "$ref"}}, defs)
    return {k: _resolved(v, defs) for k, v in node.items()}


def _section(node: dict) -> dict:
    """The object schema inside a field's schema (an Optional section's non-null branch)."""
    if "anyOf" in node:
        return next((s for s in node["anyOf"] if s.get("type") == "object"), node)
    return node


def _flatten(schema: dict, cls: type) -> dict:
    """``schema`` of model ``cls`` with inline fields' keys moved into it (its own keys win), nested sections too,
    and pydantic's generated titles dropped (the keys are their names)."""
    props = schema.get("properties", {})
    out: Dict[str, Any] = {}
    for key, (holder, owner) in _keys(cls).items():
        if holder is None:
            prop = props[key]
        else:
            prop = _section(props[holder])["properties"][key]
        prop = dict(prop)
        prop.pop("title", None)
        inner = _unwrap_optional(_hints(owner)[key])
        if dataclasses.is_dataclass(inner):
            target = _section(prop)
            flat = _flatten(target, inner)  # the section's own keys (its help, its default) kept
            prop = flat if target is prop else {**prop, "anyOf": [flat if s is target else s for s in prop["anyOf"]]}
        out[key] = prop
    result = {k: v for k, v in schema.items() if k not in ("properties", "title", "required")}
    return {**result, "type": "object", "properties": out, "additionalProperties": False}


def defaults_yaml(cls: type, header: str) -> str:
    """Every key of ``cls``'s YAML with its default: its help as comment lines above it, its type and limit as a
    comment after it. A config file that ``from_mapping(cls, ...)`` reads back to ``cls()`` (a test checks both).
    ``header``: the comment lines on top."""
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    _defaults_lines(cls, json_schema(cls), "", lines)
    return "\n".join(lines) + "\n"


def _help_lines(text: str, indent: str) -> list:
    width = WIDTH - len(indent) - 2
    return [f"{indent}# {line}" for line in textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)]


def _defaults_lines(cls: type, schema: dict, indent: str, lines: list) -> None:
    for key, (holder, owner) in _keys(cls).items():
        prop = schema["properties"][key]
        tp = _hints(owner)[key]
        default = owner.__pydantic_fields__[key].get_default(call_default_factory=True)
        if prop.get("description"):
            lines.extend(_help_lines(prop["description"], indent))
        if dataclasses.is_dataclass(tp) and dataclasses.is_dataclass(default):
            lines.append(f"{indent}{key}:")
            _defaults_lines(tp, _section(prop), indent + "  ", lines)
            continue
        plain = _yaml_form(default)
        value = "{}" if plain == {} else _flow(plain)
        comment = _comment(prop)
        line = f"{key}: {value}" + (f"  # {comment}" if comment else "")
        try:  # a default that cannot be written as a value (keys configured to none are refused): left unset
            read_field(owner, key, plain, key)
        except FieldError:
            line = f"# {key}: unset by default" + (f"  # {comment}" if comment else "")
        lines.append(indent + line)


def _yaml_form(value: Any) -> Any:
    """``value`` as its YAML reads back: a model as its mapping, a path as a string, tuples as lists."""
    from policy_bundle.quantize.config.schema import to_mapping

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


def _comment(schema: dict) -> str:
    """The field's type and limit in words, from its schema: ``integer in [1, 4096], or null``."""
    optional = "anyOf" in schema and any(s.get("type") == "null" for s in schema["anyOf"])
    if optional:
        schema = next(s for s in schema["anyOf"] if s.get("type") != "null")
    kind = schema.get("type", "")
    if "enum" in schema:
        text = " | ".join(str(v) for v in schema["enum"])
    elif "minimum" in schema or "exclusiveMinimum" in schema:
        lo = schema.get("minimum", schema.get("exclusiveMinimum"))
        bracket = "(" if "exclusiveMinimum" in schema else "["
        text = f"{kind} in {bracket}{lo}, {schema['maximum']}]" if "maximum" in schema else \
            f"{kind} {'>' if bracket == '(' else '>='} {lo}"
    elif kind == "array" and "items" in schema:
        items = schema["items"]
        text = f"list of {items.get('type', 'values')}"
        inner = _comment(items) if ("enum" in items or "minimum" in items or "exclusiveMinimum" in items) else ""
        if inner:
            text = f"list, each {inner}"
    else:
        text = kind
    return f"{text}, or null" if optional and text else text
