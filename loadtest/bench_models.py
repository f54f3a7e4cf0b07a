"""Benchmark models: the reference policy and a seeded random ~100M-parameter Llama (HF dirs on disk)."""

from __future__ import annotations

from pathlib import Path

from quantize.model import PolicyConfig, init_random_policy
from quantize.reference import default_cache_dir, ensure_reference_policy, write_policy_dir

RANDOM_100M = PolicyConfig(family="llama", vocab_size=16000, dim=768, n_layers=12, n_heads=12, n_kv_heads=4,
                           head_dim=64, intermediate_size=2304, max_seq_len=256, tie_embeddings=True,
                           bos_token_id=1, eos_token_id=2, pad_token_id=0)


def random_100m_dir() -> Path:
    """A seeded random Llama-family model (~100M params) saved once as an FP32 HF directory."""
    out = default_cache_dir() / "random-100m"
    if not (out / "config.json").is_file():
        write_policy_dir(init_random_policy(RANDOM_100M, seed=0), RANDOM_100M, out)
    return out


def bench_models() -> dict[str, Path]:
    return {"reference": ensure_reference_policy(), "random-100m": random_100m_dir()}
