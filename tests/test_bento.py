"""`bentoml build` packages the router with both models; `bentoml serve <tag>` serves the same API."""

import json
import os
import subprocess
import sys

import httpx

from cli_helpers import ROOT
from serve_helpers import Server, register_into

def test_built_bento_serves_the_api(small_bundle, tmp_path):
    env = {**os.environ, "BENTOML_HOME": str(tmp_path / "home"), "BENTOML_DO_NOT_TRACK": "True"}
    register_into(small_bundle, tmp_path / "home")
    built = subprocess.run([sys.executable, "-m", "bentoml", "build", "--output", "tag"], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    tag = built.stdout.strip().splitlines()[-1].removeprefix("__tag__:")
    assert tag.startswith("policy-bundle:")
    bento_dir = tmp_path / "home" / "bentos" / "policy-bundle" / tag.split(":")[1]
    assert "torch==2.13.0" in (bento_dir / "env" / "python" / "requirements.txt").read_text()
    assert (bento_dir / "env" / "docker" / "Dockerfile").is_file()
    models = json.dumps([m["tag"] for m in __import__("yaml").safe_load((bento_dir / "bento.yaml").read_text())["models"]])
    assert "policy-int8:" in models and "policy-fp16:" in models

    server = Server({"BENTOML_HOME": str(tmp_path / "home"), "POLICY_BUNDLE_DISABLE_VLLM": "1",
                     "POLICY_BUNDLE_STATE_DIR": str(tmp_path / "state")}, tmp_path / "bento.log", target=tag)
    try:
        server.wait_ready()
        r = httpx.post(f"{server.url}/v1/completions", json={"model": "policy", "prompt": "358+64=", "temperature": 0},
                       timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "998"
    finally:
        server.stop()
