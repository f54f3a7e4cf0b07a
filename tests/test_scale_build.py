"""A policy of real size builds within a memory limit below three times its weights, and one that cannot fit is
refused before it starts.

The policy is a randomly initialised transformers Qwen3 of 0.3B parameters (16 layers of Qwen3-0.6B's shape, 1.2 GB
of float32 safetensors): its cost is real, its answers are not (the gate is off: random weights say nothing of
fidelity). The build runs in a memory cgroup of its own whose limit is 2.9x the weights file, every process it
starts (Monarch actors included) inside it; the kernel's OOM killer ends the build if the limit is crossed.
Not in the default run (minutes on 2 cores): ``.ci/run`` runs it after the suite, ``-m scale -n 0``.
"""

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from policy_bundle.loadtest.bench_build import make_policy

LIMIT_TIMES_WEIGHTS = 2.9


def memory_cgroup(limit: int):
    """A new memory cgroup (v2, else v1) limited to ``limit`` bytes: (its procs file, its peak-usage file), or None."""
    name = f"policy-bundle-{uuid.uuid4().hex[:8]}"
    for base, limit_file, peak_file in ((Path("/sys/fs/cgroup"), "memory.max", "memory.peak"),
                                        (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes",
                                         "memory.max_usage_in_bytes")):
        if not (base / limit_file).exists() and not (base / "cgroup.procs").exists():
            continue
        d = base / name
        try:
            d.mkdir()
            (d / limit_file).write_text(str(limit))
            if (d / "memory.swap.max").exists():
                (d / "memory.swap.max").write_text("0")
            return d, d / peak_file
        except OSError:
            if d.exists():
                d.rmdir()
    return None


def build_in(cgroup: Path, config: Path, out: Path) -> subprocess.CompletedProcess:
    code = (f"import os, sys; open({str(cgroup / 'cgroup.procs')!r}, 'w').write(str(os.getpid())); "
            "from policy_bundle.build.cli import main; sys.exit(main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, "build", "--config", str(config), "--out", str(out), "--force"],
                          capture_output=True, text=True, timeout=3000)


def write_config(path: Path, source: Path) -> Path:
    path.write_text("\n".join([
        "name: scale-0.3b", "policy:", f"  source: {source}", "prompts:", "  max_new_tokens: 8",
        "calibration:", "  samples: 24", "  golden: 20", "  batch_size: 8", "  procs: 0",
        "recipe:", "  scheme: smooth-w8a8", "canary:", "  enabled: false",
        "export:", "  int8_vllm: false", "  onnx: false", "register:", "  bentoml: false"]) + "\n")
    return path


@pytest.fixture(scope="module")
def policy_0_3b(tmp_path_factory):
    from policy_bundle.loadtest.real_lm import smollm2_dir

    return make_policy("0.3b", "float32", tmp_path_factory.mktemp("scale") / "qwen3-0.3b", Path(smollm2_dir()))


def cgroup_or_skip(limit: int):
    made = memory_cgroup(limit)
    if made is None:
        if os.environ.get("POLICY_BUNDLE_CI"):
            pytest.fail("no writable memory cgroup: the scale test needs one (run as root)")
        pytest.skip("no writable memory cgroup here")
    return made


@pytest.mark.scale
def test_a_0_3b_policy_builds_under_a_memory_limit_below_three_times_its_weights(policy_0_3b, tmp_path):
    weights = sum(f.stat().st_size for f in policy_0_3b.glob("*.safetensors"))
    params = sum(v["shape"][0] * (v["shape"][1] if len(v["shape"]) > 1 else 1)
                 for f in policy_0_3b.glob("*.safetensors")
                 for k, v in json.loads(f.read_bytes()[8:8 + int.from_bytes(f.read_bytes()[:8], "little")]).items()
                 if k != "__metadata__")
    assert params >= 300e6, params
    cgroup, peak_file = cgroup_or_skip(int(weights * LIMIT_TIMES_WEIGHTS))
    try:
        res = build_in(cgroup, write_config(tmp_path / "c.yaml", policy_0_3b), tmp_path / "bundle")
        peak = int(peak_file.read_text()) if peak_file.exists() else None
    finally:
        cgroup.rmdir()
    assert res.returncode == 0, (res.returncode, res.stderr[-3000:])
    assert "memory plan:" in res.stderr
    m = json.loads((tmp_path / "bundle" / "bundle.json").read_text())
    assert m["recipe"]["scheme"] == "smooth-w8a8"
    assert (tmp_path / "bundle" / "int8" / "policy.ts").stat().st_size < weights * 0.4  # int8, not float
    if peak is not None:
        assert peak <= weights * LIMIT_TIMES_WEIGHTS
        print(f"peak {peak / 1e9:.2f} GB for {weights / 1e9:.2f} GB of weights ({peak / weights:.2f}x)")


