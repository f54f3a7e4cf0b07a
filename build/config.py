"""Build configuration: frozen dataclasses loaded from YAML, every field validated with its limit."""

from __future__ import annotations

import contextlib
import dataclasses
import typing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import yaml

from policy_bundle.build.candidates import parse_candidate
from policy_bundle.build.errors import ConfigError
from policy_bundle.quantize.fidelity import THRESHOLD_RANGES, GateThresholds
from policy_bundle.quantize.recipes import BACKENDS, MODES, ROUNDINGS, SCHEMES, RecipeConfig, RecipeError


@dataclass(frozen=True)
class TorchtitanSection:
    """``policy.torchtitan``: ``policy.source`` is a torchtitan DCP step directory written by this model/flavor."""

    model: str = "llama3"  # llama3 | qwen3
    flavor: str = "debugmodel"  # a key of torchtitan.models.<model>.<model>_configs, or policy-bundle-reference
    tokenizer: Optional[str] = None  # "reference" (the task's tokenizer) or a directory with tokenizer files


@dataclass(frozen=True)
class PolicySection:
    source: str = "reference"  # "reference", a path to an HF directory, or a torchtitan step-N directory
    max_seq_len: int = 256
    torchtitan: Optional[TorchtitanSection] = None  # set when source is a torchtitan DCP checkpoint


@dataclass(frozen=True)
class PromptsSection:
    file: Optional[str] = None  # JSONL ({"prompt": ...}) or one prompt per line; None: task prompts
    max_new_tokens: int = 8


@dataclass(frozen=True)
class RolloutsSection:
    engine: str = "local"  # local | vllm
    jsonl: Optional[str] = None  # {"prompt", "completion"} records used instead of generating
    batch_size: int = 16  # local engine: sequences per batched decode step


@dataclass(frozen=True)
class CalibrationSection:
    samples: int = 256
    batch_size: int = 32
    golden: Optional[int] = None  # a number: exactly that many golden items, or a one-line refusal; None: 128
    # task prompts, a quarter of a prompts file. The task: N gate items + N for the float-layer search; a file:
    # its N split in halves
    procs: int = 2  # calibration actors per host on the Monarch mesh; 0 = in this process, no mesh
    hosts: int = 0  # >0: a host mesh of this many hosts from ``launcher`` (see README)
    launcher: str = "process"  # "process" (local ProcessJob) or the path of a saved Monarch job
    timeout_s: float = 600.0
    outlier_sigma: float = 10.0  # report samples whose activation range is this many std above the rest; 0 = off
    drop_outliers: bool = False  # ... and leave them out of calibration


INLINE = "inline"


def inline(cls: type) -> Any:
    """A section field holding a library dataclass whose fields are written as the section's own keys."""
    return field(default_factory=cls, metadata={INLINE: True})


@dataclass(frozen=True)
class RecipeSection:
    """``recipe:``: the quantize library's ``RecipeConfig`` (its fields are this section's keys) and ``auto``.

    Two keys are written differently from the library and are this section's own: ``scheme`` may also
    be ``auto`` (gate every ``auto_candidates`` entry, ship the fastest that passes; an entry is a
    scheme, optionally with recipe fields of its own: ``build/candidates.py``), and ``overrides`` is a
    mapping (layer pattern -> mode) rather than pairs.
    """

    scheme: str = "static"
    auto_candidates: Tuple[str, ...] = ("static", "smooth-static", "dynamic", "smooth-dynamic", "weight-only")
    overrides: Dict[str, str] = field(default_factory=dict)  # layer pattern -> static|dynamic|weight-only|fp32
    base: RecipeConfig = inline(RecipeConfig)  # scheme: the first candidate's; overrides: as above

    @classmethod
    def from_keys(cls, own: dict, inlined: Dict[str, dict]) -> "RecipeSection":
        section = cls(**own)
        first = parse_candidate(section.candidates()[0], _candidate_field).scheme
        base = RecipeConfig(**inlined["base"], scheme=first, overrides=tuple(section.overrides.items()))
        section = replace(section, base=base)
        for entry in section.candidates():  # a combination the library refuses fails at load time
            section.candidate_config(entry)
        return section

    def candidate_config(self, entry: str) -> RecipeConfig:
        """The library recipe of one candidate entry (``scheme`` or ``scheme key=value ...``)."""
        c = parse_candidate(entry, _candidate_field)
        return replace(self.base, scheme=c.scheme, **dict(c.fields))

    def candidates(self) -> List[str]:
        """The schemes the build gates: the configured one, or every auto candidate."""
        return list(self.auto_candidates) if self.scheme == "auto" else [self.scheme]


