"""The config loader (quantize/config/schema.py): a limit declared on a field holds for YAML and for Python alike,
and the build and the router name the field and its limit."""

import pickle
from typing import Optional, Tuple

import pytest

from policy_bundle.build.config.build_config import ConfigError, load_config
from policy_bundle.quantize.config.schema import (FieldError, choice, config_model, from_mapping, inline, ranged,
                                                  setting, to_mapping)
from policy_bundle.quantize.fidelity.scores import GateThresholds, ThresholdError
from policy_bundle.quantize.recipes import RecipeConfig, RecipeError
from policy_bundle.serve.settings import SettingsError, load_settings


@config_model("outer.inner")
class Inner:
    alpha: float = ranged(0.5, 0.0, 1.0, help="a")
    mode: str = choice("fast", ("fast", "exact"), help="m")
    sizes: Tuple[int, ...] = ranged((1, 2), 1, None, help="s")


@config_model("outer")
class Outer:
    name: str = setting("x", help="n")
    inner: Inner = setting(default_factory=Inner, help="i")
    spare: Optional[Inner] = setting(None, help="o")


@config_model("flat")
class Flat:
    enabled: bool = setting(True, help="e")
    inner: Inner = inline(Inner)


def test_a_ranged_field_refuses_a_value_off_its_limit_from_yaml():
    with pytest.raises(FieldError, match=r"^outer.inner.alpha: 2 is out of range \[0.0, 1.0\]$"):
        from_mapping(Outer, {"inner": {"alpha": 2}}, "outer")


def test_a_ranged_field_refuses_a_value_off_its_limit_from_python():
    with pytest.raises(FieldError, match=r"^outer.inner.alpha: 2.0 is out of range \[0.0, 1.0\]$"):
        Inner(alpha=2.0)


def test_a_value_within_the_limit_passes_both_ways():
    assert Inner(alpha=1.0).alpha == 1.0
    assert from_mapping(Outer, {"inner": {"alpha": 1}}, "outer").inner == Inner(alpha=1.0)  # an int widens to float


def test_a_choice_field_names_its_options_both_ways():
    with pytest.raises(FieldError, match=r"^outer.inner.mode: 'slow' is not one of \['fast', 'exact'\]$"):
        from_mapping(Outer, {"inner": {"mode": "slow"}}, "outer")
    with pytest.raises(FieldError, match=r"'slow' is not one of"):
        Inner(mode="slow")
    assert Inner(mode="exact").mode == "exact"


def test_a_limit_on_a_tuple_field_holds_for_each_element():
    with pytest.raises(FieldError, match=r"^outer.inner.sizes\[1\]: 0 must be >= 1$"):
        from_mapping(Outer, {"inner": {"sizes": [3, 0]}}, "outer")
    assert from_mapping(Outer, {"inner": {"sizes": [3, 4]}}, "outer").inner.sizes == (3, 4)


def test_an_unknown_field_is_named_with_the_known_ones():
    with pytest.raises(FieldError, match=r"^outer.inner.alfa: unknown field \(known: alpha, mode, sizes\)$"):
        from_mapping(Outer, {"inner": {"alfa": 1}}, "outer")


@pytest.mark.parametrize("data, message", [
    ({"name": 3}, r"^name: expected str, got int 3$"),
    ({"inner": {"alpha": True}}, r"^inner.alpha: expected a number, got bool True$"),
    ({"inner": {"alpha": "0.5"}}, r"^inner.alpha: expected float, got str '0.5'$"),  # strict: YAML's type is the type
    ({"inner": {"sizes": 3}}, r"^inner.sizes: expected a list of integers, got int 3$"),
    ({"inner": [1]}, r"^inner: expected a mapping, got list$"),
    ({"spare": {"mode": 1}}, r"^spare.mode: expected str, got int 1$"),
])
def test_a_wrong_type_names_the_field_and_the_expected_type(data, message):
    with pytest.raises(FieldError, match=message):
        from_mapping(Outer, data)


