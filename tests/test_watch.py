"""The drift monitor (`policy-bundle watch`) over a directory of training checkpoints, through the real CLI:
a checkpoint whose weights did not move builds nothing; one whose weights moved reports the layers that
drifted and builds + registers a new bundle version; bad options fail with one line. Also the odd
calibration samples the build reports (and drops on request)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cli_helpers import run_cli

FAST = ("--set", "calibration.procs=0", "--set", "calibration.samples=64", "--set", "calibration.batch_size=16",
        "--set", "calibration.golden=32", "--set", "export.onnx=false", "--set", "export.int8_vllm=false")


def checkpoint(src: Path, dst: Path, norm_scale: float | None = None) -> Path:
    """A training checkpoint as a trainer writes it: the policy's HF files in ``step-N``; with
    ``norm_scale``, layer 1's attention-input norm moved (what a stretch of training can do)."""
    shutil.copytree(src, dst)
    if norm_scale is not None:
        path = dst / "model.safetensors"
        weights = load_file(str(path))
        weights["model.layers.1.input_layernorm.weight"] = weights["model.layers.1.input_layernorm.weight"] * norm_scale
        save_file(weights, str(path), metadata={"format": "pt"})
    return dst


def store_versions(home: Path, name: str) -> list[str]:
    return sorted(p.name for p in (home / "models" / name).iterdir() if p.is_dir()) if (home / "models" / name).is_dir() else []


@pytest.fixture(scope="module")
def deployed(tmp_path_factory, reference_dir, bentoml_home):
    root = tmp_path_factory.mktemp("watch")
    ckpts = root / "checkpoints"
    ckpts.mkdir()
    checkpoint(reference_dir, ckpts / "step-0")
    bundle = root / "bundles" / "deployed"
    res = run_cli("build", "--config", "build/configs/main.yaml", "--out", str(bundle), "--set",
                  f"policy.source={ckpts / 'step-0'}", *FAST)
    assert res.returncode == 0, res.stderr[-3000:]
    return root, ckpts, bundle


def watch_once(root: Path, ckpts: Path, bundle: Path, *extra: str):
    return run_cli("watch", "--bundle", str(bundle), "--checkpoints", str(ckpts), "--out-root", str(root / "bundles"),
                   "--once", "--set", "calibration.procs=0", *extra)


def test_unmoved_checkpoint_builds_nothing_and_a_moved_one_builds_a_new_version(deployed, reference_dir, bentoml_home):
    root, ckpts, bundle = deployed
    before = store_versions(bentoml_home, "policy-int8")
    checkpoint(reference_dir, ckpts / "step-1000")

    res = watch_once(root, ckpts, bundle)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "step 1000: no drift (max 0.00%" in res.stderr, res.stderr[-2000:]
    state = json.loads((root / "bundles" / "watch-state.json").read_text())
    assert [c["step"] for c in state["checks"]] == [1000] and state["checks"][0]["decision"] == "no drift"
    assert state["deployed"] == str(bundle.resolve())
    assert not (root / "bundles" / "reference-step-1000").exists()
    assert store_versions(bentoml_home, "policy-int8") == before

    # Nothing is due until step 2000 (1000 steps after the last check); a second pass only waits.
    checkpoint(reference_dir, ckpts / "step-1500", norm_scale=1.3)
    res = watch_once(root, ckpts, bundle)
    assert res.returncode == 0 and "waiting for a checkpoint at step >= 2000" in res.stderr, res.stderr[-2000:]

    checkpoint(reference_dir, ckpts / "step-2000", norm_scale=1.3)
    res = watch_once(root, ckpts, bundle)
    assert res.returncode == 0, res.stderr[-3000:]
    new = root / "bundles" / "reference-step-2000"
    assert "drifted more than 5%" in res.stderr and f"building {new}" in res.stderr
    report = json.loads((new / "drift_report.json").read_text())
    # Layer 1's attention inputs saw a norm 1.3x larger: their scale moved ~30 %; layer 0 did not move.
    drifted = set(report["drifted_layers"])
    assert {f"layers.1.self_attn.{p}_proj" for p in "qkv"} <= drifted
    assert not any(d.startswith("layers.0.") for d in drifted)
    q = next(entry for entry in report["layers"] if entry["layer"] == "layers.1.self_attn.q_proj")
    assert q["scale"][1] / q["scale"][0] == pytest.approx(1.3, rel=0.02)
    assert report["step"] == 2000 and report["previous_bundle"] == str(bundle.resolve())
    manifest = json.loads((new / "bundle.json").read_text())
    assert manifest["drift"]["step"] == 2000 and manifest["drift"]["report"] == "drift_report.json"
    assert "drift_report.json" in manifest["files"]
    assert run_cli("verify", str(new)).returncode == 0
    after = store_versions(bentoml_home, "policy-int8")
    assert len(after) == len(before) + 1 and manifest["config"]["name"] in next(iter(set(after) - set(before)))
    state = json.loads((root / "bundles" / "watch-state.json").read_text())
    assert state["deployed"] == str(new.resolve()) and state["deployed_step"] == 2000
    assert [c["decision"] for c in state["checks"]] == ["no drift", "drift, rebuilt"]


