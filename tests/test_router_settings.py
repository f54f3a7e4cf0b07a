"""Router settings that need no server: where int8_engine comes from and what it accepts."""

import pytest

from policy_bundle.serve.settings import SettingsError, load_settings


def test_int8_engine_comes_from_the_file_and_the_env_var_wins(tmp_path, monkeypatch):
    cfg = tmp_path / "router.yaml"
    cfg.write_text("int8_engine: vllm\n")
    monkeypatch.setenv("POLICY_ROUTER_CONFIG", str(cfg))
    monkeypatch.delenv("POLICY_BUNDLE_INT8_ENGINE", raising=False)
    assert load_settings().int8_engine == "vllm"
    monkeypatch.setenv("POLICY_BUNDLE_INT8_ENGINE", "torchscript")
    assert load_settings().int8_engine == "torchscript"
    monkeypatch.setenv("POLICY_BUNDLE_INT8_ENGINE", "onnx")
    with pytest.raises(SettingsError, match=r"int8_engine: 'onnx' is not one of \['torchscript', 'vllm'\]"):
        load_settings()
