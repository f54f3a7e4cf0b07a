"""Fidelity of what the build ships: the exported artifacts, loaded back the way their consumers load
them, against the FP32 policy on the golden set (with the gate's measurement arguments, ``gate/measure.py``),
and the gate on each: an INT8 artifact that misses it is left out of the bundle with the reason in the
manifest (ONNX here, ``int8-vllm/`` in int8_vllm.py), or fails the build when it is the one every
consumer needs (the TorchScript)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from policy_bundle.build.config.build_config import ONNX_AUTO_OFF, ONNX_NOT_INSTALLED, BuildConfig
from policy_bundle.build.errors import GateError
from policy_bundle.build.gate.measure import fidelity_kwargs, greedy_completion
from policy_bundle.build.progress import log, set_status
from policy_bundle.bundle.layout import INT8_ONNX, INT8_TORCHSCRIPT, BundleLayout
from policy_bundle.quantize.fidelity.scores import (LOGITS_ONLY_NOTE, FidelityReport, GateThresholds, evaluate_gate,
                                                    measure_fidelity, policy_logits_fn)
from policy_bundle.quantize.model.hf_weights import load_policy
from policy_bundle.quantize.model.policy import Policy
from policy_bundle.quantize.fidelity.reference_logits import ReferenceLogits
from policy_bundle.quantize.runtime.script_runner import load_torchscript, release_freed_memory


FP16_GREEDY_NOTE = ("teacher-forced metrics of the directory's float16 weights computed in float32: what its bytes "
                    "lose. vLLM serves it in float16 arithmetic; that side (greedy agreement included) is the served "
                    "golden canary's and `policy-bundle check-fp16 --engine vllm`'s. Torch's float16 matmuls on a CPU "
                    "without native float16 took 125 s of a SmolLM2-135M build's 215 s fidelity stage for the "
                    "teacher-forced pass alone")
FP16_COMPUTED_AS = "float16 weights, float32 compute (torch, CPU)"


GREEDY_REUSED_NOTE = ("greedy completions: the gate's, of the module this file was saved from (its teacher-forced "
                      "logits here matched the gated module's on every token, so its greedy decode is the same)")


def quick_fidelity(cfg: BuildConfig, policy: Policy, tok, golden, bundle: Path,
                   reference_logits: ReferenceLogits, gate_report: Optional[FidelityReport] = None) -> dict:
    """FP32 vs INT8 (the exported TorchScript as loaded back, and the ONNX model) on the golden set, against the FP32
    policy's teacher-forced logits computed once for every artifact (``reference_logits_of``). ``gate_report``: the
    shipped candidate's held-out gate report on the same items (``torchscript_fidelity``)."""
    kw, layout = fidelity_kwargs(cfg, tok), BundleLayout(bundle)
    n = len(golden)
    set_status(f"{INT8_TORCHSCRIPT} as loaded back: {n} golden items teacher-forced, then greedy")
    scripted = load_torchscript(layout.int8_torchscript)
    ref = dict(reference_outputs=[g.completion_ids for g in golden], reference_logits=reference_logits)
    out = {"int8_torchscript": gated(torchscript_fidelity(policy, scripted, golden, reference_logits, kw, gate_report),
                                     cfg.gate.thresholds)}
    del scripted  # one artifact in memory at a time
    release_freed_memory()
    # The FP16 artifact's own distance from FP32 on the same golden set, so a reader can tell whether INT8 is as
    # faithful as the FP16 directory: its float16 weights (widened as they load), computed in float32
    set_status(f"the FP16 directory's float16 weights: {n} golden items teacher-forced")
    fp16 = load_policy(layout.fp16_dir, max_seq_len=cfg.policy.max_seq_len)
    out["fp16_hf"] = {**measure_fidelity(policy, fp16, golden, generate=False, logits_only_note=FP16_GREEDY_NOTE,
                                         **ref, **kw).summary(), "computed_as": FP16_COMPUTED_AS}
    del fp16
    release_freed_memory()
    if cfg.onnx_export():
        set_status(f"{INT8_ONNX} in onnxruntime: {n} golden items teacher-forced")
        out["int8_onnx"] = gated(onnx_fidelity(policy, layout.int8_onnx, golden, kw, ref["reference_logits"]),
                                 cfg.gate.thresholds)
    return out


