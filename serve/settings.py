"""Router settings: environment variables plus an optional YAML file (``POLICY_ROUTER_CONFIG``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Optional, Tuple

import yaml

from policy_bundle.quantize.fidelity import GateThresholds
from policy_bundle.serve.rollout import RolloutConfig


@dataclass(frozen=True)
class RouterSettings:
    state_dir: Path = Path(os.path.expanduser("~/.cache/policy-bundle/router"))
    admin_token: Optional[str] = None  # POLICY_BUNDLE_ADMIN_TOKEN; unset = admin API disabled
    api_keys: Tuple[str, ...] = ()  # POLICY_BUNDLE_API_KEYS (comma-separated); empty = open
    model_name: str = "policy"
    sticky_salt: str = "policy-bundle"
    max_inflight: int = 32  # beyond this: 429 with Retry-After
    request_timeout_s: float = 60.0
    health_interval_s: float = 1.0  # variant health probes; a variant that fails one gets no new traffic
    health_timeout_s: float = 3.0
    max_body_bytes: int = 65536
    rollout: RolloutConfig = field(default_factory=RolloutConfig)


def _rollout_from(data: dict) -> RolloutConfig:
    data = dict(data)
    thresholds = GateThresholds(**data.pop("thresholds", {}))
    if "steps" in data:
        data["steps"] = tuple(float(s) for s in data["steps"])
    known = {f.name for f in fields(RolloutConfig)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"rollout.{sorted(unknown)[0]}: unknown field (known: {', '.join(sorted(known))})")
    return RolloutConfig(**data, thresholds=thresholds)


def load_settings() -> RouterSettings:
    s = RouterSettings()
    path = os.environ.get("POLICY_ROUTER_CONFIG")
    if path:
        data = yaml.safe_load(Path(path).read_text()) or {}
        rollout = _rollout_from(data.pop("rollout", {}))
        if "state_dir" in data:
            data["state_dir"] = Path(data["state_dir"])
        s = replace(s, **data, rollout=rollout)
    env = os.environ
    if env.get("POLICY_BUNDLE_STATE_DIR"):
        s = replace(s, state_dir=Path(env["POLICY_BUNDLE_STATE_DIR"]))
    if env.get("POLICY_BUNDLE_ADMIN_TOKEN"):
        s = replace(s, admin_token=env["POLICY_BUNDLE_ADMIN_TOKEN"])
    if env.get("POLICY_BUNDLE_API_KEYS"):
        s = replace(s, api_keys=tuple(k.strip() for k in env["POLICY_BUNDLE_API_KEYS"].split(",") if k.strip()))
    return s