@dataclass(frozen=True)
class CanarySection:
    """``canary:``: the build's accuracy gate; its ``GateThresholds`` fields (the live canary's too) are keys here."""

    enabled: bool = True
    max_fp_layers: int = 8  # layer fallback budget; 0 = no fallback (a failure still ranks layers for the report)
    gate: GateThresholds = inline(GateThresholds)


@dataclass(frozen=True)
class ExportSection:
    onnx: bool = True
    int8_vllm: str = "auto"  # the compressed-tensors W8A8 dir vLLM serves: auto (when vLLM is here) | true | false


@dataclass(frozen=True)
class RegisterSection:
    bentoml: bool = True


@dataclass(frozen=True)
class BuildConfig:
    name: str = "reference"
    seed: int = 0
    policy: PolicySection = field(default_factory=PolicySection)
    prompts: PromptsSection = field(default_factory=PromptsSection)
    rollouts: RolloutsSection = field(default_factory=RolloutsSection)
    calibration: CalibrationSection = field(default_factory=CalibrationSection)
    recipe: RecipeSection = field(default_factory=RecipeSection)
    canary: CanarySection = field(default_factory=CanarySection)
    export: ExportSection = field(default_factory=ExportSection)
    register: RegisterSection = field(default_factory=RegisterSection)

    def to_dict(self) -> dict:
        """The YAML shape (library dataclasses flattened into their sections), as the manifest stores it."""
        return _as_mapping(self)

    def recipe_config(self, candidate: Optional[str] = None) -> RecipeConfig:
        """The quantize-library recipe (``candidate``, a scheme or an auto entry, replaces the configured one)."""
        return self.recipe.candidate_config(candidate) if candidate else self.recipe.base


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
                parse_candidate(entry, _candidate_field)
        return tuple(value)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
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


def _candidate_field(key: str, value: Any) -> Any:
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


def _build(cls: type, data: Any, prefix: str = "") -> Any:
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


def _as_mapping(obj: Any) -> dict:
    out: dict = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.metadata.get(INLINE):
            own = {g.name for g in dataclasses.fields(obj)}
            out.update({k: v for k, v in dataclasses.asdict(value).items() if k not in own})
        elif dataclasses.is_dataclass(value):
            out[f.name] = _as_mapping(value)
        else:
            out[f.name] = dict(value) if isinstance(value, dict) else value
    return out


def _apply_override(data: dict, override: str) -> None:
    key, sep, raw = override.partition("=")
    if not sep:
        raise ConfigError(f"--set {override!r}: expected KEY=VALUE (e.g. calibration.procs=2)")
    node = data
    parts = key.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key}: {p} is not a section")
    node[parts[-1]] = yaml.safe_load(raw)


def load_config(path: Optional[Path], overrides: Tuple[str, ...] = ()) -> BuildConfig:
    """Read, override (``section.field=value``) and validate a build config."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML ({exc})") from None
    return config_from_dict(data, overrides)


def config_from_dict(data: dict, overrides: Tuple[str, ...] = ()) -> BuildConfig:
    """Validate a config mapping (e.g. the resolved config stored in a bundle manifest)."""
    data = dict(data)
    for o in overrides:
        _apply_override(data, o)
    cfg = _build(BuildConfig, data)
    if cfg.calibration.hosts and not cfg.calibration.procs:
        raise ConfigError("calibration.procs: 0 (in-process) cannot be combined with calibration.hosts > 0")
    if cfg.calibration.batch_size > cfg.calibration.samples:
        raise ConfigError(
            f"calibration.batch_size: {cfg.calibration.batch_size} exceeds calibration.samples "
            f"({cfg.calibration.samples})"
        )
    return cfg
