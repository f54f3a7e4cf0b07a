"""Build configuration: pydantic models (``quantize/config/schema.py``: frozen pydantic dataclasses), each field's
limit and help declared on the field (the library's ``RecipeConfig`` and ``GateThresholds`` are held whole, their
keys inlined)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import yaml

from policy_bundle.build.config.candidates import parse_candidate
from policy_bundle.build.config.defaults import (DEFAULT_SAMPLES, DEFAULT_TASK_GOLDEN, GENERAL_NEW_TOKENS,
                                                 TASK_NEW_TOKENS, default_general_golden, prompts_path,
                                                 read_prompts_file)
from policy_bundle.build.errors import ConfigError
from policy_bundle.quantize.config.schema import (FieldError, choice, config_model, env_mapping, from_mapping, inline,
                                                  merged, ranged, read_field, read_yaml, setting, to_mapping,
                                                  variable_of)
from policy_bundle.quantize.extras import installed, require
from policy_bundle.quantize.fidelity.scores import GateThresholds
from policy_bundle.quantize.recipe_types import recipe_of
from policy_bundle.quantize.recipes import SCHEMES, RecipeConfig


def candidate_field(key: str, value: Any) -> Any:
    """One recipe field of an auto candidate, read and checked like the ``recipe`` section's own key."""
    try:
        return read_field(RecipeConfig, key, value, f"recipe.{key}")
    except FieldError as exc:
        raise ConfigError(str(exc)) from None


def _auto_or_bool(path: str, value: Any) -> Any:
    """YAML reads ``true``/``false`` as booleans; ``export.int8_vllm`` keeps them as strings beside ``auto``."""
    return str(value).lower() if isinstance(value, bool) else value


@config_model("policy.torchtitan")
class TorchtitanSection:
    """``policy.torchtitan``: ``policy.source`` is a torchtitan DCP step directory written by this model/flavor."""

    model: str = choice("llama3", ("llama3", "qwen3"), help="the torchtitan model (dense flavors, unscaled RoPE)")
    flavor: str = setting("debugmodel", help=(
        "a key of torchtitan.models.<model>.<model>_configs, or policy-bundle-reference"))
    tokenizer: Optional[str] = setting(None, help=(
        "reference (the task's tokenizer) or a directory with tokenizer files"))


@config_model("policy")
class PolicySection:
    """The policy to build from, and the context its bundle serves."""

    source: str = setting("reference", help=(
        "reference (the embedded policy), a path to a Llama/Qwen2/Qwen3 HF directory (safetensors: float32, "
        "bfloat16 or float16), or a torchtitan step-N directory"))
    max_seq_len: Optional[int] = ranged(None, 8, 262144, help=(
        "the context the bundle serves (prompt + answer); unset: the model's own (max_position_embeddings), at most "
        "max_seq_len_cap. The served KV cache grows with what requests use (serve's kv_cache_bytes bounds it)"))
    max_seq_len_cap: int = ranged(8192, 8, 262144, help="the most context an unset max_seq_len takes from the model")
    torchtitan: Optional[TorchtitanSection] = setting(None, help="set when source is a torchtitan DCP checkpoint")
    kind: str = choice("auto", ("auto", "task", "general"), help=(
        "task: judged on the reference task's prompts and exact-match reward; general: a general LM, judged on its "
        "prompts' logits and greedy text; auto: task for the reference policy and what derives from it (a "
        "reference.json beside the weights, a torchtitan checkpoint with the task's tokenizer) unless prompts.file is "
        "set. Decided once when the build starts; the manifest records the decision"))


@config_model("prompts")
class PromptsSection:
    """The prompts the policy answers: calibration samples and the gate's held-out (golden) items."""

    file: Optional[str] = setting(None, help=(
        "JSONL ({\"prompt\": ...} per line) or one prompt per line; unset: the task's prompts (task policies)"))
    max_new_tokens: Optional[int] = ranged(None, 1, 4096, help=(
        "tokens each sample's completion generates; unset: 8 for a task policy, 32 for a general LM"))


@config_model("samples")
class SamplesSection:
    """``samples:``: how the calibration samples (the policy's rollouts on the prompts) and the golden completions
    are made. The section's old name, ``rollouts:``, is still read (``LEGACY_SECTIONS``)."""

    engine: str = choice("local", ("local", "vllm"), help=(
        "local (batched greedy decode in the actors) or vllm (one float32 vLLM engine per actor)"))
    jsonl: Optional[str] = setting(None, help=(
        "a TorchForge rollout dump, {\"prompt\": ..., \"completion\": ...} per line, used instead of generating"))
    batch_size: int = ranged(16, 1, 1024, help="local engine: sequences per batched decode step")


