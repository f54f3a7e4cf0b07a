"""W8A8 with per-token activation quantization: the recipe that survives real pretrained LMs.

Why per token: a pretrained LM's attention-sink position (position 0 when there is no BOS) carries
massive activations, ~250x the RMS of every other token in ``down_proj``'s input on SmolLM2-135M.
A per-tensor scale that sees it (torch.ao ``static``, and ``dynamic`` over a whole prompt) rounds every
other token's activations to a handful of levels. Here each row (token) is quantized on its own.

The arithmetic is fbgemm's dynamic quantized linear (``quantized::linear_dynamic``), applied one row at a
time: per row an asymmetric uint8 scale and zero point chosen from the row's min and max exactly as fbgemm
chooses them, int8 weights per output channel (symmetric), int32 accumulation, one float rescale. Measured on
SmolLM2-135M, every linear in int8 and nothing else changed: top-1 0.941 / KL 0.018 against FP32, where a
symmetric int8 row scale gave 0.898 / 0.031 (the asymmetric scale spends all 256 levels on the row's range).

Two kernels, one result:

- **one row** (a batch-1 decode step): fbgemm itself over its pre-packed weight, the cheapest int8 matmul on
  this CPU (``quantize/bench_kernels.py``: 0.07-0.6x of fp32 ``F.linear`` at SmolLM2's shapes);
- **several rows** (prefill, batched decode, the teacher-forced gate): the same quantization computed per row,
  then ``torch._int_mm`` (int8 x int8 -> int32, exact) on ``x_u8 - 128`` with the zero-point term added back
  from the weight's column sums. The integers equal fbgemm's and so do the floats, bitwise (tested).

Rows whose max |x| exceeds a threshold calibrated per layer (the sink) are split: their ``outlier_channels``
largest channels are multiplied in float against those few weight columns (dequantized from int8, a gather of
k columns, not the whole weight), the rest of the row is quantized as any other row.
"""

from __future__ import annotations

import warnings
from typing import List, Optional, Tuple

import torch
from torch import Tensor, nn

from policy_bundle.quantize.rotation import (  # noqa: F401 (rotation_block, rotation_matrix: re-exported)
    kron_factors, rotation_block, rotation_matrix, rotation_signs)

# TorchScript reads no module constants: the kernels below write fbgemm's two as literals, 255.0 (uint8
# activation levels, no reduce_range) and 6.1e-5 (the smallest activation scale, quant_utils' SMALL_SCALE_THRESHOLD).
OUTLIER_CHANNELS = 8  # channels of an outlier row computed in float


def quantize_weight(w: Tensor) -> Tuple[Tensor, Tensor]:
    """Per output channel symmetric int8 of a [out, in] weight: (int8 [out, in], scales [out])."""
    scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-8)
    return torch.round(w / scales.unsqueeze(1)).clamp(-127, 127).to(torch.int8), scales


def row_qparams(flat: Tensor) -> Tuple[Tensor, Tensor]:
    """Per row of a float [rows, in]: fbgemm's dynamic uint8 (scale float32 [rows, 1], zero point float64 [rows, 1]).

    The range always holds 0; the scale is computed in double and used in float; an all-zero row takes
    scale 0.1 and rows whose scale falls under 6.1e-5 are widened, as fbgemm does."""
    mn, mx = torch.aminmax(flat, dim=-1, keepdim=True)
    mn = mn.clamp_max(0.0).double()
    mx = mx.clamp_min(0.0).double()
    scale = (mx - mn) / 255.0
    if bool((scale.float() < 6.1e-5).any()):
        org = scale.float().double()
        zero = org == 0.0  # an all-zero row: fbgemm takes scale 0.1 (then no widening)
        small = (scale < 6.1e-5) & ~zero
        amp = 6.1e-5 / org.clamp_min(1e-30)
        both = small & (mn != 0) & (mx != 0)
        new_mn = torch.where(both, mn * amp, torch.where(small & (mx == 0), torch.full_like(mn, -6.1e-5 * 255.0), mn))
        mx = torch.where(both, mx * amp, torch.where(small & (mn == 0), torch.full_like(mx, 6.1e-5 * 255.0), mx))
        mn = new_mn
        scale = torch.where(zero, torch.full_like(scale, 0.1), torch.where(small, torch.full_like(scale, 6.1e-5), scale))
    zp = torch.round((-mn / scale).clamp(0.0, 255.0))
    return scale.float(), zp


