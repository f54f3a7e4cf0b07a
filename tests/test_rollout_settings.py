"""Rollout settings from POLICY_BUNDLE_ROUTER_CONFIG: steps with pauses, cohort match rules, the state database URL."""

import pytest
import yaml

from policy_bundle.serve.rollout.types import MatchRule, RolloutStep
from policy_bundle.serve.settings import SettingsError, load_settings


def settings_from(tmp_path, monkeypatch, body: dict):
    cfg = tmp_path / "router.yaml"
    cfg.write_text(yaml.safe_dump(body))
    monkeypatch.setenv("POLICY_BUNDLE_ROUTER_CONFIG", str(cfg))
    monkeypatch.delenv("POLICY_BUNDLE_STATE_URL", raising=False)
    return load_settings()


def test_steps_take_weights_pause_durations_and_an_indefinite_pause(tmp_path, monkeypatch):
    s = settings_from(tmp_path, monkeypatch, {"rollout": {"steps": [
        1, {"weight": 25, "pause_s": 600}, {"weight": 50, "pause": "indefinite"}, 100]}})
    assert s.rollout.steps == (RolloutStep(1.0), RolloutStep(25.0, 600.0), RolloutStep(50.0, indefinite=True),
                               RolloutStep(100.0))


@pytest.mark.parametrize("steps, message", [
    ([5, 1], r"rollout.steps: weights \[5.0, 1.0\] must rise strictly"),
    ([{"weight": 50, "pause": "forever"}], r"rollout.steps\[0\].pause: only 'indefinite'"),
    ([{"weight": "50"}], r"rollout.steps\[0\].weight: '50' is not a number"),
    ([{"pause_s": 5}], r"rollout.steps\[0\]: .* is not a weight"),
    ("1,5,100", "rollout.steps: must be a list"),
])
def test_bad_steps_are_named(tmp_path, monkeypatch, steps, message):
    with pytest.raises(SettingsError, match=message):
        settings_from(tmp_path, monkeypatch, {"rollout": {"steps": steps}})


def test_match_rules_route_a_header_or_cookie_cohort(tmp_path, monkeypatch):
    s = settings_from(tmp_path, monkeypatch, {"rollout": {"match": [
        {"header": "X-Cohort", "value": "beta", "variant": "int8"}, {"cookie": "cohort", "value": "ctl",
                                                                      "variant": "fp16"}]}})
    assert s.rollout.match == (MatchRule("int8", "beta", header="x-cohort"), MatchRule("fp16", "ctl", cookie="cohort"))
    for bad in ({"header": "x", "value": "v", "variant": "int4"}, {"value": "v", "variant": "int8"},
                {"header": "x", "cookie": "y", "value": "v", "variant": "int8"}):
        with pytest.raises(SettingsError, match="rollout.match"):
            settings_from(tmp_path, monkeypatch, {"rollout": {"match": [bad]}})


def test_the_state_url_comes_from_the_file_and_the_env_var_wins(tmp_path, monkeypatch):
    s = settings_from(tmp_path, monkeypatch, {"state_url": "sqlite:////tmp/x.sqlite"})
    assert s.state_url == "sqlite:////tmp/x.sqlite"
    monkeypatch.setenv("POLICY_BUNDLE_STATE_URL", "postgresql+psycopg://u@db/rollout")
    assert load_settings().state_url == "postgresql+psycopg://u@db/rollout"


def test_an_unreachable_state_database_is_one_line(tmp_path):
    from policy_bundle.serve.rollout.state import RolloutDatabase, StoreUnavailable

    from policy_bundle.serve.rollout.state import BundlePair

    db = RolloutDatabase("postgresql+psycopg://user:secret@127.0.0.1:1/x")  # connects at its first use
    with pytest.raises(StoreUnavailable, match=r"rollout state database 127.0.0.1:1/x: ") as err:
        db.load(BundlePair("a" * 64, "a" * 64))
    assert "secret" not in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(StoreUnavailable, match="rollout state database"):
        RolloutDatabase("nosuchdialect://x")
