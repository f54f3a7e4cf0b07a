"""Quantize + gate: every recipe candidate is converted and gated in order (with the layer-fallback
search of build/gate/fallback.py, which rejects a candidate early when its fallback budget cannot make it
pass; a family whose candidates share kernels stops at its first pass); the fastest one that passes ships. Progress: a status line (candidate, step, layers done /
total, best so far) for the build's heartbeat, and one line per candidate. A rejected build raises with its report written next to the output directory."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

from policy_bundle.build.calibrate.calibrated import CalibratedModels
from policy_bundle.build.calibrate.prompt_split import GoldenSplit
from policy_bundle.build.config.build_config import BuildConfig
from policy_bundle.build.errors import GateError
from policy_bundle.build.gate.report import GateOutcome, write_report
from policy_bundle.build.gate.families import handler
from policy_bundle.build.gate.measure import decode_batch, fidelity_kwargs, gate_measures, greedy_completion
from policy_bundle.build.progress import log, set_status
from policy_bundle.quantize import recipes
from policy_bundle.quantize.runtime.decode import decode_tokens_per_s
from policy_bundle.quantize.export.exporters import script_int8
from policy_bundle.quantize.fidelity.scores import FidelityReport, GateThresholds, evaluate_gate
from policy_bundle.quantize.model.policy import Policy, set_kv_cache
from policy_bundle.quantize.fidelity.reference_logits import ReferenceLogits
from policy_bundle.quantize.runtime.script_runner import ScriptRunner, release_freed_memory


@dataclass
class Trial:
    name: str  # the auto_candidates entry (or the configured scheme)
    recipe: recipes.RecipeConfig
    outcome: GateOutcome
    decode_tok_s: Optional[float]

    def summary(self) -> dict:
        o = self.outcome
        return {"candidate": self.name, "scheme": self.recipe.scheme, "verdict": o.verdict.label,
                "failures": o.verdict.failures, "rejected": o.rejected, "fp32_layers": o.fp32_layers,
                "decode_tok_s": self.decode_tok_s, "metrics": o.report.summary()}

    def line(self) -> str:
        o = self.outcome
        return (f"{self.name} ({o.verdict.label}, {len(o.fp32_layers)} float layers, top-1 "
                f"{o.report.top1_agreement:.4f}, KL {o.report.kl_mean:.4g}"
                + (f", {self.decode_tok_s:.1f} tok/s)" if self.decode_tok_s else ")"))


@dataclass
class ChosenRecipe:
    """The recipe that ships (its fallback layers included), its gate outcome and every candidate's trial."""

    recipe: recipes.RecipeConfig
    outcome: GateOutcome
    trials: List[dict]
    plan: Any  # the w8a8 quantization plan, None for torch.ao recipes
    golden_split: dict = field(default_factory=dict)  # sizes of the search and held-out gate parts
    # the FP32 teacher-forced logits of the held-out gate items: the exported artifacts are measured against them
    gate_reference: Optional[ReferenceLogits] = None


def decode_speed(int8, prompt_len: int = 8, new_tokens: int = 16, repeats: int = 3, warmup: int = 3) -> float:
    """Batch-1 decode tokens/s of the candidate as TorchScript, run as every reader runs it (``ScriptRunner``)."""
    return decode_tokens_per_s(ScriptRunner(script_int8(int8)), [1] * prompt_len, new_tokens, repeats, warmup)


def best_so_far(trials: Sequence[Trial]) -> str:
    passing = [t for t in trials if t.outcome.verdict.passed]
    if passing:
        return max(passing, key=lambda t: t.decode_tok_s or 0.0).line()
    return "none passed yet" + (f" (closest: {max(trials, key=lambda t: t.outcome.report.top1_agreement).line()})"
                                if trials else "")


def held_out_verdict(outcome: GateOutcome, report: FidelityReport, thresholds: GateThresholds) -> GateOutcome:
    """A candidate the search passed, judged again on the held-out gate prompts: that verdict and those
    metrics are the ones that count (the search's stay in ``search_metrics`` and the attempts)."""
    verdict = evaluate_gate(report, thresholds)
    judged = replace(outcome, verdict=verdict, report=report, search_metrics=outcome.report.summary())
    if not verdict.passed:
        judged.rejected = ("passes on the search prompts but fails on the held-out gate prompts: "
                           + "; ".join(verdict.failures))
        log(f"[gate] {judged.rejected} ({len(outcome.fp32_layers)} layer(s) in float)")
    else:
        log(f"[gate] held-out gate prompts, {len(outcome.fp32_layers)} layer(s) in float: pass, top-1 "
            f"{report.top1_agreement:.4f}, KL mean {report.kl_mean:.4g}")
    return judged


