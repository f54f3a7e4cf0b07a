"""Calibration samples that would set a scale on their own: per-sample activation ranges, and the
samples whose range stands out from the rest of the set.

A MinMax observer keeps the extreme of everything it sees, so one odd input (a corrupted rollout, a
prompt from another distribution) can widen a layer's scale for every token served later. Each
sample's max |x| at each observed linear input is compared with the *other* samples' mean and
standard deviation at that layer (leave-one-out: with the sample itself in the statistics a z-score
can never exceed sqrt(n - 1), so a 10-sigma rule would never fire on a set of 60). A sample is odd when
any layer's range exceeds the others' mean by more than ``sigma`` times their standard deviation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence

import torch
from torch import Tensor, nn

from policy_bundle.quantize.model.policy import run_with_hooks


@dataclass(frozen=True)
class OddSample:
    index: int  # position in the sequence list the ranges were measured on
    layer: str  # the layer where it stands out most
    absmax: float  # its max |x| there
    others_mean: float
    others_std: float
    sigmas: float  # (absmax - others_mean) / others_std

    def as_dict(self) -> dict:
        return {"sample": self.index, "layer": self.layer, "absmax": round(self.absmax, 4),
                "others_mean": round(self.others_mean, 4), "others_std": round(self.others_std, 4),
                "sigmas": round(self.sigmas, 2)}


@torch.no_grad()
def sample_absmax(policy: nn.Module, sequences: Sequence[Sequence[int]], layers: Sequence[str],
                  done: Callable[[int], None] = lambda n: None, rows: int = 8) -> Tensor:
    """``[n_samples, n_layers]``: each sequence's max |x| at the input of each named linear, teacher-forced in
    right-padded batches of ``rows`` (causal attention: a pad after a sequence never reaches its positions, and
    the pads' own rows are masked out of the max); ``done(n)`` after each batch."""
    out = torch.zeros(len(sequences), len(layers))
    batch = {"first": 0, "valid": torch.ones(1, 1, 1, dtype=torch.bool)}
    hooks = []
    mods = dict(policy.named_modules())
    for j, name in enumerate(layers):
        def hook(_m, args, j=j):
            x = args[0].detach().abs().masked_fill(~batch["valid"], 0.0)
            first = batch["first"]
            out[first:first + x.shape[0], j] = x.amax(dim=(1, 2))

        hooks.append(mods[name].register_forward_pre_hook(hook))

    def batches():
        for first in range(0, len(sequences), rows):
            if first:
                done(first)
            part = [list(s) for s in sequences[first:first + rows]]
            lengths = torch.tensor([len(s) for s in part])
            width = int(lengths.max())
            batch["first"] = first
            batch["valid"] = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).unsqueeze(2)
            yield torch.tensor([s + [0] * (width - len(s)) for s in part], dtype=torch.long)

    run_with_hooks(policy, batches(), hooks)
    done(len(sequences))
    return out


def odd_samples(ranges: Tensor, layers: Sequence[str], sigma: float) -> List[OddSample]:
    """The samples whose range at some layer exceeds the other samples' mean by more than ``sigma``
    standard deviations (leave-one-out), worst layer each, most extreme first. Needs 3 samples."""
    n = ranges.shape[0]
    if n < 3 or sigma <= 0:
        return []
    x = ranges.double()
    total, total_sq = x.sum(0), (x * x).sum(0)
    others_mean = (total - x) / (n - 1)
    others_var = ((total_sq - x * x) - (n - 1) * others_mean ** 2) / (n - 2)
    others_std = others_var.clamp_min(0).sqrt()
    # A layer whose other samples agree exactly (std 0) flags any sample above them by a relative margin.
    floor = others_mean.abs() * 1e-6 + 1e-12
    z = (x - others_mean) / torch.maximum(others_std, floor)
    found: Dict[int, OddSample] = {}
    for i in range(n):
        j = int(z[i].argmax())
        if float(z[i, j]) > sigma:
            found[i] = OddSample(i, layers[j], float(x[i, j]), float(others_mean[i, j]), float(others_std[i, j]),
                                 float(z[i, j]))
    return sorted(found.values(), key=lambda o: -o.sigmas)
