"""The gate judges every artifact the bundle ships, on prompts the float-layer search never saw: an INT8
artifact that misses it is left out with the reason in the manifest, and the golden set is the size asked
for or refused with one line."""

from __future__ import annotations

import json
import re

import pytest

from cli_helpers import SMALL, run_cli

FAST = (*SMALL, "--set", "calibration.procs=0")


@pytest.fixture(scope="module")
def faulty_onnx(tmp_path_factory, bentoml_home):
    """A reference build (64 golden items) whose exported ONNX model has wrong weights."""
    out = tmp_path_factory.mktemp("gate") / "b"
    res = run_cli("build", "--config", "build/configs/main.yaml", "--out", str(out), *FAST,
                  env={"POLICY_BUNDLE_TEST_FAULT": "artifact:name=onnx"})
    assert res.returncode == 0, res.stderr[-3000:]
    return res, out, json.loads((out / "bundle.json").read_text())


def test_an_onnx_model_that_fails_the_gate_is_left_out_and_the_bundle_still_verifies(faulty_onnx):
    res, out, m = faulty_onnx
    assert not (out / "int8" / "policy-int8.onnx").exists() and "int8/policy-int8.onnx" not in m["files"]
    assert m["artifacts"]["int8_onnx"] is None
    assert m["artifacts"]["int8_onnx_skipped"].startswith("failed the accuracy gate in onnxruntime (top1_agreement")
    assert m["fidelity"]["int8_onnx"]["gate"] == "fail" and m["fidelity"]["int8_torchscript"]["gate"] == "pass"
    assert run_cli("verify", str(out)).returncode == 0

    # what serving loads: the registered INT8 entry verifies without the ONNX file
    from policy_bundle.bundle.model_store import verified_store_path

    int8_tag = re.search(r"model store: (\S+)", res.stdout)[1]
    assert (verified_store_path(int8_tag, "int8") / "policy.ts").is_file()


def test_the_gate_judges_on_golden_prompts_the_float_layer_search_never_saw(faulty_onnx):
    from policy_bundle.quantize.reference import task

    _, out, m = faulty_onnx
    split = m["gate"]["golden_split"]
    assert (split["search"], split["gate"]) == (64, 64) and "held out" in split["rule"]  # the task: golden=64 gated
    every = [g.prompt for g in task.golden_set(128)]
    shipped = [json.loads(line)["prompt"] for line in (out / "golden.jsonl").read_text().splitlines()]
    assert shipped == every[::2] and not set(shipped) & set(every[1::2])  # golden.jsonl is the held-out part
    assert all(f["items"] == 64 for f in m["fidelity"].values() if "items" in f)
    report = json.loads((out / "gate_report.json").read_text())
    assert report["metrics"]["items"] == 64 and all(a["metrics"]["items"] == 64 for a in report["attempts"])


def test_a_candidate_the_search_passes_is_rejected_when_the_held_out_prompts_fail_it():
    from torch import nn

    from policy_bundle.build.gate.report import GateOutcome
    from policy_bundle.build.gate.recipe_choice import held_out_verdict
    from policy_bundle.quantize.fidelity.scores import FidelityReport, GateThresholds, GateVerdict

    gate = GateThresholds(min_top1_agreement=0.9)
    searched = GateOutcome(GateVerdict(True, []), FidelityReport(16, 100, 0.99, 0.001, 0.01), ["lm_head"], nn.Identity())
    judged = held_out_verdict(searched, FidelityReport(16, 100, 0.80, 0.001, 0.01), gate)
    assert not judged.verdict.passed and judged.report.top1_agreement == 0.80
    assert judged.search_metrics["top1_agreement"] == 0.99
    assert judged.rejected.startswith("passes on the search prompts but fails on the held-out gate prompts: top1")


def prompts_file(path, n: int):
    path.write_text("".join(f"Say the number {i} in words.\n" for i in range(n)))
    return path


def test_the_golden_set_is_exactly_the_size_asked_for(tmp_path):
    from policy_bundle.build.calibrate.prompt_split import split_prompts
    from policy_bundle.build.config.build_config import load_config

    sets = (f"prompts.file={prompts_file(tmp_path / 'p.txt', 9)}", "calibration.golden=8", "calibration.samples=16",
            "calibration.batch_size=4")
    split = split_prompts(load_config(None, sets))
    assert len(split.golden) == 8 and set(split.calibration) == {"Say the number 0 in words."}
    task = split_prompts(load_config(None, ("calibration.golden=500", "calibration.batch_size=4")))
    # the task: 500 for the gate and 500 more for the float-layer search, none of them in calibration
    assert len(task.golden) == 1000 and not set(task.golden) & set(task.calibration)


