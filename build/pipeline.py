"""The build: FP32 policy -> calibrated INT8 (TorchScript + ONNX) + FP16 HF dir, manifest, model store.

The stages of docs/architecture.md, one function each, and each stage's code lives in one sub-package:
load (source/), rollouts, prepare and calibrate (calibrate/), convert + accuracy gate (gate/), export,
fidelity, manifest and register (artifacts/); the build config is config/. Everything is written into a
partial directory next to the output, renamed into place at the very end (artifacts/output_dir.py), then
registered in the model store: a failed or interrupted build leaves nothing where the next step would look.
"""

from __future__ import annotations

import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator, List, Optional, Tuple

import torch
from torch import Tensor

from policy_bundle.build.artifacts.artifact_fidelity import gate_artifacts, quick_fidelity, reference_logits_of
from policy_bundle.build.artifacts.int8_vllm import (Int8Vllm, check_int8_vllm, export_int8_vllm, planned,
                                                     start_int8_vllm_check)
from policy_bundle.build.artifacts.manifest_body import calibration_section, manifest_body, write_drift_report
from policy_bundle.build.artifacts.output_dir import (check_output, move_into_place, new_partial_dir,
                                                      remove_stale_work_dirs)
from policy_bundle.build.calibrate.calibrated import CalibratedModels
from policy_bundle.build.calibrate.prompt_split import (GoldenSplit, golden_items, search_share, split_golden,
                                                        split_prompts)
from policy_bundle.build.calibrate.samples import (calibration_batches, local_samples, read_samples_jsonl,
                                                    screen_odd_samples, vllm_samples)
from policy_bundle.build.config.build_config import BuildConfig, resolve_defaults
from policy_bundle.build import build_faults
from policy_bundle.build.errors import RegistrationError
from policy_bundle.build.gate.report import add_artifact_comparison
from policy_bundle.build.gate.families import by_family, handler
from policy_bundle.build.gate.recipe_choice import ChosenRecipe, choose_recipe
from policy_bundle.build.source.memory_plan import check_memory, plan_memory
from policy_bundle.build.progress import Stages, Throttled, bar, heartbeat, log
from policy_bundle.build.source.policy_source import resolve_policy_dir
from policy_bundle.bundle.info import encode_prompt, load_tokenizer, write_golden_jsonl
from policy_bundle.bundle.layout import INT8_VLLM_DIR, BundleLayout
from policy_bundle.bundle.manifest import manifest_hash, read_manifest, write_manifest
from policy_bundle.bundle.signing import sign_bundle, signing_key_from_env
from policy_bundle.quantize import recipes
from policy_bundle.quantize.export.exporters import (copy_tokenizer_files, export_fp16_hf, export_onnx_int8,
                                                     export_torchscript)
from policy_bundle.quantize.fidelity.scores import GoldenItem
from policy_bundle.quantize.model.hf_weights import load_hf_config, load_policy
from policy_bundle.quantize.model.policy import Policy
from policy_bundle.quantize.runtime.script_runner import release_freed_memory


@dataclass
class BuildResult:
    bundle: Path
    manifest_sha256: str
    int8_tag: Optional[str]
    fp16_tag: Optional[str]
    fidelity: dict


@dataclass
class Loaded:
    policy_dir: Path
    policy: Policy
    tok: Any


@dataclass
class CalibrationSamples:
    seqs: List[List[int]]  # calibration sequences (prompt + completion ids)
    golden: GoldenSplit  # search part and held-out gate part
    batches: List[Tensor]  # the calibration batches cut from ``seqs``
    odd: dict  # odd samples found (and maybe dropped) before calibration


