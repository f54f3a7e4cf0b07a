"""Outlier-aware recipes: smoothing preserves the function, plain INT8 fails on massive activations,
smoothing / auto pass, weight-only and per-layer overrides land in the shipped TorchScript."""

import json

import pytest
import torch

from cli_helpers import SMALL, run_cli
from policy_bundle.quantize import recipes
from policy_bundle.quantize.model.policy import PolicyConfig, full_logits
from policy_bundle.quantize.model.hf_weights import init_random_policy
from policy_bundle.quantize.calibration.smooth import (apply_smoothing, collect_channel_absmax, make_outlier_model,
                                                       smoothing_scales)

FAST = (*SMALL, "--set", "register.bentoml=false", "--set", "export.onnx=false", "--set", "calibration.procs=0")


@pytest.fixture(scope="module")
def gqa_bias_policy():
    cfg = PolicyConfig(family="qwen2", vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                       intermediate_size=128, max_seq_len=48, attention_bias=True)
    return init_random_policy(cfg, seed=3)


def batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 64, (4, 12), generator=g) for _ in range(3)]


def test_outlier_transform_keeps_logits_and_creates_massive_activations(gqa_bias_policy):
    outliers = make_outlier_model(gqa_bias_policy, channels=2, factor=100.0)
    x = torch.randint(0, 64, (2, 10))
    ref = full_logits(gqa_bias_policy, x)
    assert (full_logits(outliers, x) - ref).abs().max() <= 1e-4 * ref.abs().max()
    plain = max(float(v.max()) for v in collect_channel_absmax(gqa_bias_policy, batches()).values())
    massive = max(float(v.max()) for v in collect_channel_absmax(outliers, batches()).values())
    assert massive > 50 * plain


@pytest.mark.parametrize("alpha", [0.5, 0.65, 0.85])
def test_smoothed_fp32_model_computes_the_same_logits(gqa_bias_policy, alpha):
    model = make_outlier_model(gqa_bias_policy)
    smoothed = apply_smoothing(model, smoothing_scales(model, collect_channel_absmax(model, batches()), alpha))
    x = torch.randint(0, 64, (2, 10))
    ref = full_logits(model, x)
    assert (full_logits(smoothed, x) - ref).abs().max() <= 1e-4 * ref.abs().max()
    worst_before = max(float(v.max()) for v in collect_channel_absmax(model, batches()).values())
    worst_after = max(float(v.max()) for v in collect_channel_absmax(smoothed, batches()).values())
    assert worst_after < worst_before / 10


def test_overrides_pick_each_layers_mode_in_torchscript(gqa_bias_policy, tmp_path):
    recipe = recipes.RecipeConfig(scheme="static", overrides=(("down_proj", "weight-only"), ("o_proj", "fp32"),
                                                              ("gate_proj", "dynamic")))
    prepared = recipes.prepare(gqa_bias_policy, recipe)
    recipes.calibrate(prepared, batches())
    int8 = recipes.convert(prepared, recipe)
    torch.jit.save(torch.jit.script(int8), str(tmp_path / "p.ts"))
    mods = dict(torch.jit.load(str(tmp_path / "p.ts")).named_modules())
    assert mods["layers.0.mlp.down_proj"].original_name == "WeightOnlyInt8Linear"
    assert mods["layers.0.self_attn.o_proj"].original_name == "Linear"
    assert not hasattr(mods["layers.0.self_attn.o_proj"], "_packed_params")  # plain float
    gate = mods["layers.0.mlp.gate_proj"]  # torch.ao.nn.quantized.dynamic.Linear: packed int8, no output scale
    assert gate.original_name == "Linear" and hasattr(gate, "_packed_params")  # int8, not in a static slot
    assert mods["layers.0.self_attn.q_proj"].original_name == "QuantizedLinearSlot"
    x = torch.randint(0, 64, (1, 9))
    assert torch.equal(full_logits(int8, x), full_logits(mods[""], x))


def test_weight_only_linear_matches_float_within_int8_rounding():
    lin = torch.nn.Linear(32, 16)
    wo = recipes.WeightOnlyInt8Linear.from_float(lin)
    x = torch.randn(3, 5, 32)
    step = wo.scales.max().item()
    assert (wo(x) - lin(x)).abs().max() <= step * x.abs().sum(-1).max()


@pytest.fixture(scope="module")
def outlier_dir():
    from policy_bundle.loadtest.bench_models import outlier_reference_dir

    return outlier_reference_dir()


def test_plain_int8_fails_the_gate_on_massive_activations(outlier_dir, tmp_path):
    res = run_cli("build", "--out", str(tmp_path / "plain"), "--config", "build/configs/main.yaml", *FAST,
                  "--set", f"policy.source={outlier_dir}", "--set", "recipe.scheme=static",
                  "--set", "gate.max_fp_layers=0")
    assert res.returncode == 4 and "accuracy gate failed" in res.stderr
    report = json.loads((tmp_path / "plain.gate-rejected" / "gate_report.json").read_text())
    assert report["metrics"]["top1_agreement"] < 0.9


def test_auto_picks_a_passing_recipe_and_ships_it(outlier_dir, tmp_path):
    out = tmp_path / "auto"
    res = run_cli("build", "--out", str(out), "--config", "build/configs/main.yaml", *FAST,
                  "--set", f"policy.source={outlier_dir}", "--set", "recipe.scheme=auto", "--set", "gate.max_fp_layers=2")
    assert res.returncode == 0, res.stderr[-3000:]
    manifest = json.loads((out / "bundle.json").read_text())
    cands = {c["scheme"]: c for c in manifest["recipe"]["candidates"]}
    assert set(cands) == {"static", "smooth-static", "dynamic", "smooth-dynamic", "weight-only"}
    assert cands["smooth-static"]["verdict"] == "pass"
    winner = manifest["recipe"]["scheme"]
    assert cands[winner]["verdict"] == "pass"
    assert cands[winner]["decode_tok_s"] == max(c["decode_tok_s"] for c in cands.values() if c["verdict"] == "pass")
    report = json.loads((out / "gate_report.json").read_text())
    assert report["winner"] == winner and "fastest" in report["why"]
    assert "## Recipe candidates (auto)" in (out / "gate_report.md").read_text()
    # The shipped TorchScript reproduces the eager winner the gate measured.
    shipped = manifest["fidelity"]["int8_torchscript"]
    assert shipped["top1_agreement"] == report["metrics"]["top1_agreement"]
    assert shipped["kl_mean"] == pytest.approx(report["metrics"]["kl_mean"], rel=1e-6, abs=1e-9)
    assert shipped["top1_agreement"] >= 0.98 and shipped["reward_candidate"] >= 0.95
