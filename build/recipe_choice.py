"""Quantize + gate: every recipe candidate is converted and gated (with layer fallback); the fastest
one that passes ships. A rejected build raises with its report written next to the output directory."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, List, Optional, Sequence

import torch

from policy_bundle.build.artifact_fidelity import fidelity_kwargs
from policy_bundle.build.calibrated import CalibratedModels, plan_key
from policy_bundle.build.canary import CanaryOutcome, gate_with_fallback, write_report
from policy_bundle.build.config import BuildConfig
from policy_bundle.build.errors import CanaryGateError
from policy_bundle.build.progress import log
from policy_bundle.quantize import recipes
from policy_bundle.quantize.decode import decode_tokens_per_s
from policy_bundle.quantize.fidelity import GateVerdict, GoldenItem, measure_fidelity
from policy_bundle.quantize.model import Policy


@dataclass
class Trial:
    recipe: recipes.RecipeConfig
    outcome: CanaryOutcome
    decode_tok_s: Optional[float]

    def summary(self) -> dict:
        o = self.outcome
        return {"scheme": self.recipe.scheme, "verdict": o.verdict.label, "failures": o.verdict.failures,
                "fp32_layers": o.fp32_layers, "decode_tok_s": self.decode_tok_s, "metrics": o.report.summary()}


@dataclass
class ChosenRecipe:
    """The recipe that ships (its fallback layers included), its gate outcome and every candidate's trial."""

    recipe: recipes.RecipeConfig
    outcome: CanaryOutcome
    trials: List[dict]
    plan: Any  # the w8a8 quantization plan, None for torch.ao recipes


def decode_speed(int8, prompt_len: int = 8, new_tokens: int = 16, repeats: int = 3, warmup: int = 3) -> float:
    """Batch-1 decode tokens/s of the candidate as TorchScript (what ships)."""
    return decode_tokens_per_s(torch.jit.script(int8), [1] * prompt_len, new_tokens, repeats, warmup)


def choose_recipe(cfg: BuildConfig, policy: Policy, calibrated: CalibratedModels,
                  candidates: Sequence[recipes.RecipeConfig], tok, golden: List[GoldenItem], tmp: Path,
                  final: Path) -> ChosenRecipe:
    """Gate every candidate; a single candidate (no ``auto``) skips the speed measurement."""
    kw = fidelity_kwargs(cfg, tok)
    ref_outputs = [g.completion_ids for g in golden]  # the FP32 policy's greedy completions
    measure = lambda m: measure_fidelity(policy, m, golden, reference_outputs=ref_outputs, **kw)  # noqa: E731
    logits_only = lambda m: measure_fidelity(policy, m, golden, generate=False, **kw)  # noqa: E731
    trials = []
    for recipe in candidates:
        outcome = gate_candidate(cfg, policy, calibrated, recipe, golden, measure, logits_only)
        speed = decode_speed(outcome.int8) if len(candidates) > 1 else None
        trials.append(Trial(recipe, outcome, speed))
        log(f"[auto] {recipe.scheme}: {outcome.verdict.label}, {len(outcome.fp32_layers)} float layers"
            + (f", decode {speed:.1f} tok/s" if speed else ""))
    summary = [t.summary() for t in trials]
    passing = [t for t in trials if t.outcome.verdict.passed]
    if not passing:
        raise_rejected(cfg, trials[0].outcome, summary, final)
    winner = max(passing, key=lambda t: t.decode_tok_s or 0.0)
    why = (f"{winner.recipe.scheme} is the fastest of {len(passing)} passing candidate(s)"
           if len(candidates) > 1 else "the configured recipe")
    if cfg.canary.enabled:
        write_report(tmp, winner.outcome, cfg.canary.gate, {"candidates": summary, "winner": winner.recipe.scheme,
                                                           "why": why})
    recipe = replace(winner.recipe, fp32_layers=winner.recipe.fp32_layers + tuple(winner.outcome.fp32_layers))
    return ChosenRecipe(recipe, winner.outcome, summary, calibrated.plans.get(plan_key(recipe)))


def gate_candidate(cfg: BuildConfig, policy: Policy, calibrated: CalibratedModels, recipe: recipes.RecipeConfig,
                   golden: List[GoldenItem], measure, measure_logits) -> CanaryOutcome:
    """Convert one candidate and gate it (with layer fallback); with the canary off, only measure it."""
    c = cfg.canary
    if recipe.base_mode == "w8a8":
        return gate_w8a8_candidate(cfg, policy, calibrated, recipe, measure, measure_logits)
    prepared, _ = calibrated.get(recipe.smooth)
    if not c.enabled:
        int8 = recipes.convert(prepared, recipe)
        return CanaryOutcome(GateVerdict(True, []), measure(int8), [], int8)
    return gate_with_fallback(policy, prepared, recipe, golden, c.gate, c.max_fp_layers, measure)


def gate_w8a8_candidate(cfg: BuildConfig, policy: Policy, calibrated: CalibratedModels, recipe, measure,
                        measure_logits) -> CanaryOutcome:
    from policy_bundle.build.canary import gate_w8a8
    from policy_bundle.build.w8a8 import sensitivity_probe

    plan = calibrated.plan(recipe)
    names = recipes.selected_linears(policy, recipe)
    if not cfg.canary.enabled:
        int8 = plan.convert(policy, names)
        return CanaryOutcome(GateVerdict(True, []), measure(int8), [], int8)
    return gate_w8a8(policy, plan, names, sensitivity_probe(calibrated.batches), cfg.canary.gate,
                     cfg.canary.max_fp_layers, measure, measure_logits)


def raise_rejected(cfg: BuildConfig, best: CanaryOutcome, summary: List[dict], final: Path) -> None:
    """Write the rejected build's report next to the output directory and raise with its gist."""
    rejected = final.parent / f"{final.name}.canary-rejected"
    shutil.rmtree(rejected, ignore_errors=True)
    report = write_report(rejected, best, cfg.canary.gate, {"candidates": summary})
    top = best.sensitivity[0][0] if best.sensitivity else "n/a"
    raise CanaryGateError(f"accuracy gate failed ({'; '.join(best.verdict.failures)}) after keeping "
                          f"{len(best.fp32_layers)} layer(s) in float (canary.max_fp_layers="
                          f"{cfg.canary.max_fp_layers}); most sensitive layer: {top}; report: {report}")