@config_model("calibration")
class CalibrationSection:
    """Calibration on the Monarch mesh (docs/mesh.md): the samples, the golden set and the actors."""

    samples: Optional[int] = ranged(None, 1, 100_000, help=(
        "calibration sequences; unset: 256, or for a prompts file each of its calibration prompts once (<= 256)"))
    batch_size: int = ranged(32, 1, 4096, help="calibration sequences per forward")
    golden: Optional[int] = ranged(None, 2, 100_000, help=(
        "held-out golden items: a number is exactly that many, or a one-line refusal; unset: 128 task prompts, or a "
        "prompts file's past its first 40 (up to 100). A task uses N for the gate and N for the search; a file at "
        "most 20 to search"))
    procs: int = ranged(2, 0, 256, help="calibration actors per host on the Monarch mesh; 0: in this process, no mesh")
    hosts: int = ranged(0, 0, 4096, help="> 0: a host mesh of this many hosts from launcher (docs/mesh.md)")
    launcher: str = setting("process", help=(
        "process (hosts as local processes, monarch.job.ProcessJob) or the path of a Monarch job your scheduler "
        "launcher saved (job.dump)"))
    timeout_s: float = ranged(600.0, 1.0, 86_400.0, help="seconds any one call to an actor may take")
    outlier_sigma: float = ranged(10.0, 0.0, 1_000_000.0, help=(
        "report samples whose max |x| at some linear input is this many std above the other samples' mean "
        "(leave-one-out), so one odd input cannot set a scale; 0: off"))
    drop_outliers: bool = setting(False, help=(
        "leave those samples out of calibration (the manifest lists them either way)"))


@config_model("recipe")
class RecipeSection:
    """``recipe:``: the quantize library's ``RecipeConfig`` (its fields are this section's keys) and ``auto``.

    Two keys are written differently from the library and are this section's own: ``scheme`` may also
    be ``auto`` (gate the ``auto_candidates`` entries, ship the fastest that passes; an entry is a
    scheme, optionally with recipe fields of its own: ``build/config/candidates.py``), and ``overrides`` is a
    mapping (layer pattern -> mode) rather than pairs.
    """

    scheme: str = choice("static", SCHEMES + ("auto",), help=(
        "a recipe scheme (static | dynamic | weight-only | smooth-static | smooth-dynamic | w8a8 | smooth-w8a8), or "
        "auto: gate each of auto_candidates in turn and ship the fastest that passes"))
    # The recipes that pass on pretrained LMs (per-token activations, fast one-pass layer ranking); the torch.ao
    # ones reach 20-82 % top-1 on SmolLM2-135M (docs/recipes.md) and are listed explicitly where wanted. The first
    # has an int8 LM head whose top-64 logits are rescored in float (the head was 10.6 of a 27.7 ms decode step on
    # SmolLM2-135M); the float-head recipes follow it where it fails.
    auto_candidates: Tuple[str, ...] = setting(("smooth-w8a8 skip=[embed_tokens]", "smooth-w8a8", "w8a8"), help=(
        "tried by scheme: auto, in order: a scheme, optionally with recipe fields of its own (\"smooth-w8a8 "
        "skip=[embed_tokens]\")"))
    overrides: Dict[str, str] = setting(default_factory=dict, help=(
        "per-layer modes, layer pattern -> static | dynamic | weight-only | w8a8 | fp32 (e.g. {down_proj: "
        "weight-only})"))
    base: RecipeConfig = inline(RecipeConfig)  # scheme: the first candidate's; overrides: as above

    def __post_init__(self) -> None:
        if not self.auto_candidates:
            raise ConfigError("recipe.auto_candidates: expected at least one candidate")
        for entry in self.auto_candidates:  # each entry reads, used or not
            parse_candidate(entry, candidate_field)
        first = parse_candidate(self.candidates()[0], candidate_field).scheme
        object.__setattr__(self, "base", recipe_of(self.base, scheme=first, overrides=tuple(self.overrides.items())))
        for entry in self.candidates():  # a combination the library refuses fails at load time
            self.candidate_config(entry)

    def candidate_config(self, entry: str) -> RecipeConfig:
        """The library recipe of one candidate entry (``scheme`` or ``scheme key=value ...``), as its family's
        config type (``quantize.recipe_types``)."""
        c = parse_candidate(entry, candidate_field)
        return recipe_of(self.base, scheme=c.scheme, **dict(c.fields))

    def candidates(self) -> List[str]:
        """The schemes the build gates: the configured one, or every auto candidate."""
        return list(self.auto_candidates) if self.scheme == "auto" else [self.scheme]


