"""Quantization recipes: which linears become INT8 and how (eager ``torch.ao.quantization``).

One entry point per phase, torchao-style: ``prepare(policy, recipe)`` inserts observers,
``calibrate`` feeds data (``quantize/calibration/observers.py`` moves the results between processes), and
``convert(prepared, recipe)`` returns the INT8 module.

- ``static``: W8A8 post-training static quantization. Per-channel symmetric int8 weights,
  per-tensor affine uint8 activations from MinMax observers (their merge is exact, so a sharded
  calibration gives bit-identical parameters). The Llama block has no Conv/BN/ReLU chain, so there
  is no module fusion to do; every selected linear is wrapped as quant -> linear -> dequant.
- ``dynamic``: int8 per-channel weights, activations quantized per batch at run time.

Layer filters pick the linears: by default embeddings and ``lm_head`` stay in floating point.
"""

from __future__ import annotations

import copy
import fnmatch
from typing import Dict, Iterable, List, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.ao.quantization import (DeQuantStub, MinMaxObserver, PerChannelMinMaxObserver, QConfig, QuantStub,
                                   per_channel_dynamic_qconfig)

from policy_bundle.quantize.model.blocks import widen_narrow
from policy_bundle.quantize.config.schema import FieldError, choice, config_model, ranged, setting
from policy_bundle.quantize.model.policy import KV_CACHES, full_logits

SCHEMES = ("static", "dynamic", "weight-only", "smooth-static", "smooth-dynamic", "w8a8", "smooth-w8a8")
MODES = ("static", "dynamic", "weight-only", "w8a8", "fp32")  # per-layer overrides
ROUNDINGS = ("nearest", "gptq")
VOCAB_ROWS = ("float32", "int16", "int12")
BACKENDS = ("x86", "fbgemm", "qnnpack")


class RecipeError(FieldError):
    """A recipe field holds a value outside what the recipe supports."""


@config_model("recipe", RecipeError)
class RecipeConfig:
    """Which linears become INT8 and how: one recipe of the quantize library."""

    scheme: str = choice("static", SCHEMES, help=(
        "static: per-tensor int8 activations from calibration (torch.ao); dynamic: activations quantized per batch "
        "at run time; weight-only: int8 weights, float activations; w8a8: per-token int8 activations and int8 "
        "weights (the recipes that pass on pretrained LMs); smooth-*: the same after SmoothQuant smoothing"))
    backend: str = choice("x86", BACKENDS, help="torch.ao's quantized engine for the torch.ao schemes")
    reduce_range: bool = setting(True, help=(
        "7-bit activations, which avoid int16 overflow in the x86/fbgemm kernels (qnnpack does not need it)"))
    skip: Tuple[str, ...] = setting(("embed_tokens", "lm_head"), help=(
        "module name patterns kept in float (w8a8 without embed_tokens here: an int8 embedding, the tied head's "
        "rows)"))
    fp32_layers: Tuple[str, ...] = setting(default_factory=tuple, help=(
        "linears kept in float by the accuracy fallback (the build fills it; a config may name some itself)"))
    smooth_alpha: float = ranged(0.65, 0.0, 1.0, help="SmoothQuant migration strength of the smooth-* torch.ao schemes")
    overrides: Tuple[Tuple[str, str], ...] = setting((), help=(
        "(layer pattern, mode) pairs, e.g. (down_proj, weight-only); a mode is static, dynamic, weight-only, w8a8 "
        "or fp32"))
    outlier_ratio: float = ranged(8.0, 0.0, 10_000.0, help=(
        "w8a8: a linear's input rows (tokens) whose max |x| exceeds this many times the median row's are outlier "
        "rows, run in float; 0: none"))
    smooth_alphas: Tuple[float, ...] = ranged((0.3, 0.4, 0.5, 0.6, 0.7, 0.8), 0.0, 1.0, help=(
        "smooth-w8a8: the migration strengths searched for each group of linears that share an input"))
    rounding: str = choice("gptq", ROUNDINGS, help=(
        "w8a8 weight rounding: gptq (error-feedback rounding on the calibration Hessians) or nearest"))
    gptq_damp: float = ranged(0.01, 0.0, 1.0, low_open=True, help=(
        "GPTQ dampening added to the Hessian's diagonal, a fraction of its mean"))
    lm_head_topk: int = ranged(64, 0, 4096, help=(
        "an int8 lm_head rescores each row's top-k logits in float; 0: no rescoring"))
    rotation_block: int = ranged(512, 0, 4096, help=(
        "w8a8: Hadamard rotation blocks up to this size (0 or a power of two); 0: no rotation"))
    vocab_rows: str = choice("int12", VOCAB_ROWS, help=(
        "w8a8 with an int8 head: the vocabulary rows kept beside it for its top-k rescoring (and the tied "
        "embedding's): int12 (the head's int8 rows and a 4-bit residual each), int16 (a scale per row) or float32"))
    kv_cache: str = choice("float16", KV_CACHES, help=(
        "the served INT8 policy's KV cache: float16 or bfloat16 (half float32's bytes a token; float16 keeps three "
        "more mantissa bits, bfloat16 float32's range) or float32; the gate measures the candidate with it"))

    def __post_init__(self) -> None:
        for pattern, mode in self.overrides:
            if mode not in MODES:
                raise RecipeError(f"recipe.overrides.{pattern}", f"{mode!r} is not one of {list(MODES)}")
        if self.rotation_block & (self.rotation_block - 1):
            raise RecipeError("recipe.rotation_block", f"{self.rotation_block} is not 0 or a power of two up to 4096")
        if not self.smooth_alphas:
            raise RecipeError("recipe.smooth_alphas", "expected at least one value")
        if self.base_mode == "w8a8":
            for pattern, mode in self.overrides:
                if mode not in ("w8a8", "fp32"):
                    raise RecipeError(f"recipe.overrides.{pattern}", f"{mode!r} cannot be mixed with scheme "
                                      f"{self.scheme!r} (use 'w8a8' or 'fp32')")
        elif any(mode == "w8a8" for _, mode in self.overrides):
            raise RecipeError("recipe.overrides",
                              f"mode 'w8a8' needs scheme 'w8a8' or 'smooth-w8a8', not {self.scheme!r}")
        if self.backend not in torch.backends.quantized.supported_engines:
            raise RecipeError("recipe.backend", f"{self.backend!r} is not supported by this torch build "
                              f"(available: {torch.backends.quantized.supported_engines})")

    @property
    def smooth(self) -> bool:
        return self.scheme.startswith("smooth-")

    @property
    def base_mode(self) -> str:
        return self.scheme.removeprefix("smooth-")

    # The family (torch.ao or per-token w8a8) is the recipe's config type: ``quantize.recipe_types``.

    @property
    def rows_independent(self) -> bool:
        """Each sequence's logits do not depend on the others in its batch: false when a layer quantizes its
        activations dynamically with one scale over the whole input (torch.ao ``dynamic``), so a batched
        decode would change a request's tokens with its neighbours."""
        return self.base_mode != "dynamic" and all(mode != "dynamic" for _, mode in self.overrides)

    def layer_mode(self, name: str) -> str:
        """The mode of one layer: the first matching override, else the scheme's."""
        for pattern, mode in self.overrides:
            if _matches(name, (pattern,)):
                return mode
        return self.base_mode


