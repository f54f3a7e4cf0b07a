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

Two entry points to one packed weight (``quantize/runtime/fbgemm_int8.py``), one result:

- **one row** (a batch-1 decode step): fbgemm's dynamic linear over its pre-packed weight, the cheapest int8
  matmul where fbgemm does not saturate (``loadtest/bench_kernels.py`` compares it with fp32 ``F.linear``);
- **several rows** (prefill, batched decode, the teacher-forced gate): the same quantization computed per row,
  then fbgemm's GEMM over those uint8 codes (``quantized::linear_with_input_q_dq_qweight_dq_output_fp32``, input
  scale 1), the zero-point term added back from the weight's column sums. The integers equal the one-row
  kernel's and so do the floats, bitwise (tested): a row's output does not depend on its batch.

On a CPU whose fbgemm saturates int16 pair sums (AVX2 without VNNI: ``fbgemm_saturates``) one row takes the several-rows
path too, with the codes split by sign so no pair overflows (``rows``): the same integers as on a VNNI CPU.

The packed weight is the only copy of the int8 weight in RAM. fbgemm's GEMM returns each sum times the channel's
scale; where that cannot be divided back exactly (``sums_recoverable``: SmolLM2-135M's ``down_proj``s) the weight is
packed with unit scales and its own applied after the kernel, at one row and at more alike (``unit_scales``); only a
weight whose plain sums could pass 2^24 (none on SmolLM2-135M) keeps an ``[out, in]`` copy for ``torch._int_mm``
(that copy of every weight would be 134 MB on SmolLM2-135M).

Rows whose max |x| exceeds a threshold calibrated per layer (the sink) are split: their ``outlier_channels``
largest channels are multiplied in float against those few weight columns (dequantized from int8: fbgemm over
one-hot rows, k columns, not the whole weight), the rest of the row is quantized as any other row.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor, nn

from policy_bundle.quantize.runtime.fbgemm_int8 import (  # noqa: F401 (quantize_weight, fake_quant_rows: re-exported)
    FbgemmWeight, centred_sum_bound, fake_quant_rows, quantize_rows, quantize_weight, sums_exact_in_float,
    sums_recoverable)
from policy_bundle.quantize.runtime.row_stable import RowStableLinear
from policy_bundle.quantize.w8a8.rotation import (  # noqa: F401 (rotation_block, rotation_matrix: re-exported)
    kron_factors, mm_rows, rotated_weight, rotation_block, rotation_matrix, rotation_signs)

OUTLIER_CHANNELS = 8  # channels of an outlier row computed in float


class Int8TokenLinear(nn.Module):
    """int8 per-channel weights x uint8 per-token activations (fbgemm's arithmetic, row by row).

    ``outlier_threshold`` is an absolute max |x| per row above which the row's largest ``outlier_channels``
    run in float (0 disables it). Scriptable: the exported TorchScript and the teacher-forced scorer run this
    same forward, so the build gate measures what ships.
    """

    def __init__(self, weight_int8: Tensor, scales: Tensor, bias: Optional[Tensor], outlier_threshold: float,
                 outlier_channels: int = OUTLIER_CHANNELS, rot_block: int = 0, share_weight: bool = False):
        super().__init__()
        # rot_block > 0: the input is rotated (``quantize.w8a8.rotation``) before it is quantized, and ``weight_int8``
        # is
        # the rotated weight W @ R; the output is unchanged (R is orthogonal), the quantization error smaller.
        self.rot_block = int(rot_block)
        # The block's Hadamard is applied as two Kronecker factors (``kron_factors``): rot_outer [a, a], rot_inner [b, b].
        outer, inner = kron_factors(self.rot_block) if rot_block else (torch.zeros(0, 0), torch.zeros(0, 0))
        self.register_buffer("rot_outer", outer)
        self.register_buffer("rot_inner", inner)
        self.register_buffer("rot_signs", rotation_signs(int(weight_int8.shape[1]))
                             if rot_block else torch.zeros(0))
        self.rot_a, self.rot_b = int(outer.shape[0]), int(inner.shape[0])
        # The int8 weight lives in fbgemm's packed copy; its scales and per-output-channel sums are kept beside it
        # for the several-rows kernel. A weight whose plain sums could pass 2^24 (``sums_exact_in_float``) keeps a
        # second, [out, in] copy for exact int32 sums on ``torch._int_mm``.
        weight_int8 = weight_int8.contiguous()
        self.register_buffer("scales", scales.float().contiguous())
        self.register_buffer("col_sums", weight_int8.sum(dim=1, dtype=torch.int32))
        # A weight whose scaled sums are not recoverable but whose plain sums are exact floats is packed with unit
        # scales, its own applied after the kernel at one row and at more alike (``unit_scales``): no second copy.
        bound = centred_sum_bound(weight_int8)
        recoverable = sums_recoverable(bound)
        self.unit_scales = not recoverable and sums_exact_in_float(bound)
        self.fbgemm = FbgemmWeight(weight_int8, torch.ones_like(self.scales) if self.unit_scales else self.scales,
                                   keep=not recoverable and not self.unit_scales, share=share_weight)
        self.register_buffer("int_mm_weight", self.fbgemm.kept)  # the same tensor: saved once
        self.bias = nn.Parameter(bias.float(), requires_grad=False) if bias is not None else None
        self.in_features = int(weight_int8.shape[1])
        self.out_features = int(weight_int8.shape[0])
        self.outlier_threshold = float(outlier_threshold)
        self.outlier_channels = int(min(outlier_channels, self.in_features))

    @classmethod
    def from_float(cls, linear: nn.Linear, outlier_threshold: float = 0.0, weight_int8: Optional[Tensor] = None,
                   scales: Optional[Tensor] = None, rot_block: int = 0, share_weight: bool = False) -> "Int8TokenLinear":
        """``weight_int8``/``scales``, when given, are already of the rotated weight (``rot_block`` > 0)."""
        if weight_int8 is None or scales is None:
            weight_int8, scales = quantize_weight(rotated_weight(linear.weight, rot_block))
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        return cls(weight_int8, scales, bias, outlier_threshold, rot_block=rot_block, share_weight=share_weight)

    @classmethod
    def concat(cls, parts: List["Int8TokenLinear"]) -> "Int8TokenLinear":
        """One linear for several that read the same input (q/k/v, gate/up): one activation quantization,
        one matmul; its output is the parts' outputs side by side, equal to theirs."""
        biases = [p.bias for p in parts]
        bias = None if all(b is None for b in biases) else torch.cat(
            [b if b is not None else torch.zeros(p.out_features) for b, p in zip(biases, parts)])
        return cls(torch.cat([p.int8_weight() for p in parts]), torch.cat([p.scales for p in parts]), bias,
                   parts[0].outlier_threshold, parts[0].outlier_channels, parts[0].rot_block)

    def int8_weight(self) -> Tensor:
        """The int8 weight [out, in], unpacked from fbgemm's copy (a new tensor: for building, not for running)."""
        return self.fbgemm.unpacked()[0]

    def dequantized_weight(self) -> Tensor:
        """[out, in] float weight as the int8 kernel sees it, in the input's own basis (rotation undone)."""
        w = self.int8_weight().float() * self.scales.unsqueeze(1)
        return w @ rotation_matrix(self.in_features, self.rot_block).t() if self.rot_block else w

    def rotate(self, flat: Tensor) -> Tensor:
        """``flat @ R`` block by block: each block as X [a, b] becomes ``H_a @ X @ H_b``."""
        x = flat * self.rot_signs
        if self.rot_a > 1:
            x = torch.matmul(self.rot_outer, x.view(-1, self.rot_a, self.rot_b))
        return mm_rows(x.view(-1, self.rot_b), self.rot_inner).view(-1, self.in_features)  # matmul's own folding

    def rows(self, flat: Tensor, lo: Optional[Tensor] = None, hi: Optional[Tensor] = None) -> Tensor:
        """Any number of rows: per-row quantization as fbgemm's, then fbgemm's GEMM over the codes themselves (input
        scale 1 and zero point 128: the codes pass through unchanged). It returns ``fl(acc * scale_j)``: dividing the
        scale out and rounding gives ``acc`` back exactly (``sums_recoverable``; a weight it does not hold for runs
        ``torch._int_mm`` on its kept copy). The zero-point term is added back from the column sums and the float
        result formed as the one-row kernel forms it: the same floats, bitwise (tested). ``lo``/``hi``: the rows' min and
        max, where ``forward`` has them already."""
        q, scale, zp = quantize_rows(flat, lo, hi)
        q = q.sub_(128.0)  # in place here and below: the same elementwise operations, fewer [rows, n] buffers
        if self.int_mm_weight.numel() == 0 and not self.fbgemm.exact_one_row:
            y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(q, 1.0, 128, self.fbgemm.packed)
            # in float, in place: the sums (exact: under 2^22, or 2^24 with unit scales) plus the zero-point term
            # (128 - zp) x col_sums, exact too (|128 - zp| <= 128 and |col_sums| <= sum |w|, so under the weight's
            # ``centred_sum_bound``, which is under 2^24 wherever there is no ``torch._int_mm`` copy), rounded once, as
            # the int32 path below rounds its exact sum to float; without its two [rows, out] conversions (SmolLM2-135M's
            # gate/up at 28 rows: 43 us against 69)
            acc = (y if self.unit_scales else y.div_(self.scales).round_()).addcmul_((128.0 - zp).float(), self.col_sums)
        elif self.int_mm_weight.numel() > 0:
            acc = torch._int_mm(q.to(torch.int8), self.int_mm_weight.t())
            acc = acc.addcmul_(128 - zp.to(torch.int32), self.col_sums).float()  # in place: no [rows, out] product
        else:
            # Where fbgemm adds u8 x s8 products in int16 pairs and saturates (``fbgemm_saturates``: AVX2 without VNNI),
            # the centred codes d = q - 128 go in split: sum(d w) = sum(d+ w) - sum(d- w), d+ = max(d, 0) and
            # d- = max(-d, 0) in [0, 128], whose pairs of products stay within int16 (2 x 128 x 127). Both halves go in
            # one call (one read of the weight); each comes back as sum((code - 128) w), and the 128 sum(w) terms cancel.
            n = q.shape[0]
            codes = torch.cat([q.clamp_min(0.0), q.neg().clamp_min_(0.0)]).sub_(128.0)
            y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(codes, 1.0, 128, self.fbgemm.packed)
            sums = (y if self.unit_scales else y.div_(self.scales).round_()).to(torch.int32)
            acc = (sums[:n] - sums[n:]).addcmul_(128 - zp.to(torch.int32), self.col_sums).float()
        if self.unit_scales:  # as fbgemm's one row with unit scales (its sum times the row's scale), then ours
            return acc.mul_(scale).mul_(self.scales)
        return acc.mul_(scale * self.scales)

    def forward(self, x: Tensor) -> Tensor:
        if self.fbgemm.pending.numel() > 0:  # loaded and not yet packed (``FbgemmWeight.pack_pending``)
            self.fbgemm.pack_pending()
        flat = x.reshape(-1, self.in_features).float()
        if self.rot_block > 0:
            flat = self.rotate(flat)
        if flat.shape[0] == 1:  # a decode step: one reduction and a compare, no index tensor unless loud
            loud = False
            if self.outlier_threshold > 0.0:  # max |x| as max(max, -min): aminmax is 1.4 us here, the inf-norm 6-8
                lo, hi = torch.aminmax(flat)
                loud = float(hi) > self.outlier_threshold or -float(lo) > self.outlier_threshold
            if loud:
                out = self._with_outliers(flat, torch.zeros(1, dtype=torch.long))
            elif self.fbgemm.exact_one_row:
                out = self.rows(flat)
            else:
                out = torch.ops.quantized.linear_dynamic(flat, self.fbgemm.packed, False)
                if self.unit_scales:
                    out = out * self.scales
        else:  # the rows' min and max serve the outlier test (max |x| is max(max, -min)) and the quantization alike
            lo, hi = flat.amin(dim=-1, keepdim=True), flat.amax(dim=-1, keepdim=True)
            loud = torch.empty(0, dtype=torch.bool)
            if self.outlier_threshold > 0.0:
                loud = torch.maximum(hi, lo.neg()).squeeze(1) > self.outlier_threshold
            if bool(loud.any()):
                out = self._with_outliers(flat, loud.nonzero().squeeze(1))
            else:
                out = self.rows(flat, lo, hi)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(x.shape[:-1] + (self.out_features,))

    def _with_outliers(self, flat: Tensor, rows: Tensor) -> Tensor:
        loud = flat.index_select(0, rows)
        idx = loud.abs().topk(self.outlier_channels, dim=-1).indices
        big = loud.gather(1, idx)
        rest = flat.index_copy(0, rows, loud.scatter(1, idx, torch.zeros_like(big)))
        out = self.rows(rest)
        # the int8 weight's columns at those channels, times the scales: fbgemm over one-hot rows (codes 0 and 1)
        onehot = torch.zeros(idx.numel(), self.in_features).scatter_(1, idx.reshape(-1, 1), 1.0)
        cols = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(onehot, 1.0, 0, self.fbgemm.packed)
        if self.unit_scales:  # w itself (exact), times the scale: the same floats as a scaled packing gives
            cols = cols * self.scales
        cols = cols.view(idx.shape[0], self.outlier_channels, self.out_features)  # fl(w * scale_j), as fbgemm's
        return out.index_add_(0, rows, torch.bmm(big.unsqueeze(1), cols).squeeze(1))  # out: rows()'s own tensor


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


def mark_batchable(model: nn.Module) -> int:
    """In place: each attention block whose q/k/v (fused) and output projections, and each MLP whose gate/up (fused)
    and down projections, are ``Int8TokenLinear`` (per-token int8 with exact sums: a row's output the same beside any
    rows) is marked batchable, so ``Policy.step_seqs`` runs them once over a step's decode rows and prompt
    chunks together; an MLP whose gate/up alone is int8 runs that once and its float ``down_proj`` per part
    (``batchable_gate_up``); the rest run per part, as alone. Returns the projections marked."""
    marked = 0
    for mod in model.modules():
        if hasattr(mod, "batchable_qkv"):
            mod.batchable_qkv = bool(mod.fused_qkv) and type(mod.qkv_proj) is Int8TokenLinear
            mod.batchable_o = type(mod.o_proj) is Int8TokenLinear
            marked += int(mod.batchable_qkv) + int(mod.batchable_o)
        elif hasattr(mod, "fused_gate_up"):
            # the float down_proj then reads each part as a view into one [rows, n] tensor: with n a multiple of 16
            # floats every part starts 64-byte aligned, as its own fresh tensor would (MKL's sums may depend on it)
            mod.batchable_gate_up = (bool(mod.fused_gate_up) and type(mod.gate_up_proj) is Int8TokenLinear
                                     and mod.intermediate_size % 16 == 0)
            mod.batchable = mod.batchable_gate_up and type(mod.down_proj) is Int8TokenLinear
            marked += int(mod.batchable_gate_up) + int(mod.batchable)
    return marked


def stabilize_float_linears(model: nn.Module) -> int:
    """In place, in a policy with ``Int8TokenLinear``s: each float ``nn.Linear`` but the LM head becomes a
    ``RowStableLinear`` (the same weight, not a copy), so a row decodes the same alone or in a batch. The head is
    left as it is: nothing after it rounds, a 1-ulp logit difference flips only an exact tie, and a per-row loop
    over its 49152 x 576 weight would cost 32x at batch 32. Returns the linears wrapped."""
    if not any(isinstance(m, Int8TokenLinear) for m in model.modules()):
        return 0
    targets = [(name, mod) for name, mod in model.named_modules()
               if type(mod) is nn.Linear and name != "lm_head" and not name.endswith(".lm_head")]
    for name, mod in targets:
        model.set_submodule(name, RowStableLinear(mod))
    return len(targets)