def test_a_golden_set_larger_than_the_prompts_allow_is_refused_with_one_line(tmp_path, bentoml_home):
    res = run_cli("build", "--config", "build/configs/main.yaml", "--out", str(tmp_path / "b"), *FAST,
                  "--set", f"prompts.file={prompts_file(tmp_path / 'p.txt', 9)}", "--set", "calibration.golden=9")
    assert res.returncode == 3, res.stderr[-2000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: calibration.golden: 9 exceeds 8, the most") and "9 prompts" in last, last
    assert "Traceback" not in res.stderr and not (tmp_path / "b").exists()
    res = run_cli("build", "--config", "build/configs/main.yaml", "--out", str(tmp_path / "b"), *FAST,
                  "--set", "calibration.golden=501")
    assert res.returncode == 3 and "calibration.golden: 501 exceeds 500" in res.stderr, res.stderr[-2000:]


def test_the_artifact_checks_say_which_artifact_they_measure_for_the_heartbeat():
    """Stage 7 runs minutes on a real LM (SmolLM2-135M: 169 s); its heartbeat names the artifact and the items."""
    import torch

    from policy_bundle.build.artifacts.artifact_fidelity import reference_logits_of
    from policy_bundle.build.progress import heartbeat_line, set_status
    from policy_bundle.quantize.fidelity.scores import GoldenItem
    from policy_bundle.quantize.model.hf_weights import init_random_policy

    from test_int8_embedding import CFG

    set_status("")
    golden = [GoldenItem(prompt="a", prompt_ids=[1, 2, 3], completion_ids=[4, 5]) for _ in range(3)]
    logits = reference_logits_of(init_random_policy(CFG, seed=0), golden).all()
    assert len(logits) == 3 and all(x.shape[0] == 2 and torch.isfinite(x).all() for x in logits)
    assert "the FP32 reference logits: 3 golden items teacher-forced" in heartbeat_line()


def test_the_loaded_files_greedy_metrics_are_the_gates_only_where_its_logits_match_on_every_token():
    """The exported TorchScript's greedy decode is skipped only when its teacher-forced KL equals the gated module's
    on every token (then the decode is the same); a report that differs anywhere decodes again (negative control)."""
    from dataclasses import replace

    from policy_bundle.build.artifacts.artifact_fidelity import GREEDY_REUSED_NOTE, torchscript_fidelity
    from policy_bundle.quantize.fidelity.scores import GoldenItem, greedy_completions, measure_fidelity
    from policy_bundle.quantize.model.hf_weights import init_random_policy
    from policy_bundle.quantize.fidelity.reference_logits import ReferenceLogits
    from policy_bundle.quantize.fidelity.scores import policy_logits_fn

    from test_int8_embedding import CFG

    fp32, other = init_random_policy(CFG, seed=0), init_random_policy(CFG, seed=1)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    outs = greedy_completions(fp32, [GoldenItem(prompt="p", prompt_ids=p, completion_ids=[]) for p in prompts], 6, None)
    golden = [GoldenItem(prompt="p", prompt_ids=p, completion_ids=o) for p, o in zip(prompts, outs)]
    kw = dict(max_new_tokens=6, eos_token_id=None, decode=lambda ids: " ".join(map(str, ids)), reward=None)
    ref = ReferenceLogits.compute(policy_logits_fn(fp32), golden)
    gated = measure_fidelity(fp32, other, golden, reference_outputs=outs, reference_logits=ref, **kw)
    assert gated.greedy_agreement is not None and gated.kl_mean > 0

    reused = torchscript_fidelity(fp32, other, golden, ref, kw, gated)
    assert GREEDY_REUSED_NOTE in reused.notes and reused.greedy_agreement == gated.greedy_agreement

    fake = replace(gated, greedy_agreement=0.123456)  # the same logits: its (fake) greedy figure is taken as is
    assert torchscript_fidelity(fp32, other, golden, ref, kw, fake).greedy_agreement == 0.123456
    moved = replace(fake, kl_per_token=[*fake.kl_per_token[:-1], fake.kl_per_token[-1] * 1.0000001])
    decoded = torchscript_fidelity(fp32, other, golden, ref, kw, moved)  # one token differs: decoded again
    assert GREEDY_REUSED_NOTE not in decoded.notes and decoded.greedy_agreement == gated.greedy_agreement != 0.123456
    assert torchscript_fidelity(fp32, other, golden, ref, kw, None).greedy_agreement == gated.greedy_agreement
