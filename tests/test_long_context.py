"""The policy's own context, over a real `bentoml serve`: a bundle built without ``policy.max_seq_len`` serves the
model's 8192 positions; a 6000-token prompt and 2000 new tokens are answered (streamed and plain alike); 32
concurrent long requests against a small KV budget are each answered or refused with a 429 and ``Retry-After``,
the cache never past its budget, and everything back to 0 afterwards (the engine side: tests/test_kv_budget.py)."""

import asyncio
import json
import threading
import time

import httpx
import pytest
import yaml

from cli_helpers import SMALL, run_cli
from policies import WORDS, sentencepiece_policy
from serve_helpers import Server, bundle_version, sse_events

CONTEXT = 8192
# this model's KV costs 256 bytes a position in the INT8 artifact's float16 cache (the build's default) and 512 in the
# FP fallback's float32 one: the budget takes one 6144-position request of either, and 8192 positions of INT8 only
BUDGET = int(3.5 * 2**20)
FORCE = {v: {"x-policy-variant": v, "x-admin-token": "t"} for v in ("int8", "fp16")}


def words(n: int, seed: int = 0) -> str:
    return " ".join(WORDS[(i * 7 + seed) % len(WORDS)] for i in range(n))


@pytest.fixture(scope="module")
def long_server(tmp_path_factory, bentoml_home):
    tmp = tmp_path_factory.mktemp("long")
    policy = sentencepiece_policy(tmp / "policy", max_positions=CONTEXT)
    out = tmp / "bundle"
    res = run_cli("build", "--config", "build/configs/main.yaml", "--out", str(out), *SMALL,
                  "--set", f"policy.source={policy}", "--set", "gate.enabled=false", "--set", "export.onnx=false",
                  "--set", "calibration.procs=0", "--set", "name=long")  # policy.max_seq_len unset: the model's own
    assert res.returncode == 0, res.stderr[-3000:]
    config = tmp / "router.yaml"
    config.write_text(yaml.safe_dump({"kv_cache_bytes": BUDGET, "kv_wait_s": 4.0, "max_inflight": 40,
                                      "request_timeout_s": 120.0,
                                      "rollout": {"analysis_interval_s": 3600, "golden_interval_s": 3600,
                                                  "shadow_fraction": 0.0}}))
    env = {"POLICY_BUNDLE_VERSION": bundle_version(out), "POLICY_BUNDLE_STATE_DIR": str(tmp / "state"),
           "POLICY_BUNDLE_ADMIN_TOKEN": "t", "POLICY_BUNDLE_DISABLE_VLLM": "1", "POLICY_BUNDLE_ROUTER_CONFIG": str(config)}
    server = Server(env, tmp / "server.log").wait_ready()
    yield server
    server.stop()


def post(server, path, body, headers=None, timeout=300):
    return httpx.post(f"{server.url}/v1/{path}", json={"model": "policy", "temperature": 0, **body},
                      headers=headers or {}, timeout=timeout)


def test_the_context_is_the_models_own(long_server):
    models = httpx.get(f"{long_server.url}/v1/models", timeout=30).json()["data"]
    assert models[0]["max_model_len"] == CONTEXT


@pytest.mark.parametrize("variant", ["int8", "fp16"])
def test_a_6000_token_prompt_is_answered_and_one_past_the_context_is_refused_with_the_numbers(long_server, variant):
    r = post(long_server, "completions", {"prompt": words(6000), "max_tokens": 8}, FORCE[variant])
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] >= 6000 and r.json()["usage"]["completion_tokens"] == 8
    err = post(long_server, "completions", {"prompt": words(CONTEXT + 10), "max_tokens": 8}, FORCE[variant])
    assert err.status_code == 400 and str(CONTEXT) in err.json()["error"]["message"]


def test_a_request_whose_worst_case_exceeds_the_whole_kv_budget_is_a_400_naming_max_tokens(long_server):
    r = post(long_server, "completions", {"prompt": words(6000), "max_tokens": 2000}, FORCE["fp16"])
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert "kv_cache_bytes" in r.json()["error"]["message"]


def test_the_int8_16_bit_cache_takes_a_request_twice_its_float32_size(long_server):
    """The same worst case (8192 positions) on INT8, whose float16 cache costs half of the fallback's float32 one a
    token: within the budget, answered in full."""
    batches = {n: v["batch"] for n, v in httpx.get(f"{long_server.url}/status", timeout=30).json()["variants"].items()}
    assert batches["int8"]["kv_bytes_per_token"] * 2 == batches["fp16"]["kv_bytes_per_token"] == 512
    r = post(long_server, "completions", {"prompt": words(6000), "max_tokens": 2000, "ignore_eos": True}, FORCE["int8"])
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2000, r.text[:300]


