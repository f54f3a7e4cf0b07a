"""Router overhead and throughput, measured side by side in one run (printed, never asserted).

Starts the served bundle (router + both variants) and each variant service on its own, then:
- added latency: p50/p99 of the same greedy request through the router (variant forced) vs posted
  straight to that variant's own ``/generate``;
- requests/s at 1, 8 and 32 concurrent clients per variant through the router.
Needs a bundle in the BentoML store (``policy-bundle build ...``). Run:
``.venv/bin/python -m policy_bundle.loadtest.bench_router [--requests 200]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

import httpx

from policy_bundle.loadtest.servers import Server
from policy_bundle.quantize.percentile import percentile
from policy_bundle.quantize.runtime.vllm_launch import vllm_env

TOKEN = "bench-admin-token"
PROMPT = "358+64="


async def timed_posts(url: str, payload: dict, headers: dict, n: int, concurrency: int) -> tuple[list, float]:
    sem = asyncio.Semaphore(concurrency)
    lat = []
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=concurrency)) as client:
        async def one():
            async with sem:
                t = time.perf_counter()
                r = await client.post(url, json=payload, headers=headers)
                r.raise_for_status()
                lat.append(time.perf_counter() - t)
        t0 = time.perf_counter()
        await asyncio.gather(*[one() for _ in range(n)])
        return lat, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-router-"))
    # the router's own cost: no golden-canary runs or shadow calls competing with the measured requests
    (tmp / "router.yaml").write_text("rollout: {golden_interval_s: 36000, analysis_interval_s: 36000, "
                                     "shadow_fraction: 0.0}\n")
    env = vllm_env(POLICY_BUNDLE_ADMIN_TOKEN=TOKEN, POLICY_BUNDLE_STATE_DIR=str(tmp / "state"),
                   POLICY_BUNDLE_ROUTER_CONFIG=str(tmp / "router.yaml"))
    servers = {"router": Server(env, tmp / "router.log"),
               "int8": Server(env, tmp / "int8.log", target="policy_bundle.serve.variants.services:Int8Policy")}
    for s in servers.values():
        s.wait_ready(360)
    servers["fp16"] = Server(env, tmp / "fp16.log",
                             target="policy_bundle.serve.variants.services:Fp16Policy").wait_ready(360)
    try:
        status = httpx.get(f"{servers['router'].url}/status", timeout=30).json()
        print(f"variants: int8={status['variants']['int8']['engine']} fp16={status['variants']['fp16']['engine']}")
        prompt_ids = [1, 6, 8, 11, 13, 9, 7, 14]  # "<s>358+64=" in the reference tokenizer
        body = {"model": "policy", "prompt": PROMPT, "temperature": 0, "max_tokens": 6}
        direct = {"prompt_ids": prompt_ids, "max_tokens": 6, "temperature": 0.0, "stop_token_id": 2}
        print(f"\n== added latency ({args.requests} sequential requests each, ms)")
        print(f"{'variant':8s} {'direct p50':>11s} {'router p50':>11s} {'added p50':>10s} {'direct p99':>11s} "
              f"{'router p99':>11s} {'added p99':>10s}")
        for v in ("int8", "fp16"):
            hdr = {"x-policy-variant": v, "x-admin-token": TOKEN}
            d, _ = asyncio.run(timed_posts(f"{servers[v].url}/generate", direct, {}, args.requests, 1))
            r, _ = asyncio.run(timed_posts(f"{servers['router'].url}/v1/completions", body, hdr, args.requests, 1))
            d50, r50, d99, r99 = (percentile(x, q) * 1e3 for q in (0.5, 0.99) for x in (d, r))
            print(f"{v:8s} {d50:11.1f} {r50:11.1f} {r50 - d50:10.1f} {d99:11.1f} {r99:11.1f} {r99 - d99:10.1f}")
        print("\n== requests/s through the router (6 new tokens per request)")
        print(f"{'variant':8s} " + " ".join(f"{f'c={c}':>12s}" for c in (1, 8, 32)) + "   p99 ms at c=32")
        for v in ("int8", "fp16"):
            hdr = {"x-policy-variant": v, "x-admin-token": TOKEN}
            row, last = [], None
            for c in (1, 8, 32):
                lat, wall = asyncio.run(timed_posts(f"{servers['router'].url}/v1/completions", body, hdr,
                                                    max(60, 4 * c), c))
                row.append(len(lat) / wall)
                last = lat
            print(f"{v:8s} " + " ".join(f"{x:12.1f}" for x in row) + f"   {percentile(last, 0.99) * 1e3:.0f}")
        print(f"\nmachine: {os.cpu_count()} cores. Logs: {tmp}")
    finally:
        for s in servers.values():
            s.stop()


if __name__ == "__main__":
    main()
