"""Build config: defaults load, and every bad field is named with its value and limit."""

import pytest

from policy_bundle.build.config import ConfigError, load_config


def test_reference_config_loads_with_mesh_by_default():
    cfg = load_config("build/configs/reference.yaml")
    assert cfg.policy.source == "reference" and cfg.calibration.procs == 2 and cfg.recipe.scheme == "static"


@pytest.mark.parametrize(
    "override, message",
    [
        ("calibration.samples=0", r"calibration.samples: 0 is out of range \[1, 100000\]"),
        ("recipe.scheme=int4", r"recipe.scheme: 'int4' is not one of \['static', 'dynamic', 'weight-only'"),
        ("recipe.overrides={down_proj: int4}", r"recipe.overrides.down_proj: 'int4' is not one of"),
        ("recipe.smooth_alpha=1.5", r"recipe.smooth_alpha: 1.5 is out of range \[0.0, 1.0\]"),
        ("calibration.batch_size=abc", r"calibration.batch_size: expected int, got str 'abc'"),
        ("calibration.bogus=1", r"calibration.bogus: unknown field"),
        ("export.onnx=3", r"export.onnx: expected bool"),
        ("calibration.batch_size=999", r"calibration.batch_size: 999 exceeds calibration.samples"),
        ("recipe.skip=lm_head", r"recipe.skip: expected a list of strings"),
    ],
)
def test_bad_field_is_named(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("build/configs/reference.yaml", (override,))


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