def test_an_inline_dataclass_reads_its_fields_as_the_sections_own_keys_and_round_trips():
    flat = from_mapping(Flat, {"enabled": False, "alpha": 0.25}, "flat")
    assert flat == Flat(False, Inner(alpha=0.25)) and from_mapping(Flat, to_mapping(flat)) == flat
    with pytest.raises(FieldError, match=r"^flat.inner: unknown field \(known: alpha, enabled, mode, sizes\)$"):
        from_mapping(Flat, {"inner": {}}, "flat")


def test_the_library_dataclasses_check_themselves_when_constructed():
    with pytest.raises(RecipeError, match=r"^recipe.gptq_damp: 0.0 is out of range \(0.0, 1.0\]$"):
        RecipeConfig(gptq_damp=0.0)
    with pytest.raises(ThresholdError, match=r"^max_kl_mean: 101 is out of range \[0.0, 100.0\]$"):
        GateThresholds(max_kl_mean=101)
    with pytest.raises(ThresholdError, match=r"expected a number, got bool True"):
        GateThresholds(min_top1_agreement=True)
    assert RecipeConfig(gptq_damp=1e-7).gptq_damp == 1e-7 and GateThresholds(max_kl_mean=100.0).max_kl_mean == 100.0


def test_a_field_error_keeps_its_field_across_processes():
    err = pickle.loads(pickle.dumps(RecipeError("recipe.rounding", "'x' is not one of ['nearest', 'gptq']")))
    assert isinstance(err, FieldError) and err.path == "recipe.rounding" and str(err).startswith("recipe.rounding: ")


def test_the_build_accepts_what_the_recipe_accepts():
    """The build once refused a gptq_damp under 1e-6 that the recipe takes: the limit is the recipe's own now
    (out-of-range build fields: tests/test_config.py)."""
    assert load_config("build/configs/main.yaml", ("recipe.gptq_damp=1e-7",)).recipe_config().gptq_damp == 1e-7
    with pytest.raises(ConfigError, match=r"^recipe.gptq_damp: 0 is out of range \(0.0, 1.0\]$"):
        load_config("build/configs/main.yaml", ("recipe.gptq_damp=0",))


def router(tmp_path, monkeypatch, text: str):
    cfg = tmp_path / "router.yaml"
    cfg.write_text(text)
    monkeypatch.setenv("POLICY_BUNDLE_ROUTER_CONFIG", str(cfg))
    for name in ("POLICY_BUNDLE_INT8_ENGINE", "POLICY_BUNDLE_API_KEYS"):
        monkeypatch.delenv(name, raising=False)
    return load_settings()


@pytest.mark.parametrize("text, message", [
    ("rollout:\n  confidence: 1.5\n", r"^rollout.confidence: 1.5 is out of range \[0.5, 0.9999\]$"),
    ("rollout:\n  failure_limit: 0\n", r"^rollout.failure_limit: 0 must be >= 1$"),
    ("max_batch: 0\n", r"^max_batch: 0 must be >= 1$"),
    ("rollout:\n  thresholds:\n    max_kl_p99: -1\n",
     r"^rollout.thresholds.max_kl_p99: -1 is out of range \[0.0, 100.0\]$"),
    ("rollout:\n  golden_items: many\n", r"^rollout.golden_items: expected int, got str 'many'$"),
])
def test_the_router_names_an_out_of_range_field_and_its_limit(tmp_path, monkeypatch, text, message):
    with pytest.raises(SettingsError, match=message):
        router(tmp_path, monkeypatch, text)


def test_the_router_keeps_values_within_their_limits(tmp_path, monkeypatch):
    s = router(tmp_path, monkeypatch, "max_batch: 1\nrollout:\n  confidence: 0.9999\n  failure_limit: 1\n")
    assert (s.max_batch, s.rollout.confidence, s.rollout.failure_limit) == (1, 0.9999, 1)


