"""Typed config dataclasses: each field's limit declared on the field, checked on construction and on reading YAML.

    @dataclass(frozen=True)
    class Section:
        alpha: float = ranged(0.5, 0.0, 1.0)
        mode: str = choice("fast", ("fast", "exact"))

        def __post_init__(self) -> None:
            check(self, "section")  # Section(alpha=2.0) fails as the YAML does

    from_mapping(Section, {"alpha": 2}, "section")  # FieldError: section.alpha: 2 is out of range [0.0, 1.0]

The build config (``build/config/build_config.py``) and the router settings (``serve/settings.py``) read their
YAML through ``from_mapping``; each turns ``FieldError`` into its own exception. A field whose YAML form is not its
Python type (a list of steps that may be plain numbers, one key or a list of keys) declares a reader with
``read_as``; a section that writes a library dataclass's fields as its own keys declares it with ``inline``.
``quantize/config_json_schema.py`` publishes the same fields, types, limits and defaults as a JSON Schema.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import typing
from dataclasses import field
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence, Type, TypeVar

import yaml

T = TypeVar("T")
Reader = Callable[[str, Any], Any]  # (field path, YAML value) -> the field's value
RANGE, LOW_OPEN, CHOICES, READ, INLINE = "range", "low_open", "choices", "read", "inline"
PLURALS = {str: "strings", int: "integers", float: "numbers", bool: "booleans"}


class FieldError(ValueError):
    """A config field that is unknown, of the wrong type or outside its limit: its dotted path and what is wrong."""

    def __init__(self, path: str, problem: str):
        super().__init__(path, problem)  # both in args: the error pickles across processes
        self.path, self.problem = path, problem

    def __str__(self) -> str:
        return f"{self.path}: {self.problem}" if self.path else self.problem


def ranged(default: Any, lo: float, hi: Optional[float] = None, *, low_open: bool = False,
           read: Optional[Reader] = None) -> Any:
    """A number field within [lo, hi] ((lo, hi] with ``low_open``; no upper limit when ``hi`` is None). On a
    tuple field the limit holds for each element; None passes (an unset Optional field)."""
    return _field(default, {RANGE: (lo, hi), LOW_OPEN: low_open}, read)


def choice(default: Any, options: Sequence[Any], *, read: Optional[Reader] = None) -> Any:
    """A field that holds one of ``options``."""
    return _field(default, {CHOICES: tuple(options)}, read)


def read_as(reader: Reader, default: Any) -> Any:
    """A field whose YAML value ``reader(path, value)`` turns into the field's value (in place of its type)."""
    return _field(default, {}, reader)


def inline(cls: type) -> Any:
    """A field holding dataclass ``cls`` whose fields are written as the enclosing mapping's own keys (a key of
    the enclosing dataclass itself wins over an inlined one of the same name)."""
    return field(default_factory=cls, metadata={INLINE: True})


def _field(default: Any, meta: dict, read: Optional[Reader]) -> Any:
    return field(default=default, metadata={**meta, READ: read} if read else meta)


def _join(path: str, name: Any) -> str:
    return f"{path}.{name}" if path else str(name)


