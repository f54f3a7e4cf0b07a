"""torchtitan checkpoints as a policy source: a Monarch trainer actor's DCP checkpoint builds a gated bundle,
our converted policy reproduces torchtitan's forward, and broken checkpoints fail with one line."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from cli_helpers import load_example, run_cli

STEPS = 60
SAVE_EVERY = 20  # the trainer also leaves step-20 and step-40 behind, for the drift monitor
TITAN = ("--config", "build/configs/torchtitan.yaml")
FAST = ("--set", "register.bentoml=false", "--set", "export.onnx=false")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(step directory, trainer actor): torchtitan training in a real Monarch process, still alive."""
    example = load_example("torchtitan_trainer")
    result, trainer, procs = example.train_on_mesh(tmp_path_factory.mktemp("titan"), STEPS, save_every=SAVE_EVERY)
    yield Path(result["checkpoint"]), trainer
    procs.stop().get(timeout=30)


@pytest.fixture(scope="module")
def model_only_checkpoint(tmp_path_factory) -> Path:
    """A model-only DCP checkpoint of the reference flavor, as torchtitan's last-step save writes it."""
    import torch.distributed.checkpoint as dcp

    from policy_bundle.build.source.torchtitan_checkpoint import REFERENCE_FLAVOR, model_spec

    spec = model_spec("llama3", REFERENCE_FLAVOR)
    with torch.device("meta"):
        model = spec.model.build()
    model.to_empty(device="cpu")
    model.init_states(buffer_device=torch.device("cpu"))
    step = tmp_path_factory.mktemp("ckpt") / "step-3"
    dcp.save(model.state_dict(), checkpoint_id=str(step), no_dist=True)
    return step


def build_titan(step: Path, tmp_path: Path, *args: str):
    return run_cli("build", *TITAN, "--out", str(tmp_path / "out"), "--set", f"policy.source={step}", *FAST, *args,
                   env={"POLICY_BUNDLE_CACHE": str(tmp_path / "cache")})


@pytest.mark.slow
def test_converted_policy_logits_equal_torchtitans_forward(trained, tmp_path):
    from policy_bundle.build.config.build_config import TorchtitanSection
    from policy_bundle.build.source.torchtitan_checkpoint import REFERENCE_FLAVOR, resolve_torchtitan_source
    from policy_bundle.quantize.reference import task
    from policy_bundle.quantize.model.hf_weights import load_policy
    from policy_bundle.quantize.model.policy import full_logits

    step, trainer = trained
    src = TorchtitanSection(model="llama3", flavor=REFERENCE_FLAVOR, tokenizer="reference")
    policy = load_policy(resolve_torchtitan_source(step, src, tmp_path, log=lambda m: None), max_seq_len=32)
    tokens = torch.randint(0, len(task.VOCAB), (8, 20), generator=torch.Generator().manual_seed(0))
    theirs = trainer.logits.call_one(tokens.tolist()).get(timeout=60)
    with torch.no_grad():
        ours = full_logits(policy, tokens)
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (ours - theirs).abs().max()


