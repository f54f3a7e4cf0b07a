"""Config models: pydantic dataclasses whose fields declare their limit and their help, one-line errors.

    @config_model("section")
    class Section:
        alpha: float = ranged(0.5, 0.0, 1.0, help="how much to migrate")
        mode: str = choice("fast", ("fast", "exact"), help="the search")

    Section(alpha=2.0)                                # FieldError: section.alpha: 2.0 is out of range [0.0, 1.0]
    from_mapping(Section, {"alpha": 2}, "section")    # FieldError: section.alpha: 2 is out of range [0.0, 1.0]

The build config (``build/config/build_config.py``), the router settings (``serve/settings.py``) and the library's
``RecipeConfig`` and ``GateThresholds`` are such models: pydantic validates them, whether built in Python or read
from YAML, and publishes their JSON Schema (``quantize/config/json_schema.py``) with each field's type, limit,
default and help. They stay frozen dataclasses, so the code that holds them reads attributes and calls
``dataclasses.replace`` as before.

What this module adds to pydantic: a YAML value is validated strictly (``"3"`` is not an int, ``true`` not a
number), every error is one line, ``path: problem``, naming the field as the YAML writes it and its limit
(``FieldError``, or the model's own subclass), and an unknown key lists the known ones. A field whose YAML form is
not its Python type (a list of steps that may be plain numbers, one key or a list of keys) declares a reader with
``read_as``; a section that writes a library model's fields as its own keys declares it with ``inline``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import typing
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence, Type, TypeVar

import yaml
from pydantic import BeforeValidator, ConfigDict, Field, PlainValidator, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass as pydantic_dataclass
from pydantic_core import PydanticCustomError

T = TypeVar("T")
Reader = Callable[[str, Any], Any]  # (field path, YAML value) -> the field's value
INLINE = "inline"
PLURALS = {str: "strings", int: "integers", float: "numbers", bool: "booleans"}
MODEL_CONFIG = ConfigDict(extra="forbid", arbitrary_types_allowed=True)
# YAML 1.1 reads an exponent without a dot ("1e-9") as a string: such a string is the number it spells
_EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


class FieldError(ValueError):
    """A config field that is unknown, of the wrong type or outside its limit: its dotted path and what is wrong."""

    def __init__(self, path: str, problem: str):
        super().__init__(path, problem)  # both in args: the error pickles across processes
        self.path, self.problem = path, problem

    def __str__(self) -> str:
        return f"{self.path}: {self.problem}" if self.path else self.problem


def _problem(problem: str, sub: str = "") -> PydanticCustomError:
    """A field's own error inside pydantic's validation; ``sub`` continues the field's path (``[1]``, ``.pause``)."""
    return PydanticCustomError("policy_bundle_field", "{problem}", {"problem": problem, "sub": sub})


