"""A whole build with the real-LM recipe (smooth-w8a8) on the reference policy, over the Monarch mesh."""

import json

import torch

from cli_helpers import SMALL, run_cli


def test_smooth_w8a8_build_over_the_mesh_ships_per_token_int8_and_says_what_onnx_is(tmp_path, bentoml_home):
    out = tmp_path / "w8a8"
    res = run_cli("build", "--config", "build/configs/reference.yaml", "--out", str(out), *SMALL,
                  "--set", "recipe.scheme=smooth-w8a8", "--set", "calibration.procs=2")
    assert res.returncode == 0, res.stderr[-3000:]
    m = json.loads((out / "bundle.json").read_text())
    assert m["recipe"]["scheme"] == "smooth-w8a8" and m["recipe"]["rounding"] == "gptq"
    assert m["canary"]["verdict"] == "pass"
    assert "weaker recipe" in m["artifacts"]["int8_onnx_recipe"] and "int8_onnx" in m["fidelity"]
    groups = m["calibration"]["groups"]
    assert "layers.0.input_layernorm" in groups and all(g["rows"] > 0 for g in groups.values())
    assert m["fidelity"]["int8_torchscript"]["reward_candidate"] >= m["fidelity"]["int8_torchscript"]["reward_reference"] - 0.02
    assert "fp16_hf" in m["fidelity"] and "Exported artifacts vs FP32" in (out / "canary_report.md").read_text()
    ts = torch.jit.load(str(out / "int8" / "policy.ts"))
    int8 = [m for m in ts.modules() if m.original_name == "Int8TokenLinear"]
    assert int8 and all("_int_mm" in m.code for m in int8)