class WeightOnlyInt8Linear(nn.Module):
    """int8 per-channel weights, float activations (``torch._weight_int8pack_mm``); scriptable."""

    def __init__(self, weight_int8: Tensor, scales: Tensor, bias: Optional[Tensor]):
        super().__init__()
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("scales", scales)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.out_features = int(weight_int8.shape[0])

    @classmethod
    def from_float(cls, linear: nn.Linear) -> "WeightOnlyInt8Linear":
        w = linear.weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-8)
        q = torch.round(w / scales.unsqueeze(1)).clamp(-127, 127).to(torch.int8)
        return cls(q, scales, linear.bias.detach().clone() if linear.bias is not None else None)

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1]).float()
        out = torch._weight_int8pack_mm(flat, self.weight_int8, self.scales)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(x.shape[:-1] + (self.out_features,))


class QuantizedLinearSlot(nn.Module):
    """quant -> linear -> dequant: the eager-mode boundary that lets one linear run in INT8."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.quant = QuantStub()
        self.linear = linear
        self.dequant = DeQuantStub()

    def forward(self, x: Tensor) -> Tensor:
        return self.dequant(self.linear(self.quant(x)))


def _matches(name: str, patterns: Iterable[str]) -> bool:
    parts = name.split(".")
    return any(fnmatch.fnmatch(name, p) or p in parts for p in patterns)


def kept_float(name: str, recipe: RecipeConfig) -> bool:
    """Whether ``recipe.skip`` or ``recipe.fp32_layers`` names ``name`` (a pattern or a dotted part of it)."""
    return _matches(name, recipe.skip + recipe.fp32_layers)


def selected_linears(policy: nn.Module, recipe: RecipeConfig) -> List[str]:
    """Names of the linears the recipe quantizes (filters applied), in model order. A prepared
    model's calibration slots count under the name of the linear they wrap."""
    names = []
    for name, mod in policy.named_modules():
        if isinstance(mod, QuantizedLinearSlot) or (isinstance(mod, nn.Linear) and not name.endswith(".linear")):
            if not _matches(name, recipe.skip + recipe.fp32_layers) and recipe.layer_mode(name) != "fp32":
                names.append(name)
    return names


