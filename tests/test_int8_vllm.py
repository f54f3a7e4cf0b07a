"""int8-vllm/: the build writes the compressed-tensors W8A8 directory, runs it in vLLM on the golden set, gates
it, records it in the manifest and registers it inside the policy-int8 store entry."""

import json
import math
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from cli_helpers import CLI, ROOT, SMALL, WITH_INT8_VLLM, needs_vllm, run_cli
from serve_helpers import bundle_version


@needs_vllm
def test_reference_bundle_ships_a_w8a8_dir_that_vllm_runs_and_passes_the_gate(small_bundle):
    m = json.loads((small_bundle / "bundle.json").read_text())
    art, fid = m["artifacts"], m["fidelity"]["int8_vllm"]
    assert art["int8_vllm"] == "int8-vllm" and art["int8_vllm_skipped"] is None
    assert fid["gate"] == "pass" and fid["greedy_agreement"] >= 0.9 and fid["engine"].startswith("vllm ")
    assert fid["reward_candidate"] >= fid["reward_reference"] - 0.02
    note = art["int8_vllm_recipe"]  # the reference recipe is torch.ao static: what differs is said
    assert "per token" in note["activations"] and "static" in note["activations"] and "lm_head" in note["float_linears"]
    assert {"int8-vllm/model.safetensors", "int8-vllm/config.json", "int8-vllm/tokenizer.json"} <= set(m["files"])
    assert run_cli("verify", str(small_bundle)).returncode == 0


@needs_vllm
def test_the_int8_store_entry_holds_the_w8a8_dir_verified(small_bundle):
    from policy_bundle.bundle.model_store import verified_store_path

    path = verified_store_path(f"policy-int8:{bundle_version(small_bundle)}", "int8-vllm")
    assert json.loads((path / "config.json").read_text())["quantization_config"]["format"] == "int-quantized"


def test_int8_vllm_true_without_vllm_is_one_line_before_any_work(tmp_path):
    res = run_cli("build", "--config", "build/configs/main.yaml", "--out", str(tmp_path / "b"), *SMALL,
                  "--set", "export.int8_vllm=true", env={"POLICY_BUNDLE_DISABLE_VLLM": "1"}, timeout=120)
    assert res.returncode == 3 and "Traceback" not in res.stderr
    assert "export.int8_vllm: true, but vLLM is not installed here" in res.stderr
    assert not (tmp_path / "b").exists()


def test_vllm_top_k_logprobs_give_the_bucketed_kl_and_the_exact_one_with_the_whole_vocabulary():
    from policy_bundle.build.artifacts.int8_vllm import vllm_logprobs
    from policy_bundle.quantize.fidelity.scores import kl_per_token

    g = torch.Generator().manual_seed(0)
    ref = torch.log_softmax(torch.randn(3, 10, generator=g, dtype=torch.float64), -1)
    cand = torch.log_softmax(ref + 0.3 * torch.randn(3, 10, generator=g, dtype=torch.float64), -1)

    def rows(k):  # vLLM's prompt_logprobs: None for the first token, then row t predicts token t + 1
        return [None] + [{str(int(i)): float(cand[t, i]) for i in cand[t].topk(k).indices} for t in range(2)]
    exact = kl_per_token(ref[:2], cand[:2])
    assert torch.allclose(kl_per_token(ref[:2], vllm_logprobs(rows(10), ref)[:2]), exact)
    top = cand[0].topk(4).indices
    rest = [i for i in range(10) if i not in top.tolist()]
    p, q = ref[0].exp(), cand[0].exp()
    bucketed = float(sum(p[i] * (ref[0, i] - cand[0, i]) for i in top)) + float(p[rest].sum()) * math.log(
        float(p[rest].sum()) / float(q[rest].sum()))
    got = float(kl_per_token(ref[:1], vllm_logprobs(rows(4), ref)[:1]))
    assert abs(got - bucketed) < 1e-9 and got <= float(exact[0]) + 1e-12


def _golden_processes(marker: Path) -> list:
    """Pids of the build's vLLM check processes whose files live under ``marker`` (the build's TMPDIR)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmd = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "artifacts.vllm_golden" in cmd and str(marker) in cmd:
            found.append(int(entry.name))
    return found


def _gone_within(marker: Path, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _golden_processes(marker):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def _start_build(tmp_path, marker: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen(CLI + ["build", "--config", "build/configs/main.yaml", "--out", str(tmp_path / "b"),
                                   *SMALL, *WITH_INT8_VLLM, "--set", "register.bentoml=false"],
                            cwd=ROOT, env={**os.environ, "TMPDIR": str(marker), **env}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_until(check, build: subprocess.Popen, seconds: float = 120) -> bool:
    deadline = time.monotonic() + seconds
    while not check() and build.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    return bool(check())


@needs_vllm
def test_a_build_that_fails_stops_the_vllm_process_it_started(tmp_path, bentoml_home):
    """The build starts vLLM's process when it begins (its imports overlap the build); a failure before the
    check stops it."""
    marker = tmp_path / "tmp"
    marker.mkdir()
    build = _start_build(tmp_path, marker, {"POLICY_BUNDLE_TEST_FAULT": "raise:shard=0"})
    try:
        assert _wait_until(lambda: _golden_processes(marker), build), "the build started no vLLM process"
        _, err = build.communicate(timeout=600)
        assert build.returncode == 3 and "injected fault" in err
        assert _gone_within(marker, 5), "a vllm_golden process outlived its failed build"
        assert not list(marker.glob("vllm-golden-*")), "its work folder was left behind"
    finally:
        _kill_session(build)


@needs_vllm
@pytest.mark.parametrize("moment", ["importing vLLM", "running the golden set"])
def test_the_vllm_process_quits_when_its_build_is_killed(moment, tmp_path, bentoml_home):
    """SIGKILL leaves no finally block to run: the process notices its parent is gone and exits, whether it is
    still importing vLLM or already running the request the build handed it."""
    marker = tmp_path / "tmp"
    marker.mkdir()
    build = _start_build(tmp_path, marker, {})
    try:
        if moment == "importing vLLM":
            assert _wait_until(lambda: _golden_processes(marker), build), "the build started no vLLM process"
        else:
            assert _wait_until(lambda: list(marker.glob("vllm-golden-*/request.json")), build), "no request handed"
        build.send_signal(signal.SIGKILL)
        build.wait()
        assert _gone_within(marker, 60), "the vllm_golden process outlived its killed build"
        assert not list(marker.glob("vllm-golden-*")), "its work folder was left behind"
    finally:
        _kill_session(build)


def _kill_session(build: subprocess.Popen) -> None:
    """The build's Monarch processes share its session."""
    try:
        os.killpg(build.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
