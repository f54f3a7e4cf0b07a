"""A whole build with the real-LM recipe (smooth-w8a8) on the reference policy, over the Monarch mesh."""

import json

import torch

from cli_helpers import SMALL, run_cli


def test_smooth_w8a8_build_over_the_mesh_ships_per_token_int8_and_says_what_onnx_is(tmp_path, bentoml_home):
    out = tmp_path / "w8a8"
    res = run_cli("build", "--config", "build/configs/main.yaml", "--out", str(out), *SMALL,
                  "--set", "recipe.scheme=smooth-w8a8", "--set", "calibration.procs=2")
    assert res.returncode == 0, res.stderr[-3000:]
    m = json.loads((out / "bundle.json").read_text())
    assert m["recipe"]["scheme"] == "smooth-w8a8" and m["recipe"]["rounding"] == "gptq"
    assert m["gate"]["verdict"] == "pass"
    assert "weaker recipe" in m["artifacts"]["int8_onnx_recipe"] and "int8_onnx" in m["fidelity"]
    groups = m["calibration"]["groups"]
    assert "layers.0.input_layernorm" in groups and all(g["rows"] > 0 for g in groups.values())
    assert m["fidelity"]["int8_torchscript"]["reward_candidate"] >= m["fidelity"]["int8_torchscript"]["reward_reference"] - 0.02
    assert "fp16_hf" in m["fidelity"] and "Exported artifacts vs FP32" in (out / "gate_report.md").read_text()
    ts = torch.jit.load(str(out / "int8" / "policy.ts"))
    int8 = [m for m in ts.modules() if m.original_name == "Int8TokenLinear"]
    # one row and several both on fbgemm's packed weight, the only copy of the int8 weight
    assert int8 and all("linear_dynamic" in m.code and "linear_with_input_q_dq_qweight_dq_output_fp32" in m.rows.code
                        for m in int8)


def test_candidates_differing_in_the_head_share_one_layer_stream_and_one_ranking(tmp_path, bentoml_home):
    """The shipped pair (int8 head with a float embedding; float head) plans the decoder layers once and ranks them once:
    the second candidate plans its head alone and reuses the ranking. Both fail a KL-0 gate, so both are searched."""
    res = run_cli("build", "--config", "build/configs/main.yaml", "--out", str(tmp_path / "pair"), *SMALL,
                  "--set", "recipe.scheme=auto", "--set",
                  'recipe.auto_candidates=["smooth-w8a8 skip=[embed_tokens]", smooth-w8a8]',
                  "--set", "gate.max_kl_mean=0", "--set", "gate.max_fp_layers=3", "--set", "calibration.procs=0")
    err = res.stderr
    assert res.returncode == 4 and "accuracy gate failed" in err, err[-3000:]
    assert err.count("[w8a8] plan: ") == 2 and "the decoder layers' plan of an earlier candidate reused" in err
    assert err.count("[w8a8] layers quantized, head:") == 1  # one stream: the second candidate planned its head alone
    assert err.count("[gate] sensitivity: linears done") == 1
    assert "smooth-w8a8: the sensitivity ranking of an earlier candidate with the same int8 linears reused" in err
    report = json.loads((tmp_path / "pair.gate-rejected" / "gate_report.json").read_text())
    assert [c["verdict"] for c in report["candidates"]] == ["fail", "fail"]


def test_auto_rejects_candidates_that_cannot_pass_within_the_fallback_budget(tmp_path, bentoml_home):
    """KL 0 needs every linear in float; with one fewer allowed, the w8a8 candidate is measured with
    nothing and with its whole budget in float, then rejected by name (ranked in the controller, which holds the
    float model, while the mesh calibrates); the torch.ao one walks its ranking to the budget and fails."""
    out = tmp_path / "auto"
    res = run_cli("build", "--config", "build/configs/main.yaml", "--out", str(out), *SMALL,
                  "--set", "recipe.scheme=auto", "--set", 'recipe.auto_candidates=["w8a8 rounding=nearest", static]',
                  "--set", "gate.max_kl_mean=0", "--set", "gate.max_fp_layers=27", "--set", "calibration.procs=2")
    assert res.returncode == 4 and "accuracy gate failed" in res.stderr, res.stderr[-3000:]
    assert "[gate] sensitivity: linears done" in res.stderr and "(28/28," in res.stderr
    assert "[mesh] sensitivity" not in res.stderr  # no actor maps the whole model to rank
    report = json.loads((tmp_path / "auto.gate-rejected" / "gate_report.json").read_text())
    cands = {c["candidate"]: c for c in report["candidates"]}
    assert set(cands) == {"w8a8 rounding=nearest", "static"}
    assert "even with its 27 most sensitive layers in float" in cands["w8a8 rounding=nearest"]["rejected"]
    assert cands["static"]["verdict"] == "fail" and len(cands["static"]["fp32_layers"]) == 27
    assert [len(a["fp32_layers"]) for a in report["attempts"]] == [0, 27]  # the first candidate's measurements
    assert "[auto] candidate 2/2: static (fail, 27 float layers" in res.stderr


def test_auto_gates_no_second_w8a8_candidate_once_one_passes_but_does_while_none_has(tmp_path, bentoml_home):
    """w8a8 candidates run the same kernels: after the first passes, the second is listed as not gated (a torch.ao
    one after it is still gated and timed). The control: with a gate nothing meets, every candidate is gated."""
    entries = '["w8a8 rounding=nearest", "smooth-w8a8 rounding=nearest", static]'
    out = tmp_path / "auto"
    res = run_cli("build", "--config", "build/configs/main.yaml", "--out", str(out), *SMALL,
                  "--set", "recipe.scheme=auto", "--set", f"recipe.auto_candidates={entries}",
                  "--set", "calibration.procs=0")
    assert res.returncode == 0, res.stderr[-3000:]
    cands = {c["candidate"]: c for c in json.loads((out / "bundle.json").read_text())["recipe"]["candidates"]}
    assert cands["w8a8 rounding=nearest"]["verdict"] == "pass" and cands["w8a8 rounding=nearest"]["decode_tok_s"]
    assert cands["smooth-w8a8 rounding=nearest"]["verdict"] == "not gated"
    assert "w8a8 rounding=nearest passed" in cands["smooth-w8a8 rounding=nearest"]["not_gated"]
    assert cands["static"]["verdict"] in ("pass", "fail") and cands["static"]["metrics"]["top1_agreement"] is not None
    assert "[auto] candidate 2/3: smooth-w8a8 rounding=nearest not gated" in res.stderr
    assert "not gated" in (out / "gate_report.md").read_text()

    res = run_cli("build", "--config", "build/configs/main.yaml", "--out", str(tmp_path / "none"), *SMALL,
                  "--set", "recipe.scheme=auto", "--set", f"recipe.auto_candidates={entries}",
                  "--set", "calibration.procs=0", "--set", "gate.max_kl_mean=0", "--set", "gate.max_fp_layers=0")
    assert res.returncode == 4 and "accuracy gate failed" in res.stderr, res.stderr[-3000:]
    report = json.loads((tmp_path / "none.gate-rejected" / "gate_report.json").read_text())
    assert [c["verdict"] for c in report["candidates"]] == ["fail", "fail", "fail"]