def static_qconfig(recipe: RecipeConfig) -> QConfig:
    act = MinMaxObserver.with_args(dtype=torch.quint8, qscheme=torch.per_tensor_affine, reduce_range=recipe.reduce_range)
    weight = PerChannelMinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
    return QConfig(activation=act, weight=weight)


def _set_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, new)


def prepare(policy: nn.Module, recipe: RecipeConfig) -> nn.Module:
    """A copy of ``policy`` with activation observers around every selected linear (static scheme).

    The dynamic scheme also calibrates with these observers: it does not need them to convert, but
    the build reports activation ranges for every recipe.
    """
    torch.backends.quantized.engine = recipe.backend
    model = widen_narrow(copy.deepcopy(policy)).eval()  # torch.ao reads float32 weights outside the blocks' calls
    model.qconfig = None
    qconfig = static_qconfig(recipe)
    for name in selected_linears(model, recipe):
        slot = QuantizedLinearSlot(model.get_submodule(name))
        slot.qconfig = qconfig
        _set_submodule(model, name, slot)
    torch.ao.quantization.prepare(model, inplace=True)
    return model


@torch.no_grad()
def calibrate(prepared: nn.Module, batches: Iterable[Tensor]) -> int:
    """Run teacher-forced forwards so the observers see every batch; returns tokens seen."""
    seen = 0
    for batch in batches:
        full_logits(prepared, batch)
        seen += batch.numel()
    return seen


def _unwrap_slot(model: nn.Module, name: str, slot: QuantizedLinearSlot) -> None:
    """Put the plain float linear back where a calibration slot was."""
    lin = slot.linear
    for attr in ("activation_post_process", "qconfig"):
        if hasattr(lin, attr):
            delattr(lin, attr)
    lin._forward_hooks.clear()
    _set_submodule(model, name, lin)


def convert(prepared: nn.Module, recipe: RecipeConfig) -> nn.Module:
    """The INT8 module: each selected layer in its mode (static: observers become scales/zero
    points; dynamic: int8 weights, activations quantized at run time; weight-only: int8 weights,
    float activations). Layers in ``recipe.fp32_layers`` stay in floating point even when
    ``prepared`` observed them, so the accuracy fallback re-converts without calibrating again.
    """
    torch.backends.quantized.engine = recipe.backend
    model = copy.deepcopy(prepared)
    modes = {name: recipe.layer_mode(name) for name in selected_linears(model, recipe)}
    for name, mod in list(model.named_modules()):
        if isinstance(mod, QuantizedLinearSlot) and modes.get(name) != "static":
            _unwrap_slot(model, name, mod)
    if "static" in modes.values():
        model = torch.ao.quantization.convert(model, inplace=False)
    dynamic = {n: per_channel_dynamic_qconfig for n, m in modes.items() if m == "dynamic"}
    if dynamic:
        model = torch.ao.quantization.quantize_dynamic(model, dynamic, dtype=torch.qint8)
    for name, mode in modes.items():
        if mode == "weight-only":
            _set_submodule(model, name, WeightOnlyInt8Linear.from_float(model.get_submodule(name)))
    return model.eval()


def quantized_parameters(int8: nn.Module) -> Dict[str, Dict[str, Tensor]]:
    """Every static-quantized linear's int8 weight, weight scales/zero points and output
    scale/zero point, and every Quantize step's scale/zero point. Works on the eager INT8 module
    and on a loaded TorchScript file alike (both hold the same packed params)."""
    out: Dict[str, Dict[str, Tensor]] = {}
    for name, mod in int8.named_modules():
        packed = getattr(getattr(mod, "_packed_params", None), "_packed_params", None)
        if packed is not None:
            w, _ = torch.ops.quantized.linear_unpack(packed)
            out[name] = {"int_weight": w.int_repr(), "weight_scales": w.q_per_channel_scales(),
                         "weight_zero_points": w.q_per_channel_zero_points()}
            if hasattr(mod, "zero_point"):  # static linears requantize their output
                out[name]["out_scale"] = torch.tensor(float(mod.scale))
                out[name]["out_zero_point"] = torch.tensor(int(mod.zero_point))
        elif name.endswith(".quant") and hasattr(mod, "scale"):
            out[name] = {"scale": torch.as_tensor(mod.scale).clone(), "zero_point": torch.as_tensor(mod.zero_point).clone()}
    return out