def quantize_rows(flat: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """uint8 codes (as float), scale and zero point per row, as fbgemm quantizes them."""
    scale, zp = row_qparams(flat)
    q = torch.round(flat / scale + zp.float()).clamp(0.0, 255.0)  # fbgemm's order: bitwise equal, tested
    return q, scale, zp


def fake_quant_rows(x: Tensor) -> Tensor:
    """What the int8 kernel sees of ``x`` [..., in] (each row quantized then dequantized), in float."""
    flat = x.reshape(-1, x.shape[-1]).float()
    q, scale, zp = quantize_rows(flat)
    return ((q - zp.float()) * scale).reshape(x.shape)


def pack_int8(weight_int8: Tensor, scales: Tensor):
    """fbgemm's pre-packed weight (no bias: both kernels add it after, so their sums are equal)."""
    qw = torch._make_per_channel_quantized_tensor(weight_int8, scales.double(),
                                                  torch.zeros(weight_int8.shape[0], dtype=torch.long), 0)
    return torch.ops.quantized.linear_prepack(qw, None)


class FbgemmWeight(nn.Module):
    """fbgemm's pre-packed copy of an int8 weight. Saved as that int8 weight and its scales (the owner's own
    tensors: a TorchScript file stores them once) and packed again where it is loaded or copied."""

    def __init__(self, weight_int8: Tensor, scales: Tensor):
        super().__init__()
        self.weight_int8, self.scales = weight_int8, scales
        with warnings.catch_warnings():  # quantized tensors are deprecated as a user type; the packing needs one
            warnings.simplefilter("ignore")
            self.packed = pack_int8(weight_int8, scales)

    def __reduce__(self):  # eager copies and pickles: rebuilt from the int8 weight
        return (FbgemmWeight, (self.weight_int8, self.scales))

    @torch.jit.export
    def __getstate__(self) -> Tuple[Tensor, Tensor, bool]:
        return self.weight_int8, self.scales, self.training

    @torch.jit.export
    def __setstate__(self, state: Tuple[Tensor, Tensor, bool]) -> None:
        self.weight_int8, self.scales, self.training = state[0], state[1], state[2]
        self.packed = pack_int8(state[0], state[1])


class Int8TokenLinear(nn.Module):
    """int8 per-channel weights x uint8 per-token activations (fbgemm's arithmetic, row by row).

    ``outlier_threshold`` is an absolute max |x| per row above which the row's largest ``outlier_channels``
    run in float (0 disables it). Scriptable: the exported TorchScript and the teacher-forced scorer run this
    same forward, so the build gate measures what ships.
    """

    def __init__(self, weight_int8: Tensor, scales: Tensor, bias: Optional[Tensor], outlier_threshold: float,
                 outlier_channels: int = OUTLIER_CHANNELS, rot_block: int = 0):
        super().__init__()
        # rot_block > 0: the input is rotated (``quantize.rotation``) before it is quantized, and ``weight_int8`` is
        # the rotated weight W @ R; the output is unchanged (R is orthogonal), the quantization error smaller.
        self.rot_block = int(rot_block)
        # The block's Hadamard is applied as two Kronecker factors (``kron_factors``): rot_outer [a, a], rot_inner [b, b].
        outer, inner = kron_factors(self.rot_block) if rot_block else (torch.zeros(0, 0), torch.zeros(0, 0))
        self.register_buffer("rot_outer", outer)
        self.register_buffer("rot_inner", inner)
        self.register_buffer("rot_signs", rotation_signs(int(weight_int8.shape[1]))
                             if rot_block else torch.zeros(0))
        self.rot_a, self.rot_b = int(outer.shape[0]), int(inner.shape[0])
        # [out, in] contiguous, passed to _int_mm as its transposed view: measured faster on AVX2 than an
        # [in, out] contiguous copy.
        self.register_buffer("weight_int8", weight_int8.contiguous())
        self.register_buffer("scales", scales.float().contiguous())
        self.register_buffer("col_sums", weight_int8.sum(dim=1, dtype=torch.int32))
        self.bias = nn.Parameter(bias.float(), requires_grad=False) if bias is not None else None
        self.fbgemm = FbgemmWeight(self.weight_int8, self.scales)
        self.in_features = int(weight_int8.shape[1])
        self.out_features = int(weight_int8.shape[0])
        self.outlier_threshold = float(outlier_threshold)
        self.outlier_channels = int(min(outlier_channels, self.in_features))

    @classmethod
    def from_float(cls, linear: nn.Linear, outlier_threshold: float = 0.0, weight_int8: Optional[Tensor] = None,
                   scales: Optional[Tensor] = None, rot_block: int = 0) -> "Int8TokenLinear":
        """``weight_int8``/``scales``, when given, are already of the rotated weight (``rot_block`` > 0)."""
        if weight_int8 is None or scales is None:
            w = linear.weight.detach().float()
            if rot_block:
                w = w @ rotation_matrix(w.shape[1], rot_block)
            weight_int8, scales = quantize_weight(w)
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        return cls(weight_int8, scales, bias, outlier_threshold, rot_block=rot_block)

    @classmethod
    def concat(cls, parts: List["Int8TokenLinear"]) -> "Int8TokenLinear":
        """One linear for several that read the same input (q/k/v, gate/up): one activation quantization,
        one matmul; its output is the parts' outputs side by side, equal to theirs."""
        biases = [p.bias for p in parts]
        bias = None if all(b is None for b in biases) else torch.cat(
            [b if b is not None else torch.zeros(p.out_features) for b, p in zip(biases, parts)])
        return cls(torch.cat([p.weight_int8 for p in parts]), torch.cat([p.scales for p in parts]), bias,
                   parts[0].outlier_threshold, parts[0].outlier_channels, parts[0].rot_block)

    def dequantized_weight(self) -> Tensor:
        """[out, in] float weight as the int8 kernel sees it, in the input's own basis (rotation undone)."""
        w = self.weight_int8.float() * self.scales.unsqueeze(1)
        return w @ rotation_matrix(self.in_features, self.rot_block).t() if self.rot_block else w

    def rotate(self, flat: Tensor) -> Tensor:
        """``flat @ R`` block by block: each block as X [a, b] becomes ``H_a @ X @ H_b``."""
        x = (flat * self.rot_signs).view(-1, self.rot_a, self.rot_b)
        if self.rot_a > 1:
            x = torch.matmul(self.rot_outer, x)
        return torch.matmul(x, self.rot_inner).view(-1, self.in_features)

    def rows(self, flat: Tensor) -> Tensor:
        """Any number of rows: per-row quantization, ``_int_mm``, rescale (fbgemm's integers)."""
        q, scale, zp = quantize_rows(flat)
        acc = torch._int_mm((q - 128.0).to(torch.int8), self.weight_int8.t())
        acc = acc + (128 - zp.to(torch.int32)) * self.col_sums
        return acc.float() * (scale * self.scales)

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.in_features).float()
        if self.rot_block > 0:
            flat = self.rotate(flat)
        rows = torch.empty(0, dtype=torch.long)
        if self.outlier_threshold > 0.0:
            if flat.shape[0] == 1:  # a decode step: one reduction and one compare, no index tensor unless loud
                if float(torch.linalg.vector_norm(flat, float("inf"))) > self.outlier_threshold:
                    rows = torch.zeros(1, dtype=torch.long)
            else:
                rows = (flat.abs().amax(dim=-1) > self.outlier_threshold).nonzero().squeeze(1)
        if rows.numel() > 0:
            out = self._with_outliers(flat, rows)
        elif flat.shape[0] == 1:
            out = torch.ops.quantized.linear_dynamic(flat, self.fbgemm.packed, False)
        else:
            out = self.rows(flat)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(x.shape[:-1] + (self.out_features,))

    def _with_outliers(self, flat: Tensor, rows: Tensor) -> Tensor:
        loud = flat.index_select(0, rows)
        idx = loud.abs().topk(self.outlier_channels, dim=-1).indices
        big = loud.gather(1, idx)
        rest = flat.index_copy(0, rows, loud.scatter(1, idx, torch.zeros_like(big)))
        out = self.rows(rest)
        cols = self.weight_int8.t().index_select(0, idx.reshape(-1)).float()
        cols = cols.view(idx.shape[0], self.outlier_channels, self.out_features) * self.scales
        return out.index_add(0, rows, torch.bmm(big.unsqueeze(1), cols).squeeze(1))


