"""Router settings: environment variables plus an optional YAML file (``POLICY_ROUTER_CONFIG``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Optional, Tuple

import yaml

from policy_bundle.quantize.fidelity import GateThresholds, ThresholdError
from policy_bundle.serve.rollout_types import MatchRule, RolloutConfig, RolloutStep


@dataclass(frozen=True)
class RouterSettings:
    state_dir: Path = Path(os.path.expanduser("~/.cache/policy-bundle/router"))
    # POLICY_BUNDLE_STATE_URL: the rollout database shared by replicas (SQLAlchemy URL, e.g.
    # postgresql+psycopg://user@host/db); unset = sqlite:///<state_dir>/rollout.sqlite (one process)
    state_url: Optional[str] = None
    admin_token: Optional[str] = None  # POLICY_BUNDLE_ADMIN_TOKEN; unset = admin API disabled
    api_keys: Tuple[str, ...] = ()  # POLICY_BUNDLE_API_KEYS (comma-separated); empty = open
    model_name: str = "policy"
    sticky_salt: str = "policy-bundle"
    max_inflight: int = 32  # calls in flight (client, shadow, golden); beyond this: 429 with Retry-After
    background_slots: int = 2  # of those, the most shadow + golden-canary calls at once
    max_batch: int = 32  # sequences one INT8 (TorchScript) decode step advances at once (continuous batching)
    prefill_chunk: int = 64  # prompt tokens prefilled per decode step while others decode (long prompts: chunks)
    request_timeout_s: float = 60.0
    health_interval_s: float = 1.0  # variant health probes; a variant that fails one gets no new traffic
    health_timeout_s: float = 3.0
    max_body_bytes: int = 65536
    require_vllm: bool = False  # the FP16 variant refuses to start on the fallback engine
    int8_engine: str = "torchscript"  # POLICY_BUNDLE_INT8_ENGINE; "vllm" serves the bundle's int8-vllm/ W8A8 dir
    rollout: RolloutConfig = field(default_factory=RolloutConfig)


INT8_ENGINES = ("torchscript", "vllm")


class SettingsError(ValueError):
    """POLICY_ROUTER_CONFIG (or an env var) names an unknown field or holds a bad value."""


def _check_fields(cls, data: dict, prefix: str) -> None:
    if not isinstance(data, dict):
        raise SettingsError(f"{prefix.rstrip('.') or 'config'}: must be a mapping")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise SettingsError(f"{prefix}{unknown[0]}: unknown field (known: {', '.join(sorted(known))})")
    defaults = cls()
    for key, value in data.items():
        default = getattr(defaults, key)
        if isinstance(default, bool) and not isinstance(value, bool):
            raise SettingsError(f"{prefix}{key}: {value!r} is not true/false")
        if isinstance(default, (int, float)) and not isinstance(default, bool) and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
            raise SettingsError(f"{prefix}{key}: {value!r} is not a number >= 0")


def _rollout_from(data: dict) -> RolloutConfig:
    _check_fields(RolloutConfig, data, "rollout.")
    data = dict(data)
    thresholds = data.pop("thresholds", None)
    if thresholds is not None:
        _check_fields(GateThresholds, thresholds, "rollout.thresholds.")
        try:
            thresholds = GateThresholds(**thresholds)  # the ranges the build checks too
        except ThresholdError as exc:
            raise SettingsError(f"rollout.thresholds.{exc}") from None
    if "steps" in data:
        data["steps"] = tuple(_step(s, i) for i, s in enumerate(_listed(data["steps"], "rollout.steps")))
    if "match" in data:
        data["match"] = tuple(_rule(r, i) for i, r in enumerate(_listed(data["match"], "rollout.match")))
    return RolloutConfig(**data, thresholds=thresholds)


def _listed(value, where: str) -> list:
    if not isinstance(value, list):
        raise SettingsError(f"{where}: must be a list")
    return value


def _step(value, i: int) -> RolloutStep:
    """A weight, or ``{weight: W, pause_s: S}``, or ``{weight: W, pause: indefinite}`` (waits for promote)."""
    where = f"rollout.steps[{i}]"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return RolloutStep(float(value))
    if not isinstance(value, dict) or set(value) - {"weight", "pause_s", "pause"} or "weight" not in value:
        raise SettingsError(f"{where}: {value!r} is not a weight or {{weight, pause_s | pause: indefinite}}")
    if value.get("pause", "indefinite") != "indefinite" or ("pause" in value and "pause_s" in value):
        raise SettingsError(f"{where}.pause: only 'indefinite' (or pause_s: seconds instead)")
    weight, pause_s = value["weight"], value.get("pause_s", 0.0)
    for name, v in (("weight", weight), ("pause_s", pause_s)):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise SettingsError(f"{where}.{name}: {v!r} is not a number")
    return RolloutStep(float(weight), float(pause_s), indefinite="pause" in value)


def _rule(value, i: int) -> MatchRule:
    """``{header: NAME, value: V, variant: int8|fp16}`` or the same with ``cookie: NAME``."""
    where = f"rollout.match[{i}]"
    if not isinstance(value, dict) or set(value) - {"header", "cookie", "value", "variant"}:
        raise SettingsError(f"{where}: {value!r} is not {{header | cookie, value, variant}}")
    if not all(isinstance(value.get(k, ""), str) for k in ("header", "cookie", "value", "variant")) \
            or "value" not in value:
        raise SettingsError(f"{where}: header/cookie, value and variant must be strings")
    header = value.get("header")
    return MatchRule(value.get("variant", ""), value["value"], header.lower() if header else None, value.get("cookie"))


def _api_keys(value) -> Tuple[str, ...]:
    """``api_keys``: one key (a YAML string) or a list of them; the error names the type, never a key."""
    keys = () if value is None else (value,) if isinstance(value, str) else value
    if not isinstance(keys, (list, tuple)) or not all(isinstance(k, str) and k.strip() for k in keys):
        got = type(value).__name__ if not isinstance(value, (list, tuple)) else \
            f"a list holding {', '.join(sorted({type(k).__name__ for k in value}))}"
        raise SettingsError(f"api_keys: must be a non-empty string or a list of non-empty strings (got {got})")
    return tuple(k.strip() for k in keys)


def _from_file(path: str) -> RouterSettings:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise SettingsError(f"POLICY_ROUTER_CONFIG: cannot read {path}: {str(exc).splitlines()[0]}") from None
    _check_fields(RouterSettings, data, "")
    rollout = _rollout_from(data.pop("rollout", {}) or {})
    if "state_dir" in data:
        data["state_dir"] = Path(data["state_dir"])
    if "api_keys" in data:
        data["api_keys"] = _api_keys(data["api_keys"])
    return replace(RouterSettings(), **data, rollout=rollout)


def load_settings() -> RouterSettings:
    """Settings from the file and the environment; SettingsError names the field that is wrong."""
    path = os.environ.get("POLICY_ROUTER_CONFIG")
    try:
        s = _from_file(path) if path else RouterSettings()
    except (TypeError, ValueError) as exc:
        if isinstance(exc, SettingsError):
            raise
        raise SettingsError(f"POLICY_ROUTER_CONFIG: {exc}") from None
    if s.max_batch < 1:
        raise SettingsError(f"max_batch: {s.max_batch} must be >= 1 (sequences per INT8 decode step)")
    if s.prefill_chunk < 1:
        raise SettingsError(f"prefill_chunk: {s.prefill_chunk} must be >= 1 (prompt tokens per decode step)")
    env = os.environ
    if env.get("POLICY_BUNDLE_STATE_DIR"):
        s = replace(s, state_dir=Path(env["POLICY_BUNDLE_STATE_DIR"]))
    if env.get("POLICY_BUNDLE_STATE_URL"):
        s = replace(s, state_url=env["POLICY_BUNDLE_STATE_URL"].strip())
    if env.get("POLICY_BUNDLE_ADMIN_TOKEN"):
        s = replace(s, admin_token=env["POLICY_BUNDLE_ADMIN_TOKEN"])
    if env.get("POLICY_BUNDLE_API_KEYS"):
        s = replace(s, api_keys=tuple(k.strip() for k in env["POLICY_BUNDLE_API_KEYS"].split(",") if k.strip()))
    if env.get("POLICY_BUNDLE_INT8_ENGINE"):
        s = replace(s, int8_engine=env["POLICY_BUNDLE_INT8_ENGINE"].strip())
    if s.int8_engine not in INT8_ENGINES:
        raise SettingsError(f"int8_engine: {s.int8_engine!r} is not one of {list(INT8_ENGINES)}")
    return s


def settings_or_exit() -> RouterSettings:
    """``load_settings`` for a server's start-up: a bad setting is one log line and exit, not a traceback."""
    import logging

    try:
        return load_settings()
    except SettingsError as exc:
        logging.getLogger("policy_bundle.router").error("refusing to start: %s", exc)
        raise SystemExit(f"policy-bundle: {exc}") from None
