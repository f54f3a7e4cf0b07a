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
        # one alpha against "no smoothing": the search still runs (it keeps one trial at a time, so its memory is
        # that of the default six); the search is about a quarter of the calibration time with six
        "recipe:", "  scheme: smooth-w8a8", "  smooth_alphas: [0.5]", "gate:", "  enabled: false",
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