def test_none_passes_only_an_optional_field():
    with pytest.raises(ThresholdError, match="min_top1_agreement: expected a value, got None"):
        GateThresholds(min_top1_agreement=None)
    with pytest.raises(ConfigError, match="export.int8_vllm: expected a value, got None"):
        load_config(None, ("export.int8_vllm=null",))
    assert load_config(None, ("calibration.samples=null",)).calibration.samples is None  # Optional: unset is fine


@pytest.mark.parametrize("override,message", [
    ("recipe.skip=[a", r"--set recipe.skip: '\[a' is not a YAML value"),
    ("recipe.auto_candidates=['w8a8 skip=[a']", r"recipe.auto_candidates: .*skip=\[a is not a YAML value"),
])
def test_an_unreadable_value_is_one_line_naming_the_field(override, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config(None, ("recipe.scheme=auto", override) if "candidates" in override else (override,))
    assert "\n" not in str(err.value)


def test_a_config_that_is_not_a_mapping_is_named(tmp_path):
    (tmp_path / "c.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="config: expected a mapping of sections, got list"):
        load_config(tmp_path / "c.yaml")


def test_a_number_written_as_a_string_is_refused_in_code_too():
    """Built in code, pydantic's lax mode would read "500" as 500 past the range check: it is refused as in YAML."""
    from policy_bundle.serve.rollout.types import RolloutConfig

    with pytest.raises(ThresholdError, match=r"^max_kl_mean: expected float, got str '500'$"):
        GateThresholds(max_kl_mean="500")
    with pytest.raises(FieldError, match=r"^rollout.min_samples: expected int, got str '0'$"):
        RolloutConfig(min_samples="0")
    assert RecipeConfig(gptq_damp="1e-7").gptq_damp == 1e-7  # YAML 1.1's exponent strings are the numbers they spell


def test_a_section_written_empty_takes_its_defaults_and_an_optional_one_stays_unset():
    from policy_bundle.build.config.build_config import RegisterSection, config_from_dict

    cfg = config_from_dict({"register": None, "gate": None, "policy": {"torchtitan": None}})
    assert cfg.register == RegisterSection() and cfg.gate.thresholds == GateThresholds() and cfg.policy.torchtitan is None


def test_a_choice_read_by_its_own_reader_refuses_what_the_reader_cannot_make_an_option():
    from policy_bundle.build.config.build_config import config_from_dict

    assert config_from_dict({"export": {"int8_vllm": True}}).export.int8_vllm == "true"
    with pytest.raises(ConfigError, match=r"^export.int8_vllm: 0 is not one of \['auto', 'true', 'false'\]$"):
        config_from_dict({"export": {"int8_vllm": 0}})


def test_yaml_values_outside_json_are_named_not_turned_into_text():
    import datetime

    from policy_bundle.build.config.build_config import config_from_dict

    with pytest.raises(ConfigError, match=r"^recipe.overrides.1: expected a string key, got int 1$"):
        config_from_dict({"recipe": {"overrides": {1: "fp32"}}})
    with pytest.raises(ConfigError, match=r"^name: expected a plain YAML value .*, got date datetime.date\(2020, 1, 1\)$"):
        config_from_dict({"name": datetime.date(2020, 1, 1)})


def test_an_optional_sections_keys_come_from_the_environment_too():
    from policy_bundle.quantize.config.schema import from_mapping
    from policy_bundle.serve.settings import RouterSettings, env_settings

    values, source = env_settings({"POLICY_BUNDLE_ROLLOUT__THRESHOLDS__MAX_KL_MEAN": "0.2"})
    assert from_mapping(RouterSettings, values).rollout.thresholds.max_kl_mean == 0.2
    assert source == {"rollout.thresholds.max_kl_mean": "POLICY_BUNDLE_ROLLOUT__THRESHOLDS__MAX_KL_MEAN"}
    cfg = load_config(None, env={"POLICY_BUNDLE_BUILD__POLICY__TORCHTITAN__MODEL": "qwen3"})
    assert cfg.policy.torchtitan.model == "qwen3"
