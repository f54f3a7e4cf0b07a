"""int8-vllm/: the build writes the compressed-tensors W8A8 directory, runs it in vLLM on the golden set, gates
it, records it in the manifest and registers it inside the policy-int8 store entry."""

import json

import pytest

from cli_helpers import SMALL, run_cli
from serve_helpers import bundle_version


def test_reference_bundle_ships_a_w8a8_dir_that_vllm_runs_and_passes_the_gate(small_bundle):
    pytest.importorskip("vllm")
    m = json.loads((small_bundle / "bundle.json").read_text())
    art, fid = m["artifacts"], m["fidelity"]["int8_vllm"]
    assert art["int8_vllm"] == "int8-vllm" and art["int8_vllm_skipped"] is None
    assert fid["gate"] == "pass" and fid["greedy_agreement"] >= 0.9 and fid["engine"].startswith("vllm ")
    assert fid["reward_candidate"] >= fid["reward_reference"] - 0.02
    note = art["int8_vllm_recipe"]  # the reference recipe is torch.ao static: what differs is said
    assert "per token" in note["activations"] and "static" in note["activations"] and "lm_head" in note["float_linears"]
    assert {"int8-vllm/model.safetensors", "int8-vllm/config.json", "int8-vllm/tokenizer.json"} <= set(m["files"])
    assert run_cli("verify", str(small_bundle)).returncode == 0


def test_the_int8_store_entry_holds_the_w8a8_dir_verified(small_bundle):
    pytest.importorskip("vllm")
    from policy_bundle.bundle.store import verified_store_path

    path = verified_store_path(f"policy-int8:{bundle_version(small_bundle)}", "int8-vllm")
    assert json.loads((path / "config.json").read_text())["quantization_config"]["format"] == "int-quantized"


def test_int8_vllm_true_without_vllm_is_one_line_before_any_work(tmp_path):
    res = run_cli("build", "--config", "build/configs/reference.yaml", "--out", str(tmp_path / "b"), *SMALL,
                  "--set", "export.int8_vllm=true", env={"POLICY_BUNDLE_DISABLE_VLLM": "1"}, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "export.int8_vllm: true, but vLLM is not installed here" in res.stderr
    assert not (tmp_path / "b").exists()
