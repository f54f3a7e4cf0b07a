"""The machinery under the build config: YAML values checked against the dataclasses' type hints, each
field's limit (``RANGES``, ``CHOICES``) and library dataclasses whose fields a section inlines as its own keys.
Nothing here names a section class: ``build/config/build_config.py`` defines them and calls ``build_section``."""

from __future__ import annotations

import contextlib
import dataclasses
import typing
from dataclasses import field
from typing import Any, Dict, Optional, Tuple

from policy_bundle.build.config.candidates import parse_candidate
from policy_bundle.build.errors import ConfigError
from policy_bundle.quantize.fidelity import THRESHOLD_RANGES
from policy_bundle.quantize.recipes import BACKENDS, MODES, ROUNDINGS, SCHEMES, RecipeConfig, RecipeError

INLINE = "inline"


def inline(cls: type) -> Any:
    """A section field holding a library dataclass whose fields are written as the section's own keys."""
    return field(default_factory=cls, metadata={INLINE: True})


# (field path) -> (minimum, maximum) for numbers; (field path) -> allowed values for strings.
RANGES = {
    "seed": (0, 2**31 - 1),
    "policy.max_seq_len": (8, 32768),
    "prompts.max_new_tokens": (1, 4096),
    "calibration.samples": (1, 100_000),
    "calibration.batch_size": (1, 4096),
    "calibration.golden": (2, 100_000),  # half for the float-layer search, half held out for the gate
    "rollouts.batch_size": (1, 1024),
    "calibration.procs": (0, 256),
    "calibration.hosts": (0, 4096),
    "calibration.timeout_s": (1.0, 86_400.0),
    "calibration.outlier_sigma": (0.0, 1_000_000.0),
    "recipe.smooth_alpha": (0.0, 1.0),
    "recipe.outlier_ratio": (0.0, 10_000.0),
    "recipe.gptq_damp": (1e-6, 1.0),
    "recipe.lm_head_topk": (0, 4096),
    "recipe.rotation_block": (0, 4096),  # and a power of two (RecipeConfig says so)
    **{f"canary.{name}": limits for name, limits in THRESHOLD_RANGES.items()},  # GateThresholds' own ranges
    "canary.max_fp_layers": (0, 10_000),
}
CHOICES = {
    "rollouts.engine": ("local", "vllm"),
    "policy.torchtitan.model": ("llama3", "qwen3"),
    "recipe.scheme": SCHEMES + ("auto",),
    "recipe.backend": BACKENDS,
    "recipe.rounding": ROUNDINGS,
    "export.int8_vllm": ("auto", "true", "false"),
}
AUTO_OR_BOOL = ("export.int8_vllm",)  # YAML's true/false are read as the strings "true"/"false"


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _coerce(path: str, value: Any, tp: Any) -> Any:
    if path in AUTO_OR_BOOL and isinstance(value, bool):
        value = str(value).lower()
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:  # Optional[X]
        if value is None:
            return None
        return _coerce(path, value, next(a for a in args if a is not type(None)))
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            raise ConfigError(f"{path}: expected a mapping of strings, got {value!r}")
        for k, v in value.items():
            if path == "recipe.overrides" and v not in MODES:
                raise ConfigError(f"{path}.{k}: {v!r} is not one of {list(MODES)}")
        return dict(value)
    if origin in (tuple, Tuple) and args and args[0] is float:
        nums = isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                        for v in value)
        if not nums or not value:
            raise ConfigError(f"{path}: expected a non-empty list of numbers, got {value!r}")
        if any(not 0.0 <= v <= 1.0 for v in value):
            raise ConfigError(f"{path}: {next(v for v in value if not 0.0 <= v <= 1.0)!r} is out of range [0, 1]")
        return tuple(float(v) for v in value)
    if origin in (tuple, Tuple):
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{path}: expected a list of strings, got {value!r}")
        if path == "recipe.auto_candidates":
            if not value:
                raise ConfigError(f"{path}: expected at least one candidate")
            for entry in value:
                parse_candidate(entry, candidate_field)
        return tuple(value)
    if dataclasses.is_dataclass(tp):
        return build_section(tp, value, path)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads "1e-9" (no dot) as a string
        with contextlib.suppress(ValueError):
            return float(value)
    if tp is bool and not isinstance(value, bool) or tp is not bool and isinstance(value, bool):
        raise ConfigError(f"{path}: expected {_type_name(tp)}, got {value!r}")
    if not isinstance(value, tp):
        raise ConfigError(f"{path}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    return value


def candidate_field(key: str, value: Any) -> Any:
    """One recipe field of an auto candidate, checked like the ``recipe`` section's own key."""
    value = _coerce(f"recipe.{key}", value, typing.get_type_hints(RecipeConfig)[key])
    _check_limits(f"recipe.{key}", value)
    return value


def _keys(cls: type) -> Dict[str, Tuple[Optional[str], Any]]:
    """Every key a section accepts -> (the inline field holding it, or None for the section's own; its type).
    A section's own field shadows an inline dataclass field of the same name."""
    keys: Dict[str, Tuple[Optional[str], Any]] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get(INLINE):
            inner = typing.get_type_hints(hints[f.name])
            keys.update({g.name: (f.name, inner[g.name]) for g in dataclasses.fields(hints[f.name])
                         if g.name not in keys and g.name not in hints})
        else:
            keys[f.name] = (None, hints[f.name])
    return keys


def _check_limits(path: str, value: Any) -> None:
    if path in RANGES and value is not None:
        lo, hi = RANGES[path]
        if not lo <= value <= hi:
            raise ConfigError(f"{path}: {value!r} is out of range [{lo}, {hi}]")
    if path in CHOICES and value not in CHOICES[path]:
        raise ConfigError(f"{path}: {value!r} is not one of {list(CHOICES[path])}")


def build_section(cls: type, data: Any, prefix: str = "") -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {type(data).__name__}")
    keys = _keys(cls)
    unknown = sorted(set(data) - set(keys))
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(f"{where}{unknown[0]}: unknown field (known: {', '.join(sorted(keys))})")
    own: dict = {}
    inlined: Dict[str, dict] = {f.name: {} for f in dataclasses.fields(cls) if f.metadata.get(INLINE)}
    for name, value in data.items():
        path = f"{prefix}.{name}" if prefix else name
        holder, tp = keys[name]
        value = _coerce(path, value, tp)
        _check_limits(path, value)
        (own if holder is None else inlined[holder])[name] = value
    try:
        if hasattr(cls, "from_keys"):
            return cls.from_keys(own, inlined)
        hints = typing.get_type_hints(cls)
        return cls(**own, **{name: hints[name](**kw) for name, kw in inlined.items()})
    except RecipeError as exc:  # a combination the library refuses, e.g. a w8a8 override under scheme static
        raise ConfigError(str(exc)) from None


def as_mapping(obj: Any) -> dict:
    out: dict = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.metadata.get(INLINE):
            own = {g.name for g in dataclasses.fields(obj)}
            out.update({k: v for k, v in dataclasses.asdict(value).items() if k not in own})
        elif dataclasses.is_dataclass(value):
            out[f.name] = as_mapping(value)
        else:
            out[f.name] = dict(value) if isinstance(value, dict) else value
    return out
