"""Where the FP32 policy comes from: the embedded reference policy, an HF directory, or the HF directory
converted from a torchtitan checkpoint; and whether it is the task policy (scored by task reward)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from policy_bundle.build.config.build_config import BuildConfig
from policy_bundle.build.errors import ConfigError, UnsupportedPolicyError
from policy_bundle.quantize.model.hf_weights import load_hf_config
from policy_bundle.quantize.model.policy import UnsupportedModelError


def resolve_policy_dir(cfg: BuildConfig, log: Callable[[str], None] = print) -> Path:
    """The HF directory of the FP32 policy: the embedded reference policy, a user path, or the HF directory
    converted (once, into the cache) from a torchtitan checkpoint."""
    if cfg.policy.torchtitan is not None:
        from policy_bundle.build.source.torchtitan_checkpoint import resolve_torchtitan_source
        from policy_bundle.quantize.reference.embedded import default_cache_dir

        return resolve_torchtitan_source(Path(cfg.policy.source).expanduser(), cfg.policy.torchtitan,
                                         default_cache_dir(), log=log)
    if cfg.policy.source == "reference":
        from policy_bundle.quantize.reference.embedded import ensure_reference_policy

        return ensure_reference_policy(log=log)
    path = Path(cfg.policy.source).expanduser()
    if not path.exists():
        raise ConfigError(f"policy.source: {str(path)!r} does not exist")
    if not path.is_dir():
        raise ConfigError(f"policy.source: {str(path)!r} is not a directory")
    try:
        load_hf_config(path)
    except UnsupportedModelError as exc:  # e.g. GPT-2
        raise UnsupportedPolicyError(f"policy.source: {exc}") from None
    if not list(path.glob("*.safetensors")):
        raise UnsupportedPolicyError(f"policy.source: {path} holds no *.safetensors weights")
    return path