def test_a_broken_checkpoint_is_a_recorded_failed_check_and_another_bundles_state_is_not_overwritten(
        deployed, reference_dir, tmp_path, bentoml_home):
    root, ckpts, bundle = deployed
    state_file = root / "bundles" / "watch-state.json"
    rebuilt = Path(json.loads(state_file.read_text())["deployed"])  # the previous test's step-2000 rebuild
    # A trainer that died mid-write: config.json is there, the weights are cut short.
    broken = checkpoint(reference_dir, ckpts / "step-3000")
    weights = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(weights[: len(weights) // 3])
    res = watch_once(root, ckpts, rebuilt)  # the deployed (rebuilt) bundle continues the same state
    assert res.returncode == 3, res.stderr[-3000:]
    assert "step 3000: check failed (" in res.stderr and "Traceback" not in res.stderr, res.stderr[-3000:]
    state = json.loads(state_file.read_text())
    assert state["checks"][-1]["decision"] == "check failed" and state["checks"][-1]["step"] == 3000
    assert state["last_step"] == 2000  # not done: the next look tries step 3000 again
    # Once its weights are whole, the same step is checked (same policy as step 2000: no drift).
    shutil.copy(ckpts / "step-2000" / "model.safetensors", broken / "model.safetensors")
    res = watch_once(root, ckpts, rebuilt)
    assert res.returncode == 0 and "step 3000: no drift (max 0.00%" in res.stderr, res.stderr[-3000:]

    other = tmp_path / "other"
    shutil.copytree(bundle, other)
    kept = state_file.read_text()
    res = watch_once(root, ckpts, other)
    assert res.returncode == 3 and "--bundle: " in res.stderr and "follows" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and state_file.read_text() == kept
    state_file.write_text("{not json")
    res = watch_once(root, ckpts, rebuilt)
    assert res.returncode == 3 and "not a watch state file" in res.stderr and "--reset" in res.stderr, res.stderr

    # --keep 1: the next rebuild removes the bundle the monitor built before it, from disk and from the model store
    state_file.write_text(kept)
    before = store_versions(bentoml_home, "policy-int8")
    checkpoint(reference_dir, ckpts / "step-4000", norm_scale=1.8)
    res = watch_once(root, ckpts, rebuilt, "--keep", "1")
    assert res.returncode == 0 and "(--keep 1)" in res.stderr, res.stderr[-3000:]
    assert (root / "bundles" / "reference-step-4000" / "bundle.json").is_file() and not rebuilt.exists()
    after = store_versions(bentoml_home, "policy-int8")
    assert len(after) == len(before) and len(set(before) - set(after)) == 1  # step 4000's entry in, step 2000's out
    assert bundle.is_dir()  # the first deployed bundle is not the monitor's to remove


@pytest.mark.parametrize("args, message", [
    (("--threshold", "0"), "--threshold: 0 is out of range"),
    (("--every-steps", "0"), "--every-steps: 0 is out of range"),
    (("--poll-s", "0.1"), "--poll-s: 0.1 is out of range"),
])
def test_bad_watch_options_fail_with_one_line(deployed, args, message):
    root, ckpts, bundle = deployed
    res = watch_once(root, ckpts, bundle, *args)
    assert res.returncode == 3 and message in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_missing_checkpoint_dir_and_tampered_bundle_fail_with_one_line(deployed, tmp_path):
    root, ckpts, bundle = deployed
    res = watch_once(root, tmp_path / "nowhere", bundle)
    assert res.returncode == 3 and "--checkpoints:" in res.stderr and "is not a directory" in res.stderr
    tampered = tmp_path / "tampered"
    shutil.copytree(bundle, tampered)
    (tampered / "golden.jsonl").write_text("{}\n")
    res = watch_once(tmp_path, ckpts, tampered)
    assert res.returncode == 3 and "golden.jsonl" in res.stderr and "Traceback" not in res.stderr, res.stderr


ODD_INDEX = 17  # where the out-of-distribution record sits in the calibration jsonl


def policy_with_a_one_hot_pad(reference_dir: Path, dst: Path) -> Path:
    """The reference policy with ``<pad>`` (also the unknown-character token) embedded as a one-hot vector
    along layer 0's largest attention-norm weight. After RMSNorm a one-hot row becomes sqrt(dim) x that
    weight at layer 0's q/k/v input: the largest value any token can give there (a dense row reaches a few
    times less), so a sample holding it stands out by construction, whatever training made of the rest."""
    shutil.copytree(reference_dir, dst)
    path = dst / "model.safetensors"
    w = load_file(str(path))
    norm = w["model.layers.0.input_layernorm.weight"]
    emb = w["model.embed_tokens.weight"].clone()
    row = torch.zeros_like(emb[0])
    row[int(norm.abs().argmax())] = float(emb.norm(dim=1).mean())
    emb[0] = row  # task.VOCAB[0] is <pad>
    w["model.embed_tokens.weight"] = emb
    save_file(w, str(path), metadata={"format": "pt"})
    return dst


def calibration_jsonl(path: Path, n: int = 64) -> Path:
    """``n`` task rollouts (prompt and correct answer); record ``ODD_INDEX`` opens with a run of a character
    the task never uses (tokenized as ``<pad>``)."""
    from policy_bundle.quantize.reference import task

    golden = frozenset(i.prompt for i in task.golden_set(1000))
    items = task.make_items(task.PROMPT_SEED, n, exclude=golden)
    recs = [{"prompt": ("?" * 12 if i == ODD_INDEX else "") + it.prompt, "completion": it.answer}
            for i, it in enumerate(items)]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_odd_samples_are_found_against_the_others_and_dropped_on_request(reference_dir, tmp_path):
    from policy_bundle.quantize.calibration.odd_samples import odd_samples

    # Unit: one sample 20 std above 60 others is found; the same set without it has none above 10.
    g = torch.Generator().manual_seed(0)
    ranges = 5.0 + 0.1 * torch.randn(61, 3, generator=g)
    ranges[17, 2] = 5.0 + 2.0
    found = odd_samples(ranges, ["a", "b", "c"], 10.0)
    assert [(o.index, o.layer) for o in found] == [(17, "c")] and found[0].sigmas > 10
    assert odd_samples(torch.cat([ranges[:17], ranges[18:]]), ["a", "b", "c"], 10.0) == []

    # Through the build: the calibration sample made out of distribution is reported as the most extreme
    # at a 4-sigma rule, dropped on request (with any others the weights make odd), and the calibrated
    # range is then below its max |x|.
    policy = policy_with_a_one_hot_pad(reference_dir, tmp_path / "policy")
    out = tmp_path / "b"
    res = run_cli("build", "--config", "build/configs/main.yaml", "--out", str(out), *FAST, "--set",
                  f"policy.source={policy}", "--set", f"samples.jsonl={calibration_jsonl(tmp_path / 'r.jsonl')}",
                  "--set", "calibration.outlier_sigma=4", "--set", "calibration.drop_outliers=true", "--set",
                  "register.bentoml=false", "--set", "gate.enabled=false")
    assert res.returncode == 0, res.stderr[-3000:]
    cal = json.loads((out / "bundle.json").read_text())["calibration"]
    odd = cal["odd_samples"]
    assert odd["dropped"] and odd["sigma"] == 4 and odd["samples"], odd
    worst = odd["samples"][0]
    assert worst["sample"] == ODD_INDEX and worst["sigmas"] > 4, odd["samples"][:3]
    assert cal["samples"] == 64 - len(odd["samples"])
    assert f"odd sample {ODD_INDEX}:" in res.stderr and "(dropped)" in res.stderr
    lo, hi = cal["activation_ranges"][worst["layer"]]
    assert max(abs(lo), abs(hi)) < worst["absmax"]


def test_drift_is_the_scale_change_or_zero_point_shift_of_the_shipped_observer():
    from torch.ao.quantization.observer import MinMaxObserver

    from policy_bundle.build.watch.drift import activation_qparams, calibration_drift

    obs = MinMaxObserver(dtype=torch.quint8, qscheme=torch.per_tensor_affine, reduce_range=True)
    obs(torch.tensor([-1.5, 4.0]))
    scale, zp = obs.calculate_qparams()
    assert activation_qparams(-1.5, 4.0, True) == (float(scale), int(zp))

    old = {"activation_ranges": {"a": [-1.0, 1.0], "b": [0.0, 2.0], "c": [-2.0, 2.0], "gone": [0.0, 1.0]}}
    new = {"activation_ranges": {"a": [-1.0, 1.0], "b": [0.0, 2.2], "c": [-1.0, 3.0], "added": [0.0, 1.0]}}
    what, drifts = calibration_drift(old, new, reduce_range=False)
    by = {d.layer: d for d in drifts}
    assert set(by) == {"a", "b", "c"} and "zero point" in what
    assert by["a"].drift == 0.0
    assert by["b"].drift == pytest.approx(0.1, rel=1e-4)  # same zero point (0), scale 10 % larger
    s0, z0 = activation_qparams(-2.0, 2.0, False)
    s1, z1 = activation_qparams(-1.0, 3.0, False)
    assert s0 == pytest.approx(s1) and by["c"].drift == pytest.approx(abs(z1 - z0) / 255)  # a pure shift
    assert [d.layer for d in drifts] == ["c", "b", "a"]  # largest first


def test_w8a8_drift_compares_outlier_thresholds_and_channel_maxima():
    from policy_bundle.build.watch.drift import calibration_drift

    old = {"groups": {"layers.0.attn_in": {"outlier_threshold": 10.0, "channel_absmax_max": 4.0},
                      "layers.0.down_in": {"outlier_threshold": 100.0, "channel_absmax_max": None}}}
    new = {"groups": {"layers.0.attn_in": {"outlier_threshold": 10.5, "channel_absmax_max": 3.0},
                      "layers.0.down_in": {"outlier_threshold": 100.0, "channel_absmax_max": None}}}
    _, drifts = calibration_drift(old, new, reduce_range=False)
    assert [(d.layer, round(d.drift, 4)) for d in drifts] == [("layers.0.attn_in", 0.25), ("layers.0.down_in", 0.0)]
    with pytest.raises(ValueError, match="different statistics"):
        calibration_drift(old, {"activation_ranges": {}}, reduce_range=False)
