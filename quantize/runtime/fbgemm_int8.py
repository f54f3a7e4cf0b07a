"""fbgemm's int8 arithmetic, reproduced: its per-row dynamic quantization and its pre-packed weight.

``quantize/w8a8/linear.py``'s kernels call fbgemm at one row and compute the same quantization themselves at more rows;
these are the pieces both need to agree bitwise.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import FrozenSet, Optional, Tuple

import torch
from torch import Tensor, nn

# TorchScript reads no module constants: the kernels below write fbgemm's two as literals, 255.0 (uint8
# activation levels, no reduce_range) and 6.1e-5 (the smallest activation scale, quant_utils' SMALL_SCALE_THRESHOLD).


def quantize_weight(w: Tensor, qmax: int = 127, dtype: torch.dtype = torch.int8,
                    min_scale: float = 1e-8) -> Tuple[Tensor, Tensor]:
    """Per output channel symmetric int8 of a [out, in] weight: (int8 [out, in], scales [out]); ``qmax``, ``dtype``
    and ``min_scale`` give other widths (``w8a8.head.quantize_rows_int16``)."""
    scales = (w.abs().amax(dim=1) / float(qmax)).clamp_min(min_scale)
    return torch.round(w / scales.unsqueeze(1)).clamp(-qmax, qmax).to(dtype), scales


def row_qparams(flat: Tensor, lo: Optional[Tensor] = None, hi: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Per row of a float [rows, in]: fbgemm's dynamic uint8 (scale float32 [rows, 1], zero point float64 [rows, 1]).
    ``lo``/``hi``: the rows' min and max [rows, 1] where the caller has them already (``Int8TokenLinear.forward``).

    The range always holds 0; the scale is computed in double and used in float; an all-zero row takes
    scale 0.1 and rows whose scale falls under 6.1e-5 are widened, as fbgemm does."""
    # amin and amax, not aminmax: the same values, and aminmax over a dim was 15x slower here (512 x 1536: 900 us vs
    # 59 us; 9 % of a SmolLM2-135M 8 x 64 prefill)
    if lo is None or hi is None:
        mn, mx = flat.amin(dim=-1, keepdim=True), flat.amax(dim=-1, keepdim=True)
    else:
        mn, mx = lo, hi
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


