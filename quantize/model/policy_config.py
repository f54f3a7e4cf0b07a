"""The policy's shape: which HF architectures load (``SUPPORTED_ARCHITECTURES``), the config read from an HF
``config.json`` (``PolicyConfig``) and the RoPE frequencies it implies (Llama-3 scaling included)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


class UnsupportedModelError(ValueError):
    """The directory holds a model this project cannot load (wrong architecture or feature)."""


@dataclass(frozen=True)
class PolicyConfig:
    family: str  # llama | qwen2 | qwen3
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    attention_bias: bool = False  # q/k/v bias (always on for Qwen2)
    qk_norm: bool = False  # Qwen3 per-head RMSNorm on q and k
    tie_embeddings: bool = False
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    pad_token_id: Optional[int] = None
    # Llama-3 RoPE scaling: (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
    rope_llama3: Optional[Tuple[float, float, float, float]] = None

    @classmethod
    def from_hf_dict(cls, hf: dict) -> "PolicyConfig":
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else hf.get("model_type", "?")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {arch!r} is not supported; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3", None):
            raise UnsupportedModelError(f"rope_type {rope_type!r} is not supported (only 'default' and 'llama3')")
        llama3 = None
        if rope_type == "llama3":
            llama3 = (float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
                      float(rope["original_max_position_embeddings"]))
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        n_heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return cls(
            family=family,
            vocab_size=hf["vocab_size"],
            dim=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
            intermediate_size=hf["intermediate_size"],
            max_seq_len=hf.get("max_position_embeddings", 2048),
            rope_theta=float(theta),
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            attention_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos,
            pad_token_id=hf.get("pad_token_id"),
            rope_llama3=llama3,
        )

    def to_hf_dict(self) -> dict:
        arch = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[self.family]
        hf = {
            "architectures": [arch],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_seq_len,
            "rope_theta": self.rope_theta,
            "rope_parameters": self.rope_parameters(),
            "rms_norm_eps": self.norm_eps,
            "hidden_act": "silu",
            "tie_word_embeddings": self.tie_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if self.family == "llama":
            hf["attention_bias"] = self.attention_bias
            hf["mlp_bias"] = False
        if self.family == "qwen3":
            hf["attention_bias"] = False
        return hf

    def rope_parameters(self) -> dict:
        if self.rope_llama3 is None:
            return {"rope_type": "default", "rope_theta": self.rope_theta}
        factor, low, high, original = self.rope_llama3
        return {"rope_type": "llama3", "rope_theta": self.rope_theta, "factor": factor, "low_freq_factor": low,
                "high_freq_factor": high, "original_max_position_embeddings": int(original)}

    def num_params(self) -> int:
        d, f, v = self.dim, self.intermediate_size, self.vocab_size
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        per_layer = d * (q + 2 * kv) + q * d + 3 * d * f + 2 * d
        return self.n_layers * per_layer + v * d * (1 if self.tie_embeddings else 2) + d


def rope_inv_freq(cfg: PolicyConfig) -> Tensor:
    """RoPE inverse frequencies; with Llama-3 scaling, long wavelengths are slowed by ``factor`` and the
    band between the two wavelength limits is interpolated (as transformers' and torchtitan's llama3 RoPE)."""
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
    if cfg.rope_llama3 is None:
        return inv_freq
    factor, low, high, original = cfg.rope_llama3
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) & ~(wavelen > original / low)
    return torch.where(medium, smoothed, scaled)