class Int8RescoredHead(nn.Module):
    """The LM head in int8, with each row's top-k logits recomputed in float.

    On a 49k vocabulary the head is the largest matmul of a small LM's decode step (SmolLM2-135M:
    28M of its 134M multiply-adds per token), so it is where int8 pays most; near-tied top logits
    are where int8 errors flip the greedy choice. The int8 logits pick the k candidates, the float
    weight rows (shared with the tied embedding, not copied) score them exactly: greedy decoding is
    exact whenever the float top-1 is among the int8 top-k, and the tail keeps int8 logits.

    A row's logits are the same bitwise alone or in any batch (fbgemm at one row and ``_int_mm`` at more give
    the same integers; the rescoring is a per-row product and sum), so batched greedy decoding equals unbatched.
    Many rows (a teacher-forced batch) go 64 at a time into the output: the int32/float temporaries over the
    vocabulary stay 64 rows' (SmolLM2-135M, 512 rows: 100 MB each otherwise).
    """

    def __init__(self, int8: Int8TokenLinear, float_weight: Tensor, topk: int):
        super().__init__()
        self.int8 = int8
        self.register_buffer("float_weight", float_weight)
        self.topk = int(min(topk, int8.out_features))  # a vocabulary smaller than k: every row rescored
        self.in_features, self.out_features = int8.in_features, int8.out_features

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.in_features).float()
        rows = flat.shape[0]
        if rows <= 64:
            out = self.scored(flat)
        else:
            out = flat.new_empty([rows, self.out_features])
            for start in range(0, rows, 64):
                out[start:start + 64] = self.scored(flat[start:start + 64])
        return out.reshape(x.shape[:-1] + (self.out_features,))

    def scored(self, flat: Tensor) -> Tensor:
        out = self.int8(flat)
        idx = out.topk(self.topk, dim=-1).indices
        rows = self.float_weight.index_select(0, idx.reshape(-1)).view(idx.shape[0], self.topk, self.in_features)
        # a product and a sum per row, not bmm: bmm's kernel depends on the batch (1-ulp differences between a row
        # alone and in a batch); this is the same for a row in any batch, and cheaper at 32 rows (3.4 vs 13 ms)
        exact = (rows * flat.unsqueeze(1)).sum(-1)
        return out.scatter(1, idx, exact)


