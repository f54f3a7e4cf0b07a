"""``policy-bundle config schema build|router``: a JSON Schema of the keys, types, limits and defaults the config
readers enforce. The shipped configs validate against it; what the reader refuses (a value off its limit, an unknown
key, the wrong type), the schema refuses too; its defaults are the dataclasses' defaults."""

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from cli_helpers import run_cli
from policy_bundle.build.config.build_config import BuildConfig, ConfigError, config_from_dict
from policy_bundle.quantize.config.schema import to_mapping

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def build_schema():
    res = run_cli("config", "schema", "build")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def errors(schema, doc):
    return [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(doc)]


def test_the_shipped_build_configs_validate(build_schema):
    jsonschema.Draft202012Validator.check_schema(build_schema)
    for path in sorted((ROOT / "build" / "configs").glob("*.yaml")):
        assert errors(build_schema, yaml.safe_load(path.read_text())) == [], path


@pytest.mark.parametrize("doc", [
    {"calibration": {"samples": 0}},  # off its limit
    {"calibration": {"sample": 64}},  # unknown key
    {"recipe": {"scheme": "int4"}},  # not one of the schemes
    {"gate": {"max_kl_mean": "small"}},  # the wrong type
])
def test_what_the_reader_refuses_the_schema_refuses(build_schema, doc):
    with pytest.raises(ConfigError):
        config_from_dict(doc)
    assert errors(build_schema, doc)


def test_what_a_fields_reader_accepts_the_schema_accepts(build_schema):
    """``export.int8_vllm: true`` (a YAML boolean the field's reader makes "true") is valid in both."""
    assert config_from_dict({"export": {"int8_vllm": True}}).export.int8_vllm == "true"
    assert errors(build_schema, {"export": {"int8_vllm": True}}) == []
    assert errors(build_schema, {"export": {"int8_vllm": "sometimes"}})


def test_the_schemas_defaults_are_the_configs_defaults(build_schema):
    defaults = to_mapping(BuildConfig())

    def walk(schema, values, path=""):
        seen = 0
        for key, sub in schema["properties"].items():
            if key not in values:
                continue
            if sub.get("type") == "object" and "properties" in sub:
                seen += walk(sub, values[key], f"{path}{key}.")
            elif "default" in sub:
                value = values[key]
                value = list(value) if isinstance(value, tuple) else value
                assert sub["default"] == (str(value) if isinstance(value, Path) else value), f"{path}{key}"
                seen += 1
        return seen

    assert walk(build_schema, defaults) > 40  # most fields carry their default


def test_the_router_settings_schema_validates_the_shipped_settings_and_refuses_an_unknown_key():
    res = run_cli("config", "schema", "router")
    assert res.returncode == 0, res.stderr
    schema = json.loads(res.stdout)
    (configmap,) = [d for d in yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "configmap.yaml").read_text())
                    if d["metadata"]["name"] == "policy-bundle-router"]
    assert errors(schema, yaml.safe_load(configmap["data"]["router.yaml"])) == []
    assert errors(schema, {"no_such_setting": 1}) and errors(schema, {"max_batch": 0})  # max_batch is at least 1


def test_the_committed_defaults_file_is_what_the_config_fields_give_and_reads_back_to_the_defaults():
    """build/configs/reference.yaml is `policy-bundle config defaults build`'s output now (so its values are the real
    defaults, and a changed default leaves it stale: this fails), and read back it is ``BuildConfig()``."""
    from policy_bundle.build.config.build_config import BuildConfig
    from policy_bundle.quantize.config.schema import from_mapping

    res = run_cli("config", "defaults", "build")
    assert res.returncode == 0, res.stderr
    committed = (ROOT / "build" / "configs" / "reference.yaml").read_text()
    assert committed == res.stdout, "stale: policy-bundle config defaults build > build/configs/reference.yaml"
    assert from_mapping(BuildConfig, yaml.safe_load(committed)) == BuildConfig()
    assert "samples: null  # integer in [1, 100000], or null" in committed  # each key with its type and limit


