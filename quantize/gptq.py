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

import torch
from torch import Tensor


def gptq_quantize(weight: Tensor, hessian: Tensor, damp: float = 0.01, block: int = 128) -> tuple[Tensor, Tensor]:
    """int8 [out, in] and per-row scales [out] for ``weight`` given the input Hessian [in, in]."""
    w = weight.detach().double().clone()
    h = hessian.detach().double().clone()
    scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-8)
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    perm = torch.argsort(torch.diag(h), descending=True)
    w, h = w[:, perm], h[perm][:, perm]
    h += damp * torch.mean(torch.diag(h)) * torch.eye(h.shape[0], dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q_all = torch.zeros_like(w)
    s = scales.unsqueeze(1)
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
    inverse = torch.argsort(perm)
    return q_all[:, inverse].to(torch.int8), scales.float()