def _got(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def _limit_text(lo: float, hi: Optional[float], low_open: bool) -> str:
    if hi is None:
        return f"must be {'>' if low_open else '>='} {lo}"
    return f"is out of range {'(' if low_open else '['}{lo}, {hi}]"


def _check_value(path: str, value: Any, meta: Any, error: Type[FieldError], optional: bool = False) -> None:
    if value is None:
        if optional:  # an unset Optional field
            return
        raise error(path, "expected a value, got None")
    if isinstance(value, tuple) and (RANGE in meta or CHOICES in meta):
        for i, v in enumerate(value):
            _check_value(f"{path}[{i}]", v, meta, error)
        return
    if RANGE in meta:
        (lo, hi), low_open = meta[RANGE], meta[LOW_OPEN]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise error(path, f"expected a number, got {_got(value)}")
        above = value > lo if low_open else value >= lo  # NaN is neither above nor below: it fails
        if not (above and (hi is None or value <= hi)):
            raise error(path, f"{value!r} {_limit_text(lo, hi, low_open)}")
    if CHOICES in meta and value not in meta[CHOICES]:
        raise error(path, f"{value!r} is not one of {list(meta[CHOICES])}")


def check(obj: Any, path: str = "", error: Type[FieldError] = FieldError) -> None:
    """Raise ``error`` for the first field of dataclass ``obj`` outside its declared limit (call it from
    ``__post_init__``; ``path`` is the object's place in the config, e.g. ``recipe``)."""
    for f in dataclasses.fields(obj):
        _check_value(_join(path, f.name), getattr(obj, f.name), f.metadata, error, _optional(type(obj), f.name))


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> Dict[str, Any]:
    return typing.get_type_hints(cls)


def _optional(cls: type, name: str) -> bool:
    """Field ``name`` of ``cls`` may hold None (``Optional[X]``, or typed ``Any``)."""
    tp = _hints(cls)[name]
    return tp is Any or (typing.get_origin(tp) is typing.Union and type(None) in typing.get_args(tp))


def _read(path: str, value: Any, tp: Any) -> Any:
    """``value`` as type ``tp`` (ints widen to float; a string becomes a Path), or FieldError naming the type."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:  # Optional[X]
        if value is None and type(None) in args:
            return None
        return _read(path, value, next(a for a in args if a is not type(None)))
    if dataclasses.is_dataclass(tp):
        return from_mapping(tp, value, path)
    if origin is dict:
        if not isinstance(value, dict):
            raise FieldError(path, f"expected a mapping, got {_got(value)}")
        return {_read(path, k, args[0]): _read(_join(path, k), v, args[1]) for k, v in value.items()}
    if origin is tuple:
        same = len(args) == 2 and args[1] is Ellipsis
        if not isinstance(value, (list, tuple)) or not same and len(value) != len(args):
            what = f"a list of {PLURALS.get(args[0], f'{args[0]} values')}" if same else f"a list of {len(args)}"
            raise FieldError(path, f"expected {what}, got {_got(value)}")
        return tuple(_read(f"{path}[{i}]", v, args[0] if same else args[i]) for i, v in enumerate(value))
    if tp is float and isinstance(value, str):  # YAML 1.1 reads "1e-9" (no dot) as a string
        with contextlib.suppress(ValueError):
            value = float(value)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is Path and isinstance(value, str):
        return Path(value)
    if tp is not Any and (isinstance(value, bool) != (tp is bool) or not isinstance(value, tp)):
        raise FieldError(path, f"expected {getattr(tp, '__name__', tp)}, got {_got(value)}")
    return value


def read_field(cls: type, name: str, value: Any, path: str) -> Any:
    """One field of dataclass ``cls`` from its YAML value: its reader or its type, then its limit."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    reader = f.metadata.get(READ)
    out = reader(path, value) if reader else _read(path, value, _hints(cls)[name])
    _check_value(path, value if out == value else out, f.metadata, FieldError, _optional(cls, name))  # as written
    return out


def _keys(cls: type) -> Dict[str, tuple]:
    """Every key ``cls`` reads -> (the inline field holding it, or None; the dataclass that declares it)."""
    own = {f.name for f in dataclasses.fields(cls)}
    keys: Dict[str, tuple] = {}
    for f in dataclasses.fields(cls):
        if f.metadata.get(INLINE):
            inner = _hints(cls)[f.name]
            keys.update({g.name: (f.name, inner) for g in dataclasses.fields(inner) if g.name not in own})
        else:
            keys[f.name] = (None, cls)
    return keys


def from_mapping(cls: Type[T], data: Any, path: str = "") -> T:
    """Dataclass ``cls`` from a YAML mapping (None: every default); nested dataclasses read with dotted paths.
    FieldError names the field: an unknown key (with the known ones), the wrong type, or a value off its limit."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise FieldError(path or "config", f"expected a mapping, got {type(data).__name__}")
    keys = _keys(cls)
    unknown = sorted(str(k) for k in set(data) - set(keys))
    if unknown:
        raise FieldError(_join(path, unknown[0]), f"unknown field (known: {', '.join(sorted(keys))})")
    own: Dict[str, Any] = {}
    inlined: Dict[str, dict] = {f.name: {} for f in dataclasses.fields(cls) if f.metadata.get(INLINE)}
    for name, value in data.items():
        holder, owner = keys[name]
        (own if holder is None else inlined[holder])[name] = read_field(owner, name, value, _join(path, name))
    return cls(**own, **{name: _hints(cls)[name](**kw) for name, kw in inlined.items()})


def to_mapping(obj: Any) -> dict:
    """The YAML shape of dataclass ``obj`` (inline fields flattened into it): ``from_mapping`` reads it back."""
    own = {f.name for f in dataclasses.fields(obj)}
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
    """What ``env`` sets of dataclass ``cls``'s YAML, and the variable behind each dotted key: ``<prefix><KEY>``, a
    section's ``<prefix><SECTION>__<KEY>`` (an inline field's keys under their section, as the YAML writes them).
    A value is read as YAML, a string or path field's taken as written, a key in ``readers`` by
    ``reader(variable, raw)``; a variable set empty is unset (but for a reader's key). FieldError names the
    variable of a value that is not YAML."""
    values: dict = {}
    source: Dict[str, str] = {}
    for key, (_, owner) in _keys(cls).items():
        tp, var = _hints(owner)[key], prefix + key.upper()
        if dataclasses.is_dataclass(tp):
            inner, inner_source = env_mapping(tp, var + "__", env)
            if inner:
                values[key] = inner
                source.update({f"{key}.{k}": v for k, v in inner_source.items()})
            continue
        if var not in env or (not env[var].strip() and key not in (readers or {})):
            continue
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
