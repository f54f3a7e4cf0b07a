"""Build config: defaults load, and every bad field is named with its value and limit."""

import json
import re

import pytest

from cli_helpers import run_cli
from policy_bundle.build.config.build_config import ConfigError, config_from_dict, load_config
from policy_bundle.quantize.fidelity.scores import GateThresholds
from policy_bundle.quantize.recipe_types import W8A8Recipe


def test_reference_config_loads_with_mesh_by_default():
    cfg = load_config("build/configs/main.yaml")
    assert cfg.policy.source == "reference" and cfg.calibration.procs == 2 and cfg.recipe.scheme == "static"


@pytest.mark.parametrize(
    "override, message",
    [
        ("calibration.samples=0", r"calibration.samples: 0 is out of range \[1, 100000\]"),
        ("recipe.scheme=int4", r"recipe.scheme: 'int4' is not one of \['static', 'dynamic', 'weight-only'"),
        ("recipe.overrides={down_proj: int4}", r"recipe.overrides.down_proj: 'int4' is not one of"),
        ("recipe.smooth_alpha=1.5", r"recipe.smooth_alpha: 1.5 is out of range \[0.0, 1.0\]"),
        ("recipe.gptq_damp=2", r"recipe.gptq_damp: 2 is out of range \(0.0, 1.0\]"),
        ("recipe.smooth_alphas=[0.5, 1.5]", r"recipe.smooth_alphas\[1\]: 1.5 is out of range \[0.0, 1.0\]"),
        ("gate.min_top1_agreement=5", r"gate.min_top1_agreement: 5 is out of range \[0.0, 1.0\]"),
        ("samples.batch_size=0", r"samples.batch_size: 0 is out of range \[1, 1024\]"),
        ("calibration.batch_size=abc", r"calibration.batch_size: expected int, got str 'abc'"),
        ("calibration.bogus=1", r"calibration.bogus: unknown field"),
        ("gate.bogus=1", r"gate.bogus: unknown field \(known: enabled, max_fp_layers, max_kl_mean"),
        ("gate.max_kl_p99=-1", r"gate.max_kl_p99: -1 is out of range \[0.0, 100.0\]"),
        ("export.onnx=3", r"export.onnx: expected bool"),
        ("export.int8_vllm=maybe", r"export.int8_vllm: 'maybe' is not one of \['auto', 'true', 'false'\]"),
        ("calibration.batch_size=999", r"calibration.batch_size: 999 exceeds calibration.samples"),
        ("recipe.skip=lm_head", r"recipe.skip: expected a list of strings"),
        ("policy.torchtitan.model=gpt2", r"policy.torchtitan.model: 'gpt2' is not one of \['llama3', 'qwen3'\]"),
        ("policy.torchtitan.bogus=1", r"policy.torchtitan.bogus: unknown field \(known: flavor, model, tokenizer\)"),
    ],
)
def test_bad_field_is_named(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("build/configs/main.yaml", (override,))


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_sections_hold_the_library_dataclasses_with_their_yaml_keys():
    cfg = load_config("build/configs/smollm2.yaml", ("gate.max_kl_mean=0.01", "recipe.overrides={down_proj: fp32}"))
    assert cfg.gate.thresholds == GateThresholds(0.02, 0.98, 0.01, 0.5, 0.5)
    assert cfg.recipe_config() == W8A8Recipe(scheme="smooth-w8a8", skip=("embed_tokens",),
                                             overrides=(("down_proj", "fp32"),))  # typed by its family


def test_auto_defaults_to_the_recipes_that_pass_on_real_lms(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("policy:\n  source: /some/model\nrecipe:\n  scheme: auto\n")
    cfg = load_config(str(cfg_file))
    assert cfg.recipe.candidates() == ["smooth-w8a8 skip=[embed_tokens]", "smooth-w8a8", "w8a8"]
    assert cfg.recipe_config().scheme == "smooth-w8a8"
    first = cfg.recipe.candidate_config(cfg.recipe.candidates()[0])  # an int8 head, its top-64 rescored in float
    assert first.skip == ("embed_tokens",) and first.lm_head_topk == 64


def test_auto_scheme_gates_every_candidate_starting_with_the_first():
    cfg = load_config("build/configs/main.yaml", ("recipe.scheme=auto", "recipe.auto_candidates=[dynamic, static]"))
    assert cfg.recipe.candidates() == ["dynamic", "static"] and cfg.recipe_config().scheme == "dynamic"


def test_the_samples_section_is_read_under_its_old_name_rollouts(tmp_path, capsys):
    import policy_bundle.build.config.build_config as bc

    bc._warned.clear()
    old = tmp_path / "old.yaml"
    old.write_text("rollouts:\n  engine: vllm\n")
    cfg = load_config(str(old), ("rollouts.batch_size=4",), env={"POLICY_BUNDLE_BUILD__ROLLOUTS__JSONL": "r.jsonl"})
    assert (cfg.samples.engine, cfg.samples.batch_size, cfg.samples.jsonl) == ("vllm", 4, "r.jsonl")
    assert capsys.readouterr().err.count("`rollouts` is now `samples`") == 1
    assert config_from_dict({"rollouts": {"batch_size": 2}}).samples.batch_size == 2  # a stored manifest's config
    assert load_config(str(old)).samples.engine == "vllm" and not hasattr(load_config(str(old)), "rollouts")
    both = tmp_path / "both.yaml"
    both.write_text("rollouts:\n  engine: vllm\nsamples:\n  engine: local\n")
    with pytest.raises(ConfigError, match=r"^samples: given twice, also under its old name `rollouts`"):
        load_config(str(both))


def test_the_gate_section_is_read_under_its_old_name_canary(tmp_path, capsys):
    import policy_bundle.build.config.build_config as bc

    bc._warned.clear()
    old = tmp_path / "old.yaml"
    old.write_text("canary:\n  max_kl_mean: 0.007\n  max_fp_layers: 3\n")
    cfg = load_config(str(old), ("canary.min_top1_agreement=0.9",),
                      env={"POLICY_BUNDLE_BUILD__CANARY__MAX_KL_P99": "0.4"})
    assert (cfg.gate.thresholds.max_kl_mean, cfg.gate.max_fp_layers) == (0.007, 3)
    assert (cfg.gate.thresholds.min_top1_agreement, cfg.gate.thresholds.max_kl_p99) == (0.9, 0.4)
    assert capsys.readouterr().err.count("`canary` is now `gate`") == 1  # once per process, whatever the sources
    assert config_from_dict({"canary": {"enabled": False}}).gate.enabled is False  # a stored manifest's config
    both = tmp_path / "both.yaml"
    both.write_text("canary:\n  max_kl_mean: 0.007\ngate:\n  max_kl_mean: 0.005\n")
    with pytest.raises(ConfigError, match=r"^gate: given twice, also under its old name `canary`"):
        load_config(str(both))
    for var, value, says in (("POLICY_BUNDLE_BUILD__CANARY__MAX_KL_MEAN", "-1", "max_kl_mean"),
                             ("POLICY_BUNDLE_BUILD__CANARY__BOGUS", "1", "names no build setting")):
        with pytest.raises(ConfigError, match=rf"^{var}: .*{says}"):  # the variable as set, not its new name
            load_config(None, env={var: value})
    capsys.readouterr()
    fresh = load_config(None, ("gate.max_kl_mean=0.004",))  # the new name alone: nothing said
    assert fresh.gate.thresholds.max_kl_mean == 0.004 and capsys.readouterr().err == ""


def test_resolved_config_round_trips_through_its_manifest_shape():
    cfg = load_config("build/configs/smollm2.yaml")
    stored = json.loads(json.dumps(cfg.to_dict()))
    assert stored["gate"]["max_kl_mean"] == 0.005 and stored["recipe"]["overrides"] == {}
    assert config_from_dict(stored) == cfg


def test_a_combination_the_recipe_refuses_is_a_config_error():
    with pytest.raises(ConfigError, match="recipe.overrides: mode 'w8a8' needs scheme"):
        load_config("build/configs/main.yaml", ("recipe.overrides={down_proj: w8a8}",))


@pytest.mark.parametrize("value, stored", [("true", "true"), ("false", "false"), ("auto", "auto")])
def test_int8_vllm_takes_auto_or_a_yaml_bool(value, stored):
    assert load_config("build/configs/main.yaml", (f"export.int8_vllm={value}",)).export.int8_vllm == stored


def test_torchtitan_config_round_trips_through_its_manifest_shape():
    cfg = load_config("build/configs/torchtitan.yaml", ("policy.source=/ckpt/step-60",))
    assert (cfg.policy.torchtitan.model, cfg.policy.torchtitan.tokenizer) == ("llama3", "reference")
    assert config_from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert load_config("build/configs/main.yaml").policy.torchtitan is None


def test_an_auto_candidate_can_set_its_own_w8a8_fields():
    cfg = load_config("build/configs/smollm2.yaml", ("recipe.scheme=auto",
                      'recipe.auto_candidates=[smooth-w8a8, "w8a8 rounding=nearest skip=[embed_tokens, lm_head]"]'))
    first, second = (cfg.recipe_config(c) for c in cfg.recipe.candidates())
    assert (first.scheme, first.rounding, first.skip) == ("smooth-w8a8", "gptq", ("embed_tokens",))
    assert (second.scheme, second.rounding, second.skip) == ("w8a8", "nearest", ("embed_tokens", "lm_head"))


@pytest.mark.parametrize("entry, message", [
    ('"w8a8 rounding=stochastic"', r"recipe.auto_candidates: 'w8a8 rounding=stochastic': recipe.rounding: "
                                   r"'stochastic' is not one of \['nearest', 'gptq'\]"),
    ('"w8a8 lm_head_topk=-1"', r"recipe.lm_head_topk: -1 is out of range \[0, 4096\]"),
    ('"w8a8 backend=x86"', r"'backend' cannot be set per candidate"),
    ('"static rounding=nearest"', r"fields per candidate apply to the w8a8 recipes only"),
    ('"w8a8 rounding"', r"expected 'scheme key=value ...'"),
    ("int4", r"recipe.auto_candidates: 'int4' is not one of \['static'"),
])
def test_a_bad_auto_candidate_is_named(entry, message):
    with pytest.raises(ConfigError, match=message):
        load_config("build/configs/main.yaml", (f"recipe.auto_candidates=[{entry}]",))


def test_every_build_setting_also_comes_from_the_environment_and_set_wins():
    env = {"POLICY_BUNDLE_BUILD__CALIBRATION__SAMPLES": "64", "POLICY_BUNDLE_BUILD__SEED": "3",
           "POLICY_BUNDLE_BUILD__GATE__MIN_TOP1_AGREEMENT": "0.9",  # a gate threshold, written inline in canary:
           "POLICY_BUNDLE_BUILD__EXPORT__ONNX": "", "POLICY_BUNDLE_VERSION": "not a build setting"}
    cfg = load_config(None, (), env=env)
    assert (cfg.calibration.samples, cfg.seed, cfg.gate.thresholds.min_top1_agreement) == (64, 3, 0.9)
    assert load_config(None, ("calibration.samples=80",), env=env).calibration.samples == 80  # --set wins
    assert load_config(None, (), env={}).calibration.samples is None  # the control: unset without the variable
    # a string field takes the value as written (YAML would make 2024 an integer), a misspelt variable is refused
    assert load_config(None, (), env={"POLICY_BUNDLE_BUILD__NAME": "2024"}).name == "2024"
    with pytest.raises(ConfigError, match=r"^POLICY_BUNDLE_BUILD__CALIBRATION__SMAPLES: names no build setting"):
        load_config(None, (), env={"POLICY_BUNDLE_BUILD__CALIBRATION__SMAPLES": "64"})


@pytest.mark.parametrize("value, message", [
    ("0", r"^POLICY_BUNDLE_BUILD__CALIBRATION__SAMPLES: calibration.samples: 0 is out of range \[1, 100000\]$"),
    ("[1,", r"^POLICY_BUNDLE_BUILD__CALIBRATION__SAMPLES: '\[1,' is not a YAML value"),
])
def test_a_bad_build_variable_is_one_cli_line_naming_it_and_the_limit(value, message):
    res = run_cli("build", "--out", "/nonexistent/never-written",
                  env={"POLICY_BUNDLE_BUILD__CALIBRATION__SAMPLES": value})
    assert res.returncode == 3 and "Traceback" not in res.stderr, res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert re.search(message, line.removeprefix("error: ")), line
