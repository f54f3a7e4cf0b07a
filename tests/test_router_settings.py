"""Router settings that need no server: where int8_engine comes from and what it accepts."""

import re

import pytest

from policy_bundle.serve.settings import SettingsError, load_settings


def test_int8_engine_comes_from_the_file_and_the_env_var_wins(tmp_path, monkeypatch):
    cfg = tmp_path / "router.yaml"
    cfg.write_text("int8_engine: vllm\n")
    monkeypatch.setenv("POLICY_BUNDLE_ROUTER_CONFIG", str(cfg))
    monkeypatch.delenv("POLICY_BUNDLE_INT8_ENGINE", raising=False)
    assert load_settings().int8_engine == "vllm"
    monkeypatch.setenv("POLICY_BUNDLE_INT8_ENGINE", "torchscript")
    assert load_settings().int8_engine == "torchscript"
    monkeypatch.setenv("POLICY_BUNDLE_INT8_ENGINE", "onnx")
    with pytest.raises(SettingsError, match=r"int8_engine: 'onnx' is not one of \['torchscript', 'vllm'\]"):
        load_settings()


def settings_from(tmp_path, monkeypatch, text: str):
    cfg = tmp_path / "router.yaml"
    cfg.write_text(text)
    monkeypatch.setenv("POLICY_BUNDLE_ROUTER_CONFIG", str(cfg))
    monkeypatch.delenv("POLICY_BUNDLE_API_KEYS", raising=False)
    return load_settings()


def test_api_keys_as_one_yaml_string_is_one_key(tmp_path, monkeypatch):
    assert settings_from(tmp_path, monkeypatch, "api_keys: s3cr3t\n").api_keys == ("s3cr3t",)


def test_api_keys_as_a_yaml_list_are_those_keys(tmp_path, monkeypatch):
    assert settings_from(tmp_path, monkeypatch, "api_keys: [s3cr3t, other]\n").api_keys == ("s3cr3t", "other")


@pytest.mark.parametrize("value", ["5", "{a: b}", "[s3cr3t, 7]", "['']", "true"])
def test_api_keys_of_another_type_is_one_settings_error(tmp_path, monkeypatch, value):
    with pytest.raises(SettingsError, match=r"^api_keys: .* (a non-empty string|non-empty strings)"):
        settings_from(tmp_path, monkeypatch, f"api_keys: {value}\n")


@pytest.mark.parametrize("field, value, limit", [("min_top1_agreement", "5", r"\[0.0, 1.0\]"),
                                                  ("max_kl_mean", "101", r"\[0.0, 100.0\]"),
                                                  ("min_greedy_agreement", ".nan", r"\[0.0, 1.0\]")])
def test_router_gate_thresholds_have_the_builds_ranges(tmp_path, monkeypatch, field, value, limit):
    with pytest.raises(SettingsError, match=rf"^rollout.thresholds.{field}: .* is out of range {limit}$"):
        settings_from(tmp_path, monkeypatch, f"rollout:\n  thresholds:\n    {field}: {value}\n")


def test_router_gate_thresholds_in_range_are_kept(tmp_path, monkeypatch):
    s = settings_from(tmp_path, monkeypatch, "rollout:\n  thresholds:\n    min_top1_agreement: 0.9\n")
    assert s.rollout.thresholds.min_top1_agreement == 0.9


def test_engine_threads_default_to_one_and_have_a_range(tmp_path, monkeypatch):
    assert settings_from(tmp_path, monkeypatch, "model_name: policy\n").engine_threads == 1
    assert settings_from(tmp_path, monkeypatch, "engine_threads: 4\n").engine_threads == 4
    with pytest.raises(SettingsError, match=r"^engine_threads: .* is out of range \[1, 256\]$"):
        settings_from(tmp_path, monkeypatch, "engine_threads: 0\n")


def test_engine_lanes_default_to_one_per_usable_core_and_have_a_range(tmp_path, monkeypatch):
    from policy_bundle.serve.variants.lanes import lane_count, usable_cores

    assert settings_from(tmp_path, monkeypatch, "model_name: policy\n").engine_lanes == 0
    assert lane_count(0, 1, 32) == min(usable_cores(), 4) and lane_count(0, 10_000, 32) == 1  # at least one lane
    assert lane_count(0, 1, 8) == 1  # each automatic lane keeps room to batch 8 sequences
    assert lane_count(3, 1, 32) == 3 and lane_count(3, 1, 2) == 2  # asked for: no more lanes than sequences
    quota = tmp_path / "cpu.max"
    quota.write_text("200000 100000\n")  # a container's quota of 2 CPUs
    assert usable_cores(quota) == min(2, usable_cores()) and usable_cores(tmp_path / "none") == usable_cores()
    quota.write_text("max 100000\n")
    assert usable_cores(quota) == usable_cores(tmp_path / "none")
    with pytest.raises(SettingsError, match=r"^engine_lanes: .* is out of range \[0, 256\]$"):
        settings_from(tmp_path, monkeypatch, "engine_lanes: -1\n")


