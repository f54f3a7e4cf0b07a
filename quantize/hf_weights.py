"""HuggingFace directories in and out: the config and safetensors of a Llama/Qwen2/Qwen3 directory into a
``Policy``, a ``Policy`` back out as HF weights, and a randomly initialised one for tests and benchmarks."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch

from policy_bundle.quantize.model import Policy, PolicyConfig, UnsupportedModelError


def load_hf_config(path: Path, max_seq_len: Optional[int] = None) -> PolicyConfig:
    """The policy config of an HF directory, optionally with a shorter context (smaller caches)."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise UnsupportedModelError(f"{path}: no config.json (expected a HuggingFace model directory)")
    cfg = PolicyConfig.from_hf_dict(json.loads(cfg_file.read_text()))
    if max_seq_len and max_seq_len < cfg.max_seq_len:
        cfg = PolicyConfig(**{**asdict(cfg), "max_seq_len": max_seq_len})
    return cfg


def _hf_key(ours: str) -> str:
    return ours if ours.startswith("lm_head") else "model." + ours


def load_policy(path: Path | str, max_seq_len: Optional[int] = None) -> Policy:
    """Load a Llama/Qwen2/Qwen3 HF directory (safetensors) into an FP32 ``Policy`` in eval mode."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg = load_hf_config(path, max_seq_len)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(f"{path}: no *.safetensors weights found")
    weights = {}
    for f in files:
        weights.update(load_file(str(f)))
    policy = Policy(cfg)
    state = {}
    for name in policy.state_dict():
        key = _hf_key(name)
        if key not in weights:
            if name == "lm_head.weight" and cfg.tie_embeddings:
                continue
            raise UnsupportedModelError(f"{path}: weight {key!r} missing from safetensors")
        state[name] = weights[key].float()
    policy.load_state_dict(state, strict=not cfg.tie_embeddings)
    return policy.eval()


def save_hf_weights(policy: Policy, cfg: PolicyConfig, out: Path, dtype: torch.dtype) -> None:
    """Write config.json + model.safetensors in HF layout (tied lm_head stored once)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in policy.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_embeddings:
            continue
        tensors[_hf_key(name)] = t.detach().to(dtype).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf = cfg.to_hf_dict()
    hf["torch_dtype"] = str(dtype).removeprefix("torch.")
    hf["dtype"] = hf["torch_dtype"]
    (out / "config.json").write_text(json.dumps(hf, indent=2))


def init_random_policy(cfg: PolicyConfig, seed: int) -> Policy:
    """A seeded random policy (for tests and benchmarks), initialised like HF (normal, std 0.02)."""
    g = torch.Generator().manual_seed(seed)
    policy = Policy(cfg)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return policy.eval()