def run_build(cfg: BuildConfig, out: Path, force: bool = False, drift: Optional[dict] = None) -> BuildResult:
    """Build the bundle at ``out``. ``drift``: the drift monitor's report that triggered this build, kept in the bundle
    (``drift_report.json``) and summarised in the manifest. The bundle is registered in the model store only once it
    is in place at ``out``. Unset config fields take this policy's defaults first."""
    out, cfg = Path(out), resolve_defaults(cfg)
    check_output(out, force)
    signing_key_from_env()  # a bad POLICY_BUNDLE_SIGNING_KEY fails now, not after the build
    torch.manual_seed(cfg.seed)
    int8_vllm = planned(cfg)  # export.int8_vllm: true without vLLM fails here, before any work
    cfg.require_extras()  # so does a setting whose extra is not installed
    build_faults.spec()  # announced (and recorded in the manifest) when a test fault is set
    stages = Stages(9)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_work_dirs(out.parent, log=log)
    tmp = new_partial_dir(out)
    try:
        int8_vllm.prestart()
        with heartbeat():
            result = _build_into(cfg, tmp, out, stages, int8_vllm, drift)
            move_into_place(tmp, out, force)
            result.bundle = out
            result.int8_tag, result.fp16_tag = register_stage(cfg, stages, out, result.manifest_sha256)
        log(f"bundle ready at {out} in {stages.elapsed():.1f}s (manifest sha256 {result.manifest_sha256[:16]})")
        return result
    finally:
        int8_vllm.close()
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def optional_mesh(cfg: BuildConfig, policy_dir: Path) -> Iterator[Any]:
    """The Monarch calibration mesh when ``calibration.procs`` > 0, else None (in-process)."""
    if cfg.calibration.procs == 0:
        yield None
        return
    from policy_bundle.build.calibrate.mesh import calibration_mesh

    with calibration_mesh(cfg, policy_dir) as mesh:
        yield mesh


def _build_into(cfg: BuildConfig, tmp: Path, final: Path, stages: Stages, int8_vllm: Int8Vllm,
                drift: Optional[dict]) -> BuildResult:
    loaded = load_stage(cfg, stages)
    cfg = replace(cfg, policy=replace(cfg.policy, max_seq_len=loaded.policy.max_seq_len))  # as resolved
    candidates = [(name, cfg.recipe_config(name)) for name in cfg.recipe.candidates()]
    with optional_mesh(cfg, loaded.policy_dir) as mesh:
        rollouts = samples_stage(cfg, stages, mesh, loaded)
        calibrated = CalibratedModels(cfg, mesh, loaded.policy, rollouts.batches)
        prepare_stage(cfg, stages, calibrated, [r for _, r in candidates])
        calibrate_stage(cfg, stages, calibrated, [r for _, r in candidates], rollouts)
        # The actors stop here: from now on their processes would only hold memory. A later candidate that needs a
        # calibration of its own runs it in this process (bitwise what the mesh computes, tests/test_mesh.py).
        calibrated.mesh = None
    chosen = quantize_and_gate_stage(cfg, stages, loaded, calibrated, candidates, rollouts.golden, tmp, final)
    export_stage(cfg, stages, loaded, chosen, calibrated, rollouts, tmp, int8_vllm)
    fidelity, onnx_skipped = fidelity_stage(cfg, stages, loaded, rollouts.golden.gate, tmp, int8_vllm,
                                            chosen.gate_reference, chosen.outcome.report)
    summary = handler(chosen.recipe).calibration_summary(calibrated, chosen.recipe)
    calibration = calibration_section(cfg, rollouts.seqs, rollouts.batches, {**summary, "odd_samples": rollouts.odd})
    body = manifest_body(cfg, loaded.policy_dir, loaded.policy, chosen, calibration, fidelity, int8_vllm, onnx_skipped)
    if drift is not None:
        body["drift"] = write_drift_report(tmp, drift)
    sha = manifest_stage(stages, body, tmp)
    return BuildResult(final, sha, None, None, fidelity)


def load_stage(cfg: BuildConfig, stages: Stages) -> Loaded:
    with stages.run("load policy") as s:
        policy_dir = resolve_policy_dir(cfg, log=log)
        memory = plan_memory(cfg, policy_dir, cfg.calibration.samples * (cfg.prompts.max_new_tokens + 64),
                             cfg.calibration.procs)
        log(f"[build] {memory.line()}")
        check_memory(memory)
        policy = load_policy(policy_dir, max_seq_len=cfg.policy.max_seq_len or cfg.policy.max_seq_len_cap)
        tok = load_tokenizer(policy_dir)
        s.detail = f"{policy_dir}, {sum(p.numel() for p in policy.parameters()) / 1e6:.2f}M params"
    return Loaded(policy_dir, policy, tok)


