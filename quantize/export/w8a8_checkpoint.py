"""A compressed-tensors W8A8 checkpoint that vLLM serves: the INT8 policy as an HF directory.

int8 weights (symmetric, per output channel: ``weight`` int8 [out, in] + ``weight_scale`` float32
[out, 1]) and int8 activations quantized per token at run time (a scale and a zero point per token), as
``compressed-tensors`` writes them (``format: int-quantized``); the config is built with that package's own classes, so vLLM's
loader and ours read the same schema. Everything not quantized is stored in ``dtype``.

vLLM fuses q/k/v and gate/up into one matmul each and needs one scheme per fused matmul: a block
whose q_proj stays in float keeps k_proj and v_proj in float too (``vllm_float_linears``). The LM
head is always float here (vLLM's W8A8 path has no rescored int8 head).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import Tensor, nn

from policy_bundle.quantize.export.exporters import write_serving_files
from policy_bundle.quantize.runtime.fbgemm_int8 import quantize_weight
from policy_bundle.quantize.model.policy import Policy, PolicyConfig
from policy_bundle.quantize.model.hf_weights import hf_config_dict
from policy_bundle.quantize.model.safetensors_io import write_streaming
from policy_bundle.quantize.export.w8a8_transforms import add_rotations, hf_name

FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # one matmul each in vLLM
Int8Weights = Dict[str, Tuple[Tensor, Tensor]]  # linear (our name) -> (int8 [out, in], scales [out])


def quantization_config(ignore: List[str]):
    """W8A8 int8: per-channel symmetric static weights, dynamic per-token asymmetric activations (a scale and a
    zero point per token from its min and max: what our INT8 kernel does; vLLM-CPU runs it on oneDNN with azp)."""
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 QuantizationStatus, QuantizationStrategy, QuantizationType)

    weights = QuantizationArgs(num_bits=8, type=QuantizationType.INT, symmetric=True,
                               strategy=QuantizationStrategy.CHANNEL, dynamic=False)
    activations = QuantizationArgs(num_bits=8, type=QuantizationType.INT, symmetric=False,
                                   strategy=QuantizationStrategy.TOKEN, dynamic=True)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=activations)
    return QuantizationConfig(config_groups={"group_0": scheme}, format=CompressionFormat.int_quantized.value,
                              quantization_status=QuantizationStatus.COMPRESSED, ignore=ignore)


def with_fused_siblings(names: Iterable[str]) -> set:
    """``names`` and, for each, the linears vLLM runs in one matmul with it (q/k/v, gate/up)."""
    out = set(names)
    for name in list(out):
        parent, _, child = name.rpartition(".")
        for group in FUSED:
            if child in group:
                out |= {f"{parent}.{sibling}" for sibling in group}
    return out


def vllm_float_linears(policy: nn.Module, quantized: Iterable[str]) -> List[str]:
    """Every linear the checkpoint keeps in float: those not in ``quantized``, their fused siblings, lm_head."""
    linears = [n for n, m in policy.named_modules() if isinstance(m, nn.Linear)]
    floating = with_fused_siblings({n for n in linears if n not in set(quantized)} |
                                   {n for n in linears if n.startswith("lm_head")})
    return [n for n in linears if n in floating]


def export_w8a8_checkpoint(float_policy: Policy, cfg: PolicyConfig, int8: Int8Weights, source_dir: Path, out: Path,
                           dtype: torch.dtype, rot_blocks: Optional[Dict[str, int]] = None,
                           tensor_of: Optional[Callable[[str], Tensor]] = None) -> List[str]:
    """Write the HF directory (config.json with ``quantization_config``, model.safetensors, tokenizer,
    generation_config); returns the linears kept in float.

    ``float_policy`` holds every float weight (smoothing already folded in), or ``tensor_of`` (parameter name ->
    tensor) gives them from it as they are written (``w8a8.plan.smoothed_tensors``: no smoothed copy of the model);
    ``int8`` the quantized linears' weights. Linears ``vllm_float_linears`` keeps in float are written from the float
    weights. The file is written one tensor at a time (``safetensors_io.write_streaming``).
    ``rot_blocks``: the quantized linears whose ``int8`` weight is of a rotated input (linear -> Hadamard block,
    ``W8A8Plan.rot_blocks``); vLLM rotates their inputs online (``quantize.export.w8a8_transforms``). vLLM's transforms
    assert their layer has no bias (Qwen2's q/k/v have one), so a rotated linear with a bias, and its fused
    siblings, get nearest rounding of their unrotated (smoothed) float weight instead, and no transform.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    params = {n: p for n, p in float_policy.state_dict(keep_vars=True).items()
              if not (n == "lm_head.weight" and cfg.tie_embeddings)}
    value = tensor_of or (lambda n: params[n].detach())
    rot_blocks = {n: b for n, b in (rot_blocks or {}).items() if b}
    biased = with_fused_siblings(n for n in int8 if float_policy.get_submodule(n).bias is not None) & set(rot_blocks)
    int8 = {n: (quantize_weight(value(n + ".weight").float()) if n in biased else w) for n, w in int8.items()}
    floating = vllm_float_linears(float_policy, int8)
    file = _LazyCheckpoint()
    for name, p in params.items():
        module = name.rpartition(".")[0]
        if name.endswith(".weight") and module in int8 and module not in floating:
            q, scales = int8[module]
            file.plan(hf_name(name), tuple(q.shape), torch.int8, lambda q=q: q.to(torch.int8))
            file.plan(hf_name(name) + "_scale", (q.shape[0], 1), torch.float32,
                      lambda s=scales: s.float().reshape(-1, 1))
        else:
            file.plan(hf_name(name), tuple(p.shape), dtype, lambda name=name: value(name).to(dtype))
    rotated = {n: (float_policy.get_submodule(n).in_features, b) for n, b in rot_blocks.items()
               if n in int8 and n not in set(floating) | biased}
    transforms = add_rotations(file, rotated, dtype) if rotated else None
    write_streaming(out / "model.safetensors", file.shapes, file.__getitem__, {"format": "pt"})
    hf = hf_config_dict(cfg, dtype)
    hf["quantization_config"] = quantization_config([hf_name(n) for n in floating]).to_dict()
    if transforms:
        hf["quantization_config"]["transform_config"] = transforms
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    write_serving_files(cfg, Path(source_dir), out)
    return floating


class _LazyCheckpoint(dict):
    """The checkpoint's tensors by key, each made when read (``plan``) unless set (``add_rotations`` replaces a few
    and adds its transforms); ``shapes`` is what ``write_streaming`` writes, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: Dict[str, Tuple[Tuple[int, ...], torch.dtype]] = {}
        self.makers: Dict[str, Callable[[], Tensor]] = {}

    def plan(self, key: str, shape: Tuple[int, ...], dtype: torch.dtype, make: Callable[[], Tensor]) -> None:
        self.shapes[key], self.makers[key] = (tuple(shape), dtype), make

    def __getitem__(self, key: str) -> Tensor:
        return super().__getitem__(key) if dict.__contains__(self, key) else self.makers[key]()

    def __setitem__(self, key: str, value: Tensor) -> None:
        super().__setitem__(key, value)
        self.shapes[key] = (tuple(value.shape), value.dtype)