def choose_recipe(cfg: BuildConfig, policy: Policy, calibrated: CalibratedModels,
                  candidates: Sequence[Tuple[str, recipes.RecipeConfig]], tok, golden: GoldenSplit, tmp: Path,
                  final: Path) -> ChosenRecipe:
    """Gate every candidate in order; a single candidate (no ``auto``) skips the speed measurement.
    Only passing candidates are timed (the winner is the fastest of them). Once a candidate passes, later
    ones of its family are not gated where the family's candidates share their kernels (w8a8: they differ
    in calibration only, so the earlier entry is preferred and a second search would cost minutes on a
    real LM for a speed within noise). The float-layer search measures
    on ``golden.search``; a candidate it passes is then judged on ``golden.gate`` alone."""
    kw = fidelity_kwargs(cfg, tok)
    search_whole, search_logits, _ = gate_measures(policy, golden.search, kw, tmp)
    _, judge_logits, gate_reference = gate_measures(policy, golden.gate, kw, tmp)
    judge_greedy = greedy_completion(golden.gate, kw)
    trials: List[Trial] = []
    summary: List[dict] = []  # every candidate in order, gated or not
    auto = len(candidates) > 1
    for i, (name, recipe) in enumerate(candidates):
        def status(step: str, i=i, name=name) -> str:
            return f"candidate {i + 1}/{len(candidates)} {name}: {step}; best so far: {best_so_far(trials)}"

        # every module the gate measures, and the one that ships, allocates the candidate's KV cache (``kv_cache``)
        def measure(int8, kv=recipe.kv_cache, batch=decode_batch(recipe)):
            return search_whole(set_kv_cache(int8, kv), batch)

        def logits_only(int8, kv=recipe.kv_cache):
            return search_logits(set_kv_cache(int8, kv))

        def confirm(searched: GateOutcome, status=status, kv=recipe.kv_cache, batch=decode_batch(recipe)
                    ) -> GateOutcome:
            """Teacher-forced on the held-out prompts, then the one greedy confirmation where those pass, both on the
            candidate scripted as it ships (``script_int8``), decoding in batches where its rows are independent
            (``decode_batch``: 80 SmolLM2-135M items in 46 s, one at a time 124 s; AMD EPYC, AVX2)."""
            floats = len(searched.fp32_layers)
            set_status(status(f"teacher-forced metrics on the held-out prompts ({floats} float layers)"))
            scripted = ScriptRunner(script_int8(set_kv_cache(searched.int8, kv)))
            report = judge_logits(scripted)
            if evaluate_gate(report, cfg.gate.thresholds).passed:
                set_status(status(f"the whole gate on the held-out prompts ({floats} float layers)"))
                report = judge_greedy(scripted, report, batch)
            else:
                report.notes.append("greedy generation not run: the teacher-forced metrics failed")
            return held_out_verdict(searched, report, cfg.gate.thresholds)

        family = handler(recipe)
        settled = next((t for t in trials if t.outcome.verdict.passed and handler(t.recipe) is family), None)
        if settled is not None and family.shares_kernels:
            why = (f"not gated: {settled.name} passed, and the {family.name} family's candidates run the same "
                   f"kernels (the earlier entry is preferred: list the one to prefer first, e.g. an int8 head)")
            summary.append(not_gated(name, recipe, why))
            log(f"[auto] candidate {i + 1}/{len(candidates)}: {name} {why}")
            continue
        set_status(status("preparing"))
        outcome = family.gate(cfg, policy, calibrated, recipe, measure, logits_only, name, status, confirm)
        if outcome.int8 is not None:
            set_kv_cache(outcome.int8, recipe.kv_cache)
        speed = None
        if auto and outcome.verdict.passed:
            set_status(status("decode speed of the passing candidate (TorchScript)"))
            speed = decode_speed(outcome.int8)
        if not outcome.verdict.passed:  # only a passing candidate can ship: a failed one's int8 model goes now
            outcome.int8 = None
            release_freed_memory()
        trials.append(Trial(name, recipe, outcome, speed))
        summary.append(trials[-1].summary())
        log(f"[auto] candidate {i + 1}/{len(candidates)}: {trials[-1].line()}; best so far: {best_so_far(trials)}")
    passing = [t for t in trials if t.outcome.verdict.passed]
    if not passing:
        raise_rejected(cfg, trials[0].outcome, summary, final)
    winner = max(passing, key=lambda t: t.decode_tok_s or 0.0)
    why = (f"{winner.name} is the fastest of {len(passing)} passing candidate(s)"
           if auto else "the configured recipe")
    if cfg.gate.enabled:
        write_report(tmp, winner.outcome, cfg.gate.thresholds, {"candidates": summary, "winner": winner.recipe.scheme,
                                                           "winner_candidate": winner.name, "why": why,
                                                           "golden_split": golden.summary()})
    recipe = replace(winner.recipe, fp32_layers=winner.recipe.fp32_layers + tuple(winner.outcome.fp32_layers))
    return ChosenRecipe(recipe, winner.outcome, summary, handler(recipe).plan(calibrated, recipe), golden.summary(),
                        gate_reference)


def not_gated(name: str, recipe: recipes.RecipeConfig, why: str) -> dict:
    """A candidate's summary row when an earlier one of its family settled it (the report's shape, no metrics)."""
    return {"candidate": name, "scheme": recipe.scheme, "verdict": "not gated", "failures": [], "rejected": None,
            "not_gated": why, "fp32_layers": [], "decode_tok_s": None,
            "metrics": {"top1_agreement": None, "kl_mean": None, "kl_p99": None}}


def raise_rejected(cfg: BuildConfig, best: GateOutcome, summary: List[dict], final: Path) -> None:
    """Write the rejected build's report next to the output directory and raise with its gist."""
    rejected = final.parent / f"{final.name}.gate-rejected"
    shutil.rmtree(rejected, ignore_errors=True)
    report = write_report(rejected, best, cfg.gate.thresholds, {"candidates": summary})
    top = best.sensitivity[0][0] if best.sensitivity else "n/a"
    raise GateError(f"accuracy gate failed ({'; '.join(best.verdict.failures)}) after keeping "
                    f"{len(best.fp32_layers)} layer(s) in float (gate.max_fp_layers="
                    f"{cfg.gate.max_fp_layers}); most sensitive layer: {top}; report: {report}")
