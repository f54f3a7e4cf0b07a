"""The build's accuracy gate: exact metrics on known logits, the gate, layer fallback, `policy-bundle gate`."""

import json
import math
import re

import pytest
import torch

from cli_helpers import SMALL, run_cli
from policy_bundle.quantize.fidelity.scores import (FidelityReport, GateThresholds, evaluate_gate, kl_per_token,
                                                    top1_agreement)

FAST = (*SMALL, "--set", "calibration.procs=0", "--set", "register.bentoml=false", "--set", "export.onnx=false")


def test_identical_logits_have_zero_kl_and_full_agreement():
    logits = torch.randn(50, 17, generator=torch.Generator().manual_seed(0))
    assert kl_per_token(logits, logits).abs().max().item() < 1e-12
    assert top1_agreement(logits, logits) == 1.0


def test_known_shift_gives_the_exact_kl():
    ref = torch.tensor([[0.0, 0.0]], dtype=torch.float64)  # p = (1/2, 1/2)
    cand = torch.tensor([[math.log(3.0), 0.0]], dtype=torch.float64)  # q = (3/4, 1/4)
    expected = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)
    assert kl_per_token(ref, cand).item() == pytest.approx(expected, abs=1e-12)
    assert top1_agreement(ref, cand) == 1.0  # argmax ties resolve to index 0 in both


def test_a_constant_logit_offset_changes_nothing():
    ref = torch.randn(10, 5, generator=torch.Generator().manual_seed(1))
    assert kl_per_token(ref, ref + 7.0).abs().max().item() < 1e-12


def test_gate_lists_every_missed_threshold():
    report = FidelityReport(items=10, tokens=30, top1_agreement=0.9, kl_mean=0.2, kl_p99=0.1, greedy_agreement=1.0,
                            reward_reference=1.0, reward_candidate=0.9, reward_delta=-0.1)
    verdict = evaluate_gate(report, GateThresholds())
    assert not verdict.passed
    assert [f.split()[0] for f in verdict.failures] == ["top1_agreement", "kl_mean", "reward_drop"]


def test_reference_policy_passes_default_gate_without_fallback(small_bundle):
    manifest = json.loads((small_bundle / "bundle.json").read_text())
    assert manifest["gate"]["verdict"] == "pass" and manifest["gate"]["fallback_layers"] == []
    report = json.loads((small_bundle / "gate_report.json").read_text())
    assert report["verdict"] == "pass" and report["metrics"]["kl_mean"] < 0.05
    md = (small_bundle / "gate_report.md").read_text()
    assert "![kl_distribution](kl_distribution.png)" in md and (small_bundle / "kl_distribution.png").stat().st_size > 0


def test_broken_layer_fails_the_gate_and_is_named_most_sensitive(tmp_path, reference_dir):
    out = tmp_path / "broken"
    res = run_cli("build", "--config", "build/configs/main.yaml", "--out", str(out), *FAST,
                  "--set", "gate.max_fp_layers=0",
                  env={"POLICY_BUNDLE_TEST_FAULT": "scale:layer=layers.0.mlp.down_proj:factor=50"})
    assert res.returncode == 4 and "accuracy gate failed" in res.stderr and "Traceback" not in res.stderr
    assert "most sensitive layer: layers.0.mlp.down_proj" in res.stderr
    assert not out.exists()
    report = json.loads((tmp_path / "broken.gate-rejected" / "gate_report.json").read_text())
    assert report["verdict"] == "fail" and report["sensitivity"][0]["layer"] == "layers.0.mlp.down_proj"
    assert (tmp_path / "broken.gate-rejected" / "sensitivity.png").stat().st_size > 0


