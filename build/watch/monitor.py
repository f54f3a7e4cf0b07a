"""``policy-bundle watch``: calibration that follows training.

A trainer (TorchForge / torchtitan, or anything that saves ``step-N`` directories) keeps writing
checkpoints; a deployed bundle was calibrated on an older policy. The monitor waits until a checkpoint
``every_steps`` training steps past the last one it checked appears, generates fresh rollouts from it
with the deployed bundle's own build config (same prompts, engine, mesh and recipe), computes the
statistics the shipped recipe calibrates (``build/watch/drift.py``), and compares them with the deployed
bundle's manifest. When any layer drifts by more than ``threshold`` it builds a new bundle from that
checkpoint (``<out_root>/<name>-step-N``), registers it in the BentoML model store as a new version,
and keeps the drift report inside it (``drift_report.json``, summarised in its manifest); the new
bundle becomes the one later checkpoints are compared with. Below the threshold nothing is built.

Checkpoints are HF directories (``config.json`` + safetensors) or, when the deployed bundle was built
from a torchtitan checkpoint (``policy.torchtitan`` in its config), torchtitan DCP step directories
(complete once their ``.metadata`` exists). Every check is appended to ``<out_root>/watch-state.json``,
so a restarted monitor continues where it stopped.

A failed check (a checkpoint that cannot be read, a mesh that died) or a build that failed for a reason that may pass
(anything but a refused config, a policy it cannot build, a failed accuracy gate or a plan that does not fit) is tried
again after ``poll_s`` x 2^(failures - 1), at most an hour, and given up after ``max_retries`` failures (a newer
checkpoint is looked at then). The state keeps the newest ``MAX_CHECKS`` checks; with ``keep``, only that many of the
bundles the monitor built stay, on disk and in the model store (the deployed one always).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import List, Optional, Tuple

from policy_bundle.build.config.build_config import BuildConfig, config_from_dict
from policy_bundle.build.errors import (EXIT_OK, EXIT_REFUSED, BuildError, GateError, ConfigError,
                                        OutputNotReplaceableError, UnsupportedPolicyError)
from policy_bundle.build.source.memory_plan import BuildMemoryError
from policy_bundle.build.gate.families import handler
from policy_bundle.build.progress import Stages, heartbeat, log
from policy_bundle.build.watch.drift import calibration_drift
from policy_bundle.build.watch.watch_state import BUILD_FAILED, CHECK_FAILED, GIVEN_UP, WatchError, WatchState, prune
from policy_bundle.bundle.manifest import manifest_hash, read_manifest, verify_bundle

STEP_DIR = re.compile(r"^step-(\d+)$")
LIMITS = {"every_steps": (1, 10**9), "threshold": (1e-6, 100.0), "poll_s": (1.0, 86_400.0), "max_retries": (1, 1000),
          "keep": (0, 10**6)}
MAX_BACKOFF_S = 3600.0
# A build that fails with one of these fails again from the same checkpoint: not retried
PERMANENT = (ConfigError, UnsupportedPolicyError, GateError, BuildMemoryError, OutputNotReplaceableError)


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass(frozen=True)
class WatchOptions:
    bundle: Path  # the deployed bundle the first checkpoint is compared with
    checkpoints: Path  # the directory holding step-N checkpoints
    out_root: Path  # where new bundles and watch-state.json go
    every_steps: int = 1000
    threshold: float = 0.05
    poll_s: float = 30.0
    once: bool = False  # one pass, then exit (cron, tests)
    sets: Tuple[str, ...] = ()  # config overrides for checks and rebuilds, e.g. calibration.procs=0
    reset: bool = False  # forget out_root's watch-state.json and start from ``bundle``
    max_retries: int = 5  # failed checks (or builds that may pass) of one checkpoint before it is given up
    keep: int = 0  # bundles this monitor built kept on disk and in the store (0: all)

    def validate(self) -> None:
        for name, (lo, hi) in LIMITS.items():
            v = getattr(self, name)
            if not lo <= v <= hi:
                raise WatchError(f"--{name.replace('_', '-')}: {v:g} is out of range [{lo:g}, {hi:g}]")
        if not self.checkpoints.is_dir():
            raise WatchError(f"--checkpoints: {str(self.checkpoints)!r} is not a directory")


def step_of(path: Path, manifest: Optional[dict] = None) -> Optional[int]:
    """The training step a bundle's policy came from (torchtitan provenance or a ``step-N`` directory)."""
    if manifest is not None:
        titan = manifest.get("policy", {}).get("torchtitan")
        if titan and titan.get("step") is not None:
            return int(titan["step"])
        path = Path(manifest.get("config", {}).get("policy", {}).get("source", ""))
    m = STEP_DIR.match(path.name)
    return int(m.group(1)) if m else None