@pytest.mark.scale
def test_a_build_that_cannot_fit_is_refused_before_it_starts_in_one_line(policy_0_3b, tmp_path):
    weights = sum(f.stat().st_size for f in policy_0_3b.glob("*.safetensors"))
    cgroup, _ = cgroup_or_skip(int(weights * 0.8))
    try:
        res = build_in(cgroup, write_config(tmp_path / "c.yaml", policy_0_3b), tmp_path / "bundle")
    finally:
        cgroup.rmdir()
    assert res.returncode == 3, (res.returncode, res.stderr[-3000:])
    last = res.stderr.strip().splitlines()[-1]
    assert "memory: this build would need about" in last and "cgroup" in last, last
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "bundle").exists()


def _actor_pids() -> list:
    """This process's Monarch actor processes (descendants running Monarch's bootstrap)."""
    children: dict = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [os.getpid()]
    while todo:
        for c in children.get(todo.pop(), []):
            todo.append(c)
            try:
                if b"bootstrap_main" in Path(f"/proc/{c}/cmdline").read_bytes():
                    out.append(c)
            except OSError:
                pass
    return out


def _rss(pid: int) -> int:
    line = next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


@pytest.mark.scale
def test_each_mesh_actor_plans_its_share_of_the_layers_within_60_percent_of_the_weights(policy_0_3b):
    """The mesh shards layers, not only data: each of 2 actors runs in a memory cgroup of its own whose limit, with
    what the actor held when it was moved there, is 60 % of the weights file; each maps only its share of the 16
    layers and plans it. No actor is OOM-killed, and the plan is bitwise the one this process makes alone."""
    import torch

    from policy_bundle.build.calibrate.mesh import calibration_mesh
    from policy_bundle.build.calibrate.w8a8_statistics import stream_plan
    from policy_bundle.build.config.build_config import config_from_dict
    from policy_bundle.quantize.hf_weights import load_policy

    weights = sum(f.stat().st_size for f in policy_0_3b.glob("*.safetensors"))
    cfg = config_from_dict({"policy": {"source": str(policy_0_3b), "max_seq_len": 256},
                            "calibration": {"procs": 2},
                            # one smoothing strength: the search's cost, not its memory (GPTQ's Hessians stay)
                            "recipe": {"scheme": "smooth-w8a8", "smooth_alphas": [0.5]}})
    policy = load_policy(policy_0_3b, max_seq_len=256)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, policy.embed_tokens.num_embeddings, (8, 64), generator=g)]
    recipe = cfg.recipe_config()
    budget = int(0.6 * weights)
    groups = []
    try:
        with calibration_mesh(cfg, policy_0_3b) as mesh:
            pids = _actor_pids()
            assert len(pids) == 2, pids
            for pid in pids:
                held = _rss(pid)
                assert held < budget, (held, budget)
                cgroup, peak_file = cgroup_or_skip(budget - held)
                groups.append((cgroup, peak_file, held))
                (cgroup / "cgroup.procs").write_text(str(pid))
            sharded, _, _ = stream_plan(mesh, policy, batches, recipe)
            peaks = [(int(p.read_text()) if p.exists() else None, held) for _, p, held in groups]
            kills = [int(next((ln.split()[1] for ln in (c / "memory.events").read_text().splitlines()
                                if ln.startswith("oom_kill")), "0")) if (c / "memory.events").exists() else 0
                     for c, _, _ in groups]
    finally:
        for cgroup, _, _ in groups:
            for _ in range(50):  # the actors have left it once the mesh stopped
                try:
                    cgroup.rmdir()
                    break
                except OSError:
                    import time

                    time.sleep(0.2)
    assert kills == [0, 0]
    local, _, _ = stream_plan(None, policy, batches, recipe)
    assert sharded.weights.keys() == local.weights.keys() and len(local.weights) == 16 * 7  # the head stays float
    for n, (q, s) in local.weights.items():
        assert torch.equal(q, sharded.weights[n][0]) and torch.equal(s, sharded.weights[n][1]), n
    for peak, held in peaks:
        if peak is not None:
            assert peak + held <= budget
            print(f"actor: {held / 1e9:.2f} GB when moved + {peak / 1e9:.2f} GB peak after, limit {budget / 1e9:.2f} GB"
                  f" (60 % of {weights / 1e9:.2f} GB)")
