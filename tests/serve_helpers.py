"""Serving test helpers: the shared server launcher, a bundle's model-store version, /metrics and SSE readers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import yaml

from policy_bundle.loadtest.servers import Server, free_port  # noqa: F401 - re-exported for the tests
from policy_bundle.quantize.runtime.vllm_launch import vllm_env


def bundle_version(bundle: Path) -> str:
    import json

    from policy_bundle.bundle.manifest import manifest_hash

    name = json.loads((bundle / "bundle.json").read_text())["config"]["name"]
    return f"{name}-{manifest_hash(bundle)[:12]}"


def register_into(bundle: Path, home: Path) -> None:
    """Check a built bundle against its manifest and register its two entries in the BentoML store at ``home`` (a
    fresh process: this one's bentoml may already be bound to another store)."""
    import os
    import subprocess
    import sys

    from policy_bundle.bundle.manifest import manifest_hash
    from policy_bundle.loadtest.drill_kit import VERIFY_AND_REGISTER

    reg = subprocess.run([sys.executable, "-c", VERIFY_AND_REGISTER, str(bundle), bundle_version(bundle), manifest_hash(bundle)],
                         env={**os.environ, "BENTOML_HOME": str(home)}, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert reg.returncode == 0, reg.stderr[-2000:]


def metric(server, name: str, **labels) -> float:
    """The sum of ``name``'s series on /metrics whose labels include ``labels``."""
    import re

    import httpx

    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{name}(\{{[^}}]*\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def sse_events(response) -> list:
    return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


# ---- the router servers of test_serve*.py: their config and environment, and calls to them ----------------

ADMIN = {"Authorization": "Bearer test-admin-token"}
FORCE_INT8 = {"x-policy-variant": "int8", "x-admin-token": "test-admin-token"}


def router_config(tmp_path, name, **overrides):
    rollout = {"steps": [1, 5, 25, 50, 100], "analysis_interval_s": 3600, "golden_interval_s": 3600,
               "min_samples": 10, "failure_limit": 2, "golden_items": 16, "shadow_fraction": 0.25,
               **overrides.pop("rollout", {})}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"rollout": rollout, **overrides}))
    return path


def env_for(tmp_path, name, version, admin=True, vllm=True, **cfg):
    env = {"POLICY_BUNDLE_ROUTER_CONFIG": str(router_config(tmp_path, name, **cfg)),
           "POLICY_BUNDLE_STATE_DIR": str(tmp_path / f"{name}-state"), "POLICY_BUNDLE_VERSION": version, **vllm_env()}
    if admin:
        env["POLICY_BUNDLE_ADMIN_TOKEN"] = "test-admin-token"
    if not vllm:
        env["POLICY_BUNDLE_DISABLE_VLLM"] = "1"
    return env


def admin(server, action, **extra):
    r = httpx.post(f"{server.url}/admin/rollout", json={"action": action, **extra}, headers=ADMIN, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def complete(server, prompt="358+64=", headers=None, **body):
    return httpx.post(f"{server.url}/v1/completions", headers=headers or {}, timeout=60,
                      json={"model": "policy", "prompt": prompt, "temperature": 0, **body})


async def burst(url, bodies, headers=None, concurrency=8):
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=180) as client:
        async def one(body):
            async with sem:
                return await client.post(f"{url}/v1/completions", json=body, headers=headers or {})
        return await asyncio.gather(*[one(b) for b in bodies])