def torchscript_fidelity(policy: Policy, scripted, golden, reference_logits: ReferenceLogits, kw: dict,
                         gate_report: Optional[FidelityReport] = None) -> FidelityReport:
    """The exported TorchScript as loaded back: teacher-forced metrics, then greedy completions. Where the gate's
    held-out report ``gate_report`` (of the module the file was saved from, on the same items) has the same KL on
    every token, the logits are the gated module's and so are its greedy completions: the gate's greedy metrics are
    taken, not decoded again (SmolLM2-135M, 80 items: about 100 s). Any difference decodes."""
    report = measure_fidelity(policy, scripted, golden, generate=False, reference_logits=reference_logits, **kw)
    same = (gate_report is not None and gate_report.greedy_agreement is not None and report.kl_per_token
            and report.kl_per_token == gate_report.kl_per_token and report.top1_agreement == gate_report.top1_agreement)
    if not same:
        return greedy_completion(golden, kw)(scripted, report)
    report.notes = [n for n in report.notes if n != LOGITS_ONLY_NOTE] + [GREEDY_REUSED_NOTE]
    for f in ("greedy_agreement", "reward_reference", "reward_candidate", "reward_delta", "flips_right_to_wrong",
              "flips_wrong_to_right"):
        setattr(report, f, getattr(gate_report, f))
    report.notes += [n for n in gate_report.notes if n.startswith("no task reward")]
    return report


def reference_logits_of(policy: Policy, golden, dir: Optional[Path] = None) -> ReferenceLogits:
    """The FP32 policy's teacher-forced logits on the golden items (``measure_fidelity``'s ``reference_logits``), in
    a file in ``dir``."""
    set_status(f"the FP32 reference logits: {len(golden)} golden items teacher-forced")
    return ReferenceLogits.compute(policy_logits_fn(policy), golden, dir)


def gated(report: FidelityReport, thresholds: GateThresholds) -> dict:
    verdict = evaluate_gate(report, thresholds)
    return {**report.summary(), "gate": verdict.label, "failures": verdict.failures}


def gate_artifacts(cfg: BuildConfig, fidelity: dict, bundle: Path) -> Optional[str]:
    """With the gate on: the TorchScript as loaded back must pass the gate (else the build fails); an
    ONNX model that misses it is removed from ``bundle``. Returns why ONNX is not shipped (None: it is)."""
    if not cfg.onnx_export():
        if cfg.export.onnx is False:
            return "export.onnx: false"
        return ONNX_AUTO_OFF if not any(type(cfg.recipe_config(c)).onnx_carries_activations
                                        for c in cfg.recipe.candidates()) else ONNX_NOT_INSTALLED
    if not cfg.gate.enabled:
        return None
    ts = fidelity["int8_torchscript"]
    if ts["gate"] != "pass":
        raise GateError(f"{INT8_TORCHSCRIPT} as loaded back fails the accuracy gate ({'; '.join(ts['failures'])})")
    onnx = fidelity["int8_onnx"]
    if onnx["gate"] == "pass":
        return None
    path = BundleLayout(bundle).int8_onnx
    for p in path.parent.glob(path.name + "*"):  # the model and any external data
        p.unlink()
    why = f"failed the accuracy gate in onnxruntime ({'; '.join(onnx['failures'])})"
    log(f"[fidelity] {INT8_ONNX} left out of the bundle: {why}")
    return why


def onnx_fidelity(policy: Policy, path: Path, golden, kw: dict, reference_logits: ReferenceLogits) -> FidelityReport:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    logits = lambda b: torch.from_numpy(sess.run(None, {"input_ids": b.numpy()})[0])  # noqa: E731
    return measure_fidelity(policy, None, golden, candidate_logits=logits, generate=False,
                            logits_only_note="logit metrics only: this variant has no KV-cache decode",
                            reference_logits=reference_logits, **kw)
