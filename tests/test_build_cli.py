"""End to end: the real CLI builds a bundle whose every artifact loads the way its consumer loads it."""

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch

from pathlib import Path

from cli_helpers import EXAMPLES, SMALL, needs_vllm, run_cli
from policy_bundle.build.cli import EXIT_CODES
from policy_bundle.quantize import recipes
from policy_bundle.quantize.reference import task
from policy_bundle.quantize.runtime.vllm_launch import vllm_env

ROOT = Path(__file__).resolve().parents[1]

FRESH_TORCHSCRIPT = """
import sys, torch
m = torch.jit.load(sys.argv[1])
prompt = [int(t) for t in sys.argv[2].split(",")]
k, v = m.new_cache(1, 32)
logits = m.prefill(torch.tensor([prompt]), k, v)
out, pos = [], len(prompt)
for _ in range(6):
    nxt = int(logits[0, -1].argmax()); out.append(nxt)
    if nxt == 2: break
    logits = m.decode(torch.tensor([[nxt]]), pos, k, v); pos += 1
print(",".join(map(str, out)))
"""


def test_bundle_holds_every_artifact(small_bundle):
    files = json.loads((small_bundle / "bundle.json").read_text())["files"]
    for rel in ("int8/policy.ts", "int8/policy-int8.onnx", "fp16/config.json", "fp16/model.safetensors",
                "fp16/tokenizer.json", "fp16/generation_config.json", "golden.jsonl"):
        assert rel in files and files[rel]["size"] == (small_bundle / rel).stat().st_size
    assert not list(small_bundle.parent.glob(".*partial*"))


def test_manifest_records_versions_config_calibration_and_fidelity(small_bundle):
    m = json.loads((small_bundle / "bundle.json").read_text())
    assert {"torch", "transformers", "onnx", "onnxruntime"} <= set(m["versions"])
    assert m["config"]["calibration"]["samples"] == 64 and m["config"]["calibration"]["procs"] == 2
    cal = m["calibration"]
    assert cal["samples"] == 64 and cal["batches"] == 4 and "MinMax" in cal["observer"]
    assert len(cal["activation_ranges"]) == 28 and all(lo <= hi for lo, hi in cal["activation_ranges"].values())
    fid = m["fidelity"]["int8_torchscript"]
    assert fid["top1_agreement"] >= 0.95 and fid["reward_candidate"] >= 0.9
    # the file as loaded back gave the gated module's logits on every held-out token: the gate's greedy run stands
    assert any(n.startswith("greedy completions: the gate's") for n in fid["notes"]) and fid["greedy_agreement"] > 0.5
    gate = json.loads((small_bundle / "gate_report.json").read_text())
    assert fid["greedy_agreement"] == gate["metrics"]["greedy_agreement"]


def test_torchscript_generates_in_a_fresh_process_like_eager_int8(small_bundle, tmp_path):
    golden = [json.loads(line) for line in (small_bundle / "golden.jsonl").read_text().splitlines()[:5]]
    scripted = torch.jit.load(str(small_bundle / "int8/policy.ts"))
    from policy_bundle.quantize.runtime.decode import greedy_generate

    tok = task.build_tokenizer()
    for g in golden:
        res = subprocess.run([sys.executable, "-c", FRESH_TORCHSCRIPT, str(small_bundle / "int8/policy.ts"),
                              ",".join(map(str, g["prompt_ids"]))], capture_output=True, text=True, cwd=tmp_path)
        fresh = [int(t) for t in res.stdout.strip().split(",")]
        assert fresh == greedy_generate(scripted, g["prompt_ids"], 6, 2)
        assert task.reward(g["prompt"], tok.decode(fresh, skip_special_tokens=True)) == 1.0


def test_onnx_int8_runs_in_onnxruntime_within_two_points_of_torch_int8(small_bundle):
    import onnxruntime as ort

    sess = ort.InferenceSession(str(small_bundle / "int8/policy-int8.onnx"))
    logits = sess.run(None, {"input_ids": torch.tensor([[1, 5, 6, 13, 7, 14]]).numpy()})[0]
    assert logits.shape == (1, 6, len(task.VOCAB))
    fid = json.loads((small_bundle / "bundle.json").read_text())["fidelity"]
    assert abs(fid["int8_onnx"]["top1_agreement"] - fid["int8_torchscript"]["top1_agreement"]) <= 0.02