def test_broken_layer_is_fixed_by_fallback(tmp_path, reference_dir):
    out = tmp_path / "fixed"
    res = run_cli("build", "--config", "build/configs/main.yaml", "--out", str(out), *FAST,
                  env={"POLICY_BUNDLE_TEST_FAULT": "scale:layer=layers.0.mlp.down_proj:factor=50"})
    assert res.returncode == 0, res.stderr[-2000:]
    manifest = json.loads((out / "bundle.json").read_text())
    assert manifest["gate"]["fallback_layers"] == ["layers.0.mlp.down_proj"]
    # The shipped TorchScript really runs that layer in floating point, the rest in INT8.
    scripted = dict(torch.jit.load(str(out / "int8/policy.ts")).named_modules())
    assert scripted["layers.0.mlp.down_proj"].original_name == "Linear"
    others = [n for n in manifest_linears(out) if n != "layers.0.mlp.down_proj"]
    assert others and all(scripted[name].original_name == "QuantizedLinearSlot" for name in others)


def test_float_layers_found_on_the_search_prompts_must_hold_on_the_held_out_ones(small_bundle, tmp_path):
    """0.35x the reference bundle's KL (measured on its held-out gate prompts): the search on its own prompts
    finds a few float layers that meet it there (the shipped reference policy's search prompts' KL with none in float
    is 0.48x the held-out one with its float16 KV cache, 0.5x with a bfloat16 one, 0.39x on an AMD EPYC with AVX2
    alone, where 2 float layers meet 0.35x), but the held-out prompts
    judge the build, and on them those layers fall short; the walk keeps one more layer in float at a time
    (each prefix passing the search prompts' teacher-forced metrics first) up to the budget (4 here), falls short there too, and the
    build is refused with the held-out numbers, nothing ships. (Before the gate and the search used disjoint
    prompts this build passed, judged on what it was tuned on.)"""
    shipped = json.loads((small_bundle / "gate_report.json").read_text())["metrics"]
    plain = shipped["kl_mean"]
    assert shipped["greedy_agreement"] is not None  # a passing held-out judgement ran its greedy confirmation
    out = tmp_path / "strict"
    res = run_cli("build", "--config", "build/configs/main.yaml", "--out", str(out), *FAST,
                  "--set", f"gate.max_kl_mean={plain * 0.35}", "--set", "gate.max_fp_layers=4")
    assert res.returncode == 4 and "Traceback" not in res.stderr and not out.exists(), res.stderr[-2000:]
    found = re.search(r"passes on the search prompts but fails on the held-out gate prompts: .* \((\d+) layer\(s\) in "
                      r"float\)$", res.stderr, re.M)
    assert found and 0 < int(found[1]) < 4, res.stderr[-3000:]  # the search's count, below the budget
    n = int(found[1])
    assert f"the held-out gate prompts ask for more than {n} layer(s) in float; trying {n + 1}" in res.stderr
    report = json.loads((tmp_path / "strict.gate-rejected" / "gate_report.json").read_text())
    kept = [r["layer"] for r in report["fp32_layers"]]
    assert len(kept) == 4 and all("sensitivity rank" in r["reason"] for r in report["fp32_layers"])
    assert report["metrics"]["kl_mean"] > plain * 0.35  # the held-out verdict is the one reported
    # it failed teacher-forced, so its greedy generation never ran (the one greedy run is the confirmation)
    assert report["metrics"]["greedy_agreement"] is None
    assert "greedy generation not run: the teacher-forced metrics failed" in report["metrics"]["notes"]
    assert f"walked up from {n}; gate.max_fp_layers=4" in res.stderr


def manifest_linears(bundle):
    return json.loads((bundle / "bundle.json").read_text())["recipe"]["quantized_linears"]


def test_gate_cli_exit_status_follows_the_verdict(small_bundle):
    ok = run_cli("gate", str(small_bundle))  # BUNDLE positional, as every subcommand takes it
    assert ok.returncode == 0 and "verdict: PASS" in ok.stdout and "| kl_mean |" in ok.stdout
    assert "old name" not in ok.stderr
    strict = run_cli("gate", "--bundle", str(small_bundle), "--set", "gate.max_kl_mean=1e-9")
    assert strict.returncode == 4 and "verdict: FAIL (kl_mean" in strict.stdout