@pytest.mark.parametrize("value", [",", " ", " , ,", ""])
def test_api_keys_from_the_env_that_hold_no_key_are_refused_not_open(tmp_path, monkeypatch, value):
    """POLICY_BUNDLE_API_KEYS set to nothing replaced the file's keys with none, which meant open."""
    cfg = tmp_path / "router.yaml"
    cfg.write_text("api_keys: [s3cr3t]\n")
    monkeypatch.setenv("POLICY_BUNDLE_ROUTER_CONFIG", str(cfg))
    monkeypatch.setenv("POLICY_BUNDLE_API_KEYS", value)
    with pytest.raises(SettingsError, match=r"^POLICY_BUNDLE_API_KEYS: is set but holds no key, which would leave"):
        load_settings()
    monkeypatch.setenv("POLICY_BUNDLE_API_KEYS", " other , ")  # the negative control: a key replaces the file's
    assert load_settings().api_keys == ("other",)


@pytest.mark.parametrize("value", ["[]", "", "null"])
def test_api_keys_written_empty_in_the_file_are_refused(tmp_path, monkeypatch, value):
    with pytest.raises(SettingsError, match=r"^api_keys: holds no key, which would leave every route open"):
        settings_from(tmp_path, monkeypatch, f"api_keys: {value}\n")
    assert settings_from(tmp_path, monkeypatch, "model_name: policy\n").api_keys == ()  # not written: open


@pytest.fixture
def clean_env(monkeypatch):
    """No POLICY_BUNDLE_* / POLICY_ROUTER_CONFIG variable from the caller's environment."""
    import os

    for var in [v for v in os.environ if v.startswith(("POLICY_BUNDLE_", "POLICY_ROUTER_"))]:
        monkeypatch.delenv(var)
    return monkeypatch


def test_every_setting_also_comes_from_the_environment_under_one_prefix_and_wins_over_the_file(tmp_path, clean_env):
    cfg = tmp_path / "router.yaml"
    cfg.write_text("max_inflight: 8\nmodel_name: from-file\nrollout:\n  min_samples: 50\n")
    clean_env.setenv("POLICY_BUNDLE_ROUTER_CONFIG", str(cfg))
    s = load_settings()
    assert (s.max_inflight, s.model_name, s.rollout.min_samples) == (8, "from-file", 50)
    for var, value in {"POLICY_BUNDLE_MAX_INFLIGHT": "64", "POLICY_BUNDLE_MODEL_NAME": "123",  # a string, as written
                       "POLICY_BUNDLE_CHAT_CONTROL_TOKENS": "true", "POLICY_BUNDLE_KV_WAIT_S": "2.5",
                       "POLICY_BUNDLE_ROLLOUT__STEPS": "[1, 50, 100]", "POLICY_BUNDLE_ROLLOUT__AUTO_START": "false",
                       "POLICY_BUNDLE_VERSION": "not-a-setting"}.items():  # a variable of the prefix that is no field
        clean_env.setenv(var, value)
    s = load_settings()
    assert (s.max_inflight, s.model_name, s.chat_control_tokens, s.kv_wait_s) == (64, "123", True, 2.5)
    assert [step.weight for step in s.rollout.steps] == [1.0, 50.0, 100.0] and s.rollout.auto_start is False
    assert s.rollout.min_samples == 50  # the file's, where no variable sets it


@pytest.mark.parametrize("var, value, message", [
    ("POLICY_BUNDLE_MAX_INFLIGHT", "-1", r"^POLICY_BUNDLE_MAX_INFLIGHT: max_inflight: -1 must be >= 0$"),
    ("POLICY_BUNDLE_ROLLOUT__MAX_ERROR_RATE", "2", r"^POLICY_BUNDLE_ROLLOUT__MAX_ERROR_RATE: rollout.max_error_rate: 2"),
    ("POLICY_BUNDLE_MAX_BATCH", "[1, ", r"^POLICY_BUNDLE_MAX_BATCH: '\[1, ' is not a YAML value"),
    ("POLICY_BUNDLE_REQUIRE_VLLM", "maybe", r"^POLICY_BUNDLE_REQUIRE_VLLM: require_vllm: expected bool, got str"),
])
def test_a_bad_variable_is_one_line_naming_it_the_field_and_the_limit(clean_env, var, value, message):
    clean_env.setenv(var, value)
    with pytest.raises(SettingsError, match=message):
        load_settings()


def test_the_old_name_of_the_settings_file_still_works_with_a_warning(tmp_path, clean_env, caplog):
    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    old.write_text("max_inflight: 5\n")
    new.write_text("max_inflight: 6\n")
    clean_env.setenv("POLICY_ROUTER_CONFIG", str(old))
    with caplog.at_level("WARNING", logger="policy_bundle.router"):
        assert load_settings().max_inflight == 5
    # Monarch, once imported in the same test worker, prefixes every record with "[actor=...] ".
    said = [re.sub(r"^(\[actor=[^\]]*\] )*", "", r.getMessage()) for r in caplog.records]
    assert said == [
        "POLICY_ROUTER_CONFIG is the old name of POLICY_BUNDLE_ROUTER_CONFIG; it still works"]
    caplog.clear()
    clean_env.setenv("POLICY_BUNDLE_ROUTER_CONFIG", str(new))  # the new name wins, and nothing is said
    with caplog.at_level("WARNING", logger="policy_bundle.router"):
        assert load_settings().max_inflight == 6
    assert not caplog.records