def samples_stage(cfg: BuildConfig, stages: Stages, mesh, loaded: Loaded, golden_set: bool = True) -> CalibrationSamples:
    """Calibration sequences (generated or read) and the golden set's FP32 completions (``golden_set=False``: none)."""
    tok = loaded.tok
    with stages.run("samples") as s:
        prompts = split_prompts(cfg)
        cal_ids = [encode_prompt(tok, p) for p in prompts.calibration]
        gold_ids = [encode_prompt(tok, p) for p in prompts.golden]
        t0 = time.monotonic()
        gold_out: Optional[List[List[int]]] = None
        if cfg.samples.jsonl:
            seqs = read_samples_jsonl(Path(cfg.samples.jsonl), tok)[: cfg.calibration.samples]
            source = f"jsonl {cfg.samples.jsonl}"
        else:
            # the golden set's FP32 completions are the local engine's greedy ones: on the mesh in the same call
            # when the calibration rollouts use that engine there (the actors' greedy equals this process's)
            golden_too = golden_set and mesh is not None and cfg.samples.engine == "local"
            completions = make_samples(cfg, mesh, loaded.policy_dir, loaded.policy, tok,
                                        cal_ids + (gold_ids if golden_too else []))
            if golden_too:
                completions, gold_out = completions[:len(cal_ids)], completions[len(cal_ids):]
            seqs = [p + c for p, c in zip(cal_ids, completions)]
            source = f"{cfg.samples.engine} generate" + (f" on {len(mesh.workers)} mesh actors" if mesh else "")
        if golden_set and gold_out is None:
            gold_out = logged_local_samples(loaded.policy, gold_ids, cfg.prompts.max_new_tokens, tok.eos_token_id,
                                             "golden samples")
        golden = split_golden(golden_items(prompts, gold_ids, gold_out) if golden_set else [], search_share(cfg))
        rate = (len(seqs) + len(gold_out or [])) / max(1e-9, time.monotonic() - t0)
        seqs, odd = screen_odd_samples(cfg, loaded.policy, seqs, tok, log=log)
        batches = calibration_batches(seqs, cfg.calibration.batch_size, cfg.policy.max_seq_len)
        s.detail = (f"{len(seqs)} calibration sequences from {source}, golden items: {len(golden.search)} to search "
                    f"float layers on, {len(golden.gate)} held out for the gate, {rate:.1f} seq/s"
                    + (f", {len(odd['samples'])} odd sample(s)" + (" dropped" if odd["dropped"] else " kept")
                       if odd["samples"] else ""))
    return CalibrationSamples(seqs, golden, batches, odd)


def make_samples(cfg: BuildConfig, mesh, policy_dir: Path, policy: Policy, tok, prompt_ids: List[List[int]]) -> List[List[int]]:
    """Completions for calibration prompts: on the Monarch mesh, or in-process (vLLM or local generate)."""
    max_new = cfg.prompts.max_new_tokens
    if mesh is not None:
        from policy_bundle.build.calibrate.mesh import mesh_samples

        return mesh_samples(mesh, prompt_ids, tok.eos_token_id)
    if cfg.samples.engine == "vllm":
        return vllm_samples(policy_dir, prompt_ids, max_new, tok.eos_token_id)
    return logged_local_samples(policy, prompt_ids, max_new, tok.eos_token_id, "samples")


def logged_local_samples(policy, prompt_ids, max_new: int, eos, what: str) -> List[List[int]]:
    """Local greedy rollouts with a bar on a terminal and a progress line at least every 20 s."""
    b, every = bar(len(prompt_ids), what, "seq"), Throttled()

    done = [0]  # counted here: a bar off a terminal (disabled) counts nothing

    def tick() -> None:
        b.update(1)
        done[0] += 1
        every(done[0], len(prompt_ids), f"[{what}] sequences done")

    outs = local_samples(policy, prompt_ids, max_new, eos, tick=tick)
    b.close()
    return outs


