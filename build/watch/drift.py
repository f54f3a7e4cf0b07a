"""Calibration drift: how far the quantization parameters a fresh calibration implies have moved from
the ones a deployed bundle ships, per layer.

What is compared is what the shipped recipe calibrated (the manifest's ``calibration`` section):

- torch.ao recipes (static / dynamic / weight-only, smoothed or not): each quantized linear's input
  range -> its activation ``scale`` and ``zero_point`` as the recipe's MinMax observer computes them
  (quint8 per-tensor affine, ``reduce_range`` as shipped). A layer's drift is the larger of the relative
  scale change and the zero-point shift as a fraction of the quantized range.
- w8a8 recipes (per-token activation scales at run time, nothing static): each input group's outlier
  threshold (rows above it run in float) and its largest channel max |x| (what the SmoothQuant scales
  are computed from). A group's drift is the larger of the two relative changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch


@dataclass(frozen=True)
class LayerDrift:
    layer: str
    drift: float  # the fraction compared with the threshold
    quantities: Dict[str, Tuple[float, float]]  # name -> (deployed, fresh)

    def as_dict(self) -> dict:
        return {"layer": self.layer, "drift": round(self.drift, 6),
                **{k: [round(a, 6), round(b, 6)] for k, (a, b) in self.quantities.items()}}


def activation_qparams(lo: float, hi: float, reduce_range: bool) -> Tuple[float, int]:
    """(scale, zero_point) of a quint8 per-tensor affine MinMax observer that saw [lo, hi]: torch's own
    computation, so the numbers are the artifact's."""
    from torch.ao.quantization.observer import MinMaxObserver

    obs = MinMaxObserver(dtype=torch.quint8, qscheme=torch.per_tensor_affine, reduce_range=reduce_range)
    obs.min_val.resize_(()).fill_(lo)
    obs.max_val.resize_(()).fill_(hi)
    scale, zp = obs.calculate_qparams()
    return float(scale), int(zp)


APPEARED = 1e6  # the drift of a statistic one side does not have (JSON has no infinity)


def _rel(old: Optional[float], new: Optional[float]) -> float:
    if old is None or new is None:
        return 0.0 if old == new else APPEARED
    return min(APPEARED, abs(new - old) / max(abs(old), 1e-12))


def observer_drift(old: Dict[str, List[float]], new: Dict[str, List[float]], reduce_range: bool) -> List[LayerDrift]:
    qrange = 127 if reduce_range else 255
    out = []
    for layer in sorted(set(old) & set(new)):
        s0, z0 = activation_qparams(*old[layer], reduce_range)
        s1, z1 = activation_qparams(*new[layer], reduce_range)
        out.append(LayerDrift(layer, max(_rel(s0, s1), abs(z1 - z0) / qrange),
                              {"scale": (s0, s1), "zero_point": (float(z0), float(z1))}))
    return out


def group_drift(old: Dict[str, dict], new: Dict[str, dict]) -> List[LayerDrift]:
    out = []
    for g in sorted(set(old) & set(new)):
        q = {k: (old[g].get(k), new[g].get(k)) for k in ("outlier_threshold", "channel_absmax_max")}
        q = {k: v for k, v in q.items() if v != (None, None)}
        out.append(LayerDrift(g, max([_rel(a, b) for a, b in q.values()] or [0.0]),
                              {k: (float(a or 0.0), float(b or 0.0)) for k, (a, b) in q.items()}))
    return out


def calibration_drift(deployed: dict, fresh: dict, reduce_range: bool,
                      layers: Optional[set] = None) -> Tuple[str, List[LayerDrift]]:
    """(what was compared, per-layer drift, largest first) between two manifest calibration sections;
    ``layers``: the linears the deployed bundle runs in int8 (others' ranges do not matter)."""
    if "activation_ranges" in deployed and "activation_ranges" in fresh:
        what = ("activation scale / zero point of each quantized linear's input (quint8 affine MinMax, "
                f"reduce_range={reduce_range}); drift = max(|scale change| / scale, |zero-point shift| / range)")
        keep = (lambda d: {k: v for k, v in d.items() if k in layers}) if layers is not None else (lambda d: d)
        drifts = observer_drift(keep(deployed["activation_ranges"]), keep(fresh["activation_ranges"]), reduce_range)
    elif "groups" in deployed and "groups" in fresh:
        what = ("w8a8 input groups: outlier threshold and largest channel max |x| (the smoothing statistics); "
                "drift = the larger relative change")
        drifts = group_drift(deployed["groups"], fresh["groups"])
    else:
        raise ValueError("the deployed bundle and the fresh calibration record different statistics "
                         f"({sorted(deployed)} vs {sorted(fresh)})")
    return what, sorted(drifts, key=lambda d: -d.drift)
