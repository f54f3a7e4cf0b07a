"""Calibration one decoder layer at a time (llm-compressor's layer-sequential pipeline): the calibration batches'
hidden states enter a layer, its input groups' statistics are collected, the caller quantizes the layer, and the
layer's float output becomes the next layer's input. Memory is one layer's weights, its statistics (Hessians) and
the calibration set's hidden states, not the model.

A layer run here computes what the whole model's teacher-forced forward (``model.policy.full_logits``) computes at that
layer, bitwise: the same embedding, rotary tables, mask and cache shapes, one batch at a time. So the statistics
are those of hooks on a whole forward (``quantize.calibration.linear_stats``), in either process and in any number of
them:
a process holding only layers 14..27 (``hf_weights.load_policy(layers=...)``) continues from layer 14's input.
"""

from __future__ import annotations

import zlib
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from policy_bundle.quantize.calibration.linear_stats import (HEAD_GROUP, GroupCollector, GroupStats, LinearStats,
                                                             input_groups, outlier_thresholds)


@torch.no_grad()
def embed_batches(policy: nn.Module, batches: Sequence[Tensor]) -> List[Tensor]:
    """Layer 0's input of every calibration batch [B, T, dim]."""
    return [policy.embed_tokens(b) for b in batches]


@torch.no_grad()
def run_layer(policy: nn.Module, index: int, hidden: Sequence[Tensor]) -> List[Tensor]:
    """Decoder layer ``index`` over each batch's hidden states, as ``full_logits`` runs it (a fresh cache of T)."""
    layer = policy.layers[index]
    out = []
    for x in hidden:
        b, t = x.shape[0], x.shape[1]
        k = torch.zeros([1, b, policy.n_kv_heads, t, policy.head_dim], dtype=policy.new_cache(1, 1)[0].dtype)
        v = torch.zeros_like(k)
        cos, sin, mask = policy._chunk_tables(t, 0, k)
        out.append(layer(x, cos, sin, mask, 0, k[0], v[0]))
    return out


def layer_groups(policy: nn.Module, index: int) -> Dict[str, List[str]]:
    """The input groups (producer -> consumer linears) inside decoder layer ``index`` (never the head's)."""
    return {g: c for g, c in input_groups(policy, [index]).items() if g != HEAD_GROUP}


def _group_generator(seed: int, group: str) -> torch.Generator:
    """A row sampler per group: the sample does not depend on which groups a process collects, or in what order."""
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(group.encode()))


def _hooked(policy: nn.Module, groups: Dict[str, List[str]], fn: Callable[[str, Tensor], None]) -> list:
    return [policy.get_submodule(consumers[0]).register_forward_pre_hook(lambda _m, args, g=g: fn(g, args[0]))
            for g, consumers in groups.items()]


@torch.no_grad()
def layer_stats(policy: nn.Module, index: int, hidden: Sequence[Tensor], outlier_ratio: float, hessians: bool,
                seed: int = 0) -> Tuple[LinearStats, List[Tensor]]:
    """Statistics of layer ``index``'s input groups over ``hidden`` (its input), and its output: pass 1 (every row's
    max |x|, for the outlier thresholds) and pass 2 (``linear_stats.GroupCollector``) each run the layer once."""
    groups = layer_groups(policy, index)
    seen: Dict[str, List[Tensor]] = {g: [] for g in groups}
    hooks = _hooked(policy, groups, lambda g, x: seen[g].append(x.reshape(-1, x.shape[-1]).abs().amax(dim=1).float()))
    try:
        run_layer(policy, index, hidden)
    finally:
        for h in hooks:
            h.remove()
    thresholds = outlier_thresholds({g: torch.cat(v) if v else torch.zeros(0) for g, v in seen.items()}, outlier_ratio)
    collector = GroupCollector(thresholds, hessians, lambda g: _group_generator(seed, g))
    hooks = _hooked(policy, groups, collector.observe)
    try:
        out = run_layer(policy, index, hidden)
    finally:
        for h in hooks:
            h.remove()
    return collector.stats, out


@torch.no_grad()
def head_stats(policy: nn.Module, hidden: Sequence[Tensor], outlier_ratio: float, hessians: bool,
               seed: int = 0) -> LinearStats:
    """The LM head's input group (the final norm of the last layer's output)."""
    rows = [policy.norm(x) for x in hidden]
    absmax = torch.cat([r.reshape(-1, r.shape[-1]).abs().amax(dim=1).float() for r in rows])
    collector = GroupCollector(outlier_thresholds({HEAD_GROUP: absmax}, outlier_ratio), hessians,
                               lambda g: _group_generator(seed, g))
    for r in rows:
        collector.observe(HEAD_GROUP, r)
    return collector.stats


def light(stats: LinearStats) -> LinearStats:
    """The statistics a build keeps after a layer is quantized: no Hessian, no row sample (the manifest's summary
    and the outlier linears read the rest)."""
    return {g: GroupStats(token_absmax=torch.zeros(0), threshold=s.threshold, channel_absmax=s.channel_absmax,
                          rows=s.rows, outliers=s.outliers) for g, s in stats.items()}


def stream_layers(policy: nn.Module, layers: Sequence[int], hidden: List[Tensor], outlier_ratio: float,
                  hessians: bool, seed: int = 0, head: Optional[bool] = None
                  ) -> Iterator[Tuple[int, LinearStats, List[Tensor]]]:
    """(layer index, its groups' statistics, its output) for each of ``layers`` in order, from ``hidden`` (the first
    one's input); then (-1, the head group's statistics, the last output) when ``head`` (default: the last layer of
    the model is among ``layers``). The caller quantizes each layer before asking for the next: the previous
    statistics are no longer referenced here."""
    for i in layers:
        stats, hidden = layer_stats(policy, i, hidden, outlier_ratio, hessians, seed)
        yield i, stats, hidden
        del stats
    if head if head is not None else len(policy.layers) - 1 in layers:
        yield -1, head_stats(policy, hidden, outlier_ratio, hessians, seed), hidden
