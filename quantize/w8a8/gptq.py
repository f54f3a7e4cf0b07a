"""Error-feedback weight rounding (GPTQ, Frantar et al. 2022) for per-channel symmetric int8 weights.

Rounding each weight to its nearest int8 level ignores how the rounding errors of one output add
up over the inputs that actually arrive. GPTQ quantizes one input column at a time and spreads that
column's error over the columns not yet quantized, weighted by the inverse of the input Hessian
H = sum x x^T (collected on calibration data: a sum, so shards merge exactly by adding). Columns go
in order of decreasing H diagonal ("act order"), blocks of 128 keep the updates matrix-sized.
On SmolLM2-135M nearest rounding alone caps top-1 agreement near 95.6 %: 3.5 % of positions have
near-tied top-2 logits, so small systematic errors flip them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


ROWS_PER_PASS = 4096  # output rows rounded together: a vocabulary-sized head's float64 copies stay ~100 MB each


@dataclass(frozen=True)
class HessianFactor:
    """What GPTQ needs of an input Hessian, computed once for all the linears that read the same input (q, k and v;
    gate and up): act order, its inverse permutation, the dead columns and the upper Cholesky factor of H^-1."""
    perm: Tensor
    inverse: Tensor
    dead: Tensor
    hinv: Tensor


def factor_hessian(hessian: Tensor, damp: float = 0.01) -> HessianFactor:
    """``hessian`` [in, in] dampened by ``damp`` times its mean diagonal, put in act order and factored."""
    h = hessian.detach().double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    perm = torch.argsort(torch.diag(h), descending=True)
    h = h[perm][:, perm]
    h += damp * torch.mean(torch.diag(h)) * torch.eye(h.shape[0], dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    return HessianFactor(perm, torch.argsort(perm), dead, hinv)


def gptq_quantize(weight: Tensor, hessian: Optional[Tensor] = None, damp: float = 0.01, block: int = 128,
                  rows_per_pass: int = ROWS_PER_PASS, factor: Optional[HessianFactor] = None) -> tuple[Tensor, Tensor]:
    """int8 [out, in] and per-row scales [out] for ``weight`` given the input Hessian [in, in] (or its
    ``factor_hessian``, shared by the linears of one input). Output rows do not interact (each row's error feedback
    runs along its own columns), so they are rounded ``rows_per_pass`` at a time: the float64 working copies are of
    that many rows, not of the whole weight."""
    if factor is None:
        if hessian is None:
            raise ValueError("gptq_quantize needs the input Hessian or its factor")
        factor = factor_hessian(hessian, damp)
    codes = torch.empty(weight.shape, dtype=torch.int8)
    scales = torch.empty(weight.shape[0], dtype=torch.float32)
    for r1 in range(0, weight.shape[0], rows_per_pass):
        r2 = min(r1 + rows_per_pass, weight.shape[0])
        w = weight.detach()[r1:r2].double()
        s = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-8)
        w[:, factor.dead] = 0.0
        q = _rows(w[:, factor.perm], factor.hinv, s.unsqueeze(1), block)
        codes[r1:r2] = q[:, factor.inverse].to(torch.int8)
        scales[r1:r2] = s.float()
    return codes, scales


def _rows(w: Tensor, hinv: Tensor, s: Tensor, block: int) -> Tensor:
    """GPTQ's column loop over some rows (columns already in act order; ``w`` is consumed)."""
    q_all = torch.zeros_like(w)
    for i1 in range(0, w.shape[1], block):
        i2 = min(i1 + block, w.shape[1])
        w1 = w[:, i1:i2].clone()
        q1 = torch.zeros_like(w1)
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = w1[:, i : i + 1]
            q = torch.round(col / s).clamp(-127, 127)
            q1[:, i : i + 1] = q
            e = (col - q * s) / hinv1[i, i]
            w1[:, i:] -= e * hinv1[i : i + 1, i:]
            err1[:, i : i + 1] = e
        q_all[:, i1:i2] = q1
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    return q_all