@pytest.mark.parametrize("variant", ["int8", "fp16"])
def test_2000_new_tokens_are_answered_in_full_and_streamed_as_the_same_text(long_server, variant):
    body = {"prompt": words(12), "max_tokens": 2000, "ignore_eos": True}
    plain = post(long_server, "completions", body, FORCE[variant])
    assert plain.status_code == 200, plain.text
    done = plain.json()
    assert done["usage"]["completion_tokens"] == 2000 and done["choices"][0]["finish_reason"] == "length"
    with httpx.stream("POST", f"{long_server.url}/v1/completions", headers=FORCE[variant], timeout=300,
                      json={"model": "policy", "temperature": 0, **body, "stream": True}) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    streamed = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert streamed == done["choices"][0]["text"] and len(streamed.split()) >= 1500


def test_a_6000_token_prompt_joins_short_streams_at_once_holding_only_its_own_blocks(long_server):
    """Four streams of 1000 new tokens hold four blocks each (1 MiB of the 3.5 MiB budget); a 6000-token prompt sent
    while they decode holds its own 24 blocks beside them (1.5 MiB) and is answered before any of them ends. A dense
    cache of slots x the longest sequence (8 slots x 6144 positions: 12 MiB) could not take it until they had left:
    it waited ``kv_wait_s`` for them and got a 429."""
    url = f"{long_server.url}/v1/completions"

    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            started = [asyncio.Event() for _ in range(4)]

            async def short(i):
                body = {"model": "policy", "temperature": 0, "prompt": words(10, i), "max_tokens": 1000,
                        "ignore_eos": True, "stream": True}
                async with client.stream("POST", url, headers=FORCE["int8"], json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data:"):
                            started[i].set()
                return time.monotonic()
            streams = [asyncio.ensure_future(short(i)) for i in range(4)]
            await asyncio.wait_for(asyncio.gather(*[e.wait() for e in started]), 120)
            long = await client.post(url, headers=FORCE["int8"], json={"model": "policy", "temperature": 0,
                                                                       "prompt": words(6000, 3), "max_tokens": 4})
            answered = time.monotonic()
            return long, answered, await asyncio.gather(*streams)
    long, answered, ended = asyncio.run(run())
    assert long.status_code == 200, long.text[:300]
    assert answered < min(ended), (answered, ended)  # beside the streams, not after them


def test_32_concurrent_long_requests_on_a_small_budget_are_answered_or_refused_with_retry_after(long_server):
    """Each request's worst case is 2048 positions (0.5 MiB on INT8, 1 MiB on the fallback): the 3.5 MiB budget takes
    a few at a time per variant (half the requests forced to each).
    Every request is a 200 with all its tokens or a 429 with Retry-After; the caches never pass the budget; the
    router's slots, the budget held and the caches are back to 0 afterwards."""
    peaks, stop = {"int8": 0, "fp16": 0}, threading.Event()

    def watch():
        while not stop.is_set():
            for name, v in httpx.get(f"{long_server.url}/status", timeout=30).json()["variants"].items():
                batch = v.get("batch") or {}
                peaks[name] = max(peaks[name], batch.get("kv_allocated_bytes") or 0, batch.get("kv_held_bytes") or 0)
            time.sleep(0.2)

    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*[client.post(f"{long_server.url}/v1/completions", headers=FORCE[
                ("int8", "fp16")[i % 2]], json={"model": "policy", "prompt": words(1500, i), "max_tokens": 500,
                                               "ignore_eos": True, "temperature": 0}) for i in range(32)])
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        results = asyncio.run(run())
    finally:
        stop.set()
        watcher.join()
    ok = [r for r in results if r.status_code == 200]
    refused = [r for r in results if r.status_code == 429]
    assert len(ok) + len(refused) == 32, [r.text[:200] for r in results if r.status_code not in (200, 429)]
    assert ok and all(r.json()["usage"]["completion_tokens"] == 500 for r in ok)
    assert all(r.headers.get("retry-after") and r.json()["error"]["code"] == "rate_limited" for r in refused)
    assert 0 < min(peaks.values()) and max(peaks.values()) <= BUDGET, peaks  # both variants served, within it
    print(f"32 long requests: {len(ok)} answered, {len(refused)} refused (429); KV peaks {peaks}")
    deadline = time.monotonic() + 30
    while True:
        status = httpx.get(f"{long_server.url}/status", timeout=30).json()
        batches = [v.get("batch") or {} for v in status["variants"].values()]
        idle = status["inflight"] == 0 and all(not b.get("kv_held_bytes") and not b.get("kv_allocated_bytes")
                                               and not b.get("kv_blocks")
                                               and not b.get("active") for b in batches)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert idle, status
