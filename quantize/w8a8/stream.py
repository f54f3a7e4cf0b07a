"""A w8a8 plan made one decoder layer at a time (``quantize.calibration.layer_stream``): each layer's statistics,
smoothing
search, rotation and GPTQ rounding, then its Hessians and row samples are dropped before the next layer runs.

``plan_layers`` does a contiguous share of the layers from that share's input: the whole model in one process, or
one share per process of a mesh (each holding only its layers' weights), the output of one share being the input
of the next. ``merge_plans`` puts the shares' plans together; the result is the plan ``plan.build_plan`` makes
from whole-model statistics (the same statistics, layer by layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

from torch import Tensor, nn

from policy_bundle.quantize.calibration import layer_stream as stream
from policy_bundle.quantize.calibration.linear_stats import HEAD_GROUP, LinearStats
from policy_bundle.quantize.recipes import RecipeConfig, kept_float, selected_linears
from policy_bundle.quantize.w8a8.plan import W8A8Plan, build_plan


@dataclass
class PlanPart:
    """A share of the layers: its plan, the statistics a build keeps of it (``layer_stream.light``), its output."""

    plan: W8A8Plan
    stats: LinearStats
    hidden: List[Tensor]


def plan_layers(policy: nn.Module, layers: Sequence[int], hidden: List[Tensor], recipe: RecipeConfig,
                seed: int = 0, progress: Callable[[int, str], None] = lambda *_: None,
                head: Optional[bool] = None) -> PlanPart:
    """The plan of ``layers`` (and of the LM head when ``head``, by default when the model's last layer is among
    them) from ``hidden``, the first layer's input. ``progress(layer, message)`` after each layer (-1: the head)."""
    selected = set(selected_linears(policy, recipe))
    part = PlanPart(W8A8Plan({}, {}, {}, {}, rounding=recipe.rounding, head_topk=recipe.lm_head_topk), {}, hidden)
    for index, stats, out in stream.stream_layers(policy, layers, hidden, recipe.outlier_ratio,
                                                 recipe.rounding == "gptq", seed, head=head):
        groups = ({HEAD_GROUP: ["lm_head"]} if index < 0 else stream.layer_groups(policy, index))
        names = [c for cs in groups.values() for c in cs if c in selected]
        plan = build_plan(policy, stats, groups, names, smooth=recipe.smooth and index >= 0,
                          alphas=recipe.smooth_alphas, rounding=recipe.rounding, gptq_damp=recipe.gptq_damp,
                          outlier_ratio=recipe.outlier_ratio, head_topk=recipe.lm_head_topk,
                          max_rot_block=recipe.rotation_block)
        _absorb(part.plan, plan)
        part.stats.update(stream.light(stats))
        part.hidden = out
        del stats, plan
        progress(index, f"{len(names)} linears, {recipe.rounding} rounding"
                 + ("" if index < 0 else f", alphas {[part.plan.alphas.get(g) for g in groups if g in part.plan.alphas]}"))
    return part


def absorb_part(into: PlanPart, later: PlanPart) -> PlanPart:
    """``into`` continued by ``later`` (the next layers of the same share): plans and statistics merged, its output."""
    _absorb(into.plan, later.plan)
    into.stats.update(later.stats)
    into.hidden = later.hidden
    return into


def _absorb(into: W8A8Plan, part: W8A8Plan) -> None:
    into.scales.update(part.scales)
    into.alphas.update(part.alphas)
    into.weights.update(part.weights)
    into.thresholds.update(part.thresholds)
    into.rot_blocks.update(part.rot_blocks)
    into.sensitivity.extend(part.sensitivity)


def without_head(plan: W8A8Plan) -> W8A8Plan:
    """The decoder layers' part of ``plan``: the LM head's entries (its linear and its input group) left out."""
    head = {"lm_head", HEAD_GROUP}

    def keep(d: dict) -> dict:
        return {k: v for k, v in d.items() if k not in head}

    return W8A8Plan(keep(plan.scales), keep(plan.alphas), keep(plan.weights), keep(plan.thresholds),
                    [t for t in plan.sensitivity if t[0] not in head], rounding=plan.rounding,
                    rot_blocks=keep(plan.rot_blocks))


def merge_plans(parts: Sequence[W8A8Plan], recipe: RecipeConfig) -> W8A8Plan:
    """The shares' plans as one, the embedding's and vocabulary rows' settings of ``recipe``, sensitivity sorted."""
    plan = W8A8Plan({}, {}, {}, {}, rounding=recipe.rounding, head_topk=recipe.lm_head_topk)
    for p in parts:
        _absorb(plan, p)
    plan.sensitivity.sort(key=lambda t: -t[1])
    plan.int8_embedding = not kept_float("embed_tokens", recipe)
    plan.int16_rows, plan.int12_rows = recipe.vocab_rows == "int16", recipe.vocab_rows == "int12"
    return plan


def layer_shares(n_layers: int, n: int) -> List[Tuple[int, ...]]:
    """Contiguous, near-equal shares of ``n_layers`` layers for ``n`` processes (none empty)."""
    n = max(1, min(n, n_layers))
    size, extra = divmod(n_layers, n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        out.append(tuple(range(start, end)))
        start = end
    return out
