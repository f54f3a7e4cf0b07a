"""The optional parts of an install (pyproject's extras, quantize/extras.py): the base dependencies hold none of them,
each setting that needs one is refused in one line naming the extra when it is missing, and a build that asks for
none of them runs without them (the modules hidden in the CLI's process, as in a base install)."""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

import yaml

from cli_helpers import SMALL, run_cli
from policy_bundle.build.errors import EXIT_REFUSED
from policy_bundle.quantize.extras import EXTRAS, installed

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
DISTRIBUTIONS = {"monarch": "torchmonarch", "onnx": "onnx", "onnxruntime": "onnxruntime", "onnxscript": "onnxscript",
                 "torchtitan": "torchtitan", "psycopg": "psycopg"}
HIDE = {"PYTHONPATH": f"{ROOT / 'tests' / 'hide_extras'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "POLICY_BUNDLE_TEST_HIDE": ",".join(m for mods in EXTRAS.values() for m in mods)}


def _names(reqs) -> set:
    return {r.split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip() for r in reqs}


def test_each_extra_is_declared_and_the_base_install_holds_none_of_them():
    extras = PYPROJECT["optional-dependencies"]
    base = _names(PYPROJECT["dependencies"])
    for extra, modules in EXTRAS.items():
        declared = _names(extras[extra])
        for module in modules:
            assert DISTRIBUTIONS[module] in declared, (extra, module)
            assert DISTRIBUTIONS[module] not in base, module
    assert extras["all"] == [f"policy-bundle[{','.join(EXTRAS)}]"]
    assert "compressed-tensors" in _names(extras["vllm-cpu"])  # int8-vllm/'s format, imported by the build
    assert all(installed(e) for e in EXTRAS)  # this install (setup.sh) has every extra


def test_the_mesh_and_onnx_settings_are_refused_in_one_line_without_their_extras(tmp_path):
    res = run_cli("build", "--config", "build/configs/main.yaml", "--out", str(tmp_path / "b"), env=HIDE)
    assert res.returncode == EXIT_REFUSED, res.stderr[-2000:]
    assert res.stderr.strip().splitlines() == [
        "error: calibration.procs: 2 (the Monarch calibration mesh) needs the [mesh] extra (monarch cannot be "
        "imported): pip install 'policy-bundle[mesh]', or set calibration.procs: 0 (in this process)"]
    res = run_cli("build", "--config", "build/configs/main.yaml", "--out", str(tmp_path / "b"),
                  "--set", "calibration.procs=0", env=HIDE)
    assert res.returncode == EXIT_REFUSED and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("error: export.onnx: true needs the [onnx] extra")


def test_a_build_that_asks_for_no_extra_runs_without_them(tmp_path):
    """In-process calibration and ``export.onnx: auto``: built, and the manifest says why there is no ONNX model."""
    out = tmp_path / "b"
    res = run_cli("build", "--config", "build/configs/main.yaml", "--out", str(out), *SMALL,
                  "--set", "calibration.procs=0", "--set", "export.onnx=null", "--set", "register.bentoml=false",
                  env=HIDE)
    assert res.returncode == 0, res.stderr[-3000:]
    artifacts = json.loads((out / "bundle.json").read_text())["artifacts"]
    assert artifacts["int8_onnx"] is None and "[onnx] extra is not installed" in artifacts["int8_onnx_skipped"]


def test_a_postgresql_state_url_without_its_extra_stops_the_router_in_one_line(tmp_path):
    config = tmp_path / "router.yaml"
    config.write_text(yaml.safe_dump({"state_url": "postgresql+psycopg://u@127.0.0.1/db"}))
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", "from policy_bundle.serve.settings import load_settings as l; l()"],
                         env={**os.environ, **HIDE, "POLICY_BUNDLE_ROUTER_CONFIG": str(config)}, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode != 0
    assert ("state_url: a postgresql+psycopg URL (rollout state shared by replicas) needs the [postgres] extra"
            in res.stderr)


def test_a_torchtitan_source_without_its_extra_is_refused_before_any_work(tmp_path):
    res = run_cli("build", "--config", "build/configs/main.yaml", "--out", str(tmp_path / "b"),
                  "--set", "calibration.procs=0", "--set", "export.onnx=false",
                  "--set", f"policy.source={tmp_path}", "--set", "policy.torchtitan.model=llama3", env=HIDE)
    assert res.returncode == EXIT_REFUSED and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert res.stderr.strip().splitlines() == [
        "error: policy.torchtitan (a torchtitan checkpoint as the source) needs the [torchtitan] extra (torchtitan "
        "cannot be imported): pip install 'policy-bundle[torchtitan]'"]
    assert not (tmp_path / "b").exists()


def test_a_postgresql_state_url_is_accepted_where_its_extra_is_installed(tmp_path):
    """The control of the refusal above: the same settings load with psycopg importable."""
    import subprocess
    import sys

    config = tmp_path / "router.yaml"
    config.write_text(yaml.safe_dump({"state_url": "postgresql+psycopg://u@127.0.0.1/db"}))
    res = subprocess.run([sys.executable, "-c", "from policy_bundle.serve.settings import load_settings as l; "
                          "print(l().state_url)"], env={**os.environ, "POLICY_BUNDLE_ROUTER_CONFIG": str(config)},
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "postgresql+psycopg://u@127.0.0.1/db", res.stderr[-1000:]
