"""One handler per recipe family (``quantize.recipe_types``' frozen config types): what the build does for its
candidates in each stage. The stages call ``handler(recipe)``; nothing in build/ compares a scheme name with a
family's or reads a family flag (tests/test_floors.py). After the gate, the export notes read what shipped (the
w8a8 plan, present for that family only) rather than the family.

- prepare: SmoothQuant scales from per-channel statistics (torch.ao candidates that smooth);
- calibrate: observer states (torch.ao), computed once for all candidates of the family; the first w8a8
  candidate's plan, one decoder layer at a time (``quantize.w8a8.stream``: a layer's statistics are dropped once it
  is quantized, so a later candidate streams the calibration again, only if it is gated);
- gate: convert with the layer-fallback search (``build/gate/fallback.py``) or, with the gate off, measure;
- calibration_summary: the manifest's calibration section for the recipe that shipped;
- plan: the w8a8 quantization plan that shipped (None for torch.ao).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence, Tuple, Type

from policy_bundle.build.calibrate.calibrated import CalibratedModels, layer_key, plan_key
from policy_bundle.build.config.build_config import BuildConfig
from policy_bundle.build.gate.report import GateOutcome
from policy_bundle.build.gate.fallback import gate_torch_ao, gate_w8a8
from policy_bundle.build.progress import log, set_status
from policy_bundle.quantize import recipes
from policy_bundle.quantize.calibration import observers
from policy_bundle.quantize.front import quantize
from policy_bundle.quantize.recipe_types import TorchAoRecipe, W8A8Recipe, family_of
from policy_bundle.quantize.fidelity.scores import GateVerdict
from policy_bundle.quantize.model.policy import Policy
from policy_bundle.quantize.fidelity.sensitivity import sensitivity_probe

Status = Callable[[str], str]


class TorchAoFamily:
    name = "torch.ao"
    shares_kernels = False  # static, dynamic and weight-only linears run different kernels: each is timed

    def prepare(self, calibrated: CalibratedModels, candidates: Sequence[recipes.RecipeConfig]) -> None:
        smoothing = [c for c in candidates if c.smooth]
        if smoothing:
            calibrated.smoothing_scales(smoothing[0].smooth_alpha)

    def calibrate(self, calibrated: CalibratedModels, candidates: Sequence[recipes.RecipeConfig]) -> None:
        for smooth in sorted({c.smooth for c in candidates}):  # plain first: the mesh actors start plain
            calibrated.get(smooth)

    def gate(self, cfg: BuildConfig, policy: Policy, calibrated: CalibratedModels, recipe: recipes.RecipeConfig,
             measure, measure_logits, name: str, status: Status, confirm=None) -> GateOutcome:
        prepared, _ = calibrated.get(recipe.smooth)
        if not cfg.gate.enabled:
            int8 = quantize(prepared, recipe, prepared)
            return GateOutcome(GateVerdict(True, []), measure(int8), [], int8)
        c = cfg.gate
        return gate_torch_ao(prepared, recipe, sensitivity_probe(calibrated.batches), c.thresholds, c.max_fp_layers,
                             measure, measure_logits, name, status, confirm)

    def calibration_summary(self, calibrated: CalibratedModels, recipe: recipes.RecipeConfig) -> dict:
        return {"observer": "MinMaxObserver (per-tensor affine quint8)",
                "weight_observer": "PerChannelMinMaxObserver (per-channel symmetric qint8)",
                "activation_ranges": observers.activation_ranges(calibrated.get(recipe.smooth)[1])}

    def plan(self, calibrated: CalibratedModels, recipe: recipes.RecipeConfig) -> Any:
        return None


class W8A8Family:
    name = "w8a8"
    shares_kernels = True  # every candidate runs Int8TokenLinear: they differ in calibration (smoothing, rounding)

    def prepare(self, calibrated: CalibratedModels, candidates: Sequence[recipes.RecipeConfig]) -> None:
        """Nothing before calibration: the plan searches its smoothing per input group from the statistics."""

    def calibrate(self, calibrated: CalibratedModels, candidates: Sequence[recipes.RecipeConfig]) -> None:
        # the first candidate's plan, one layer at a time; a later candidate's only if it is gated (it streams the
        # calibration again: no layer's statistics are kept after it is quantized)
        calibrated.plan(candidates[0])

    def gate(self, cfg: BuildConfig, policy: Policy, calibrated: CalibratedModels, recipe: recipes.RecipeConfig,
             measure, measure_logits, name: str, status: Status, confirm=None) -> GateOutcome:
        from policy_bundle.build.calibrate.w8a8_statistics import rank_sensitivity

        set_status(status("quantization plan (smoothing search, weight rounding)"))
        plan = calibrated.plan(recipe)
        names = recipes.selected_linears(policy, recipe)
        if not cfg.gate.enabled:
            int8 = quantize(policy, recipe, plan)
            return GateOutcome(GateVerdict(True, []), measure(int8), [], int8)
        # A rescored int8 head (``lm_head_topk`` > 0) scores its top-k logits against float, int16 or int12 rows (the
        # default; FP32 with only its vocabulary in int12 agreed on 0.9992 of top-1): it is never one of the linears
        # the fallback may keep in float, so it is not ranked (measured on SmolLM2-135M with float rows, the head
        # alone: top-1 1.0000, KL 0.0002 against FP32, and 0.86 ms a decode step against the float head's 10.6 ms).
        # With an int8 embedding (tied) the rescoring reads int8 rows: then the head is ranked, so the fallback can put
        # it and the embedding back in float (its score is of the float-row head: an approximation for the ranking;
        # every verdict converts the real thing).
        ranked = [n for n in names if not (n == "lm_head" and plan.head_topk > 0 and not plan.int8_embedding)]
        # the same int8 modules for every linear ranked: the ranking of an earlier candidate with the same decoder
        # layers (``layer_key``) holds, unless the head is ranked (its module depends on the head's settings)
        key = (layer_key(recipe) if "lm_head" not in ranked else plan_key(recipe), tuple(ranked))

        def rank() -> List[Tuple[str, float]]:
            if key in calibrated.rankings:
                log(f"[gate] {name}: the sensitivity ranking of an earlier candidate with the same int8 linears "
                    "reused")
            else:
                calibrated.rankings[key] = rank_sensitivity(policy, plan, ranked, sensitivity_probe(calibrated.batches),
                                                            status)
            return calibrated.rankings[key]

        return gate_w8a8(policy, recipe, plan, rank, cfg.gate.thresholds, cfg.gate.max_fp_layers, measure,
                         measure_logits, name, status, confirm)

    def calibration_summary(self, calibrated: CalibratedModels, recipe: recipes.RecipeConfig) -> dict:
        from policy_bundle.build.calibrate.w8a8_statistics import stats_summary

        return {"statistics": "per input group: row max |x|, channel max |x|, Hessian (gptq), row sample",
                "groups": stats_summary(calibrated.linear_stats(recipe))}

    def plan(self, calibrated: CalibratedModels, recipe: recipes.RecipeConfig) -> Any:
        return calibrated.plans.get(plan_key(recipe))


HANDLERS: Dict[Type[recipes.RecipeConfig], Any] = {TorchAoRecipe: TorchAoFamily(), W8A8Recipe: W8A8Family()}


def handler(recipe: recipes.RecipeConfig):
    """The build's handler for the recipe's family."""
    return family_of(recipe, HANDLERS)


def by_family(candidates: Sequence[recipes.RecipeConfig]) -> List[Tuple[Any, List[recipes.RecipeConfig]]]:
    """(handler, its candidates) for each family among ``candidates``, in the order families first appear."""
    groups: Dict[Any, List[recipes.RecipeConfig]] = {}
    for c in candidates:
        groups.setdefault(handler(c), []).append(c)
    return list(groups.items())
