"""The one percentile: the q-quantile of a sample (a list, a tensor or an array), by rank or interpolated.

Two definitions, because their callers need different things from one: a latency p99 that is an observed
latency (``rank``), and a KL p99 that moves smoothly with the sample (``linear``, numpy's and torch's default).
"""

from __future__ import annotations

import math
from typing import Literal, Optional

Method = Literal["rank", "linear"]


def percentile(values, q: float, *, method: Method = "rank", empty: Optional[float] = math.nan) -> Optional[float]:
    """The ``q``-quantile (``q`` in [0, 1]) of ``values``: numbers, or a tensor or array of any shape.

    ``rank``: the sorted sample at index floor(q * n), the last one past the end; always an observed value, so
    the 0.99-quantile of fewer than 100 samples is their maximum. ``linear``: between the two nearest ranks,
    as ``numpy.percentile`` computes it, to the bit (``torch.quantile`` may differ in the last bit: it fuses
    the multiply-add). ``empty`` is the answer for no samples; a NaN among them makes the answer NaN."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"percentile: q={q} is outside [0, 1]")
    if method not in ("rank", "linear"):
        raise ValueError(f"percentile: method={method!r} is not 'rank' or 'linear'")
    sample = [float(v) for v in (values.reshape(-1).tolist() if hasattr(values, "reshape") else values)]
    if not sample:
        return empty
    if any(math.isnan(v) for v in sample):
        return math.nan
    s = sorted(sample)
    if method == "rank":
        return s[min(len(s) - 1, int(q * len(s)))]
    pos = q * (len(s) - 1)
    lo = int(pos)
    a, b, w = s[lo], s[math.ceil(pos)], pos - lo
    # numpy's lerp: from the nearer end, so that w = 1 gives b exactly
    return a + w * (b - a) if w < 0.5 else b - (b - a) * (1 - w)
