"""SmoothQuant-style smoothing: move activation outliers into weights without changing the function.

For a group of linears that read the same input X, per input channel j:
    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)
X is divided by s (folded into the op that produces X) and every W's column j multiplied by s, so
the FP32 model computes the same function while X's massive channels shrink before INT8.

Groups (Llama / Qwen2 / Qwen3 block):
- input_layernorm -> q_proj, k_proj, v_proj          (fold 1/s into the RMSNorm weight)
- post_attention_layernorm -> gate_proj, up_proj     (fold into the RMSNorm weight)
- up_proj -> down_proj                               (fold into up_proj's output rows: the MLP
                                                      input of down_proj is silu(gate) * up)
- v_proj -> o_proj                                   (fold into v_proj's output rows; with GQA one s
                                                      per kv channel, shared by its query heads)
"""

from __future__ import annotations

import copy
from typing import Dict, Iterable, List, Tuple

import torch
from torch import Tensor, nn

from policy_bundle.quantize.model.blocks import shared_copy, widen_narrow

ChannelStats = Dict[str, Tensor]  # linear name -> max |x_j| over calibration data, per input channel


def smoothing_groups(policy: nn.Module) -> List[Tuple[str, List[str]]]:
    """(producer, consumer linears) per smoothing group, by module name."""
    groups = []
    for i in range(len(policy.layers)):
        p = f"layers.{i}"
        groups.append((f"{p}.input_layernorm", [f"{p}.self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj")]))
        groups.append((f"{p}.post_attention_layernorm", [f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"]))
        groups.append((f"{p}.mlp.up_proj", [f"{p}.mlp.down_proj"]))
        groups.append((f"{p}.self_attn.v_proj", [f"{p}.self_attn.o_proj"]))
    return groups


@torch.no_grad()
def collect_channel_absmax(policy: nn.Module, batches: Iterable[Tensor]) -> ChannelStats:
    """Per input channel max |x| of every consumer linear (forward pre-hooks; merge = elementwise max)."""
    from policy_bundle.quantize.model.policy import run_with_hooks

    names = {c for _, consumers in smoothing_groups(policy) for c in consumers}
    stats: ChannelStats = {}
    hooks = []
    for name, mod in policy.named_modules():
        if name in names:
            def hook(_m, args, name=name):
                x = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(dim=0)
                stats[name] = torch.maximum(stats[name], x) if name in stats else x
            hooks.append(mod.register_forward_pre_hook(hook))
    run_with_hooks(policy, batches, hooks)
    return stats


def merge_channel_stats(parts: List[ChannelStats]) -> ChannelStats:
    """Exact merge of sharded statistics (max is associative and commutative)."""
    out: ChannelStats = {}
    for part in parts:
        for k, v in part.items():
            out[k] = torch.maximum(out[k], v) if k in out else v.clone()
    return out


def group_scale(policy: nn.Module, producer: str, consumers: List[str], x_max: Tensor, alpha: float) -> Tensor:
    """SmoothQuant's s for one group from its input's per-channel max |x| (per producer channel)."""
    mods = dict(policy.named_modules())
    w_max = torch.cat([mods[c].weight.detach().float().abs() for c in consumers], dim=0).amax(dim=0)
    if producer.endswith("v_proj"):  # GQA: one s per kv channel, shared by the query heads reading it
        attn = mods[producer.rsplit(".", 1)[0]]
        rep = attn.n_heads // attn.n_kv_heads
        x_max = x_max.view(attn.n_kv_heads, rep, attn.head_dim).amax(dim=1).reshape(-1)
        w_max = w_max.view(attn.n_kv_heads, rep, attn.head_dim).amax(dim=1).reshape(-1)
    s = x_max.clamp_min(1e-5).pow(alpha) / w_max.clamp_min(1e-5).pow(1 - alpha)
    return s.clamp(1e-4, 1e4)


def smoothing_scales(policy: nn.Module, stats: ChannelStats, alpha: float) -> Dict[str, Tensor]:
    """Per group (keyed by producer name): the per-channel s that smoothing divides X by."""
    return {producer: group_scale(policy, producer, consumers,
                                  torch.stack([stats[c] for c in consumers]).amax(dim=0), alpha)
            for producer, consumers in smoothing_groups(policy)}


def input_scale(policy: nn.Module, producer: str, s: Tensor) -> Tensor:
    """The per-input-channel divisor the consumers see (GQA: a kv channel's s for each query head)."""
    if not producer.endswith("v_proj"):
        return s
    attn = policy.get_submodule(producer.rsplit(".", 1)[0])
    rep = attn.n_heads // attn.n_kv_heads
    return s.view(attn.n_kv_heads, 1, attn.head_dim).expand(-1, rep, -1).reshape(-1)


@torch.no_grad()
def fold_smoothing(model: nn.Module, scales: Dict[str, Tensor], quantized: frozenset = frozenset()) -> None:
    """X / s folded into each group's producer and s into its consumers, in ``model`` (a ``shared_copy``: out of
    place, new float32 tensors, a 16-bit weight widened first) for the norms, the producers' biases and the weights of
    the linears not in ``quantized`` (an int8 linear's weight comes from its plan). A producer absent from ``scales``
    has s = 1: its division and product would be exact."""
    for producer, consumers in smoothing_groups(model):
        if producer not in scales:
            continue
        s = scales[producer].to(torch.float32)
        s_in = input_scale(model, producer, s)
        prod = model.get_submodule(producer)
        if isinstance(prod, nn.Linear):  # up_proj / v_proj: divide output rows
            if producer not in quantized:
                prod.weight = nn.Parameter(prod.weight.float() / s.unsqueeze(1), requires_grad=False)
            if prod.bias is not None:
                prod.bias = nn.Parameter(prod.bias.float() / s, requires_grad=False)
        else:  # RMSNorm: divide its weight
            prod.weight = nn.Parameter(prod.weight.float() / s, requires_grad=False)
        for c in consumers:
            if c not in quantized:
                lin = model.get_submodule(c)
                lin.weight = nn.Parameter(lin.weight.float() * s_in.unsqueeze(0), requires_grad=False)


def apply_smoothing(policy: nn.Module, scales: Dict[str, Tensor]) -> nn.Module:
    """A function-preserving copy of ``policy`` with X / s folded into producers and s into consumers
    (``fold_smoothing``): a new module tree whose smoothed tensors are new float32 ones and whose others (embedding,
    head) are ``policy``'s own."""
    model = shared_copy(policy)
    fold_smoothing(model, scales)
    return widen_narrow(model)


def make_outlier_model(policy: nn.Module, channels: int = 4, factor: float = 100.0, seed: int = 0) -> nn.Module:
    """A function-preserving transform that gives ``policy`` real-LM-like massive activations.

    In every block: ``channels`` rows of up_proj are multiplied by ``factor`` and the matching
    down_proj columns divided by it (down_proj inputs get ~factor x outliers), and ``channels``
    residual channels of each RMSNorm weight are multiplied by ``factor`` with the matching columns
    of the linears reading it divided (q/k/v and gate/up inputs get outliers too).
    """
    model = widen_narrow(copy.deepcopy(policy))  # scaled in float32, as the function it preserves is computed
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in model.layers:
            mlp, attn = block.mlp, block.self_attn
            rows = torch.randperm(mlp.up_proj.out_features, generator=g)[:channels]
            mlp.up_proj.weight[rows] *= factor
            mlp.down_proj.weight[:, rows] /= factor
            for norm, readers in ((block.input_layernorm, (attn.q_proj, attn.k_proj, attn.v_proj)),
                                  (block.post_attention_layernorm, (mlp.gate_proj, mlp.up_proj))):
                ch = torch.randperm(norm.weight.numel(), generator=g)[:channels]
                norm.weight[ch] *= factor
                for lin in readers:
                    lin.weight[:, ch] /= factor
    return model.eval()