@config_model("gate")
class GateSection:
    """``gate:``: the build's accuracy gate; its ``GateThresholds`` fields (the live canary's too) are keys here.
    The section's old name, ``canary:``, is still read (``LEGACY_SECTIONS``)."""

    enabled: bool = setting(True, help="gate the INT8 candidates on the held-out golden items (false: ship unjudged)")
    max_fp_layers: int = ranged(8, 0, 10_000, help=(
        "layer fallback budget: linears a failing candidate may keep in float to pass; 0: no fallback (a failure "
        "still ranks layers for the report)"))
    thresholds: GateThresholds = inline(GateThresholds)


ONNX_NOT_INSTALLED = "export.onnx: auto, not built: the [onnx] extra is not installed (pip install 'policy-bundle[onnx]')"
ONNX_AUTO_OFF = ("export.onnx: auto, not built for per-token (w8a8) recipes: onnxruntime's static INT8 keeps one "
                 "activation scale per tensor, which fails the gate on real LMs (set export.onnx: true to build it)")


@config_model("export")
class ExportSection:
    """The artifacts written beside the TorchScript INT8 policy and the FP16 directory."""

    onnx: Optional[bool] = setting(None, help=(
        "the INT8 ONNX export; unset (auto): built unless every recipe candidate is per-token (w8a8), whose "
        "activations onnxruntime's static INT8 cannot carry, or the [onnx] extra is not installed"))
    int8_vllm: str = choice("auto", ("auto", "true", "false"), read=_auto_or_bool, also=(True, False), help=(
        "the compressed-tensors W8A8 directory vLLM serves (int8-vllm/): auto (when vLLM is here) | true | false"))


@config_model("register")
class RegisterSection:
    """The BentoML model store."""

    bentoml: bool = setting(True, help="register the bundle's artifacts in the BentoML model store")


@config_model("")
class BuildConfig:
    """A build: the policy, its calibration samples and calibration, the recipe, the gate and the artifacts."""

    name: str = setting("reference", help=(
        "the bundle's name: its BentoML model versions and watch's bundle directories begin with it"))
    seed: int = ranged(0, 0, 2**31 - 1, help="torch's random seed for the build")
    policy: PolicySection = setting(default_factory=PolicySection, help="the policy and the context it serves")
    prompts: PromptsSection = setting(default_factory=PromptsSection, help="the prompts the policy answers")
    samples: SamplesSection = setting(default_factory=SamplesSection, help="how the calibration samples are made")
    calibration: CalibrationSection = setting(default_factory=CalibrationSection, help="calibration and its mesh")
    recipe: RecipeSection = setting(default_factory=RecipeSection, help="the INT8 recipe, or auto")
    gate: GateSection = setting(default_factory=GateSection, help="the build's accuracy gate")
    export: ExportSection = setting(default_factory=ExportSection, help="the artifacts beside policy.ts")
    register: RegisterSection = setting(default_factory=RegisterSection, help="the BentoML model store")

    def to_dict(self) -> dict:
        """The YAML shape (library dataclasses flattened into their sections), as the manifest stores it."""
        return to_mapping(self)

    def onnx_export(self) -> bool:
        """``export.onnx``, with auto resolved: off when every candidate is a per-token (w8a8) recipe, whose
        activations onnxruntime's static INT8 (one scale per tensor) cannot carry (``ONNX_AUTO_OFF``)."""
        if self.export.onnx is not None:
            return self.export.onnx
        return (any(type(self.recipe_config(c)).onnx_carries_activations for c in self.recipe.candidates())
                and installed("onnx"))  # auto without the [onnx] extra: not built (ONNX_NOT_INSTALLED)

    def require_extras(self) -> None:
        """Refuse, before any work, a setting whose extra is not installed (``quantize/extras.py``)."""
        from policy_bundle.quantize.extras import MissingExtra

        try:
            c = self.calibration
            if c.procs > 0 or c.hosts > 0:
                what = f"calibration.hosts: {c.hosts}" if c.hosts else f"calibration.procs: {c.procs}"
                require("mesh", f"{what} (the Monarch calibration mesh)", "calibration.procs: 0 (in this process)")
            if self.export.onnx:
                require("onnx", "export.onnx: true", "export.onnx: false")
            if self.policy.torchtitan is not None:
                require("torchtitan", "policy.torchtitan (a torchtitan checkpoint as the source)")
        except MissingExtra as exc:
            raise ConfigError(str(exc)) from None

    def recipe_config(self, candidate: Optional[str] = None) -> RecipeConfig:
        """The quantize-library recipe (``candidate``, a scheme or an auto entry, replaces the configured one)."""
        return self.recipe.candidate_config(candidate) if candidate else self.recipe.base