def test_the_old_names_canary_command_and_section_still_work_and_say_so_once(small_bundle):
    old = run_cli("canary", str(small_bundle), "--set", "canary.max_kl_mean=1e-9")
    assert old.returncode == 4 and "verdict: FAIL (kl_mean" in old.stdout  # the old key set the gate's threshold
    assert old.stderr.count("`policy-bundle canary` is now `policy-bundle gate`") == 1
    assert old.stderr.count("the config section `canary` is now `gate`") == 1


def crafted_bundle(root, reference_dir, artifact: str):
    """A bundle whose files all match its manifest, but whose ``artifacts.int8_torchscript`` names ``artifact``;
    a loadable TorchScript lies just outside it."""
    from pathlib import Path

    from cli_helpers import ROOT
    from policy_bundle.build.config.build_config import load_config
    from policy_bundle.bundle.manifest import write_manifest

    bundle = root / "bundle"
    (bundle / "int8").mkdir(parents=True)
    module = torch.jit.script(torch.nn.Linear(2, 2))
    torch.jit.save(module, str(bundle / "int8" / "policy.ts"))
    torch.jit.save(module, str(root / "outside.ts"))
    cfg = load_config(Path(ROOT) / "build/configs/main.yaml", ()).to_dict()
    write_manifest(bundle, {"format": "policy-bundle/1", "config": cfg, "policy": {"source": str(reference_dir)},
                            "artifacts": {"int8_torchscript": artifact.format(root=root)}})
    return bundle


@pytest.mark.parametrize("artifact, message", [
    ("../outside.ts", "is not a relative path inside the bundle"),
    ("{root}/outside.ts", "is not a relative path inside the bundle"),
    ("int8/other.ts", "is not listed in the manifest's files"),
])
def test_gate_cli_loads_only_an_artifact_the_manifest_lists_inside_the_bundle(artifact, message, tmp_path,
                                                                                 reference_dir):
    bundle = crafted_bundle(tmp_path, reference_dir, artifact)
    res = run_cli("gate", "--bundle", str(bundle))
    assert res.returncode == 3 and res.stdout == "", res.stdout + res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: artifacts.int8_torchscript:") and message in lines[0], \
        res.stderr[-2000:]


def test_the_held_out_greedy_confirmation_completes_the_teacher_forced_report_as_the_whole_gate(small_bundle,
                                                                                              reference_dir):
    """The build's held-out judgement runs the teacher-forced metrics, then (where they pass) only the greedy part on
    the same report: the same figures as the whole gate in one go, the teacher-forced pass not run twice."""
    from dataclasses import asdict

    from policy_bundle.build.config.build_config import resolve_defaults
    from policy_bundle.build.config.build_config import load_config
    from policy_bundle.build.gate.measure import fidelity_kwargs, gate_measures, greedy_completion
    from policy_bundle.bundle.info import load_tokenizer, read_golden_jsonl
    from policy_bundle.quantize.fidelity.scores import LOGITS_ONLY_NOTE
    from policy_bundle.quantize.model.hf_weights import load_policy
    from policy_bundle.quantize.runtime.script_runner import load_torchscript

    cfg, golden = resolve_defaults(load_config(None)), read_golden_jsonl(small_bundle / "golden.jsonl")[:12]
    kw = fidelity_kwargs(cfg, load_tokenizer(reference_dir))
    whole, logits_only, _ = gate_measures(load_policy(reference_dir), golden, kw)
    int8 = load_torchscript(small_bundle / "int8" / "policy.ts")
    first = logits_only(int8)
    assert first.greedy_agreement is None and LOGITS_ONLY_NOTE in first.notes
    done = greedy_completion(golden, kw)(int8, first)
    assert asdict(done) == asdict(whole(int8)) and LOGITS_ONLY_NOTE not in done.notes
    assert done.greedy_agreement is not None and done.reward_candidate is not None
