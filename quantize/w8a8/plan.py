"""The ``w8a8`` / ``smooth-w8a8`` recipes: from calibration statistics to an INT8 policy.

A plan is computed once from ``quantize.calibration.linear_stats`` and converts cheaply for any set of layers
kept in float (the accuracy fallback re-converts without touching the data again):

1. smoothing (``smooth-w8a8``): per input group, SmoothQuant's migration strength alpha is searched
   on the group's calibration rows (``recipe.smooth_alphas``; "no smoothing" is always a candidate),
   minimising the relative output error of the group's linears under int8 weights and per-token
   int8 activations;
2. weights: per-channel symmetric int8, rounded to nearest or with GPTQ error feedback
   (``recipe.rounding``) against the group's (smoothed) Hessian;
3. sensitivity (``plan_sensitivity``, on ``quantize.fidelity.sensitivity``): the logits' KL on a probe of
   calibration tokens with one linear at a time in int8; the fallback keeps the worst ones in float.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from policy_bundle.quantize.model.blocks import shared_copy, widen_narrow  # noqa: F401 (shared_copy: public here too)
from policy_bundle.quantize.w8a8.gptq import factor_hessian, gptq_quantize
from policy_bundle.quantize.w8a8.rotation import rotate, rotate_both_sides
from policy_bundle.quantize.calibration.linear_stats import HEAD_GROUP, LinearStats
from policy_bundle.quantize.fidelity.sensitivity import layer_sensitivity
from policy_bundle.quantize.calibration.smooth import fold_smoothing, group_scale, input_scale, smoothing_groups
from policy_bundle.quantize.w8a8.linear import (Int8TokenLinear, fake_quant_rows, quantize_weight, rotated_weight,
                                                rotation_block)
from policy_bundle.quantize.w8a8.head import (Int8Embedding, Int8RescoredHead, Int16Embedding, quantize_rows_int12,
                                              quantize_rows_int16)


Rotation = Callable[[Tensor], Tensor]  # x -> x @ R

def relative_output_error(x: Tensor, weight: Tensor, q_weight: Tensor, s_in: Optional[Tensor] = None,
                          rot: Optional[Rotation] = None) -> float:
    """||x W^T - fq(x / s @ R) Wq^T||^2 / ||x W^T||^2 on calibration rows (Wq already smoothed by s and rotated
    by R)."""
    ref = x @ weight.t()
    xs = x if s_in is None else x / s_in
    if rot is not None:
        xs = rot(xs)
    out = fake_quant_rows(xs) @ q_weight.t()
    return float((ref - out).pow(2).sum() / ref.pow(2).sum().clamp_min(1e-12))


@dataclass
class W8A8Plan:
    """Everything convert needs: smoothing scales, int8 weights, outlier thresholds, sensitivity."""

    scales: Dict[str, Tensor]  # producer -> s (ones where smoothing did not help)
    alphas: Dict[str, Optional[float]]  # producer -> chosen alpha (None: not smoothed)
    weights: Dict[str, Tuple[Tensor, Tensor]]  # linear -> (int8 [out, in], scales [out])
    thresholds: Dict[str, float]  # linear -> outlier threshold on its (smoothed) input
    sensitivity: List[Tuple[str, float]] = field(default_factory=list)  # most sensitive first
    rounding: str = "nearest"
    head_topk: int = 0  # lm_head: top-k logits recomputed in float (0: plain int8)
    rot_blocks: Dict[str, int] = field(default_factory=dict)  # linear -> Hadamard block of its input (absent: none)
    # the token embedding in int8 (``quantize.w8a8.head.Int8Embedding``): a tied one reads an int8 head's own rows
    # (the head's rescoring too: no float copy of the vocabulary is left), an untied one is quantized on its own
    int8_embedding: bool = False
    # the vocabulary rows kept beside a rescored int8 head (its rescoring, and a float embedding) in int16, a scale per
    # row (``quantize.w8a8.head.Int16Embedding``); a tied embedding shares the head's int16 rows
    int16_rows: bool = False
    # the vocabulary rows in int12 (``quantize.w8a8.head.quantize_rows_int12``): the rescored head's int8 weight,
    # rounded
    # to nearest, and each element's 4-bit residual; a tied embedding gathers those same rows (no float copy left)
    int12_rows: bool = False

    def quantized_module(self, name: str, float_linear: nn.Linear, tied_rows: bool = False) -> nn.Module:
        """``tied_rows``: the head of a tied model whose embedding is int8 shares its int8 rows (no float rows). A
        rescored head with ``int12_rows`` always shares them (its rescoring reads them), tied or not."""
        q, s = self.weights[name]
        rot_block = self.rot_blocks.get(name, 0)
        if name == "lm_head" and self.head_topk > 0 and self.int12_rows:
            # the int8 rows the residuals complete: nearest rounding of the same (rotated) weight, not GPTQ's, whose
            # codes can sit a whole code from the weight; the int8 logits only pick the top-k that the rows rescore
            q, s, residual = quantize_rows_int12(rotated_weight(float_linear.weight, rot_block))
            int8 = Int8TokenLinear.from_float(float_linear, self.thresholds[name], weight_int8=q, scales=s,
                                              rot_block=rot_block, share_weight=True)
            return Int8RescoredHead(int8, torch.zeros(0, 0), self.head_topk, residual=residual)
        int8 = Int8TokenLinear.from_float(float_linear, self.thresholds[name], weight_int8=q, scales=s,
                                          rot_block=rot_block, share_weight=tied_rows)
        if name == "lm_head" and self.head_topk > 0:
            if self.int16_rows and not tied_rows:
                rows16 = quantize_rows_int16(float_linear.weight)
                return Int8RescoredHead(int8, torch.zeros(0, 0), self.head_topk, *rows16)
            rows = torch.zeros(0, 0) if tied_rows else float_linear.weight.detach()
            return Int8RescoredHead(int8, rows, self.head_topk)
        return int8

    def convert(self, policy: nn.Module, quantized: Sequence[str]) -> nn.Module:
        """The smoothed policy with the named linears as ``Int8TokenLinear`` (the rest stay float). No copy of the
        float model: the new model shares every tensor smoothing leaves alone (embedding, unsmoothed linears), and
        holds new ones only for what smoothing changes and stays float (norms, biases, float linears)."""
        model = shared_copy(policy)
        if self.scales:
            fold_smoothing(model, self.scales, set(quantized))
        embed = getattr(model, "embed_tokens", None)
        tied = isinstance(embed, nn.Embedding) and getattr(model.get_submodule("lm_head"), "weight", None) is embed.weight
        # int12 rows are a rescored head's (``head_topk`` > 0): a tied embedding is those rows (as with int16 rows);
        # a tied head without rescoring, or kept in float, leaves them float
        int12 = self.int12_rows and self.head_topk > 0
        tied_rows = (self.int8_embedding or int12) and tied and "lm_head" in quantized
        for name in quantized:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child,
                    self.quantized_module(name, model.get_submodule(name), tied_rows and name == "lm_head"))
        if tied_rows:
            head = model.lm_head
            rescored = isinstance(head, Int8RescoredHead)
            model.embed_tokens = Int8Embedding.tied_to(head.int8 if rescored else head,
                                                       head.residual if rescored else None)
        elif self.int8_embedding and isinstance(embed, nn.Embedding) and not tied:  # an untied embedding: its own
            model.embed_tokens = Int8Embedding.from_float(embed, int12=int12)  # skip setting, int12 rows if rescored
        elif self.int16_rows and tied and isinstance(model.lm_head, Int8RescoredHead):
            model.embed_tokens = Int16Embedding(model.lm_head.rows16, model.lm_head.scales16)
        elif self.int16_rows and isinstance(embed, nn.Embedding) and not tied:
            model.embed_tokens = Int16Embedding.from_float(embed)
        # a tied model whose head stays float keeps its float embedding: the float rows are there anyway
        return widen_narrow(model).eval()  # the linears kept float, from a 16-bit source: float32 (scripted, exported)


Progress = Callable[[str], None]


def build_plan(policy: nn.Module, stats: LinearStats, groups: Dict[str, List[str]], selected: Sequence[str], *,
               smooth: bool, alphas: Sequence[float], rounding: str, gptq_damp: float, outlier_ratio: float,
               head_topk: int = 0, max_rot_block: int = 0, progress: Progress = lambda _: None) -> W8A8Plan:
    """Search smoothing, rotate (``max_rot_block`` > 0: a Hadamard rotation of each input group's input), round
    weights and rank sensitivity for the ``selected`` linears."""
    plan = W8A8Plan({}, {}, {}, {}, rounding=rounding, head_topk=head_topk)
    chosen = set(selected)
    work = {p: [c for c in cs if c in chosen] for p, cs in groups.items() if stats[p].sample is not None}
    work = {p: cs for p, cs in work.items() if cs}
    rotations = {p: _group_rotation(policy, p, groups, max_rot_block) for p in work}  # (block, x -> x @ R) or None
    if smooth:  # all scales first: a producer linear (up_proj, v_proj) is also another group's consumer
        for i, producer in enumerate(work):
            if producer == HEAD_GROUP:
                continue  # the final norm -> lm_head (tied to the embedding) is never smoothed
            if stats[producer].outliers is not None:
                # Massive-activation rows run in float against the int8 weights; scaling the weight
                # columns of their channel up multiplies the weight error they meet (measured on
                # SmolLM2-135M: smoothing layer 11's down_proj alone took KL from 0.012 to 0.042).
                plan.alphas[producer] = None
                progress(f"smoothing search {i + 1}/{len(work)}: {producer} has outlier rows, not smoothed")
                continue
            s, alpha = _search_alpha(policy, producer, groups[producer], stats[producer].channel_absmax,
                                     stats[producer].sample, alphas,
                                     rotations[producer][1] if rotations[producer] else None)
            plan.alphas[producer] = alpha
            if alpha is not None:
                plan.scales[producer] = s
            progress(f"smoothing search {i + 1}/{len(work)}: {producer} alpha {alpha}")
    for i, (producer, mine) in enumerate(work.items()):
        st = stats[producer]
        s_in = input_scale(policy, producer, plan.scales.get(producer, torch.ones(_channels(policy, producer, mine))))
        xs = st.sample / s_in
        h = None
        if rounding == "gptq" and st.hessian is not None:
            inv = (1.0 / s_in).double()
            h = st.hessian * inv.unsqueeze(0) * inv.unsqueeze(1)
        block, rot = rotations[producer] or (0, None)
        if rot is not None:
            xs = rot(xs)
            h = None if h is None else rotate_both_sides(h, block)
        factor = None if h is None else factor_hessian(h, gptq_damp)  # one per input, shared by its linears
        threshold = _smoothed_threshold(st, s_in, outlier_ratio, rot)
        for c in mine:
            w = smoothed_weight(policy, c, producer, plan.scales)
            if rot is not None:
                w = rot(w)
                plan.rot_blocks[c] = block
            q, sc = gptq_quantize(w, factor=factor) if factor is not None else quantize_weight(w)
            plan.weights[c], plan.thresholds[c] = (q, sc), threshold
            plan.sensitivity.append((c, relative_output_error(xs, w, q.float() * sc.unsqueeze(1))))
        progress(f"weights {i + 1}/{len(work)}: {producer} ({len(mine)} linears, {rounding})")
    plan.sensitivity.sort(key=lambda t: -t[1])
    return plan


def smoothed_weight(policy: nn.Module, name: str, producer: str, scales: Dict[str, Tensor]) -> Tensor:
    """Linear ``name``'s float weight as ``apply_smoothing`` leaves it, without a smoothed copy of the model: its
    columns times its input group's s (``producer``'s), then, where it produces a group itself (v_proj, up_proj), its
    rows divided by that group's s, in that order (bitwise ``apply_smoothing``'s)."""
    w = policy.get_submodule(name).weight.detach().float()
    if producer in scales:
        w = w * input_scale(policy, producer, scales[producer].to(torch.float32)).unsqueeze(0)
    if name in scales:
        w = w / scales[name].to(torch.float32).unsqueeze(1)
    return w


def smoothed_tensors(policy: nn.Module, scales: Dict[str, Tensor]) -> Callable[[str], Tensor]:
    """(parameter name) -> that tensor of ``policy`` as ``smooth.fold_smoothing`` leaves it
    (bitwise: the same operations in the same order), computed when asked: a writer streams the smoothed model one
    tensor at a time instead of holding a smoothed float32 copy of it. Tensors smoothing leaves alone come back as
    they are (a 16-bit layer weight 16-bit)."""
    producers = {c: p for p, cs in smoothing_groups(policy) for c in cs if p in scales}
    params = dict(policy.named_parameters(remove_duplicate=False))

    def tensor_of(name: str) -> Tensor:
        module, _, kind = name.rpartition(".")
        t = params[name].detach()
        if kind == "weight" and isinstance(policy.get_submodule(module), nn.Linear):
            if module in producers or module in scales:
                return smoothed_weight(policy, module, producers.get(module, ""), scales)
        elif kind == "bias" and module in scales:
            return t / scales[module].to(torch.float32)
        elif kind == "weight" and module in scales:  # a norm producing a group
            return t / scales[module].to(torch.float32)
        return t

    return tensor_of


def _group_rotation(policy: nn.Module, producer: str, groups: Dict[str, List[str]],
                    max_block: int) -> Optional[Tuple[int, Rotation]]:
    """The Hadamard block and rotation (``x -> x @ R``, applied block by block) of a group's (smoothed) input, or
    None: no rotation asked, or no power-of-two block divides the width. (An int8 LM head's float rescoring reads its
    input unrotated: the kernel rotates its own copy.)"""
    if max_block <= 0:
        return None
    n = policy.get_submodule(groups[producer][0]).in_features
    block = rotation_block(n, max_block)
    return (block, partial(rotate, block=block)) if block else None


def _smoothed_threshold(st, s_in: Tensor, ratio: float, rot: Optional[Rotation] = None) -> float:
    """The outlier threshold on the smoothed input: below every calibration outlier row (smoothing
    shrinks their channel, and a missed outlier row is the attention sink quantized), else the
    ratio-times-median rule on the smoothed rows."""
    if st.threshold <= 0:
        return 0.0
    turn = rot if rot is not None else (lambda x: x)  # noqa: E731
    rule = float(turn(st.sample / s_in).abs().amax(dim=1).median()) * ratio
    if st.outliers is None:
        return rule
    return min(rule, 0.9 * float(turn(st.outliers / s_in).abs().amax(dim=1).min()))


def _channels(policy: nn.Module, producer: str, consumers: List[str]) -> int:
    n = policy.get_submodule(consumers[0]).in_features
    if producer.endswith("v_proj"):
        attn = policy.get_submodule(producer.rsplit(".", 1)[0])
        n = attn.n_kv_heads * attn.head_dim
    return n


def _search_alpha(policy: nn.Module, producer: str, consumers: List[str], x_max: Tensor, x: Tensor,
                  alphas: Sequence[float], rot: Optional[Rotation] = None) -> Tuple[Tensor, Optional[float]]:
    """The s (and alpha) with the least summed relative output error (after the group's rotation, if any);
    alpha None = no smoothing."""
    weights = [policy.get_submodule(c).weight.detach().float() for c in consumers]
    best: Tuple[float, Tensor, Optional[float]] = (float("inf"), torch.ones(_channels(policy, producer, consumers)), None)
    for alpha in (None, *alphas):
        s = (torch.ones(_channels(policy, producer, consumers)) if alpha is None
             else group_scale(policy, producer, consumers, x_max, alpha))
        s_in = input_scale(policy, producer, s)
        err = 0.0
        for w in weights:
            ws = w * s_in.unsqueeze(0)
            q, sc = quantize_weight(ws if rot is None else rot(ws))
            err += relative_output_error(x, w, q.float() * sc.unsqueeze(1), s_in, rot)
        if err < best[0]:
            best = (err, s, alpha)
    return best[1], best[2]


def plan_sensitivity(policy: nn.Module, plan: W8A8Plan, names: Sequence[str], probe: Tensor,
                     progress: Callable[[int, int, str, float], None] = lambda *_: None) -> List[Tuple[str, float]]:
    """The w8a8 ranking (``quantize.fidelity.sensitivity``): the reference is the float model (smoothing and rotation
    are
    function-preserving: the plan's float model gives the same logits up to rounding), each linear swapped for its
    int8 module as it acts there (``unsmoothed_swap``). No smoothed float copy of the model is made."""
    return layer_sensitivity(policy, names, unsmoothed_swap(policy, plan), probe, progress)


def unsmoothed_swap(policy: nn.Module, plan: W8A8Plan) -> Callable[[str, nn.Module], nn.Module]:
    """(linear's name, its float module in ``policy``) -> its int8 module acting as it does in the plan's smoothed
    model (``UnsmoothedSwap``): what ``quantize.fidelity.sensitivity`` swaps into the unsmoothed float model."""
    producers = {c: p for p, cs in smoothing_groups(policy) for c in cs}

    def swapped(name: str, float_module: nn.Module) -> nn.Module:
        s_in = plan.scales.get(producers.get(name, ""))
        s_out = plan.scales.get(name)
        if s_in is None and s_out is None:
            return plan.quantized_module(name, float_module)
        module = shared_copy(float_module)
        if s_out is not None and module.bias is not None:
            module.bias = nn.Parameter(module.bias / s_out.float(), requires_grad=False)
        inner = plan.quantized_module(name, module)
        return UnsmoothedSwap(inner, None if s_in is None else input_scale(policy, producers[name], s_in.float()),
                              None if s_out is None else s_out.float())

    return swapped


class UnsmoothedSwap(nn.Module):
    """A smoothed linear's int8 module in the unsmoothed model: its input divided by its group's s (what the smoothed
    norm or producer would have done), its output times its own group's s (what its consumers would undo)."""

    def __init__(self, inner: nn.Module, s_in: Optional[Tensor], s_out: Optional[Tensor]):
        super().__init__()
        self.inner, self.s_in, self.s_out = inner, s_in, s_out

    def forward(self, x: Tensor) -> Tensor:
        y = self.inner(x if self.s_in is None else x / self.s_in)
        return y if self.s_out is None else y * self.s_out