def complete_checkpoints(root: Path, torchtitan: bool) -> List[Tuple[int, Path]]:
    """``(step, dir)`` of every complete checkpoint under ``root``, oldest first."""
    found = []
    for p in root.iterdir():
        m = STEP_DIR.match(p.name)
        if not m or not p.is_dir():
            continue
        if (p / ".metadata").is_file() if torchtitan else hf_complete(p):
            found.append((int(m.group(1)), p))
    return sorted(found)


def hf_complete(p: Path) -> bool:
    """config.json and the weights: every shard a ``model.safetensors.index.json`` lists, else one file."""
    if not (p / "config.json").is_file():
        return False
    index = p / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            return False  # still being written
        return bool(shards) and all((p / f).is_file() for f in shards)
    return any(p.glob("*.safetensors"))


def checkpoint_config(manifest: dict, checkpoint: Path, sets: Tuple[str, ...]) -> BuildConfig:
    """The deployed bundle's build config with ``policy.source`` moved to the checkpoint."""
    return config_from_dict(manifest["config"], (f"policy.source={checkpoint}",) + tuple(sets))


SHIPPED_FIELDS = ("backend", "reduce_range", "smooth_alpha", "outlier_ratio", "rounding", "gptq_damp", "lm_head_topk")


def shipped_recipe(cfg: BuildConfig, manifest: dict):
    """The recipe the deployed bundle shipped, as its manifest records it (auto's winner with the fields
    its candidate entry set, and its fallback layers)."""
    rec = manifest["recipe"]
    fields = {k: rec[k] for k in SHIPPED_FIELDS if rec.get(k) is not None}
    if rec.get("skip") is not None:
        fields["skip"] = tuple(rec["skip"])
    return replace(cfg.recipe_config(rec["scheme"]), fp32_layers=tuple(rec.get("fp32_layers", ())), **fields)


def fresh_statistics(cfg: BuildConfig, manifest: dict) -> dict:
    """The calibration section the shipped recipe would record for the checkpoint in ``cfg``."""
    from policy_bundle.build.calibrate.calibrated import CalibratedModels
    from policy_bundle.build.pipeline import load_stage, optional_mesh, samples_stage

    stages = Stages(3)
    # The compared statistics (ranges, outlier thresholds, channel maxima) do not depend on rounding: no Hessians.
    recipe = replace(shipped_recipe(cfg, manifest), rounding="nearest")
    loaded = load_stage(cfg, stages)
    with optional_mesh(cfg, loaded.policy_dir) as mesh:
        rollouts = samples_stage(cfg, stages, mesh, loaded, golden_set=False)
        with stages.run("calibration statistics of the shipped recipe") as s:
            calibrated = CalibratedModels(cfg, mesh, loaded.policy, rollouts.batches)
            family = handler(recipe)
            family.prepare(calibrated, [recipe])
            summary = family.calibration_summary(calibrated, recipe)
            s.detail = f"{recipe.scheme}, {len(rollouts.seqs)} samples"
    return summary


def shipped_int8_layers(manifest: dict) -> Optional[set]:
    """The linears the deployed bundle runs in int8 (torch.ao recipes: the float fallback layers excluded),
    or None for w8a8 recipes, whose statistics are per input group."""
    rec = manifest["recipe"]
    if "groups" in manifest["calibration"] or rec.get("quantized_linears") is None:
        return None
    return set(rec["quantized_linears"]) - set(rec.get("fp32_layers", ()))


def check(opts: WatchOptions, state: WatchState, step: int, checkpoint: Path) -> dict:
    """``compare_and_rebuild``, supervised: any failure is logged and recorded as a failed check."""
    try:
        return compare_and_rebuild(opts, state, step, checkpoint)
    except Exception as exc:  # noqa: BLE001 - the monitor outlives one bad checkpoint or a mesh timeout
        why = f"{type(exc).__name__}: {exc}".splitlines()[0]
        log(f"[watch] step {step}: check failed ({why}); it is tried again at the next look")
        return {"step": step, "checkpoint": str(checkpoint), "decision": CHECK_FAILED, "error": why,
                "checked_at": utc_now(), "new_bundle": None}


def adopt_existing(out: Path, step: int) -> Optional[Path]:
    """A bundle this monitor already built for ``step`` (a restart after the build, before the state was saved)."""
    try:
        verify_bundle(out)
        return out if read_manifest(out).get("drift", {}).get("step") == step else None
    except Exception:  # noqa: BLE001 - absent, partial or foreign: not ours to adopt
        return None


