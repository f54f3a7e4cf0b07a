"""The one percentile the load tools share (nearest rank, q in [0, 1]; NaN for no samples)."""

from __future__ import annotations

from typing import Sequence


def pct(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    return float(s[min(len(s) - 1, int(q * len(s)))]) if s else float("nan")
