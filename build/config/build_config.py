"""Build configuration: frozen dataclasses loaded from YAML, every field validated with its limit."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import yaml

from policy_bundle.build.config.candidates import parse_candidate
from policy_bundle.build.config.config_fields import as_mapping, build_section, candidate_field, inline
from policy_bundle.build.errors import ConfigError
from policy_bundle.quantize.fidelity import GateThresholds
from policy_bundle.quantize.recipes import RecipeConfig


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
    max_new_tokens: Optional[int] = None  # None: 8 for a task policy, 32 for a general LM (prompt_split.resolve_defaults)


@dataclass(frozen=True)
class RolloutsSection:
    engine: str = "local"  # local | vllm
    jsonl: Optional[str] = None  # {"prompt", "completion"} records used instead of generating
    batch_size: int = 16  # local engine: sequences per batched decode step


@dataclass(frozen=True)
class CalibrationSection:
    samples: Optional[int] = None  # None: 256, or for a prompts file each of its calibration prompts once (<= 256)
    batch_size: int = 32
    golden: Optional[int] = None  # a number: exactly that many golden items, or a one-line refusal; None: 128
    # task prompts, min(40, half) of a prompts file. The task: N gate items + N for the float-layer search; a
    # file: its N split in halves
    procs: int = 2  # calibration actors per host on the Monarch mesh; 0 = in this process, no mesh
    hosts: int = 0  # >0: a host mesh of this many hosts from ``launcher`` (see README)
    launcher: str = "process"  # "process" (local ProcessJob) or the path of a saved Monarch job
    timeout_s: float = 600.0
    outlier_sigma: float = 10.0  # report samples whose activation range is this many std above the rest; 0 = off
    drop_outliers: bool = False  # ... and leave them out of calibration


@dataclass(frozen=True)
class RecipeSection:
    """``recipe:``: the quantize library's ``RecipeConfig`` (its fields are this section's keys) and ``auto``.

    Two keys are written differently from the library and are this section's own: ``scheme`` may also
    be ``auto`` (gate every ``auto_candidates`` entry, ship the fastest that passes; an entry is a
    scheme, optionally with recipe fields of its own: ``build/config/candidates.py``), and ``overrides`` is a
    mapping (layer pattern -> mode) rather than pairs.
    """

    scheme: str = "static"
    # The recipes that pass on pretrained LMs (per-token activations, fast one-pass layer ranking); the torch.ao
    # ones reach 20-82 % top-1 on SmolLM2-135M (docs/recipes.md) and are listed explicitly where wanted.
    auto_candidates: Tuple[str, ...] = ("smooth-w8a8", "w8a8")
    overrides: Dict[str, str] = field(default_factory=dict)  # layer pattern -> static|dynamic|weight-only|fp32
    base: RecipeConfig = inline(RecipeConfig)  # scheme: the first candidate's; overrides: as above

    @classmethod
    def from_keys(cls, own: dict, inlined: Dict[str, dict]) -> "RecipeSection":
        section = cls(**own)
        first = parse_candidate(section.candidates()[0], candidate_field).scheme
        base = RecipeConfig(**inlined["base"], scheme=first, overrides=tuple(section.overrides.items()))
        section = replace(section, base=base)
        for entry in section.candidates():  # a combination the library refuses fails at load time
            section.candidate_config(entry)
        return section

    def candidate_config(self, entry: str) -> RecipeConfig:
        """The library recipe of one candidate entry (``scheme`` or ``scheme key=value ...``)."""
        c = parse_candidate(entry, candidate_field)
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


ONNX_AUTO_OFF = ("export.onnx: auto, not built for per-token (w8a8) recipes: onnxruntime's static INT8 keeps one "
                 "activation scale per tensor, which fails the gate on real LMs (set export.onnx: true to build it)")


@dataclass(frozen=True)
class ExportSection:
    onnx: Optional[bool] = None  # None (auto): built unless every recipe candidate is per-token (BuildConfig.onnx_export)
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
        return as_mapping(self)

    def onnx_export(self) -> bool:
        """``export.onnx``, with auto resolved: off when every candidate is a per-token (w8a8) recipe, whose
        activations onnxruntime's static INT8 (one scale per tensor) cannot carry (``ONNX_AUTO_OFF``)."""
        if self.export.onnx is not None:
            return self.export.onnx
        return not all(self.recipe_config(c).per_token for c in self.recipe.candidates())

    def recipe_config(self, candidate: Optional[str] = None) -> RecipeConfig:
        """The quantize-library recipe (``candidate``, a scheme or an auto entry, replaces the configured one)."""
        return self.recipe.candidate_config(candidate) if candidate else self.recipe.base


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
    cfg = build_section(BuildConfig, data)
    if cfg.calibration.hosts and not cfg.calibration.procs:
        raise ConfigError("calibration.procs: 0 (in-process) cannot be combined with calibration.hosts > 0")
    return check_batch_size(cfg)


def check_batch_size(cfg: BuildConfig) -> BuildConfig:
    """calibration.batch_size within calibration.samples (once samples is known: set, or resolved)."""
    if cfg.calibration.samples is not None and cfg.calibration.batch_size > cfg.calibration.samples:
        raise ConfigError(
            f"calibration.batch_size: {cfg.calibration.batch_size} exceeds calibration.samples "
            f"({cfg.calibration.samples})"
        )
    return cfg
