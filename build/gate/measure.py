"""How the build measures fidelity: the keyword arguments every measurement shares (the gate, the exported
artifacts' checks, ``policy-bundle gate``) and the gate's measurements of a model on a golden set."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, List, Optional, Tuple

from policy_bundle.build.config.build_config import BuildConfig
from policy_bundle.build.config.build_config import is_task_policy
from policy_bundle.quantize.reference import task
from policy_bundle.quantize.fidelity.scores import (GATE_DECODE_BATCH, LOGITS_ONLY_NOTE, FidelityReport, GoldenItem,
                                                    completion_metrics, greedy_completions, measure_fidelity,
                                                    policy_logits_fn)
from policy_bundle.quantize.fidelity.reference_logits import ReferenceLogits
from policy_bundle.quantize.model.policy import Policy
from policy_bundle.quantize.runtime.text import ids_to_text


def fidelity_kwargs(cfg: BuildConfig, tok) -> dict:
    """Completion length, EOS, the ids-to-text decode and the task reward (None without a task)."""
    reward = task.reward if is_task_policy(cfg) else None
    decode = lambda ids: ids_to_text(tok, ids)  # noqa: E731 - the text the service returns
    return dict(max_new_tokens=cfg.prompts.max_new_tokens, eos_token_id=tok.eos_token_id, decode=decode, reward=reward)


def gate_measures(policy: Policy, golden: List[GoldenItem], kw: dict, dir: Optional[Path] = None
                  ) -> Tuple[Callable, Callable, ReferenceLogits]:
    """The gate's two measurements of a model on ``golden``: the whole gate (teacher-forced metrics, greedy
    generation in decode batches of ``batch``: ``decode_batch``, reward) and the teacher-forced metrics alone; and the
    FP32 reference logits they share, computed once (kept in a file in ``dir``, ``ReferenceLogits``: the exported
    artifacts are measured against them too)."""
    ref_outputs = [g.completion_ids for g in golden]  # the FP32 policy's greedy completions
    ref_logits = ReferenceLogits.compute(policy_logits_fn(policy), golden, dir)  # once for every gate attempt
    whole = lambda m, batch=1: measure_fidelity(policy, m, golden, reference_outputs=ref_outputs,  # noqa: E731
                                                reference_logits=ref_logits, greedy_batch=batch, **kw)
    logits_only = lambda m: measure_fidelity(policy, m, golden, generate=False,  # noqa: E731
                                             reference_logits=ref_logits, **kw)
    return whole, logits_only, ref_logits


def greedy_completion(golden: List[GoldenItem], kw: dict) -> Callable[[object, FidelityReport], FidelityReport]:
    """``(model, report)`` -> the whole gate's report from the teacher-forced one ``report`` the model already has on
    ``golden``: its greedy completions and their metrics added, the teacher-forced pass not run again."""
    ref_outputs = [g.completion_ids for g in golden]

    def complete(model, report: FidelityReport, batch: int = 1) -> FidelityReport:
        report.notes = [n for n in report.notes if n != LOGITS_ONLY_NOTE]
        out = greedy_completions(model, golden, kw["max_new_tokens"], kw["eos_token_id"], batch)
        return completion_metrics(report, golden, ref_outputs, out, kw["decode"], kw.get("reward"))

    return complete


def decode_batch(recipe) -> int:
    """The greedy decode batch for a model of ``recipe``: ``GATE_DECODE_BATCH`` where its rows are independent (each
    sequence's tokens then are those it gets alone, and served), else one sequence at a time."""
    return GATE_DECODE_BATCH if recipe.rows_independent else 1
