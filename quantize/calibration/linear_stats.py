"""Calibration statistics of every linear's input, collected under forward hooks in two passes.

Linears that read the same tensor form an input group, keyed like ``quantize.calibration.smooth``'s groups by
the module that produces it (``layers.3.input_layernorm`` -> q/k/v_proj, ...). Per group:

- pass 1, ``token_absmax``: max |x| of every token (row). Its median sets the group's outlier
  threshold: rows above ``outlier_ratio`` x median run in float at inference time.
- pass 2, over the rows below that threshold only (the outliers never meet the int8 kernel):
  per-channel max |x| (for smoothing), the Hessian sum x x^T and its row count (for error-feedback
  rounding), and a fixed-seed sample of rows (for the smoothing search and layer sensitivity);
  the outlier rows themselves are kept apart (capped), so that the threshold can be re-derived for
  the smoothed input, where the outlier channel has shrunk.

Every statistic merges exactly across shards: max, sum, concatenation in shard order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import torch
from torch import Tensor, nn

from policy_bundle.quantize.model.policy import run_with_hooks
from policy_bundle.quantize.calibration.smooth import smoothing_groups

HEAD_GROUP = "norm"
SAMPLE_ROWS_PER_BATCH = 64
OUTLIER_ROWS_KEPT = 256


@dataclass
class GroupStats:
    """Statistics of one input group (see the module docstring)."""

    token_absmax: Tensor = field(default_factory=lambda: torch.zeros(0))
    threshold: float = 0.0  # absolute max |x| above which a row is an outlier (0: none)
    channel_absmax: Optional[Tensor] = None
    hessian: Optional[Tensor] = None
    rows: int = 0
    sample: Optional[Tensor] = None
    outliers: Optional[Tensor] = None  # the rows above ``threshold`` (few: the attention-sink tokens), capped


LinearStats = Dict[str, GroupStats]


def input_groups(policy: nn.Module, layers: Optional[Sequence[int]] = None) -> Dict[str, List[str]]:
    """producer -> consumer linears, for the given decoder layers (all by default)."""
    keep = None if layers is None else {f"layers.{i}." for i in layers}
    groups = {p: c for p, c in smoothing_groups(policy) if keep is None or any(p.startswith(k) for k in keep)}
    if layers is None or len(policy.layers) - 1 in layers:
        groups[HEAD_GROUP] = ["lm_head"]  # the final norm feeds the LM head (never smoothed: it is tied)
    return groups


def _hook_first_consumers(policy: nn.Module, groups: Dict[str, List[str]], fn) -> list:
    mods = dict(policy.named_modules())
    return [mods[consumers[0]].register_forward_pre_hook(lambda _m, args, g=g: fn(g, args[0]))
            for g, consumers in groups.items()]


@torch.no_grad()
def collect_token_absmax(policy: nn.Module, batches: Iterable[Tensor], layers: Optional[Sequence[int]] = None
                         ) -> Dict[str, Tensor]:
    """Pass 1: per group, max |x| of every row seen, in batch order."""
    groups = input_groups(policy, layers)
    seen: Dict[str, List[Tensor]] = {g: [] for g in groups}
    hooks = _hook_first_consumers(policy, groups, lambda g, x: seen[g].append(
        x.detach().reshape(-1, x.shape[-1]).abs().amax(dim=1).float()))
    run_with_hooks(policy, batches, hooks)
    return {g: torch.cat(v) if v else torch.zeros(0) for g, v in seen.items()}


def outlier_linears(stats: "LinearStats", policy: nn.Module) -> List[str]:
    """The linears whose calibration inputs had rows over their group's outlier threshold (the attention sink's
    massive activations: SmolLM2-135M's down_proj in 9 of 30 layers), which the int8 kernel computes partly in
    float; in the order of ``input_groups``."""
    loud = {g for g, s in stats.items() if s.outliers is not None and s.outliers.shape[0] > 0}
    return [c for g, consumers in input_groups(policy).items() if g in loud for c in consumers]


def outlier_thresholds(token_absmax: Dict[str, Tensor], ratio: float) -> Dict[str, float]:
    """Per group: ``ratio`` x the median row max |x| (0 when ``ratio`` is 0: no outlier rows)."""
    if ratio <= 0:
        return {g: 0.0 for g in token_absmax}
    return {g: float(v.median()) * ratio if v.numel() else 0.0 for g, v in token_absmax.items()}


class GroupCollector:
    """Pass 2's statistics of some input groups, fed each group's input rows batch by batch: channel max |x|, Hessian
    sum, row count and a row sample below the group's outlier threshold, the outlier rows kept apart. ``generator_of``:
    the row sampler of a group (one shared by every group, or one each)."""

    def __init__(self, thresholds: Dict[str, float], hessians: bool, generator_of: Callable[[str], torch.Generator]):
        self.stats: LinearStats = {g: GroupStats(threshold=t) for g, t in thresholds.items()}
        self.hessians = hessians
        self.gens = {g: generator_of(g) for g in thresholds}

    def observe(self, g: str, x: Tensor) -> None:
        s, rows = self.stats[g], x.detach().reshape(-1, x.shape[-1]).float()
        if s.threshold > 0:
            big = rows.abs().amax(dim=1) > s.threshold
            if bool(big.any()):
                out = rows[big] if s.outliers is None else torch.cat([s.outliers, rows[big]])
                s.outliers = out[:OUTLIER_ROWS_KEPT]
            rows = rows[~big]
        if rows.numel() == 0:
            return
        amax = rows.abs().amax(dim=0)
        s.channel_absmax = amax if s.channel_absmax is None else torch.maximum(s.channel_absmax, amax)
        if self.hessians:
            h = rows.t().double() @ rows.double()
            s.hessian = h if s.hessian is None else s.hessian + h
        s.rows += rows.shape[0]
        pick = rows[torch.randperm(rows.shape[0], generator=self.gens[g])[:SAMPLE_ROWS_PER_BATCH]]
        s.sample = pick if s.sample is None else torch.cat([s.sample, pick])


@torch.no_grad()
def collect_group_stats(policy: nn.Module, batches: Iterable[Tensor], thresholds: Dict[str, float],
                        hessians: bool = True, seed: int = 0) -> LinearStats:
    """Pass 2 (``GroupCollector``) over the whole model's forwards, one row sampler shared by every group."""
    groups = {g: c for g, c in input_groups(policy).items() if g in thresholds}
    gen = torch.Generator().manual_seed(seed)
    collector = GroupCollector(thresholds, hessians, lambda _g: gen)
    stats, observe = collector.stats, collector.observe

    hooks = _hook_first_consumers(policy, groups, observe)
    if HEAD_GROUP not in groups:  # stop each forward after the last layer these groups live in
        last = max(int(g.split(".")[1]) for g in groups)
        hooks.append(policy.layers[last].register_forward_hook(lambda *_: _raise_stop()))
    run_with_hooks(policy, batches, hooks, stop=(_StopForward,))
    return stats


class _StopForward(Exception):
    """Raised by a hook once the layers being observed have run: the rest of the forward is waste."""


def _raise_stop() -> None:
    raise _StopForward


def merge_token_absmax(parts: List[Dict[str, Tensor]]) -> Dict[str, Tensor]:
    return {g: torch.cat([p[g] for p in parts]) for g in parts[0]}


def merge_group_stats(parts: List[LinearStats]) -> LinearStats:
    """Shards in order: channel max, Hessian sum, row count, sample concatenation."""
    out: LinearStats = {}
    for g in parts[0]:
        ss = [p[g] for p in parts]
        present = [s for s in ss if s.rows]
        merged = GroupStats(threshold=ss[0].threshold, rows=sum(s.rows for s in ss))
        if present:
            merged.channel_absmax = torch.stack([s.channel_absmax for s in present]).amax(dim=0)
            if present[0].hessian is not None:
                merged.hessian = present[0].hessian.clone()
                for s in present[1:]:
                    merged.hessian += s.hessian
            merged.sample = torch.cat([s.sample for s in present])
        outliers = [s.outliers for s in ss if s.outliers is not None]
        if outliers:
            merged.outliers = torch.cat(outliers)[:OUTLIER_ROWS_KEPT]
        out[g] = merged
    return out
