"""A float linear kept in an int8 policy whose rows in a decode batch come out as they do alone.

A float GEMM over B rows sums in another order than the one-row product (1-ulp differences), and the int8 layers after
it turn such a difference into another activation code now and then: on SmolLM2-135M with one float ``down_proj`` a
two-row decode step's logits differed from the one-row step's by up to 0.55.

The BLAS picks its kernel by shape. On this project's CPUs (MKL in torch 2.13, one intra-op thread) every call of 2 to
15 rows runs one kernel, whose rows do not depend on each other, and 16 or more rows another (measured at
SmolLM2-135M's four shapes); one row takes its matrix-vector kernel. So a decode step's rows go in chunks of at most
``rows_per_call`` and a lone row goes in twice (the first result kept): every row is summed as it is alone.
``rows_per_call`` is probed on the CPU that runs the policy (``stable_rows_per_call``: where the weight is built and
again where it is loaded), at the decode's one intra-op thread (at more threads a call's rows may be split differently:
the served engine decodes at one, as the gate does); a CPU whose calls of 2 rows already differ keeps one call per
row. A chunk whose rows are not 64-byte aligned (a width not a multiple of 16 floats)
goes in as a fresh copy, as the probe's rows do. SmolLM2-135M's three float ``down_proj``s at 16 rows: 16 one-row
calls were 15 % of a decode step's time (py-spy); in chunks the 16-row step took 56.4 ms against 64.8.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

PROBE_ROWS = 16  # the largest chunk probed: one past the 15 rows of the small-matrix kernel measured here


def stable_rows_per_call(weight: Tensor, bias: Optional[Tensor], limit: int = PROBE_ROWS) -> int:
    """The most rows ``c`` such that every call of 2..c rows gives each row as the one-row call of it twice does, on
    this CPU at one intra-op thread (the decode's: ``quantize.runtime.decode.DECODE_THREADS``); 1 where 2 rows already
    differ.
    The kernel is chosen by shape, and its sums do not depend on the values: seeded random rows find it."""
    x = torch.randn(limit, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            alone = torch.cat([F.linear(torch.cat([x[i:i + 1], x[i:i + 1]]), weight, bias)[:1] for i in range(limit)])
            best = 1
            for rows in range(2, limit + 1):
                if not torch.equal(F.linear(x[:rows], weight, bias), alone[:rows]):
                    break
                best = rows
    finally:
        torch.set_num_threads(before)
    return best


def probe_row_stable(module: nn.Module) -> int:
    """``rows_per_call`` probed again for every ``RowStableLinear`` in ``module`` (eager or TorchScript: a loaded
    policy runs on this CPU, not the one that built it). Returns the linears probed."""
    probed = 0
    for sub in module.modules():
        name = sub.original_name if isinstance(sub, torch.jit.ScriptModule) else type(sub).__name__
        if name == "RowStableLinear" and hasattr(sub, "rows_per_call"):
            sub.rows_per_call = stable_rows_per_call(sub.weight, sub.bias)
            probed += 1
    return probed


class RowStableLinear(nn.Module):
    """A float linear whose decode rows (``x`` [B, 1, in]) each come out as alone: in chunks of at most
    ``rows_per_call`` rows, a lone row twice (1: one call per row); a prefill or a teacher-forced forward (T > 1) runs
    the GEMM as a float policy does."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = linear.weight
        self.bias: Optional[Tensor] = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.rows_per_call = stable_rows_per_call(self.weight, self.bias)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 3 or x.shape[1] != 1 or x.shape[0] == 0 or (x.shape[0] == 1 and self.rows_per_call < 2):
            return F.linear(x, self.weight, self.bias)
        rows = x.shape[0]
        if self.rows_per_call < 2:
            return torch.cat([F.linear(x[i : i + 1], self.weight, self.bias) for i in range(rows)])
        calls = (rows + self.rows_per_call - 1) // self.rows_per_call
        size = (rows + calls - 1) // calls  # even chunks: 16 rows as 8 + 8, not 15 + 1
        flat = x.reshape(rows, self.in_features)
        outs: List[Tensor] = []
        for start in range(0, rows, size):
            part = flat[start : start + size]
            if self.in_features % 16 != 0:  # rows not 64-byte aligned: a fresh copy, as the probe's (MKL's sums may
                part = part.clone()  # depend on alignment)
            if part.shape[0] == 1:  # a lone row: twice, as the probe compared
                outs.append(F.linear(torch.cat([part, part]), self.weight, self.bias)[:1])
            else:
                outs.append(F.linear(part, self.weight, self.bias))
        return torch.cat(outs).view(rows, 1, self.out_features)