def test_fp16_directory_reloads_in_transformers_with_fp32_greedy_outputs(small_bundle):
    from policy_bundle.build.artifacts.fp16check import check_fp16

    assert check_fp16(small_bundle, "transformers").greedy_agreement >= 0.95


@needs_vllm
def test_fp16_directory_serves_in_vllm_with_fp32_greedy_outputs(small_bundle):
    res = run_cli("check-fp16", str(small_bundle), "--engine", "vllm", env=vllm_env())
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
    assert "ok: FP16 via vllm" in res.stdout


def test_both_artifacts_are_in_the_model_store_under_one_version(small_bundle):
    import bentoml

    from policy_bundle.bundle.manifest import manifest_hash

    sha = manifest_hash(small_bundle)
    int8 = [m for m in bentoml.models.list("policy-int8") if m.info.labels.get("manifest_sha256") == sha[:32]]
    fp16 = [m for m in bentoml.models.list("policy-fp16") if m.info.labels.get("manifest_sha256") == sha[:32]]
    assert len(int8) == len(fp16) == 1 and int8[0].tag.version == fp16[0].tag.version
    assert float(int8[0].info.labels["top1_agreement"]) >= 0.95
    from policy_bundle.bundle.model_store import verified_store_path

    assert (verified_store_path(str(int8[0].tag), "int8") / "policy.ts").is_file()


def test_verify_passes_then_names_the_tampered_file(small_bundle, tmp_path):
    assert run_cli("verify", str(small_bundle)).returncode == 0
    copy = tmp_path / "copy"
    shutil.copytree(small_bundle, copy)
    with open(copy / "fp16" / "config.json", "a") as f:
        f.write(" ")
    res = run_cli("verify", str(copy))
    assert res.returncode != 0
    assert "fp16/config.json: size" in res.stderr and "Traceback" not in res.stderr


def test_store_refuses_an_entry_whose_file_changed(small_bundle):
    import bentoml

    from policy_bundle.bundle.manifest import BundleVerificationError, manifest_hash
    from policy_bundle.bundle.model_store import verified_store_path

    sha = manifest_hash(small_bundle)
    model = next(m for m in bentoml.models.list("policy-fp16") if m.info.labels.get("manifest_sha256") == sha[:32])
    target = model.path_of("fp16/generation_config.json")
    original = open(target).read()
    try:
        open(target, "w").write(original.replace("}", ', "x": 1}'))
        with pytest.raises(BundleVerificationError, match="fp16/generation_config.json"):
            verified_store_path(str(model.tag), "fp16")
    finally:
        open(target, "w").write(original)


@pytest.mark.parametrize(
    "args, message",
    [
        (("--set", "calibration.samples=0"), "calibration.samples: 0 is out of range"),
        (("--set", "recipe.scheme=int4"), "recipe.scheme: 'int4' is not one of"),
        (("--set", "policy.source=/nonexistent/model"), "policy.source: '/nonexistent/model' does not exist"),
    ],
)
def test_bad_input_gets_one_clear_line_and_no_output(args, message, tmp_path, bentoml_home):
    out = tmp_path / "out"
    res = run_cli("build", "--config", "build/configs/main.yaml", "--out", str(out), *args)
    assert res.returncode == 3
    assert message in res.stderr and "Traceback" not in res.stderr
    assert not out.exists() and not list(tmp_path.glob(".*partial*"))


def test_gpt2_directory_is_refused_by_name(tmp_path, bentoml_home):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)).save_pretrained(tmp_path / "gpt2")
    res = run_cli("build", "--out", str(tmp_path / "out"), "--set", f"policy.source={tmp_path / 'gpt2'}")
    assert res.returncode == 3 and "architecture 'GPT2LMHeadModel' is not supported" in res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "out").exists()