def prepare_stage(cfg: BuildConfig, stages: Stages, calibrated: CalibratedModels,
                  candidates: List[recipes.RecipeConfig]) -> None:
    """What each recipe family needs before calibration (SmoothQuant scales, for torch.ao candidates that smooth)."""
    recipe = cfg.recipe_config()
    with stages.run("prepare") as s:
        for family, members in by_family(candidates):
            family.prepare(calibrated, members)
        s.detail = (f"candidates {cfg.recipe.candidates()}, "
                    f"{len(recipes.selected_linears(calibrated.policy, recipe))} linears observed"
                    + (", smoothing scales from per-channel stats" if calibrated.scales else ""))


def calibrate_stage(cfg: BuildConfig, stages: Stages, calibrated: CalibratedModels,
                    candidates: List[recipes.RecipeConfig], rollouts: CalibrationSamples) -> None:
    """Each family's calibration (observer states, linear statistics), computed once for its candidates."""
    batches = rollouts.batches
    with stages.run("calibrate") as s:
        t0 = time.monotonic()
        for family, members in by_family(candidates):
            family.calibrate(calibrated, members)
        tokens = sum(b.numel() for b in batches)
        s.detail = (f"{len(rollouts.seqs)} samples, {len(batches)} batches, {tokens} tokens, "
                    f"procs={cfg.calibration.procs}, {tokens / max(1e-9, time.monotonic() - t0):.0f} tok/s")


def quantize_and_gate_stage(cfg: BuildConfig, stages: Stages, loaded: Loaded, calibrated: CalibratedModels,
                            candidates: List[Tuple[str, recipes.RecipeConfig]], golden: GoldenSplit, tmp: Path,
                            final: Path) -> ChosenRecipe:
    with stages.run("convert + accuracy gate") as s:
        chosen = choose_recipe(cfg, loaded.policy, calibrated, candidates, loaded.tok, golden, tmp, final)
        s.detail = (f"{chosen.recipe.scheme}: {chosen.outcome.verdict.label}, "
                    f"{len(chosen.outcome.fp32_layers)} layers kept in float")
    return chosen


def export_stage(cfg: BuildConfig, stages: Stages, loaded: Loaded, chosen: ChosenRecipe, calibrated: CalibratedModels,
                 rollouts: CalibrationSamples, tmp: Path, int8_vllm: Int8Vllm) -> None:
    """int8-vllm/ first, handed to the vLLM process the build started (``Int8Vllm.prestart``), which runs while the
    rest is exported and read back (the reference build: 57 s -> 40 s, fresh clone, 2 cores)."""
    policy, policy_dir, recipe, out = loaded.policy, loaded.policy_dir, chosen.recipe, BundleLayout(tmp)
    with stages.run("export INT8 (TorchScript, ONNX, W8A8 for vLLM) + FP16 HF") as s:
        if not int8_vllm.skipped:
            int8_vllm.recipe = export_int8_vllm(policy, policy_dir, chosen, calibrated, out.int8_vllm_dir)
            start_int8_vllm_check(cfg, policy, rollouts.golden.gate, tmp, int8_vllm)
        export_torchscript(chosen.outcome.int8, out.int8_torchscript)
        chosen.outcome.int8 = None  # from here the artifact is the file: the gated module's memory goes
        release_freed_memory()
        shutil.copy(policy_dir / "config.json", out.int8_dir / "config.json")
        copy_tokenizer_files(policy_dir, out.int8_dir)
        if cfg.onnx_export():
            build_faults.broken_onnx(export_onnx_int8(policy, out.int8_dir, rollouts.batches,
                                              keep_float=list(recipe.skip + recipe.fp32_layers)))
        export_fp16_hf(policy, load_hf_config(policy_dir), policy_dir, out.fp16_dir)
        s.detail = ", ".join(f"{p.relative_to(tmp)} {p.stat().st_size / 1e6:.1f} MB"
                             for p in sorted(tmp.glob("*/*")) if p.suffix in (".ts", ".onnx", ".safetensors"))


