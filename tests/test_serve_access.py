"""A router server with API keys, no admin token, a concurrency cap of 1 and no vLLM, started with
``policy-bundle serve``: who may call what, the FP16 fallback reported, 429 at the cap."""

import asyncio
import re

import httpx
import pytest

from cli_helpers import CLI
from serve_helpers import FORCE_INT8, Server, bundle_version, burst, complete, env_for


class CliServer(Server):
    """The router started by ``policy-bundle serve`` (the CLI's own command), not ``bentoml serve`` itself."""

    def command(self, target: str) -> list:
        return [*CLI, "serve", "--host", "127.0.0.1", "--port", str(self.port)]


@pytest.fixture(scope="module")
def locked(small_bundle, state):
    env = env_for(state, "locked", bundle_version(small_bundle), admin=False, vllm=False, max_inflight=1)
    env["POLICY_BUNDLE_API_KEYS"] = "key-one,key-two"
    server = CliServer(env, state / "locked.log").wait_ready()
    yield server
    server.stop()


def test_api_keys_guard_inference_routes(locked):
    assert complete(locked).status_code == 401
    assert complete(locked, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert complete(locked, headers={"Authorization": "Bearer key-two"}).status_code == 200
    # what the service knows is not public either: its state, metrics, spec (both of BentoML's) and docs page
    for path in ("/status", "/metrics", "/v1/models", "/docs.json", "/schema.json", "/"):
        assert httpx.get(f"{locked.url}{path}", timeout=30).status_code == 401, path
        assert httpx.get(f"{locked.url}{path}", headers={"Authorization": "Bearer key-one"}, timeout=30).status_code == 200
    for probe in ("/readyz", "/livez", "/healthz"):  # infrastructure probes stay open
        assert httpx.get(f"{locked.url}{probe}", timeout=30).status_code == 200, probe
    assert "serving without API keys" not in locked.log.read_text()


def test_admin_api_is_disabled_without_a_token(locked):
    r = httpx.get(f"{locked.url}/admin/rollout", headers={"Authorization": "Bearer anything"})
    assert r.status_code == 403 and "disabled" in r.json()["error"]["message"]
    assert complete(locked, headers={"Authorization": "Bearer key-one", **FORCE_INT8}).status_code == 403


def test_fp16_fallback_is_reported_without_vllm(locked):
    key = {"Authorization": "Bearer key-one"}
    status = httpx.get(f"{locked.url}/status", headers=key, timeout=30).json()
    assert status["variants"]["fp16"]["engine"] == "policy-module-fp32"
    assert "vllm is switched off (POLICY_BUNDLE_DISABLE_VLLM)" in status["variants"]["fp16"]["fallback"]
    assert status["variants"]["fp16"]["expected_engine"] and status["ready"]  # switched off on purpose: ready
    assert re.search(r"^policy_fp16_fallback(\{[^}]*\})? 1\.0", httpx.get(f"{locked.url}/metrics", headers=key).text,
                     re.M)


def test_concurrency_cap_answers_429_with_retry_after(locked):
    body = {"model": "policy", "prompt": "358+64=", "temperature": 0, "max_tokens": 6}
    responses = asyncio.run(burst(locked.url, [body] * 12, {"Authorization": "Bearer key-one"}, concurrency=12))
    codes = [r.status_code for r in responses]
    assert 429 in codes and 200 in codes and set(codes) <= {200, 429}
    limited = next(r for r in responses if r.status_code == 429)
    assert limited.headers["retry-after"] == "1" and limited.json()["error"]["limit"] == 1
    # the cap held for the whole burst: never two calls in flight at once
    metrics = httpx.get(f"{locked.url}/metrics", headers={"Authorization": "Bearer key-one"}).text
    assert re.search(r"^policy_inflight_peak(\{[^}]*\})? 1\.0$", metrics, re.M), metrics[-2000:]
