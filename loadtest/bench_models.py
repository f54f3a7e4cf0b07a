"""Benchmark models: the reference policy and a seeded random ~100M-parameter Llama (HF dirs on disk)."""

from __future__ import annotations

from pathlib import Path

from policy_bundle.quantize.model.policy import PolicyConfig

from policy_bundle.quantize.model.hf_weights import init_random_policy
from policy_bundle.quantize.reference.embedded import default_cache_dir, ensure_reference_policy, write_policy_dir

RANDOM_100M = PolicyConfig(family="llama", vocab_size=16000, dim=768, n_layers=12, n_heads=12, n_kv_heads=4,
                           head_dim=64, intermediate_size=2304, max_seq_len=256, tie_embeddings=True,
                           bos_token_id=1, eos_token_id=2, pad_token_id=0)


def random_policy_dir(name: str, cfg: PolicyConfig) -> Path:
    """A seeded random policy of shape ``cfg``, saved once as an FP32 HF directory."""
    out = default_cache_dir() / name
    if not (out / "config.json").is_file():
        write_policy_dir(init_random_policy(cfg, seed=0), cfg, out)
    return out


def random_100m_dir() -> Path:
    return random_policy_dir("random-100m", RANDOM_100M)


def outlier_reference_dir(channels: int = 4, factor: float = 100.0) -> Path:
    """The reference policy with real-LM-like massive activations (same function, see make_outlier_model).

    Keeps reference.json, so builds score it on the addition task."""
    import json
    import shutil

    from policy_bundle.quantize.model.hf_weights import load_hf_config, load_policy
    from policy_bundle.quantize.calibration.smooth import make_outlier_model

    src = ensure_reference_policy()
    out = default_cache_dir() / f"{src.name}-outliers-{channels}x{factor:g}"
    if not (out / "config.json").is_file():
        model = make_outlier_model(load_policy(src), channels=channels, factor=factor)
        write_policy_dir(model, load_hf_config(src), out)
        meta = json.loads((src / "reference.json").read_text())
        (out / "reference.json").write_text(json.dumps({**meta, "outliers": {"channels": channels, "factor": factor}}))
        shutil.copy(src / "generation_config.json", out / "generation_config.json")
    return out


def bench_models() -> dict[str, Path]:
    return {"reference": ensure_reference_policy(), "random-100m": random_100m_dir()}


# The shape of a real 135M Llama-family LM (30 thin layers, GQA 9/3, tied 49k vocabulary), random weights.
RANDOM_135M = PolicyConfig(family="llama", vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
                           head_dim=64, intermediate_size=1536, max_seq_len=256, tie_embeddings=True,
                           bos_token_id=1, eos_token_id=2, pad_token_id=0)


def random_135m_dir() -> Path:
    return random_policy_dir("random-135m", RANDOM_135M)