def fidelity_stage(cfg: BuildConfig, stages: Stages, loaded: Loaded, golden: List[GoldenItem], tmp: Path,
                   int8_vllm: Int8Vllm, ref=None, gate_report=None) -> Tuple[dict, Optional[str]]:
    """Every exported artifact measured and gated against FP32's teacher-forced logits of ``golden``: ``ref``, the
    gate's of the same held-out items, else computed here once for every artifact; ``gate_report``, the shipped
    candidate's held-out report (its greedy metrics stand for the file's when the file's logits match it). Returns the
    fidelity and why ONNX is left out (or None)."""
    with stages.run("fidelity of the exported artifacts") as s:
        ref = ref if ref is not None else reference_logits_of(loaded.policy, golden, tmp)
        fidelity = quick_fidelity(cfg, loaded.policy, loaded.tok, golden, tmp, ref, gate_report)
        onnx_skipped = gate_artifacts(cfg, fidelity, tmp)
        if not int8_vllm.skipped:
            check_int8_vllm(cfg, loaded.policy, loaded.tok, golden, tmp, int8_vllm, ref)
        if int8_vllm.fidelity:
            fidelity["int8_vllm"] = int8_vllm.fidelity
        write_golden_jsonl(golden, BundleLayout(tmp).golden)
        add_artifact_comparison(tmp, fidelity)
        ts, f16 = fidelity["int8_torchscript"], fidelity["fp16_hf"]
        s.detail = (f"INT8 top-1 agreement {ts['top1_agreement']:.3f}, KL mean {ts['kl_mean']:.4f}; FP16 weights "
                    f"top-1 {f16['top1_agreement']:.3f}, KL mean {f16['kl_mean']:.2g}") + (
            f", reward {ts['reward_reference']:.3f} -> {ts['reward_candidate']:.3f}"
            if ts.get("reward_candidate") is not None else ""
        ) + (f"; {INT8_VLLM_DIR}: skipped ({int8_vllm.skipped})" if int8_vllm.skipped else
             f"; {INT8_VLLM_DIR} in vLLM: greedy {int8_vllm.fidelity['greedy_agreement']:.3f}, "
             f"KL mean {int8_vllm.fidelity['kl_mean']:.4f}") + (
            f"; ONNX left out ({onnx_skipped})" if onnx_skipped and cfg.onnx_export() else "")
    return fidelity, onnx_skipped


def manifest_stage(stages: Stages, body: dict, tmp: Path) -> str:
    """The manifest, signed with the key ``POLICY_BUNDLE_SIGNING_KEY`` names when it is set (``bundle/signing.py``)."""
    with stages.run("manifest") as s:
        sha = write_manifest(tmp, body)
        s.detail = f"{len(read_manifest(tmp)['files'])} files, sha256 {sha[:16]}"
        key = signing_key_from_env()
        if key is not None:
            s.detail += f", signed by key {sign_bundle(tmp, key)}"
    return sha


def register_stage(cfg: BuildConfig, stages: Stages, bundle: Path, sha: str) -> Tuple[Optional[str], Optional[str]]:
    """Both artifacts of the bundle in place at ``bundle`` in the BentoML model store under one version (the
    tags), unless register.bentoml is off. A failure leaves the bundle whole and says so."""
    with stages.run("register in BentoML model store") as s:
        if not cfg.register.bentoml:
            s.detail = "skipped (register.bentoml: false)"
            return None, None
        from policy_bundle.build.artifacts.register import register_bundle

        try:
            reg = register_bundle(bundle, version=f"{cfg.name}-{sha[:12]}", manifest_sha=manifest_hash(bundle))
        except Exception as exc:  # noqa: BLE001 - any store failure: the bundle itself is done
            raise RegistrationError(f"register.bentoml: the bundle at {bundle} is complete, but registering it in "
                                    f"the BentoML model store failed ({type(exc).__name__}: {exc})") from exc
        s.detail = f"{reg.int8_tag}, {reg.fp16_tag}"
    return reg.int8_tag, reg.fp16_tag
