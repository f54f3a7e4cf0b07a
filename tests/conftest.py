"""Shared fixtures: the cached reference policy, an isolated BentoML store, one small real bundle (with
int8-vllm/ where vLLM is installed)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cli_helpers import SMALL, WITH_INT8_VLLM, run_cli


@pytest.fixture(scope="session")
def bentoml_home(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("bentoml")
    os.environ["BENTOML_HOME"] = str(home)
    return home


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    from policy_bundle.quantize.reference import ensure_reference_policy

    return ensure_reference_policy()


@pytest.fixture(scope="session")
def small_bundle(tmp_path_factory, bentoml_home, reference_dir) -> Path:
    out = tmp_path_factory.mktemp("bundles") / "reference"
    res = run_cli("build", "--config", "build/configs/reference.yaml", "--out", str(out), *SMALL, *WITH_INT8_VLLM)
    assert res.returncode == 0, res.stderr[-3000:]
    return out