@pytest.mark.slow
def test_trainer_checkpoint_builds_a_bundle_that_passes_its_gate(trained, tmp_path):
    step, _ = trained
    res = build_titan(step, tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    manifest = json.loads((tmp_path / "out" / "bundle.json").read_text())
    titan = manifest["policy"]["torchtitan"]
    assert titan["checkpoint"] == str(step) and titan["step"] == STEPS
    assert titan["adapter"].endswith("Llama3StateDictAdapter.to_hf")
    assert manifest["gate"]["verdict"] == "pass" and not manifest["gate"]["failures"]
    assert run_cli("verify", str(tmp_path / "out")).returncode == 0
    assert run_cli("gate", "--bundle", str(tmp_path / "out")).returncode == 0


@pytest.mark.slow
def test_watch_rebuilds_from_a_later_trainer_checkpoint_whose_calibration_moved(trained, tmp_path):
    """train -> checkpoint -> build -> watch: the bundle of step 20 is deployed; the monitor, checking every
    20 steps, takes the newest due checkpoint (step 60), finds its activation scales moved and rebuilds."""
    step, _ = trained
    folder = step.parent
    assert sorted(p.name for p in folder.iterdir()) == ["step-20", "step-40", "step-60"]
    first = tmp_path / "out"
    res = build_titan(folder / "step-20", tmp_path, "--set", "calibration.procs=0", "--set", "export.int8_vllm=false")
    assert res.returncode == 0, res.stderr[-3000:]
    res = run_cli("watch", "--bundle", str(first), "--checkpoints", str(folder), "--out-root", str(tmp_path / "w"),
                  "--every-steps", str(SAVE_EVERY), "--once", env={"POLICY_BUNDLE_CACHE": str(tmp_path / "cache")})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "(step 20)" in res.stderr and "step 60: fresh calibration statistics" in res.stderr
    new = tmp_path / "w" / "torchtitan-step-60"
    report = json.loads((new / "drift_report.json").read_text())
    assert report["step"] == 60 and report["drifted_layers"] and report["max_drift"] > 0.05
    manifest = json.loads((new / "bundle.json").read_text())
    assert manifest["policy"]["torchtitan"]["step"] == 60 and manifest["drift"]["previous_step"] == 20
    assert manifest["gate"]["verdict"] == "pass"
    assert run_cli("verify", str(new)).returncode == 0


@pytest.mark.parametrize("model", ["llama3", "qwen3"])
def test_stock_debugmodel_checkpoints_convert_to_torchtitans_logits(model, tmp_path):
    """torchtitan's own debugmodel flavors: llama3 (fused qkv, Llama-3 RoPE scaling), qwen3 (q/k norm, tied)."""
    import torch.distributed.checkpoint as dcp
    from torchtitan.models.common.attention import ScaledDotProductAttention

    from policy_bundle.build.config.build_config import TorchtitanSection
    from policy_bundle.build.source.torchtitan_checkpoint import model_spec, resolve_torchtitan_source
    from policy_bundle.quantize.reference import task
    from policy_bundle.quantize.model.hf_weights import load_policy
    from policy_bundle.quantize.model.policy import full_logits

    spec = model_spec(model, "debugmodel")
    for layer in spec.model.layers:  # the stock FlexAttention forward compiles on CPU; same weights, causal SDPA
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    torch.manual_seed(0)
    with torch.device("meta"):
        titan = spec.model.build()
    titan.to_empty(device="cpu")
    titan.init_states(buffer_device=torch.device("cpu"))
    dcp.save(titan.state_dict(), checkpoint_id=str(tmp_path / "step-2"), no_dist=True)
    task.save_tokenizer(tmp_path / "tok")
    src = TorchtitanSection(model=model, flavor="debugmodel", tokenizer=str(tmp_path / "tok"))
    policy_dir = resolve_torchtitan_source(tmp_path / "step-2", src, tmp_path / "cache", log=lambda m: None)
    policy = load_policy(policy_dir, max_seq_len=64)
    tokens = torch.randint(0, spec.model.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs, ours = titan(tokens), full_logits(policy, tokens)
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (ours - theirs).abs().max()


def one_line_error(res, message: str) -> None:
    assert res.returncode == 3, res.stderr[-2000:]
    assert message in res.stderr and "Traceback" not in res.stderr, res.stderr[-2000:]


def test_unknown_flavor_is_named(model_only_checkpoint, tmp_path):
    res = build_titan(model_only_checkpoint, tmp_path, "--set", "policy.torchtitan.flavor=tiny-nope")
    one_line_error(res, "policy.torchtitan.flavor: 'tiny-nope' is not a torchtitan llama3 flavor (known: debugmodel")


def test_missing_shard_file_is_named(model_only_checkpoint, tmp_path):
    step = tmp_path / "step-3"
    shutil.copytree(model_only_checkpoint, step)
    (step / "__0_0.distcp").unlink()
    one_line_error(build_titan(step, tmp_path), "shard file __0_0.distcp is missing")


def test_checkpoint_without_model_weights_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    step = tmp_path / "step-5"
    dcp.save({"train_state": {"step": torch.tensor(5)}, "lr_scheduler": {"last_epoch": torch.tensor(5)}},
             checkpoint_id=str(step), no_dist=True)
    one_line_error(build_titan(step, tmp_path), "holds no model weights of llama3/policy-bundle-reference "
                                                "(top-level keys: lr_scheduler, train_state)")


def test_mismatched_shapes_are_named(model_only_checkpoint, tmp_path):
    res = build_titan(model_only_checkpoint, tmp_path, "--set", "policy.torchtitan.flavor=debugmodel")
    one_line_error(res, "tok_embeddings.weight has shape [15, 64]")
    assert "llama3/debugmodel expects [2048, 256]" in res.stderr


class RunsACommand:
    """Unpickling this runs a shell command (what a booby-trapped checkpoint's .metadata can do)."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_a_metadata_pickle_that_would_run_code_is_refused_without_running_it(tmp_path):
    step = tmp_path / "step-7"
    step.mkdir()
    marker = tmp_path / "it-ran"
    (step / ".metadata").write_bytes(pickle.dumps(RunsACommand(f"touch {marker}")))
    res = build_titan(step, tmp_path)
    one_line_error(res, f"{step / '.metadata'} refers to posix.system, which DCP metadata never holds")
    assert not marker.exists()