def _got(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def _limit_text(lo: float, hi: Optional[float], low_open: bool) -> str:
    if hi is None:
        return f"must be {'>' if low_open else '>='} {lo}"
    return f"is out of range {'(' if low_open else '['}{lo}, {hi}]"


def _each(value: Any, one: Callable[[Any, str], Any]) -> Any:
    """``one(value, sub)`` on a scalar, or on each element of a list/tuple (``sub`` is ``[i]``; a list comes back
    as the tuple its field holds)."""
    if isinstance(value, (list, tuple)):
        return tuple(one(v, f"[{i}]") for i, v in enumerate(value))
    return one(value, "")


def _range_check(lo: float, hi: Optional[float], low_open: bool) -> Callable[[Any], Any]:
    kind = "float" if isinstance(lo, float) else "int"  # a float field's limits are written as floats

    def one(v: Any, sub: str) -> Any:
        if isinstance(v, str) and _EXPONENT.fullmatch(v.strip()):
            v = float(v)
        if isinstance(v, bool):
            raise _problem(f"expected a number, got {_got(v)}", sub)
        if isinstance(v, str):  # lax pydantic (a model built in code) would read "500" as a number past its limit
            raise _problem(f"expected {kind}, got {_got(v)}", sub)
        if isinstance(v, (int, float)):
            above = v > lo if low_open else v >= lo  # NaN is neither above nor below: it fails
            if not (above and (hi is None or v <= hi)):
                raise _problem(f"{v!r} {_limit_text(lo, hi, low_open)}", sub)
        return v  # None and non-numbers: the type says what is expected

    return lambda value: _each(value, one)


def _choice_check(options: tuple, every: bool = False) -> Callable[[Any], Any]:
    """Refuse a value of the options' type that is none of them (others: the type says what is expected), or with
    ``every`` (after a reader, which has made the value what it can) any value that is none of them."""
    kinds = tuple({type(o) for o in options})

    def one(v: Any, sub: str) -> Any:
        if (every or isinstance(v, kinds) and not isinstance(v, bool)) and v not in options:
            raise _problem(f"{v!r} is not one of {list(options)}", sub)
        return v

    return lambda value: _each(value, one)


def _into_value_schema(limits: dict) -> Callable[[dict], None]:
    """A ``json_schema_extra`` that puts ``limits`` on the field's value (inside an Optional, on a list's items)."""

    def extra(schema: dict) -> None:
        target = schema
        if "anyOf" in target:
            target = next((s for s in target["anyOf"] if s.get("type") != "null"), target)
        if target.get("type") == "array" and isinstance(target.get("items"), dict):
            target = target["items"]
        target.update(limits)

    return extra


def ranged(default: Any, lo: float, hi: Optional[float] = None, *, low_open: bool = False, help: str = "") -> Any:
    """A number field within [lo, hi] ((lo, hi] with ``low_open``; no upper limit when ``hi`` is None). On a
    tuple field the limit holds for each element; None passes (an unset Optional field)."""
    limits: Dict[str, Any] = {"exclusiveMinimum" if low_open else "minimum": lo}
    if hi is not None:
        limits["maximum"] = hi
    info = Field(default, description=help or None, json_schema_extra=_into_value_schema(limits))
    info.metadata.append(BeforeValidator(_range_check(lo, hi, low_open)))
    return info


def choice(default: Any, options: Sequence[Any], *, read: Optional[Reader] = None, also: Sequence[Any] = (),
           help: str = "") -> Any:
    """A field that holds one of ``options`` (read by ``read`` first, when the YAML writes it otherwise; ``also``:
    the other YAML values that reader turns into an option, which the JSON Schema accepts too)."""
    options = tuple(options)
    info = Field(default, description=help or None,
                 json_schema_extra=_into_value_schema({"enum": list(options) + list(also)}))
    if read is None:
        info.metadata.append(BeforeValidator(_choice_check(options)))
    else:
        check = _choice_check(options, every=True)
        info.metadata.append(PlainValidator(lambda v: check(_not_none(_read_with(read, v)))))
    return info


def _not_none(value: Any) -> Any:
    if value is None:
        raise _problem("expected a value, got None")
    return value


def _read_with(reader: Reader, value: Any) -> Any:
    try:
        return reader("", value)
    except FieldError as exc:  # the reader names its sub-path after an empty one: "[0].pause", ""
        raise _problem(exc.problem, exc.path) from None


def read_as(reader: Reader, default: Any, *, help: str = "") -> Any:
    """A field whose YAML value ``reader(path, value)`` turns into the field's value (in place of its type); the
    reader also takes the field's own Python value (a caller that builds the model in code)."""
    info = Field(default, description=help or None)
    info.metadata.append(PlainValidator(lambda v: _read_with(reader, v)))
    return info


def setting(default: Any = None, *, help: str, default_factory: Any = None) -> Any:
    """A field with no limit of its own beyond its type: its default (or ``default_factory``) and its help."""
    if default_factory is not None:
        return Field(default_factory=default_factory, description=help)
    return Field(default, description=help)


def inline(cls: type) -> Any:
    """A field holding model ``cls`` whose fields are written as the enclosing mapping's own keys (a key of
    the enclosing model itself wins over an inlined one of the same name)."""
    return dataclasses.field(default_factory=cls, metadata={INLINE: True})


def config_model(path: str = "", error: Type[FieldError] = FieldError) -> Callable[[Type[T]], Type[T]]:
    """Make ``cls`` a frozen pydantic dataclass (no unknown field) whose construction in Python fails as its YAML
    does: ``error`` naming ``path.field`` and the limit. ``path`` is the model's place in its config file."""

    def wrap(cls: Type[T]) -> Type[T]:
        model = pydantic_dataclass(frozen=True, config=MODEL_CONFIG)(cls)
        validated_init = model.__init__

        @functools.wraps(validated_init)
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            try:
                validated_init(self, *args, **kwargs)
            except ValidationError as exc:
                raise field_error(exc, model, path, error) from None

        model.__init__ = __init__
        model.__config_path__ = path
        return model

    return wrap


def _join(path: str, name: Any) -> str:
    if isinstance(name, int):
        return f"{path}[{name}]"
    return f"{path}.{name}" if path else str(name)


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> Dict[str, Any]:
    return typing.get_type_hints(cls)


def _fields(cls: type) -> Dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _unwrap_optional(tp: Any) -> Any:
    if typing.get_origin(tp) is typing.Union:
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return inner[0] if len(inner) == 1 else tp
    return tp


def _keys(cls: type) -> Dict[str, tuple]:
    """Every key ``cls`` reads -> (the inline field holding it, or None; the model that declares it)."""
    own = set(_fields(cls))
    keys: Dict[str, tuple] = {}
    for f in dataclasses.fields(cls):
        if f.metadata.get(INLINE):
            inner = _hints(cls)[f.name]
            keys.update({g.name: (f.name, inner) for g in dataclasses.fields(inner) if g.name not in own})
        else:
            keys[f.name] = (None, cls)
    return keys


def _unknown(path: str, cls: Any, key: Any, error: Type[FieldError] = FieldError) -> FieldError:
    known = sorted(_keys(cls)) if dataclasses.is_dataclass(cls) else []
    return error(_join(path, key), f"unknown field (known: {', '.join(known)})")


def _nested(data: Any, cls: type, path: str) -> Any:
    """The YAML mapping ``data`` of model ``cls`` with its inlined keys moved under their field, as pydantic reads
    it; an unknown key is refused here, with the known ones. A value that is not a mapping is left to the type."""
    if not isinstance(data, dict):
        return data
    keys = _keys(cls)
    unknown = sorted(str(k) for k in set(data) - set(keys))
    if unknown:
        raise _unknown(path, cls, unknown[0])
    out: Dict[str, Any] = {}
    for key, value in data.items():
        holder, owner = keys[key]
        hint = _hints(owner)[key]
        tp = _unwrap_optional(hint)
        if dataclasses.is_dataclass(tp):
            if value is None and tp is hint:  # a section written with nothing under it (its keys commented out)
                value = {}
            value = _nested(value, tp, _join(path, key))
        if holder is None:
            out[key] = value
        else:
            out.setdefault(holder, {})[key] = value
    return out


def _plain(value: Any, path: str) -> Any:
    """``value`` as JSON holds it, checked: mapping keys are strings, and YAML's other types (a date, binary) are
    refused naming the field, not turned into text."""
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                raise FieldError(_join(path, str(key)), f"expected a string key, got {_got(key)}")
        return {k: _plain(v, _join(path, k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, _join(path, i)) for i, v in enumerate(value)]
    if isinstance(value, Path):
        return str(value)
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    raise FieldError(path, f"expected a plain YAML value (string, number, boolean, list or mapping), got "
                           f"{_got(value)}")


@functools.lru_cache(maxsize=None)
def _adapter(cls: type) -> TypeAdapter:
    return TypeAdapter(cls)


def from_mapping(cls: Type[T], data: Any, path: str = "") -> T:
    """Model ``cls`` from a YAML mapping (None: every default), validated strictly; FieldError names the field
    (dotted from ``path``): an unknown key (with the known ones), the wrong type, or a value off its limit."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise FieldError(path or "config", f"expected a mapping, got {type(data).__name__}")
    text = json.dumps(_plain(_nested(data, cls, path), path))
    try:
        return _adapter(cls).validate_json(text, strict=True)
    except ValidationError as exc:
        raise field_error(exc, cls, path) from None


def read_field(cls: type, name: str, value: Any, path: str) -> Any:
    """One field of model ``cls`` from its YAML value, validated as ``from_mapping`` would (the rest at defaults)."""
    if name not in _fields(cls):
        raise _unknown(path.rpartition(".")[0], cls, name)
    try:
        obj = _adapter(cls).validate_json(json.dumps(_plain({name: value}, "")), strict=True)
    except ValidationError as exc:
        raise field_error(exc, cls, path.rpartition(".")[0] if "." in path else "") from None
    return getattr(obj, name)


_EXPECTED = {"int_type": "int", "int_parsing": "int", "int_from_float": "int", "float_type": "float",
             "float_parsing": "float", "bool_type": "bool", "bool_parsing": "bool", "string_type": "str",
             "path_type": "a path"}
_LISTS = ("tuple_type", "list_type", "iterable_type")
_MAPPINGS = ("dict_type", "dataclass_type", "dataclass_exact_type", "model_type", "dataclass_args_type")


def _walk(cls: type, loc: tuple, prefix: str) -> "tuple[str, Any]":
    """The dotted YAML path of pydantic's ``loc`` in model ``cls`` (inline fields are not written), and the type at
    it."""
    path, tp = prefix, cls
    for part in loc:
        inner = _unwrap_optional(tp)
        if isinstance(part, str) and dataclasses.is_dataclass(inner) and part in _fields(inner):
            tp = _hints(inner)[part]
            if not _fields(inner)[part].metadata.get(INLINE):
                path = _join(path, part)
            continue
        origin, args = typing.get_origin(inner), typing.get_args(inner)
        if isinstance(part, int) and origin is tuple:
            tp = args[0] if len(args) == 2 and args[1] is Ellipsis else args[part] if part < len(args) else Any
        elif origin is dict:
            tp = args[1]
        else:
            tp = Any
        path = _join(path, part)
    return path, tp


def _expected_list(tp: Any) -> str:
    args = typing.get_args(_unwrap_optional(tp))
    if len(args) == 2 and args[1] is Ellipsis:
        name = getattr(args[0], "__name__", args[0])
        return f"a list of {PLURALS.get(args[0], f'{name} values')}"
    return f"a list of {len(args)}" if args else "a list"


def field_error(exc: ValidationError, cls: type, prefix: str = "", error: Type[FieldError] = FieldError) -> Exception:
    """pydantic's first error as one line: ``error(path, problem)`` in the YAML's words; an error the model's own
    ``__post_init__`` raised is that error itself."""
    e = exc.errors()[0]
    ctx = e.get("ctx") or {}
    if e["type"] == "value_error" and isinstance(ctx.get("error"), Exception):
        own = ctx["error"]  # raised by a __post_init__ with its own path
        return error(own.path, own.problem) if type(own) is FieldError and error is not FieldError else own
    loc = tuple(e["loc"])
    if e["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
        path, holder = _walk(cls, loc[:-1], prefix)
        return _unknown(path, _unwrap_optional(holder), loc[-1], error)
    path, tp = _walk(cls, loc, prefix)
    if e["type"] == "policy_bundle_field":
        return error(path + ctx.get("sub", ""), ctx["problem"])
    value = e.get("input")
    if e["type"] in ("missing", "missing_argument", "missing_keyword_only_argument"):
        return error(path, "expected a value")
    if value is None:
        return error(path, "expected a value, got None")
    if e["type"] in _MAPPINGS:
        return error(path, f"expected a mapping, got {type(value).__name__}")
    if e["type"] in _LISTS:
        return error(path, f"expected {_expected_list(tp)}, got {_got(value)}")
    if e["type"] in _EXPECTED:
        return error(path, f"expected {_EXPECTED[e['type']]}, got {_got(value)}")
    return error(path, f"{value!r}: {e['msg'][0].lower()}{e['msg'][1:]}")


def to_mapping(obj: Any) -> dict:
    """The YAML shape of model ``obj`` (inline fields flattened into it): ``from_mapping`` reads it back."""
    own = set(_fields(type(obj)))
    out: dict = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.metadata.get(INLINE):
            out.update({k: v for k, v in dataclasses.asdict(value).items() if k not in own})
        elif dataclasses.is_dataclass(value):
            out[f.name] = to_mapping(value)
        else:
            out[f.name] = dict(value) if isinstance(value, dict) else value
    return out


def _is_text(tp: Any) -> bool:
    """A field whose environment variable is taken as written (a string, a path), not read as YAML."""
    args = [a for a in typing.get_args(tp) if a is not type(None)] if typing.get_origin(tp) is typing.Union else [tp]
    return len(args) == 1 and args[0] in (str, Path)


def env_mapping(cls: type, prefix: str, env: Dict[str, str], readers: Optional[Dict[str, Reader]] = None
                ) -> "tuple[dict, Dict[str, str]]":
    """What ``env`` sets of model ``cls``'s YAML, and the variable behind each dotted key: ``<prefix><KEY>``, a
    section's ``<prefix><SECTION>__<KEY>`` (an inline field's keys under their section, as the YAML writes them).
    A value is read as YAML, a string or path field's taken as written, a key in ``readers`` by
    ``reader(variable, raw)``; a variable set empty is unset (but for a reader's key). FieldError names the
    variable of a value that is not YAML."""
    values: dict = {}
    source: Dict[str, str] = {}
    for key, (_, owner) in _keys(cls).items():
        tp, var = _hints(owner)[key], prefix + key.upper()
        if var in env and env[var].strip():  # a value for the whole key (a section as a YAML mapping too)
            raw = env[var]
            if key in (readers or {}):
                values[key] = readers[key](var, raw)
            elif _is_text(tp):
                values[key] = raw.strip()
            else:
                try:
                    values[key] = yaml.safe_load(raw)
                except yaml.YAMLError as exc:
                    raise FieldError(var, f"{raw!r} is not a YAML value ({str(exc).splitlines()[0]})") from None
            source[key] = var
        elif var in env and key in (readers or {}):  # set empty: the reader says whether that means anything
            values[key] = readers[key](var, env[var])
            source[key] = var
        section = _unwrap_optional(tp)
        if dataclasses.is_dataclass(section):  # a section's keys, an Optional section's too: over its own variable
            inner, inner_source = env_mapping(section, var + "__", env)
            if inner:
                values[key] = merged(values.get(key), inner)
                source.update({f"{key}.{k}": v for k, v in inner_source.items()})
    return values, source


def merged(base: Any, over: dict) -> Any:
    """``base`` (a mapping, or nothing) with ``over``'s keys on top, sections merged key by key; a ``base`` that is
    not a mapping is returned as it is, for its reader to refuse."""
    if base is not None and not isinstance(base, dict):
        return base
    out = dict(base or {})
    for key, value in over.items():
        out[key] = merged(out.get(key), value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def variable_of(path: str, source: Dict[str, str]) -> Optional[str]:
    """The variable behind the field at dotted ``path`` (or inside it), from ``env_mapping``'s sources."""
    return next((v for p, v in source.items() if path == p or path.startswith((p + ".", p + "["))), None)


def read_yaml(path: Path, what: str) -> Any:
    """The YAML document in ``path`` (an empty file: {}); FieldError(``what``) says why it cannot be read."""
    path = Path(path)
    if not path.is_file():
        raise FieldError(what, f"{path} does not exist")
    try:
        return yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise FieldError(what, f"cannot read {path}: {' '.join(str(exc).split())}") from None