# a section's old name -> its name: read from a file, a stored manifest, ``--set`` and the environment, with one
# line on stderr per process. "canary" and "rollout" are the live traffic's words: the build's accuracy check is the
# gate, and the RL rollouts it calibrates on are its calibration samples.
LEGACY_SECTIONS = {"canary": "gate", "rollouts": "samples"}
_warned: set = set()


def _warn_renamed(old: str, new: str) -> None:
    if old not in _warned:
        _warned.add(old)
        print(f"policy-bundle: the config section `{old}` is now `{new}` (the old name is read, and will be dropped)",
              file=sys.stderr)


def renamed_sections(data: dict) -> dict:
    """``data`` with each legacy section under its name; a section given under both names is refused."""
    if not isinstance(data, dict) or not any(old in data for old in LEGACY_SECTIONS):
        return data
    data = dict(data)
    for old, new in LEGACY_SECTIONS.items():
        if old in data:
            if new in data:
                raise ConfigError(f"{new}: given twice, also under its old name `{old}` (keep `{new}`)")
            _warn_renamed(old, new)
            data[new] = data.pop(old)
    return data


def renamed_key(key: str) -> str:
    """A dotted key (``--set``) or its section's old name replaced."""
    section, dot, rest = key.partition(".")
    if section in LEGACY_SECTIONS:
        _warn_renamed(section, LEGACY_SECTIONS[section])
        return LEGACY_SECTIONS[section] + dot + rest
    return key


def renamed_env(env: Mapping[str, str]) -> Tuple[Dict[str, str], Dict[str, str]]:
    """``POLICY_BUNDLE_BUILD__<OLD>__...`` variables under their section's name, and each renamed variable's name as
    the user set it (so an error names the variable that is really there)."""
    out, set_as = {}, {}
    for var, value in env.items():
        for old, new in LEGACY_SECTIONS.items():
            prefix = f"{BUILD_ENV_PREFIX}{old.upper()}__"
            if var.startswith(prefix):
                _warn_renamed(old, new)
                renamed = f"{BUILD_ENV_PREFIX}{new.upper()}__" + var[len(prefix):]
                set_as[renamed], var = var, renamed
        out[var] = value
    return out, set_as


def _apply_override(data: dict, override: str) -> None:
    key, sep, raw = override.partition("=")
    key = renamed_key(key)
    if not sep:
        raise ConfigError(f"--set {override!r}: expected KEY=VALUE (e.g. calibration.procs=2)")
    node = data
    parts = key.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key}: {p} is not a section")
    try:
        node[parts[-1]] = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {key}: {raw!r} is not a YAML value ({str(exc).splitlines()[0]})") from None


BUILD_ENV_PREFIX = "POLICY_BUNDLE_BUILD__"


def env_settings(env: Mapping[str, str]) -> Tuple[dict, Dict[str, str]]:
    """What ``POLICY_BUNDLE_BUILD__<SECTION>__<FIELD>`` variables set (a top-level field: ``..._BUILD__<FIELD>``), as
    the config file's mapping, and the variable behind each dotted key. The prefix is the build's alone, so a
    variable that names no setting is refused, not ignored."""
    values, source = env_mapping(BuildConfig, BUILD_ENV_PREFIX, dict(env))
    unknown = sorted(v for v in env if v.startswith(BUILD_ENV_PREFIX) and env[v].strip() and v not in source.values())
    if unknown:
        raise ConfigError(f"{unknown[0]}: names no build setting (POLICY_BUNDLE_BUILD__<SECTION>__<FIELD>, as "
                          "`policy-bundle config defaults build` lists them)")
    return values, source


def load_config(path: Optional[Path], overrides: Tuple[str, ...] = (),
                env: Optional[Mapping[str, str]] = None) -> BuildConfig:
    """Read, override and validate a build config: the file, then the environment's ``POLICY_BUNDLE_BUILD__*``
    variables (``env``), then ``overrides`` (``section.field=value``, the CLI's ``--set``). An error from a variable
    names it."""
    variables, set_as = renamed_env(env or {})
    try:
        data = renamed_sections(read_yaml(Path(path), "config file") if path is not None else {})
        over, source = env_settings(variables)
    except (FieldError, ConfigError) as exc:
        var, colon, rest = str(exc).partition(":")
        raise ConfigError(f"{set_as.get(var, var)}{colon}{rest}") from None
    source = {key: set_as.get(var, var) for key, var in source.items()}
    try:
        return config_from_dict(merged(data, over), overrides)
    except ConfigError as exc:
        field_path = str(exc).partition(":")[0]
        var = variable_of(field_path, source)
        if var is None or any(o.partition("=")[0] == field_path for o in overrides):  # --set's value, not the var's
            raise
        raise ConfigError(f"{var}: {exc}") from None


