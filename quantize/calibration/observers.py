"""Calibration results that travel between processes: each activation observer's (min, max), merged exactly
across shards (independent of their order) and loaded back into a prepared model; the per-linear input
ranges the manifest records."""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch
from torch import Tensor, nn
from torch.ao.quantization import MinMaxObserver

ObserverState = Dict[str, Tuple[Tensor, Tensor]]


def observer_state(prepared: nn.Module) -> ObserverState:
    """Per activation observer: (min, max). Small tensors that travel in actor messages."""
    return {
        name: (mod.min_val.clone(), mod.max_val.clone())
        for name, mod in prepared.named_modules()
        if isinstance(mod, MinMaxObserver)
    }


def merge_observer_states(states: List[ObserverState]) -> ObserverState:
    """Elementwise min of mins and max of maxes: exact, and independent of shard order."""
    if not states:
        raise ValueError("merge_observer_states: no observer states to merge")
    keys = set(states[0])
    for s in states[1:]:
        if set(s) != keys:
            raise ValueError("merge_observer_states: shards observed different modules")
    merged: ObserverState = {}
    for k in sorted(keys):
        mins = torch.stack([s[k][0] for s in states])
        maxs = torch.stack([s[k][1] for s in states])
        merged[k] = (mins.min(dim=0).values, maxs.max(dim=0).values)
    return merged


def load_observer_state(prepared: nn.Module, state: ObserverState) -> None:
    mods = dict(prepared.named_modules())
    for name, (lo, hi) in state.items():
        obs = mods[name]
        obs.min_val.resize_(lo.shape).copy_(lo)
        obs.max_val.resize_(hi.shape).copy_(hi)


def activation_ranges(state: ObserverState) -> Dict[str, List[float]]:
    """Per quantized linear: [min, max] of its input activations (from its QuantStub observer)."""
    out = {}
    for name, (lo, hi) in state.items():
        if name.endswith(".quant.activation_post_process"):
            out[name.removesuffix(".quant.activation_post_process")] = [float(lo), float(hi)]
    return out