def compare_and_rebuild(opts: WatchOptions, state: WatchState, step: int, checkpoint: Path) -> dict:
    """Compare one checkpoint with the deployed bundle; build and register a new bundle when it drifted."""
    deployed = state.deployed
    verify_bundle(deployed)  # what we compare with is what was shipped
    manifest = read_manifest(deployed)
    cfg = checkpoint_config(manifest, checkpoint, opts.sets)
    log(f"[watch] step {step}: fresh calibration statistics from {checkpoint} (deployed: {deployed})")
    with heartbeat():  # the build has its own
        fresh = fresh_statistics(cfg, manifest)
    what, drifts = calibration_drift(manifest["calibration"], fresh, bool(manifest["recipe"].get("reduce_range")),
                                     shipped_int8_layers(manifest))
    if not drifts:
        raise WatchError(f"step {step}: no calibrated layer of {deployed} is in the fresh statistics (a different "
                         "model or recipe?); nothing to compare")
    over = [d for d in drifts if d.drift > opts.threshold]
    top = drifts[0]
    report = {"step": step, "checkpoint": str(checkpoint), "previous_bundle": str(deployed),
              "previous_manifest_sha256": manifest_hash(deployed), "previous_step": state.data["deployed_step"],
              "threshold": opts.threshold, "statistic": what, "max_drift": top.drift,
              "layers_compared": len(drifts), "drifted_layers": [d.layer for d in over],
              "layers": [d.as_dict() for d in drifts]}
    for d in (over or drifts)[:10]:
        log(f"[watch]   {d.layer}: drift {d.drift:.2%} " + ", ".join(
            f"{k} {a:.4g} -> {b:.4g}" for k, (a, b) in d.quantities.items()))
    result = {"step": step, "checkpoint": str(checkpoint), "checked_at": utc_now(), "max_drift": report["max_drift"], "max_drift_layer": top.layer,
              "drifted_layers": report["drifted_layers"], "threshold": opts.threshold, "new_bundle": None}
    if not over:
        log(f"[watch] step {step}: no drift (max {report['max_drift']:.2%} at {result['max_drift_layer']}, "
            f"threshold {opts.threshold:.0%} over {len(drifts)} layers): nothing built")
        result["decision"] = "no drift"
        return result
    from policy_bundle.build.pipeline import run_build

    out = opts.out_root / f"{cfg.name}-step-{step}"
    log(f"[watch] step {step}: {len(over)} of {len(drifts)} layers drifted more than {opts.threshold:.0%} "
        f"(max {top.drift:.2%} at {top.layer}): building {out}")
    if adopt_existing(out, step):
        log(f"[watch] step {step}: {out} is already this step's verified rebuild (an earlier run); adopting it")
        result.update(decision="drift, rebuilt", new_bundle=str(out.resolve()))
        return result
    if out.exists():
        raise WatchError(f"step {step}: {out} exists and is not this monitor's rebuild of step {step}; move it away")
    try:
        built = run_build(cfg, out, drift=report)
    except BuildError as exc:
        transient = not isinstance(exc, PERMANENT)
        log(f"[watch] step {step}: the new bundle failed to build: {exc}" + (
            " (it may pass: tried again)" if transient else " (it would fail again: not retried)"))
        result.update(decision=BUILD_FAILED, error=str(exc), transient=transient)
        return result
    result.update(decision="drift, rebuilt", new_bundle=str(built.bundle.resolve()), int8_tag=built.int8_tag,
                  fp16_tag=built.fp16_tag)
    log(f"[watch] step {step}: new bundle {built.bundle}" + (f", registered {built.int8_tag} and {built.fp16_tag}"
                                                             if built.int8_tag else ""))
    return result


def watch(opts: WatchOptions) -> int:
    """Run the monitor; with ``once``, one pass (exit 3 when the check or a triggered build failed)."""
    opts.validate()
    verify_bundle(opts.bundle)
    state = WatchState(opts, step_of)
    torchtitan = read_manifest(state.deployed)["config"]["policy"].get("torchtitan") is not None
    log(f"[watch] deployed {state.deployed} (step {state.data['deployed_step']}); checking {opts.checkpoints} "
        f"every {opts.every_steps} steps, drift threshold {opts.threshold:.0%}")
    while True:
        found = complete_checkpoints(opts.checkpoints, torchtitan)
        due = state.due(found, opts.every_steps)
        if due is not None:
            result = check(opts, state, *due)
            state.record(result, opts.max_retries)
            if result.get("new_bundle") and opts.keep:
                prune(state, opts.keep)
            if opts.once:
                return EXIT_REFUSED if result["decision"].startswith((BUILD_FAILED, CHECK_FAILED)) else EXIT_OK
            if "failures" not in result or GIVEN_UP in result["decision"]:
                continue
            wait = min(MAX_BACKOFF_S, opts.poll_s * 2 ** (result["failures"] - 1))
            log(f"[watch] step {due[0]}: failure {result['failures']} of at most {opts.max_retries}; next try in "
                f"{wait:.0f}s")
            time.sleep(wait)
            continue
        else:
            last = state.data["last_step"]
            log(f"[watch] waiting for a checkpoint at step >= {0 if last is None else last + opts.every_steps} in "
                f"{opts.checkpoints} (newest: {found[-1][1].name if found else 'none'})")
            if opts.once:
                return 0
        time.sleep(opts.poll_s)
