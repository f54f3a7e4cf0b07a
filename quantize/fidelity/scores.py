"""Fidelity metrics between a reference and a candidate policy: one implementation for the build
gate and the live canary.

task reward (and its delta) · top-1 next-token agreement · KL(reference || candidate) mean and p99
per token · flips (right->wrong, wrong->right) · greedy-output agreement. Deterministic: greedy
decoding and teacher forcing only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from policy_bundle.quantize.config.schema import FieldError, config_model, ranged
from policy_bundle.quantize.runtime.decode import DECODE_THREADS, greedy_generate, greedy_generate_batch, threads
from policy_bundle.quantize.model.policy import full_logits
from policy_bundle.quantize.percentile import percentile
from policy_bundle.quantize.fidelity.reference_logits import (TEACHER_FORCED_TOKENS, ReferenceLogits, compare_streamed,
                                                              scored_logits)


@dataclass(frozen=True)
class GoldenItem:
    """One golden-set item: the prompt's ids, the reference completion's ids, and the task answer."""

    prompt: str
    prompt_ids: List[int]
    completion_ids: List[int]
    answer: Optional[str] = None  # None when the policy has no verifiable task


@dataclass
class FidelityReport:
    items: int
    tokens: int
    top1_agreement: float
    kl_mean: float
    kl_p99: float
    greedy_agreement: Optional[float] = None
    reward_reference: Optional[float] = None
    reward_candidate: Optional[float] = None
    reward_delta: Optional[float] = None
    flips_right_to_wrong: Optional[int] = None
    flips_wrong_to_right: Optional[int] = None
    notes: List[str] = field(default_factory=list)
    kl_per_token: List[float] = field(default_factory=list, repr=False)

    def summary(self) -> dict:
        d = asdict(self)
        d.pop("kl_per_token")
        return d


def kl_per_token(ref_logits: Tensor, cand_logits: Tensor) -> Tensor:
    """KL(ref || cand) for each row of [N, V] logits, in nats."""
    ref_lp = F.log_softmax(ref_logits.double(), dim=-1)
    cand_lp = F.log_softmax(cand_logits.double(), dim=-1)
    return (ref_lp.exp() * (ref_lp - cand_lp)).sum(-1).clamp_min(0.0)


def top1_agreement(ref_logits: Tensor, cand_logits: Tensor) -> float:
    return float((ref_logits.argmax(-1) == cand_logits.argmax(-1)).double().mean())


LogitsFn = Callable[[Tensor], Tensor]


def policy_logits_fn(policy) -> LogitsFn:
    """Teacher-forced logits [B, T, V] from anything with the Policy interface (eager or TorchScript)."""
    return lambda batch: full_logits(policy, batch)


@torch.no_grad()
def teacher_forced_logits(logits_fn: LogitsFn, items: Sequence[GoldenItem],
                          max_tokens: int = TEACHER_FORCED_TOKENS) -> List[Tensor]:
    """Per item: logits [n_completion, V] at the positions that predict the reference completion, all in memory
    (``ReferenceLogits`` keeps them in a file; ``compare_streamed`` compares without holding them).

    Items are grouped by length so no batch needs padding (padding would change nothing causally,
    but exact equal-length batches keep the numbers independent of batch composition).
    """
    out: List[Optional[Tensor]] = [None] * len(items)
    for i, rows in scored_logits(logits_fn, items, max_tokens):
        out[i] = rows.clone()
    return [t for t in out if t is not None]


def compare_logits(ref: List[Tensor], cand: List[Tensor]) -> tuple[float, Tensor]:
    r, c = torch.cat(ref), torch.cat(cand)
    return top1_agreement(r, c), kl_per_token(r, c)


Reward = Callable[[str, str], float]
Decode = Callable[[List[int]], str]


GATE_DECODE_BATCH = 16  # sequences per decode step where rows are independent: 80 SmolLM2-135M items in 46 s, 124 alone


def greedy_completions(policy, items: Sequence[GoldenItem], max_new_tokens: int, eos: Optional[int],
                       batch: int = 1) -> List[List[int]]:
    """Each item's greedy completion, decoded as a served engine decodes it by default (``DECODE_THREADS``): the
    gate's greedy agreement is then what the service's golden canary measures on the same items and CPU. ``batch``
    > 1: up to that many items per decode step (``greedy_generate_batch``), only for a module whose rows do not see
    each other (``RecipeConfig.rows_independent``), where each item gets the tokens it gets alone, as served."""
    with threads(DECODE_THREADS):
        if batch > 1:
            return greedy_generate_batch(policy, [it.prompt_ids for it in items], max_new_tokens, eos, batch)
        return [greedy_generate(policy, it.prompt_ids, max_new_tokens, eos) for it in items]


LOGITS_ONLY_NOTE = "logit metrics only: greedy generation not run"


def measure_fidelity(
    reference,
    candidate,
    items: Sequence[GoldenItem],
    *,
    max_new_tokens: int,
    eos_token_id: Optional[int],
    decode: Decode,
    reward: Optional[Reward] = None,
    candidate_logits: Optional[LogitsFn] = None,
    generate: bool = True,
    reference_outputs: Optional[List[List[int]]] = None,
    reference_logits: Optional[ReferenceLogits] = None,
    logits_only_note: str = LOGITS_ONLY_NOTE,
    greedy_batch: int = 1,
) -> FidelityReport:
    """Compare ``candidate`` to ``reference`` on the golden ``items``.

    ``reference``/``candidate`` follow the Policy interface. ``candidate_logits`` overrides how
    the candidate's teacher-forced logits are computed (e.g. onnxruntime); with ``generate=False``
    only the logit metrics are computed (a variant without a KV-cache decode, or a cheap first look), and the
    report notes ``logits_only_note``.
    ``reference_outputs`` are the reference's greedy completions when the caller already has them
    (the golden set's completions are exactly that), so repeated gates do not regenerate them;
    ``reference_logits`` likewise (``ReferenceLogits.compute`` of the reference on ``items``). The candidate's logits
    are compared a batch at a time (``compare_streamed``): memory is one batch, not the golden set's logits.
    ``greedy_batch``: the candidate's greedy decode batch (``greedy_completions``).
    """
    ref_l = reference_logits if reference_logits is not None else ReferenceLogits.compute(policy_logits_fn(reference),
                                                                                          items)
    agree, kl = compare_streamed(ref_l, candidate_logits or policy_logits_fn(candidate), items)
    report = FidelityReport(
        items=len(items), tokens=int(kl.numel()), top1_agreement=agree, kl_mean=float(kl.mean()),
        kl_p99=percentile(kl, 0.99, method="linear", empty=0.0), kl_per_token=[float(v) for v in kl],
    )
    if not generate:
        report.notes.append(logits_only_note)
        return report
    ref_out = reference_outputs or greedy_completions(reference, items, max_new_tokens, eos_token_id)
    cand_out = greedy_completions(candidate, items, max_new_tokens, eos_token_id, greedy_batch)
    return completion_metrics(report, items, ref_out, cand_out, decode, reward)


def completion_metrics(report: FidelityReport, items: Sequence[GoldenItem], ref_out: List[List[int]],
                       cand_out: List[List[int]], decode: Decode, reward: Optional[Reward]) -> FidelityReport:
    """Greedy agreement, task reward per side, its delta and flips, from two sets of completions.

    Shared by the build gate (local generation) and the live canary (completions from the two
    served variants)."""
    report.greedy_agreement = sum(a == b for a, b in zip(ref_out, cand_out)) / max(1, len(items))
    if reward is None or any(it.answer is None for it in items):
        report.notes.append("no task reward: this policy has no verifiable task")
        return report
    r_ref = [reward(it.prompt, decode(o)) for it, o in zip(items, ref_out)]
    r_cand = [reward(it.prompt, decode(o)) for it, o in zip(items, cand_out)]
    report.reward_reference = sum(r_ref) / len(items)
    report.reward_candidate = sum(r_cand) / len(items)
    report.reward_delta = report.reward_candidate - report.reward_reference
    report.flips_right_to_wrong = sum(a > 0.5 >= b for a, b in zip(r_ref, r_cand))
    report.flips_wrong_to_right = sum(b > 0.5 >= a for a, b in zip(r_ref, r_cand))
    return report


# ---- the gate -------------------------------------------------------------------------------


class ThresholdError(FieldError):
    """A gate threshold outside its range (NaN, a bool or a non-number too): the field, the value and the range."""


@config_model("", ThresholdError)
class GateThresholds:
    """Limits a candidate must meet. KL rejects; task reward ranks (and rejects large drops).

    Each range is the one definition the build's config and the router's settings both check: an agreement of 5
    or a KL limit of 1e9 would make every gate fail or pass whatever the candidate."""

    max_reward_drop: float = ranged(0.02, 0.0, 1.0, help=(
        "the most the task reward may drop against float (a task policy's; a general LM has no reward)"))
    min_top1_agreement: float = ranged(0.95, 0.0, 1.0, help=(
        "the least share of held-out positions whose top-1 next token equals float's"))
    max_kl_mean: float = ranged(0.05, 0.0, 100.0, help=(
        "the largest mean KL divergence (nats) of the next-token distribution from float's"))
    max_kl_p99: float = ranged(0.5, 0.0, 100.0, help="the largest 99th-percentile KL divergence (nats) from float's")
    min_greedy_agreement: float = ranged(0.90, 0.0, 1.0, help=(
        "the least share of held-out prompts whose greedy answer equals float's, token for token"))


@dataclass
class GateVerdict:
    passed: bool
    failures: List[str]

    @property
    def label(self) -> str:
        return "pass" if self.passed else "fail"


def evaluate_gate(report: FidelityReport, t: GateThresholds) -> GateVerdict:
    """Every threshold the report misses, as 'metric value vs limit' lines. A metric that is not a number (logits that
    overflowed: a float16 KV cache past its range, say) misses its threshold."""
    fails = []
    if not report.top1_agreement >= t.min_top1_agreement:
        fails.append(f"top1_agreement {report.top1_agreement:.4f} < min {t.min_top1_agreement}")
    if not report.kl_mean <= t.max_kl_mean:
        fails.append(f"kl_mean {report.kl_mean:.5f} > max {t.max_kl_mean}")
    if not report.kl_p99 <= t.max_kl_p99:
        fails.append(f"kl_p99 {report.kl_p99:.5f} > max {t.max_kl_p99}")
    if report.greedy_agreement is not None and not report.greedy_agreement >= t.min_greedy_agreement:
        fails.append(f"greedy_agreement {report.greedy_agreement:.4f} < min {t.min_greedy_agreement}")
    if report.reward_delta is not None and -report.reward_delta > t.max_reward_drop:
        fails.append(f"reward_drop {-report.reward_delta:.4f} > max {t.max_reward_drop}")
    return GateVerdict(not fails, fails)
