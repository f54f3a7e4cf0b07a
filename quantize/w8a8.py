"""W8A8 with per-token activation scales: the recipe that survives real pretrained LMs.

Why per token: a pretrained LM's attention-sink position (position 0 when there is no BOS) carries
massive activations, ~250x the RMS of every other token in ``down_proj``'s input on SmolLM2-135M.
A per-tensor scale that sees it (torch.ao ``static``, and ``dynamic``, which takes one scale over the
whole input) rounds every other token's activations to a handful of levels. Here each row (token)
gets its own symmetric int8 scale, computed at run time, and rows whose max |x| is itself an
outlier (above a threshold calibrated per layer) are computed in float against the dequantized
weight: they are few (one per sequence), and they are the keys/values every later token attends to.

The matmul is ``torch._int_mm`` (int8 x int8 -> int32), which runs on CPU and scripts under
``torch.jit.script``; the row and column scales multiply after. Weights are int8 per output channel,
symmetric, rounded to nearest or with error feedback (``quantize.gptq``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per row: (int8 values, float scales [rows, 1])."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / 127.0
    return torch.round(x / scale).clamp(-127, 127).to(torch.int8), scale


def quantize_weight(w: Tensor) -> tuple[Tensor, Tensor]:
    """Per output channel symmetric int8 of a [out, in] weight: (int8 [out, in], scales [out])."""
    scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-8)
    return torch.round(w / scales.unsqueeze(1)).clamp(-127, 127).to(torch.int8), scales


def fake_quant_rows(x: Tensor) -> Tensor:
    """What the int8 kernel sees of ``x`` (quantize then dequantize each row), in float."""
    q, s = quantize_rows(x)
    return q.float() * s


class Int8TokenLinear(nn.Module):
    """int8 per-channel weights x int8 per-token activations; outlier rows stay in float.

    ``outlier_threshold`` is an absolute max |x| per row above which the row is not quantized (0
    disables it). Scriptable: the exported TorchScript and the teacher-forced scorer run this same
    forward, so the build gate measures what ships.
    """

    def __init__(self, weight_int8: Tensor, scales: Tensor, bias: Optional[Tensor], outlier_threshold: float):
        super().__init__()
        # [out, in] contiguous, passed to _int_mm as its transposed view: measured faster at batch 1
        # on AVX2 than an [in, out] contiguous copy.
        self.register_buffer("weight_int8", weight_int8.contiguous())
        self.register_buffer("scales", scales.float().contiguous())
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.in_features = int(weight_int8.shape[1])
        self.out_features = int(weight_int8.shape[0])
        self.outlier_threshold = float(outlier_threshold)

    @classmethod
    def from_float(cls, linear: nn.Linear, outlier_threshold: float = 0.0,
                   weight_int8: Optional[Tensor] = None, scales: Optional[Tensor] = None) -> "Int8TokenLinear":
        if weight_int8 is None or scales is None:
            weight_int8, scales = quantize_weight(linear.weight.detach().float())
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        return cls(weight_int8, scales, bias, outlier_threshold)

    def dequantized_weight(self) -> Tensor:
        """[out, in] float weight as the int8 kernel sees it."""
        return self.weight_int8.float() * self.scales.unsqueeze(1)

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.in_features).float()
        amax = flat.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8)
        row_scale = amax / 127.0
        q = torch.round(flat / row_scale).clamp(-127, 127).to(torch.int8)
        out = torch._int_mm(q, self.weight_int8.t()).float() * row_scale * self.scales
        if self.outlier_threshold > 0.0:
            rows = (amax.squeeze(1) > self.outlier_threshold).nonzero().squeeze(1)
            if rows.numel() > 0:
                w = self.weight_int8.float() * self.scales.unsqueeze(1)
                out.index_copy_(0, rows, flat.index_select(0, rows).matmul(w.t()))
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(x.shape[:-1] + (self.out_features,))


class Int8RescoredHead(nn.Module):
    """The LM head in int8, with each row's top-k logits recomputed in float.

    On a 49k vocabulary the head is the largest matmul of a small LM's decode step (SmolLM2-135M:
    28M of its 134M multiply-adds per token), so it is where int8 pays most; near-tied top logits
    are where int8 errors flip the greedy choice. The int8 logits pick the k candidates, the float
    weight rows (shared with the tied embedding, not copied) score them exactly: greedy decoding is
    exact whenever the float top-1 is among the int8 top-k, and the tail keeps int8 logits.
    """

    def __init__(self, int8: Int8TokenLinear, float_weight: Tensor, topk: int):
        super().__init__()
        self.int8 = int8
        self.register_buffer("float_weight", float_weight)
        self.topk = int(topk)
        self.in_features, self.out_features = int8.in_features, int8.out_features

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.in_features).float()
        out = self.int8(flat)
        idx = out.topk(self.topk, dim=-1).indices
        rows = self.float_weight.index_select(0, idx.reshape(-1)).view(idx.shape[0], self.topk, self.in_features)
        exact = torch.bmm(rows, flat.unsqueeze(2)).squeeze(2)
        out = out.scatter(1, idx, exact)
        return out.reshape(x.shape[:-1] + (self.out_features,))
