"""HuggingFace directories in and out: the config and safetensors of a Llama/Qwen2/Qwen3 directory into a
``Policy``, a ``Policy`` back out as HF weights, and a randomly initialised one for tests and benchmarks."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Dict, Optional, Sequence

import torch

from policy_bundle.quantize.model.blocks import NARROW
from policy_bundle.quantize.model.policy import Policy, PolicyConfig, UnsupportedModelError, rope_tables
from policy_bundle.quantize.model.safetensors_io import mapped_tensors, read_header, shapes_of, write_streaming


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


def load_policy(path: Path | str, max_seq_len: Optional[int] = None, layers: Optional[Sequence[int]] = None) -> Policy:
    """Load a Llama/Qwen2/Qwen3 HF directory (safetensors) into an FP32 ``Policy`` in eval mode.

    Weights are views of a private memory map of the files (``quantize.model.safetensors_io``): loading reads nothing,
    and
    the process holds only the pages its forwards touch. A 16-bit source's decoder-layer linears stay in their own
    dtype, mapped, and each block widens them for its own call (``blocks.Block.narrow``: exact, so bitwise a float32
    copy's outputs, with one layer's float32 weights alive at a time); the rest (embedding, head, norms, biases: a
    few percent of a real LM) is widened here. ``layers``: only these decoder layers get weights (the others stay
    on the meta device, holding nothing): a process that works on a share of the layers."""
    path = Path(path)
    cfg = load_hf_config(path, max_seq_len)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(f"{path}: no *.safetensors weights found")
    weights: Dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(mapped_tensors(f))
    with torch.device("meta"):
        policy = Policy(cfg)
    keep = None if layers is None else {f"layers.{i}." for i in layers}
    state = {}
    for name in policy.state_dict():
        if keep is not None and name.startswith("layers.") and not any(name.startswith(k) for k in keep):
            continue
        key = _hf_key(name)
        if key not in weights:
            if name == "lm_head.weight" and cfg.tie_embeddings:
                continue
            raise UnsupportedModelError(f"{path}: weight {key!r} missing from safetensors")
        t = weights.pop(key)
        narrow = t.dtype in NARROW and name.startswith("layers.") and t.dim() == 2
        state[name] = t if t.dtype == torch.float32 or narrow else t.float()
    policy.load_state_dict(state, strict=False, assign=True)
    for block in policy.layers:
        block.narrow = any(p.dtype in NARROW for p in block.parameters())
    if cfg.tie_embeddings:
        policy.lm_head.weight = policy.embed_tokens.weight
    cos, sin = rope_tables(cfg)
    policy.register_buffer("rope_cos", cos, persistent=False)
    policy.register_buffer("rope_sin", sin, persistent=False)
    missing = [n for n, p in policy.named_parameters() if p.is_meta
               and (keep is None or not n.startswith("layers.") or any(n.startswith(k) for k in keep))]
    if missing:
        raise UnsupportedModelError(f"{path}: weight {_hf_key(missing[0])!r} missing from safetensors")
    return policy.eval()


def hf_weight_bytes(path: Path | str) -> Dict[str, int]:
    """Bytes of the directory's safetensors data per dtype name (``F32``, ``BF16``...), read from the headers."""
    out: Dict[str, int] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        for entry in read_header(f)[0].values():
            b, e = entry["data_offsets"]
            out[entry["dtype"]] = out.get(entry["dtype"], 0) + e - b
    return out


def save_hf_weights(policy: Policy, cfg: PolicyConfig, out: Path, dtype: torch.dtype) -> None:
    """Write config.json + model.safetensors in HF layout (tied lm_head stored once), one tensor converted at a time
    (``quantize.model.safetensors_io.write_streaming``): no whole converted copy of the model."""
    out.mkdir(parents=True, exist_ok=True)
    state = {_hf_key(name): t for name, t in policy.state_dict().items()
             if not (name == "lm_head.weight" and cfg.tie_embeddings)}
    write_streaming(out / "model.safetensors", shapes_of(state.items(), dtype), state.__getitem__, {"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config_dict(cfg, dtype), indent=2))


def hf_config_dict(cfg: PolicyConfig, dtype: torch.dtype) -> dict:
    """config.json of an HF directory whose weights are stored in ``dtype``."""
    hf = cfg.to_hf_dict()
    hf["torch_dtype"] = str(dtype).removeprefix("torch.")
    hf["dtype"] = hf["torch_dtype"]
    return hf


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
