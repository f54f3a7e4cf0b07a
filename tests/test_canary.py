"""Accuracy canary: exact metrics on known logits, the build gate, layer fallback, the canary CLI."""

import json
import math

import pytest
import torch

from cli_helpers import SMALL, run_cli
from policy_bundle.quantize.fidelity import FidelityReport, GateThresholds, evaluate_gate, kl_per_token, top1_agreement

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
    assert manifest["canary"]["verdict"] == "pass" and manifest["canary"]["fallback_layers"] == []
    report = json.loads((small_bundle / "canary_report.json").read_text())
    assert report["verdict"] == "pass" and report["metrics"]["kl_mean"] < 0.05
    md = (small_bundle / "canary_report.md").read_text()
    assert "![kl_distribution](kl_distribution.png)" in md and (small_bundle / "kl_distribution.png").stat().st_size > 0


def test_broken_layer_fails_the_gate_and_is_named_most_sensitive(tmp_path, reference_dir):
    out = tmp_path / "broken"
    res = run_cli("build", "--config", "build/configs/reference.yaml", "--out", str(out), *FAST,
                  "--set", "canary.max_fp_layers=0",
                  env={"POLICY_BUNDLE_TEST_FAULT": "scale:layer=layers.0.mlp.down_proj:factor=50"})
    assert res.returncode == 2 and "accuracy gate failed" in res.stderr and "Traceback" not in res.stderr
    assert "most sensitive layer: layers.0.mlp.down_proj" in res.stderr
    assert not out.exists()
    report = json.loads((tmp_path / "broken.canary-rejected" / "canary_report.json").read_text())
    assert report["verdict"] == "fail" and report["sensitivity"][0]["layer"] == "layers.0.mlp.down_proj"
    assert (tmp_path / "broken.canary-rejected" / "sensitivity.png").stat().st_size > 0


def test_broken_layer_is_fixed_by_fallback(tmp_path, reference_dir):
    out = tmp_path / "fixed"
    res = run_cli("build", "--config", "build/configs/reference.yaml", "--out", str(out), *FAST,
                  env={"POLICY_BUNDLE_TEST_FAULT": "scale:layer=layers.0.mlp.down_proj:factor=50"})
    assert res.returncode == 0, res.stderr[-2000:]
    manifest = json.loads((out / "bundle.json").read_text())
    assert manifest["canary"]["fallback_layers"] == ["layers.0.mlp.down_proj"]


def test_strict_threshold_passes_with_a_few_layers_kept_in_float(small_bundle, tmp_path):
    plain = json.loads((small_bundle / "canary_report.json").read_text())["metrics"]["kl_mean"]
    out = tmp_path / "strict"
    res = run_cli("build", "--config", "build/configs/reference.yaml", "--out", str(out), *FAST,
                  "--set", f"canary.max_kl_mean={plain * 0.5}")
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.loads((out / "canary_report.json").read_text())
    kept = [r["layer"] for r in report["fp32_layers"]]
    assert 1 <= len(kept) <= 8 and report["metrics"]["kl_mean"] <= plain * 0.5
    assert all("sensitivity rank" in r["reason"] for r in report["fp32_layers"])
    # The shipped TorchScript really runs those layers in floating point, the rest in INT8.
    scripted = dict(torch.jit.load(str(out / "int8/policy.ts")).named_modules())
    assert all(scripted[name].original_name == "Linear" for name in kept)
    others = [n for n in manifest_linears(small_bundle) if n not in kept]
    assert all(scripted[name].original_name == "QuantizedLinearSlot" for name in others)


def manifest_linears(bundle):
    return json.loads((bundle / "bundle.json").read_text())["recipe"]["quantized_linears"]


def test_canary_cli_exit_status_follows_the_verdict(small_bundle):
    ok = run_cli("canary", "--bundle", str(small_bundle))
    assert ok.returncode == 0 and "verdict: PASS" in ok.stdout and "| kl_mean |" in ok.stdout
    strict = run_cli("canary", "--bundle", str(small_bundle), "--set", "canary.max_kl_mean=1e-9")
    assert strict.returncode == 1 and "verdict: FAIL (kl_mean" in strict.stdout
