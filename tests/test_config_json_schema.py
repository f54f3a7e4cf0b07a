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
from policy_bundle.quantize.config_schema import to_mapping

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
    {"canary": {"max_kl_mean": "small"}},  # the wrong type
])
def test_what_the_reader_refuses_the_schema_refuses(build_schema, doc):
    with pytest.raises(ConfigError):
        config_from_dict(doc)
    assert errors(build_schema, doc)


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
    """build/configs/defaults.yaml is `policy-bundle config defaults build`'s output now (so its values are the real
    defaults, and a changed default leaves it stale: this fails), and read back it is ``BuildConfig()``."""
    from policy_bundle.build.config.build_config import BuildConfig
    from policy_bundle.quantize.config_schema import from_mapping

    res = run_cli("config", "defaults", "build")
    assert res.returncode == 0, res.stderr
    committed = (ROOT / "build" / "configs" / "defaults.yaml").read_text()
    assert committed == res.stdout, "stale: policy-bundle config defaults build > build/configs/defaults.yaml"
    assert from_mapping(BuildConfig, yaml.safe_load(committed)) == BuildConfig()
    assert "samples: null  # integer in [1, 100000], or null" in committed  # each key with its type and limit


def test_the_router_defaults_read_back_to_the_router_defaults():
    from policy_bundle.quantize.config_schema import from_mapping
    from policy_bundle.serve.settings import RouterSettings

    res = run_cli("config", "defaults", "router")
    assert res.returncode == 0, res.stderr
    assert from_mapping(RouterSettings, yaml.safe_load(res.stdout)) == RouterSettings()
    assert "\n# api_keys: unset by default" in res.stdout  # a default that cannot be written as a value
