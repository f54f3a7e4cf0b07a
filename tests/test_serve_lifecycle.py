"""Serving lifecycle over real `bentoml serve` processes: a SIGTERM lets in-flight requests finish,
and the INT8 variant's adaptive-batched `score` API batches concurrent callers and answers each
one exactly what an unbatched forward gives."""

import asyncio
import json
import os
import re
import signal

import httpx
import pytest
import torch

from policy_bundle.serve.variants.engines import last_position_logits
from serve_helpers import Server, bundle_version

SLOW_S = 0.25  # seconds per generated token under the injected `slow` fault


def env(tmp_path, version, **extra):
    return {"POLICY_BUNDLE_STATE_DIR": str(tmp_path / "state"), "POLICY_BUNDLE_VERSION": version,
            "POLICY_BUNDLE_DISABLE_VLLM": "1", **extra}


def test_sigterm_lets_in_flight_requests_finish(small_bundle, tmp_path):
    server = Server(env(tmp_path, bundle_version(small_bundle), POLICY_BUNDLE_TEST_FAULT=f"slow:factor={SLOW_S}"),
                    tmp_path / "server.log").wait_ready()
    body = {"model": "policy", "temperature": 0, "max_tokens": 6}

    async def scenario():
        async with httpx.AsyncClient(timeout=60) as client:
            plain = [asyncio.create_task(client.post(f"{server.url}/v1/completions", json={**body, "prompt": p}))
                     for p in ("358+64=", "12+34=", "999+1=")]

            async def streamed():
                async with client.stream("POST", f"{server.url}/v1/completions",
                                         json={**body, "prompt": "71+29=", "stream": True}) as r:
                    return r.status_code, [line async for line in r.aiter_lines() if line]

            stream = asyncio.create_task(streamed())
            await asyncio.sleep(3 * SLOW_S)  # every request is now mid-generation
            inflight = (await client.get(f"{server.url}/status")).json()["inflight"]
            os.killpg(server.proc.pid, signal.SIGTERM)
            return inflight, await asyncio.gather(*plain), await stream

    try:
        inflight, answers, (stream_status, lines) = asyncio.run(scenario())
        exit_code = server.proc.wait(timeout=60)
    finally:
        server.stop()
    assert inflight == 4
    for r in answers:
        assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
    assert stream_status == 200 and lines[-1] == "data: [DONE]" and len(lines) >= 3
    assert exit_code == 0
    with pytest.raises(httpx.ConnectError):  # and nothing is listening any more
        httpx.get(f"{server.url}/readyz", timeout=5)


def test_score_api_batches_concurrent_callers_with_unbatched_results(small_bundle, tmp_path):
    server = Server(env(tmp_path, bundle_version(small_bundle)), tmp_path / "int8.log",
                    target="policy_bundle.serve.variants.services:Int8Policy").wait_ready()
    rng = torch.Generator().manual_seed(0)
    vocab = json.loads((small_bundle / "int8" / "config.json").read_text())["vocab_size"]
    sequences = [torch.randint(3, vocab, (n,), generator=rng).tolist() for n in [5] * 12 + [8] * 12]

    async def call_all():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*[client.post(f"{server.url}/score", json={"sequences": [s]})
                                          for s in sequences])

    try:
        responses = asyncio.run(call_all())
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        bad = httpx.post(f"{server.url}/score", json={"sequences": [[1, vocab]]}, timeout=30)
    finally:
        server.stop()
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200][:2]
    scripted = torch.jit.load(str(small_bundle / "int8" / "policy.ts"))
    for seq, r in zip(sequences, responses):
        # alone, over the whole 32-position attention block a generation's prefill attends over (``attention_len``:
        # the fused attention kernel's sums depend on how many keys it runs over, masked or not)
        expected = torch.tensor(last_position_logits(scripted, [seq])[0])
        got = torch.tensor(r.json()[0])
        assert torch.allclose(got, expected, atol=1e-4), (seq, (got - expected).abs().max())
    # BentoML's adaptive batcher histogram: more calls than batches means callers shared forwards
    count = float(re.search(r'^bentoml_service_adaptive_batch_size_count\{[^}]*\} (\S+)', metrics, re.M).group(1))
    total = float(re.search(r'^bentoml_service_adaptive_batch_size_sum\{[^}]*\} (\S+)', metrics, re.M).group(1))
    assert total == len(sequences) and count < total
    assert bad.status_code == 400 and f"token id {vocab} is outside the vocabulary" in bad.text