def test_existing_output_directory_needs_force(small_bundle):
    before = (small_bundle / "bundle.json").read_bytes()
    res = run_cli("build", "--config", "build/configs/main.yaml", "--out", str(small_bundle))
    assert res.returncode == 3 and "already exists (use --force" in res.stderr
    assert (small_bundle / "bundle.json").read_bytes() == before


def test_build_survives_a_killed_worker_with_identical_int8(small_bundle, tmp_path):
    out = tmp_path / "faulty"
    res = run_cli("build", "--config", "build/configs/main.yaml", "--out", str(out), *SMALL,
                  "--set", "register.bentoml=false", "--set", "export.onnx=false",
                  env={"POLICY_BUNDLE_TEST_FAULT": "kill:rank=1:after=1"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "re-run: its process (rank 1) died" in res.stderr
    a = recipes.quantized_parameters(torch.jit.load(str(small_bundle / "int8/policy.ts")))
    b = recipes.quantized_parameters(torch.jit.load(str(out / "int8/policy.ts")))
    assert a.keys() == b.keys() and all(torch.equal(a[m][f], b[m][f]) for m in a for f in a[m])


def test_failing_build_leaves_nothing_behind(tmp_path, bentoml_home):
    out = tmp_path / "failed"
    res = run_cli("build", "--config", "build/configs/main.yaml", "--out", str(out), *SMALL,
                  env={"POLICY_BUNDLE_TEST_FAULT": "raise:shard=0"})
    assert res.returncode == 3 and "shard 0" in res.stderr and "injected fault" in res.stderr
    assert not out.exists() and not list(tmp_path.glob(".*partial*"))


def test_torchforge_example_calibrates_on_its_own_mesh_and_its_jsonl_builds(tmp_path, bentoml_home, reference_dir):
    res = subprocess.run([sys.executable, str(EXAMPLES / "torchforge_app.py"), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert torch.jit.load(str(tmp_path / "policy-int8.ts")) is not None
    out = tmp_path / "from-jsonl"
    res = run_cli("build", "--config", "build/configs/main.yaml", "--out", str(out), *SMALL,
                  "--set", f"samples.jsonl={tmp_path / 'samples.jsonl'}", "--set", "calibration.procs=0",
                  "--set", "register.bentoml=false", "--set", "export.onnx=false")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "64 calibration sequences from jsonl" in res.stderr


def test_the_cli_has_a_version_shown_defaults_and_one_bundle_argument():
    version = run_cli("--version")
    assert version.returncode == 0 and version.stdout.startswith("policy-bundle ")
    watch = run_cli("watch", "--help").stdout
    assert "(default: 1000)" in watch and "(default: 30.0)" in watch and "--bundle" not in watch.split("options:")[1]
    assert run_cli("serve", "--help").stdout.count("(default: 3000)") == 1
    twice = run_cli("gate", "a", "--bundle", "b")
    assert twice.returncode == 2 and "BUNDLE given twice" in twice.stderr
    none = run_cli("canary")
    assert none.returncode == 2 and "canary: BUNDLE is required" in none.stderr


def test_each_kind_of_failure_has_its_own_exit_code_and_help_lists_them(tmp_path):
    """2 usage, 3 a refused input, 4 a failed gate (tests/test_w8a8_build.py, test_gate.py), 1 unexpected: each
    kind distinct, as ``policy-bundle --help`` documents them."""
    helptext = " ".join(run_cli("--help").stdout.split())
    for code in ("2 a usage error", "3 an input or state refused", "4 the accuracy gate failed", "1 an unexpected error"):
        assert code in helptext, helptext
    documented = re.findall(r"^\| (\d+) \|", (ROOT / "docs" / "build.md").read_text().split("# Exit codes")[1], re.M)
    assert documented == re.findall(r"(?:: |; )(\d+) ", EXIT_CODES.replace("\n", " ")), documented  # docs = --help
    assert run_cli("build", "--no-such-flag").returncode == 2  # usage
    refused = run_cli("build", "--config", "build/configs/main.yaml", "--out", str(tmp_path / "o"),
                      "--set", "calibration.samples=0")
    assert refused.returncode == 3 and "calibration.samples: 0 is out of range" in refused.stderr
    assert run_cli("verify", str(tmp_path / "nowhere")).returncode == 3  # a bundle that is not there: refused