def quantize_rows(flat: Tensor, lo: Optional[Tensor] = None, hi: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """uint8 codes (as float), scale and zero point per row, as fbgemm quantizes them: its AVX2 loop rounds
    ``fma(x, 1 / scale, zero_point)`` once to float, then to the nearest even integer. Here the product is exact in
    double and the sum rounds in double, then to float: the same float unless the exact sum lies within 2^-46 of a
    halfway point between two floats (a constructed row can; none of 4000 rows of real shapes did). ``x / scale +
    zp`` rounds twice in float and gave a different code in about 1 of 3000 rows of 576 (tested on 4000)."""
    scale, zp = row_qparams(flat, lo, hi)
    inv = (1.0 / scale).double()
    # in place after the one double copy: the same elementwise operations (bitwise), two [rows, in] buffers where
    # chaining new tensors made six (SmolLM2-135M, an 8 x 64 prefill: 6.3 MB each at down_proj's input)
    q = flat.double().mul_(inv).add_(zp).float()
    return q.round_().clamp_(0.0, 255.0), scale, zp


def fake_quant_rows(x: Tensor) -> Tensor:
    """What the int8 kernel sees of ``x`` [..., in] (each row quantized then dequantized), in float."""
    flat = x.reshape(-1, x.shape[-1]).float()
    q, scale, zp = quantize_rows(flat)
    return ((q - zp.float()) * scale).reshape(x.shape)


def use_fbgemm() -> None:
    """Make fbgemm (``x86``) the quantized engine where it is another: ``linear_prepack`` packs for the engine in
    force, and only fbgemm's packed weight has the several-rows entry point this kernel calls (a torch.ao recipe
    with ``backend: qnnpack`` earlier in the process, or an ARM host's default, would leave another one)."""
    if torch.backends.quantized.engine in ("x86", "fbgemm"):
        return
    engines = torch.backends.quantized.supported_engines
    if "x86" not in engines and "fbgemm" not in engines:
        raise RuntimeError(f"the w8a8 int8 kernel needs fbgemm (x86); this torch has the engines {engines}")
    torch.backends.quantized.engine = "x86" if "x86" in engines else "fbgemm"


def pack_int8(weight_int8: Tensor, scales: Tensor):
    """fbgemm's pre-packed weight (no bias: both kernels add it after, so their sums are equal). The engine must be
    fbgemm's (``use_fbgemm``: ``FbgemmWeight`` and the TorchScript loader see to it)."""
    qw = torch._make_per_channel_quantized_tensor(weight_int8, scales.double(),
                                                  torch.zeros(weight_int8.shape[0], dtype=torch.long), 0)
    return torch.ops.quantized.linear_prepack(qw, None)


def centred_sum_bound(weight_int8: Tensor) -> int:
    """The largest |int32 sum| fbgemm's GEMM over centred codes (``q - 128``) can reach with this weight: 128 x the
    largest sum of |w| over an output row (in int64 first: |-128| fits). SmolLM2-135M's ``down_proj``: 128 x 57k."""
    return 128 * int(weight_int8.to(torch.int64).abs().sum(dim=1).max())


def sums_recoverable(bound: int) -> bool:
    """Whether a weight of ``centred_sum_bound`` ``bound`` gets its sums back exactly from fbgemm's GEMM with its own
    scales: it gives ``fl(acc * scale_j)``, and ``round(fl(that / scale_j))`` is ``acc`` while |acc| < 2^22. On
    SmolLM2-135M it holds for every projection but ``down_proj`` (in = 1536: 1.7x the bound)."""
    return bound < 2 ** 22


def sums_exact_in_float(bound: int) -> bool:
    """Whether the int32 sums of a weight of ``centred_sum_bound`` ``bound`` are exact as floats (|acc| < 2^24):
    packed with unit scales, fbgemm's GEMM then hands them back as they are, so the weight needs no second copy
    (``Int8TokenLinear.unit_scales``; SmolLM2-135M's ``down_proj``: under half the bound)."""
    return bound < 2 ** 24


def cpu_flags() -> FrozenSet[str]:
    """This CPU's feature flags as Linux lists them (``avx2``, ``avx512_vnni``, ``amx_int8``...); empty where
    ``/proc/cpuinfo`` cannot be read."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return frozenset()
    return next((frozenset(line.split(":", 1)[1].split()) for line in lines if line.startswith("flags")), frozenset())


def fbgemm_saturates() -> bool:
    """Whether this CPU's fbgemm sums uint8 x int8 products in int16 pairs and saturates them (AVX2 without VNNI;
    with VNNI, as on this project's machines, the sums are exact int32): a probe of 16 x 256 weights of 127 against
    codes of 255, whose exact sums (8290560) fit a float. Where it saturates, every weight takes the exact path at
    one row and at more (``FbgemmWeight.exact_one_row``): its kept ``torch._int_mm`` copy, or fbgemm's GEMM over the
    codes split by sign (``Int8TokenLinear.rows``). With only kept weights on the exact path, the rest saturated and
    SmolLM2-135M's policy scored held-out top-1 0.9362 (KL 0.0194, greedy 0.05) under fbgemm's AVX2 kernels where a
    VNNI machine gave 0.9856."""
    packed = pack_int8(torch.full([16, 256], 127, dtype=torch.int8), torch.ones(16))
    y = torch.ops.quantized.linear_dynamic(torch.full([1, 256], 255.0), packed, False)
    return bool((y != 8290560.0).any())


class FbgemmWeight(nn.Module):
    """fbgemm's pre-packed int8 weight (``pack_int8``). Saved as the int8 weight and its scales and packed again where
    it is loaded or copied. ``keep``: the int8 weight itself is kept too (``kept``, for ``torch._int_mm``: see
    ``sums_recoverable``) and saved as that same tensor, so a file holds each weight once; otherwise the packed copy
    is the only one a loaded policy holds, and the weight is unpacked when it is saved. ``exact_one_row``: fbgemm
    saturates on this CPU (``fbgemm_saturates``, checked where the weight is built or loaded), so every row runs on
    the exact path (``Int8TokenLinear.rows``): the sums are the same integers as on a CPU with VNNI, and a row's
    output never depends on its batch.

    Loaded from a file, a weight without ``keep`` is packed at its first use (``pack_pending``), not as it is read:
    ``torch.jit.load`` holds every tensor it read until the whole file is read, so packing as it reads held each int8
    weight twice (SmolLM2-135M: the load peaked at 674 MB for a 497 MB process). ``load_torchscript`` packs them all
    right after the load, one at a time, each read copy freed as its packed one is made.

    ``share``: the int8 weight itself is read elsewhere too (an int8 LM head's rows, which the tied int8 embedding
    gathers and the rescoring reads: ``w8a8.head.Int8Embedding``); it is held as ``shared`` and saved as that tensor, so the
    file and the loaded policy hold it once beside the packed copy. It changes no kernel path (``kept`` does)."""

    def __init__(self, weight_int8: Tensor, scales: Tensor, keep: bool = False, share: bool = False):
        super().__init__()
        self.kept = weight_int8 if keep else torch.zeros(0, 0, dtype=torch.int8)
        self.shared = weight_int8 if share else torch.zeros(0, 0, dtype=torch.int8)
        self._drop_pending()  # ``pending``: a weight read from a file, not packed yet
        use_fbgemm()
        with warnings.catch_warnings():  # quantized tensors are deprecated as a user type; the packing needs one
            warnings.simplefilter("ignore")
            self.packed = pack_int8(weight_int8, scales)
            self.exact_one_row = fbgemm_saturates()

    def unpacked(self) -> Tuple[Tensor, Tensor]:
        """The int8 weight [out, in] and its scales [out] that were packed, exactly (new tensors)."""
        if self.pending.numel() > 0:
            return self.pending.clone(), self.pending_scales.clone()
        w, _ = torch.ops.quantized.linear_unpack(self.packed)
        return w.int_repr(), w.q_per_channel_scales().float()

    def __reduce__(self):  # eager copies and pickles: rebuilt from the saved state (the kept or shared tensor
        w, s, keep, _, share = self.__getstate__()  # itself, so a deep copy shares it with its other holders as the
        return (FbgemmWeight, (w, s, keep, share))  # original does)

    @torch.jit.export
    def __getstate__(self) -> Tuple[Tensor, Tensor, bool, bool, bool]:
        keep = self.kept.numel() > 0
        share = self.shared.numel() > 0
        if keep or share:  # the tensor another holder has: saved once
            return (self.kept if keep else self.shared), self.unpacked()[1], keep, self.training, share
        w, s = self.unpacked()
        return w, s, keep, self.training, share

    @torch.jit.export
    def __setstate__(self, state: Tuple[Tensor, Tensor, bool, bool, bool]) -> None:
        self.kept = state[0] if state[2] else torch.zeros(0, 0, dtype=torch.int8)
        self.shared = state[0] if state[4] else torch.zeros(0, 0, dtype=torch.int8)
        self.training = state[3]
        self.exact_one_row = fbgemm_saturates()
        if state[2] or state[4]:  # the read copy is kept anyway: packed now
            self._drop_pending()
            self.packed = pack_int8(state[0], state[1])
        else:  # packed at the first use; until then a 1 x 1 stand-in that no real input fits (a loud shape error)
            self.pending = state[0]
            self.pending_scales = state[1]
            self.packed = pack_int8(torch.zeros(1, 1, dtype=torch.int8), torch.ones(1))

    @torch.jit.export
    def pack_pending(self) -> None:
        """Pack a weight read from a file (``__setstate__``) and drop the read copy; nothing when it is packed. Read
        into locals first and packed before the slots are cleared: a second caller that finds them half cleared packs
        nothing. Two threads' first calls at once still race on the slots: one call first, then share the module
        (``load_torchscript`` packs everything before it returns)."""
        w = self.pending
        scales = self.pending_scales
        if w.numel() > 0 and w.shape[0] == scales.shape[0]:
            self.packed = pack_int8(w, scales)
            self._drop_pending()

    def _drop_pending(self) -> None:
        self.pending = torch.zeros(0, 0, dtype=torch.int8)
        self.pending_scales = torch.zeros(0)