def test_the_router_defaults_read_back_to_the_router_defaults():
    from policy_bundle.quantize.config.schema import from_mapping
    from policy_bundle.serve.settings import RouterSettings

    res = run_cli("config", "defaults", "router")
    assert res.returncode == 0, res.stderr
    assert from_mapping(RouterSettings, yaml.safe_load(res.stdout)) == RouterSettings()
    assert "\n# api_keys: unset by default" in res.stdout  # a default that cannot be written as a value


def undocumented(schema, path=""):
    """The dotted keys of ``schema`` (sections walked into, an Optional section's object too) with no help."""
    missing = []
    for key, sub in schema["properties"].items():
        if not (sub.get("description") or "").strip():
            missing.append(f"{path}{key}")
        section = next((s for s in sub.get("anyOf", [sub]) if s.get("type") == "object" and "properties" in s), None)
        if section is not None:
            missing += undocumented(section, f"{path}{key}.")
    return missing


def test_every_setting_has_help_in_the_schema_and_in_the_defaults_file(build_schema):
    """Each key of the build config and the router settings says what it does: a ``description`` in the JSON Schema
    and comment lines above it in the defaults file. A model with a field declared without help is caught (the
    control)."""
    from policy_bundle.quantize.config.json_schema import json_schema
    from policy_bundle.quantize.config.schema import config_model, ranged, setting

    router = json.loads(run_cli("config", "schema", "router").stdout)
    assert undocumented(build_schema) == [] and undocumented(router) == []
    assert len(build_schema["properties"]["recipe"]["properties"]) > 15  # the inline recipe's keys are walked too

    @config_model("probe")
    class Probe:
        told: int = ranged(1, 0, help="documented")
        nested: BuildConfig = setting(default_factory=BuildConfig, help="a section")
        bare: int = 3

    assert undocumented(json_schema(Probe)) == ["bare"]

    committed = (ROOT / "build" / "configs" / "reference.yaml").read_text()
    assert ("  # calibration actors per host on the Monarch mesh; 0: in this process, no mesh\n  procs: 2  # integer in "
            "[0, 256]\n") in committed


def test_the_config_models_are_pydantic_models_that_check_themselves_in_python_too():
    """One validation system: the build config's sections, the library's recipe and gate thresholds and the router
    settings are pydantic dataclasses; built in code they refuse what their YAML refuses, in the same words."""
    from pydantic.dataclasses import is_pydantic_dataclass

    from policy_bundle.build.config import build_config as bc
    from policy_bundle.quantize.config.schema import FieldError
    from policy_bundle.quantize.fidelity.scores import GateThresholds
    from policy_bundle.quantize.recipes import RecipeConfig
    from policy_bundle.serve.rollout.types import RolloutConfig
    from policy_bundle.serve.settings import RouterSettings

    models = [BuildConfig, bc.PolicySection, bc.PromptsSection, bc.SamplesSection, bc.CalibrationSection,
              bc.RecipeSection, bc.GateSection, bc.ExportSection, bc.RegisterSection, bc.TorchtitanSection,
              RecipeConfig, GateThresholds, RouterSettings, RolloutConfig]
    assert all(is_pydantic_dataclass(m) for m in models)
    with pytest.raises(FieldError, match=r"^calibration.procs: 300 is out of range \[0, 256\]$"):
        bc.CalibrationSection(procs=300)
    with pytest.raises(ConfigError, match=r"^calibration.procs: 300 is out of range \[0, 256\]$"):
        config_from_dict({"calibration": {"procs": 300}})
    with pytest.raises(ConfigError, match=r"^calibration.procs: expected int, got str '3'$"):
        config_from_dict({"calibration": {"procs": "3"}})  # a YAML string is not a number, however it reads
    with pytest.raises(FieldError, match=r"^rollout.golden_itemz: unknown field \(known: analysis_interval_s, "):
        RolloutConfig(golden_items=3, golden_itemz=4)
