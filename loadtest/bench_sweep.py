"""Concurrency sweep through the served bundle, per variant: requests/s, tokens/s, p50/p99 at
1, 2, 4, 8, 16 and 32 closed-loop clients, the knee of the latency curve, and the peak resident
memory of each variant's worker (with its child processes: vLLM's engine core is one).

Printed, never asserted; both variants are measured in one run against one server. Needs a bundle
in the BentoML store (``policy-bundle build ...``). FP16 is served by vLLM where it is importable.
Run: ``.venv/bin/python -m policy_bundle.loadtest.bench_sweep [--seconds 8] [--max-tokens 8]``; it serves the
newest bundle of the BentoML store (``BENTOML_HOME``), or ``POLICY_BUNDLE_VERSION``.

Each variant is warmed up at the top concurrency first (3 s), so no level pays a one-time KV-cache growth.

The knee is the last concurrency before adding clients stops buying throughput: the first level
whose next doubling raises requests/s by less than 10 % (latency only grows from there on).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from typing import List

import aiohttp
import httpx

from policy_bundle.loadtest.load import tree_rss_mb
from policy_bundle.loadtest.servers import Server
from policy_bundle.quantize.percentile import percentile
from policy_bundle.quantize.reference.task import rollout_prompts
from policy_bundle.quantize.runtime.vllm_launch import vllm_env

TOKEN = "bench-admin-token"
LEVELS = (1, 2, 4, 8, 16, 32)


def worker_pid(service: str) -> int:
    """PID of the BentoML worker that runs ``service`` (from /proc)."""
    for cmd in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmd.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--service-name" in argv and argv[argv.index(b"--service-name") + 1].decode() == service:
            return int(cmd.parent.name)
    raise RuntimeError(f"no worker process for {service}")


async def level(url: str, variant: str, clients: int, seconds: float, max_tokens: int, pid: int) -> dict:
    """``clients`` closed-loop users forced onto ``variant`` for ``seconds``; memory sampled meanwhile."""
    prompts = rollout_prompts(256)
    headers = {"x-policy-variant": variant, "x-admin-token": TOKEN}
    lat, tokens, peak = [], 0, 0.0
    deadline = time.monotonic() + seconds
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120),
                                     connector=aiohttp.TCPConnector(limit=clients)) as session:
        async def user(i: int) -> None:
            nonlocal tokens
            n = i
            while time.monotonic() < deadline:
                body = {"model": "policy", "prompt": prompts[n % len(prompts)], "max_tokens": max_tokens,
                        "temperature": 0}
                t = time.perf_counter()
                async with session.post(f"{url}/v1/completions", json=body, headers=headers) as r:
                    data = await r.json()
                    if r.status != 200:
                        raise RuntimeError(f"{variant} c={clients}: HTTP {r.status} {data}")
                lat.append(time.perf_counter() - t)
                tokens += data["usage"]["completion_tokens"]
                n += clients

        async def sample() -> None:
            nonlocal peak
            while time.monotonic() < deadline:
                peak = max(peak, tree_rss_mb(pid))
                await asyncio.sleep(0.25)

        t0 = time.perf_counter()
        await asyncio.gather(sample(), *[user(i) for i in range(clients)])
        wall = time.perf_counter() - t0
    return {"clients": clients, "requests": len(lat), "rps": len(lat) / wall, "tok_s": tokens / wall,
            "p50_ms": 1000 * percentile(lat, 0.5), "p99_ms": 1000 * percentile(lat, 0.99), "peak_rss_mb": peak}


def knee(rows: List[dict]) -> dict:
    for row, nxt in zip(rows, rows[1:]):
        if nxt["rps"] < 1.10 * row["rps"]:
            return row
    return rows[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=8.0, help="per concurrency level")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-sweep-"))
    env = vllm_env(POLICY_BUNDLE_ADMIN_TOKEN=TOKEN, POLICY_BUNDLE_STATE_DIR=str(tmp / "state"))
    (tmp / "router.yaml").write_text(json.dumps({"max_inflight": 64}))  # the sweep goes past the default cap
    env["POLICY_BUNDLE_ROUTER_CONFIG"] = str(tmp / "router.yaml")
    server = Server(env, tmp / "server.log").wait_ready(600)
    results = {}
    try:
        status = json.loads(httpx.get(f"{server.url}/status", timeout=30).text)
        engines = {v: status["variants"][v]["engine"] for v in ("int8", "fp16")}
        print(f"engines: {engines}; {os.cpu_count()} cores; {args.seconds:.0f} s per level, "
              f"max_tokens {args.max_tokens}")
        for variant, service in (("int8", "int8-policy"), ("fp16", "fp16-policy")):
            pid = worker_pid(service)
            # warm-up at the top concurrency: the INT8 engine grows its KV cache on demand where vLLM allocates its
            # own at start, and a growth inside a timed level is a one-time cost, not that level's throughput
            asyncio.run(level(server.url, variant, LEVELS[-1], 3.0, args.max_tokens, pid))
            rows = [asyncio.run(level(server.url, variant, c, args.seconds, args.max_tokens, pid)) for c in LEVELS]
            batch = json.loads(httpx.get(f"{server.url}/status", timeout=30).text)["variants"][variant].get("batch")
            results[variant] = {"engine": engines[variant], "levels": rows, "knee": knee(rows)["clients"], "batch": batch}
            print(f"\n== {variant} ({engines[variant]})" + (f", peak decode batch {batch['peak_batch']}" if batch else ""))
            print(f"{'clients':>8s} {'req/s':>8s} {'tok/s':>8s} {'p50 ms':>8s} {'p99 ms':>8s} {'peak MB':>8s}")
            for r in rows:
                mark = "  <- knee" if r["clients"] == results[variant]["knee"] else ""
                print(f"{r['clients']:8d} {r['rps']:8.1f} {r['tok_s']:8.1f} {r['p50_ms']:8.0f} {r['p99_ms']:8.0f} "
                      f"{r['peak_rss_mb']:8.0f}{mark}")
        i8, f16 = results["int8"]["levels"], results["fp16"]["levels"]
        print("\n== int8 / fp16 ratios (same run)")
        print(f"{'clients':>8s} {'req/s':>8s} {'p99':>8s}")
        for a, b in zip(i8, f16):
            print(f"{a['clients']:8d} {a['rps'] / b['rps']:8.2f} {a['p99_ms'] / b['p99_ms']:8.2f}")
        peak = {v: max(r["peak_rss_mb"] for r in results[v]["levels"]) for v in results}
        print(f"peak worker memory: int8 {peak['int8']:.0f} MB, fp16 {peak['fp16']:.0f} MB "
              f"({peak['int8'] / peak['fp16']:.2f}x)")
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