def config_from_dict(data: dict, overrides: Tuple[str, ...] = ()) -> BuildConfig:
    """Validate a config mapping (e.g. the resolved config stored in a bundle manifest)."""
    if not isinstance(data, dict):
        raise ConfigError(f"config: expected a mapping of sections, got {type(data).__name__}")
    data = renamed_sections(dict(data))
    for o in overrides:
        _apply_override(data, o)
    try:
        cfg = from_mapping(BuildConfig, data)
    except FieldError as exc:  # the recipe's own checks (RecipeError) included
        raise ConfigError(str(exc)) from None
    if cfg.calibration.hosts and not cfg.calibration.procs:
        raise ConfigError("calibration.procs: 0 (in-process) cannot be combined with calibration.hosts > 0")
    if cfg.policy.kind == "task" and cfg.prompts.file is not None:
        raise ConfigError("policy.kind: task is judged on the reference task's prompts, and prompts.file names others "
                          "(unset one of them)")
    return check_batch_size(cfg)


def is_task_policy(cfg: BuildConfig) -> bool:
    """Whether the policy is judged on the reference task: ``policy.kind`` once set or resolved
    (``resolve_defaults`` decides it when the build starts, so a stored config keeps its answer after the source is
    gone); for ``auto``, the reference policy, a directory derived from it (marked by its reference.json), or a
    torchtitan checkpoint with the task's tokenizer, unless the config names its own prompts."""
    if cfg.policy.kind != "auto":
        return cfg.policy.kind == "task"
    if cfg.prompts.file is not None:
        return False
    if cfg.policy.torchtitan is not None:
        return cfg.policy.torchtitan.tokenizer == "reference"
    return cfg.policy.source == "reference" or (Path(cfg.policy.source) / "reference.json").is_file()


def check_batch_size(cfg: BuildConfig) -> BuildConfig:
    """calibration.batch_size within calibration.samples (once samples is known: set, or resolved)."""
    if cfg.calibration.samples is not None and cfg.calibration.batch_size > cfg.calibration.samples:
        raise ConfigError(
            f"calibration.batch_size: {cfg.calibration.batch_size} exceeds calibration.samples "
            f"({cfg.calibration.samples})"
        )
    return cfg


def resolve_defaults(cfg: BuildConfig) -> BuildConfig:
    """The config with the fields it leaves unset (None) filled in for this policy, as the manifest records them.

    ``policy.kind`` auto becomes task or general (``is_task_policy``), so every later stage and a bundle's
    stored config read the decision instead of probing the source again.
    A task policy: ``prompts.max_new_tokens`` 8, ``calibration.samples`` 256, ``calibration.golden``
    DEFAULT_TASK_GOLDEN (the gate's items; ``split_prompts`` gives the float-layer search as many more).
    A general LM on a prompts file (the shipped general set by default): 32 new tokens per
    item, ``default_general_golden`` golden items, and every other prompt once as calibration (at most 256: a
    repeated prompt's greedy rollout is the same sequence again, work that adds nothing). Set fields are kept.
    """
    task = is_task_policy(cfg)  # decided here, once: the resolved config carries it (policy.kind)
    if cfg.policy.kind == "auto":
        cfg = replace(cfg, policy=replace(cfg.policy, kind="task" if task else "general"))
    p, c = cfg.prompts, cfg.calibration
    if p.max_new_tokens is None:
        p = replace(p, max_new_tokens=TASK_NEW_TOKENS if task else GENERAL_NEW_TOKENS)
    if task and c.golden is None:
        c = replace(c, golden=DEFAULT_TASK_GOLDEN)
    if not task and (c.golden is None or (c.samples is None and not cfg.samples.jsonl)):
        n = len(read_prompts_file(prompts_path(cfg.prompts.file)))
        c = replace(c, golden=default_general_golden(n) if c.golden is None else c.golden)
        if c.samples is None and not cfg.samples.jsonl:
            c = replace(c, samples=min(DEFAULT_SAMPLES, max(1, n - c.golden)))
    if c.samples is None:
        c = replace(c, samples=DEFAULT_SAMPLES)
    return check_batch_size(replace(cfg, prompts=p, calibration=c))