def _fusable(parts: List[nn.Module]) -> bool:
    return (all(type(p) is Int8TokenLinear for p in parts)
            and len({(p.outlier_threshold, p.outlier_channels, p.in_features, p.rot_block) for p in parts}) == 1)


def fuse_projections(model: nn.Module) -> int:
    """In place: in each attention block q/k/v, and in each MLP gate/up, when all of them are int8 with one outlier
    threshold (they read the same input), become one ``Int8TokenLinear`` (``Int8TokenLinear.concat``): the outputs
    are unchanged, the input is quantized once and one matmul replaces three (two). Returns the groups fused."""
    fused = 0
    for mod in model.modules():
        if getattr(mod, "fused_qkv", True) is False and _fusable([mod.q_proj, mod.k_proj, mod.v_proj]):
            mod.qkv_proj = Int8TokenLinear.concat([mod.q_proj, mod.k_proj, mod.v_proj])
            mod.q_proj, mod.k_proj, mod.v_proj = nn.Identity(), nn.Identity(), nn.Identity()
            mod.fused_qkv = True
            fused += 1
        if getattr(mod, "fused_gate_up", True) is False and _fusable([mod.gate_proj, mod.up_proj]):
            mod.gate_up_proj = Int8TokenLinear.concat([mod.gate_proj, mod.up_proj])
            mod.gate_proj, mod.up_proj = nn.Identity(), nn.Identity()
            mod.fused_gate_up = True
            fused += 1
    return fused
