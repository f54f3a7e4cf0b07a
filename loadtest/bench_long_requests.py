"""Long requests through the router, INT8 against FP16 on vLLM, side by side in one run (printed, never asserted):

- load: ``--clients`` concurrent requests of ``--input-len`` prompt tokens and ``--output-len`` new ones (ignore_eos,
  greedy; vLLM's own serving client, ``bench_vllm_client.run_client``): requests/s, output tok/s, TTFT, failures;
  and the peak resident memory of the variant's worker processes while it ran (vLLM's engine process counted with
  the FP16 worker, its KV space included), sampled every 0.5 s from /proc;
- a long prompt under load: the time to the first token of a ``--long-prompt``-token prompt alone, then while
  ``--decoding`` other requests decode (each streaming, its first token already received).

Every request is pinned to one variant (``x-policy-variant`` + the admin token); the router's golden canary and
shadow calls are off. The router's settings are the product's defaults otherwise (the INT8 engine's KV budget:
``kv_cache_bytes: 0``, vLLM's KV space within a tenth of the memory the worker sees; vLLM's: ``VLLM_CPU_KVCACHE_SPACE``,
1 GiB).

    .venv/bin/python -m policy_bundle.loadtest.bench_long_requests --bundle BUNDLE [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

import httpx

from policy_bundle.bundle.info import BundleInfo
from policy_bundle.bundle.layout import BundleLayout
from policy_bundle.loadtest.bench_vllm_client import MODEL, TOKEN, run_client, served_by_variant, store_version
from policy_bundle.loadtest.procs import server_processes
from policy_bundle.loadtest.servers import Server
from policy_bundle.quantize.runtime.vllm_launch import vllm_env


class PeakMemory:
    """Every 0.5 s, the resident memory summed per variant over its worker and the processes it started."""

    def __init__(self, root_pid: int, label: str = ""):
        self.root_pid, self.peak, self._stop = root_pid, {"int8": 0.0, "fp16": 0.0}, threading.Event()
        self.label = label  # where set, a progress line every 30 s (the load runs for minutes)
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> Dict[str, float]:
        now = {"int8": 0.0, "fp16": 0.0}
        for p in server_processes(self.root_pid):
            role = p.role.split(":")[0]
            if role in now:
                now[role] += p.rss_mb
        return now

    def _run(self) -> None:
        t0 = last = time.monotonic()
        while not self._stop.wait(0.5):
            now = self.sample()
            for k, v in now.items():
                self.peak[k] = max(self.peak[k], v)
            if self.label and time.monotonic() - last >= 30:  # to stderr: vLLM's client holds stdout meanwhile
                last = time.monotonic()
                print(f"  {self.label}: {last - t0:.0f} s in, worker memory {now.get(self.label, 0):.0f} MB, peak "
                      f"{self.peak.get(self.label, 0):.0f} MB", file=sys.stderr, flush=True)

    def __enter__(self) -> "PeakMemory":
        self.peak = self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def prompt_of(tokenizer, n: int, seed: int) -> str:
    """A text of about ``n`` tokens of this tokenizer (words drawn from its vocabulary, re-tokenized to check)."""
    import random

    rng = random.Random(seed)
    words = [w for w in ("river stone light garden paper window music number silver orange forest table").split()]
    text = " ".join(rng.choice(words) for _ in range(n))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:n]
    return tokenizer.decode(ids)


# what each of the other streams asks for: enough to decode on past the long prompt's first token (16 rows step in under
# 0.1 s here), and a worst case (128 + 1024 positions, 5 blocks) that lets 16 of them and the long prompt into the INT8
# engine's default KV budget (4128 positions each asked 16 x 100 MB of SmolLM2-135M's cache, over the 1 GiB budget)
DECODING_TOKENS = 1024


async def first_token_s(client: httpx.AsyncClient, url: str, headers: dict, prompt: str, max_tokens: int,
                        started: Optional[asyncio.Event] = None, done: Optional[asyncio.Event] = None) -> dict:
    """Stream one completion; the seconds to its first text chunk. With ``done``, keep reading until it is set
    (then hang up: the request is cancelled)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    t0 = time.perf_counter()
    ttft = None
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:  # refused: counted as not decoding, and nothing waits for its first token
            if started is not None:
                started.set()
            return {"status": r.status_code, "ttft_s": None, "body": (await r.aread()).decode()[:300]}
        async for line in r.aiter_lines():
            if line.startswith("data: {") and ttft is None:
                ttft = time.perf_counter() - t0
                if started is not None:
                    started.set()
                if done is None:
                    break
            if done is not None and done.is_set():
                break
    return {"status": 200, "ttft_s": ttft}


async def long_prompt_ttft(url: str, variant: str, tokenizer, long_len: int, decoding: int) -> dict:
    headers = {"x-policy-variant": variant, "x-admin-token": TOKEN}
    # two prompts of the same length: vLLM's prefix cache would answer the second from the first's blocks
    long_prompt, other_prompt = prompt_of(tokenizer, long_len, seed=1), prompt_of(tokenizer, long_len, seed=2)
    async with httpx.AsyncClient(timeout=900) as client:
        alone = await first_token_s(client, url, headers, long_prompt, 4)
        done = asyncio.Event()
        starts = [asyncio.Event() for _ in range(decoding)]
        others = [asyncio.create_task(first_token_s(client, url, headers, prompt_of(tokenizer, 128, seed=10 + i),
                                                    DECODING_TOKENS, starts[i], done)) for i in range(decoding)]
        await asyncio.wait_for(asyncio.gather(*[s.wait() for s in starts]), 600)
        await asyncio.sleep(1.0)  # the others are decoding now
        loaded = await first_token_s(client, url, headers, other_prompt, 4)
        done.set()
        rest = await asyncio.gather(*others, return_exceptions=True)
    return {"prompt_tokens": len(tokenizer(long_prompt, add_special_tokens=False)["input_ids"]),
            "alone_ttft_s": alone["ttft_s"], "loaded_ttft_s": loaded["ttft_s"], "decoding": decoding,
            "decoding_ok": sum(1 for x in rest if isinstance(x, dict) and x.get("status") == 200),
            "statuses": [alone["status"], loaded["status"]], "loaded_body": loaded.get("body")}


def bench(bundle: Path, a, tmp: Path, variants: List[str]) -> Dict[str, dict]:
    from transformers import AutoTokenizer

    version = store_version(bundle)
    (tmp / "router.yaml").write_text(json.dumps({
        "max_inflight": a.clients + a.decoding + 8,
        "rollout": {"golden_interval_s": 36000, "analysis_interval_s": 36000, "shadow_fraction": 0.0}}))
    env = {"POLICY_BUNDLE_ADMIN_TOKEN": TOKEN, "POLICY_BUNDLE_STATE_DIR": str(tmp / "state"),
           "POLICY_BUNDLE_ROUTER_CONFIG": str(tmp / "router.yaml"), "POLICY_BUNDLE_VERSION": version, **vllm_env()}
    t0 = time.monotonic()
    server = Server(env, tmp / "router.log").wait_ready(900)
    tokenizer_dir = BundleLayout(bundle).fp16_dir
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    out: Dict[str, dict] = {}
    try:
        status = httpx.get(f"{server.url}/status", timeout=30).json()
        print(f"router up in {time.monotonic() - t0:.0f} s; engines "
              f"{ {v: status['variants'][v]['engine'] for v in variants} }", flush=True)
        for variant in variants:
            engine = status["variants"][variant]["engine"]
            before = served_by_variant(server.url)
            with PeakMemory(server.proc.pid, variant) as mem:
                idle = dict(mem.peak)
                row = run_client(server.port, tokenizer_dir, a.clients, a, tmp / "results", f"{variant}-load",
                                 {"x-policy-variant": variant, "x-admin-token": TOKEN}, tmp / "client.log")
            served = {k: v - before.get(k, 0) for k, v in served_by_variant(server.url).items()}
            print(f"  {variant}: load done ({row['completed']} ok, {row['failed']} failed), peak "
                  f"{mem.peak[variant]:.0f} MB; long prompt next", flush=True)
            ttft = asyncio.run(long_prompt_ttft(server.url, variant, tokenizer, a.long_prompt, a.decoding))
            batch = httpx.get(f"{server.url}/status", timeout=30).json()["variants"][variant].get("batch") or {}
            out[variant] = {**row, "engine": engine, "served_by": served, "idle_rss_mb": idle[variant],
                            "peak_rss_mb": mem.peak[variant], "kv_bytes_per_token": batch.get("kv_bytes_per_token"),
                            "kv_budget_bytes": batch.get("kv_budget_bytes"), "long_prompt": ttft}
            print(f"  {variant}: long prompt {ttft}", flush=True)
    finally:
        server.stop()
    return out


def table(results: Dict[str, dict]) -> str:
    lines = [f"{'variant':8s} {'engine':22s} {'ok':>6s} {'req/s':>6s} {'out tok/s':>9s} {'TTFT p50 ms':>11s} "
             f"{'peak MB':>8s} {'idle MB':>8s} {'long TTFT alone / loaded s':>27s}"]
    for v, r in results.items():
        lp = r["long_prompt"]

        def s(x):
            return f"{x:.2f}" if x is not None else "-"
        lines.append(f"{v:8s} {r['engine'][:22]:22s} {r['completed']:3d}/{r['completed'] + r['failed']:<2d} "
                     f"{r['req_s']:6.3f} {r['out_tok_s']:9.1f} {r['ttft_p50_ms'] or 0:11.0f} {r['peak_rss_mb']:8.0f} "
                     f"{r['idle_rss_mb']:8.0f} {s(lp['alone_ttft_s']):>13s} / {s(lp['loaded_ttft_s']):<11s}")
    if {"int8", "fp16"} <= set(results):
        i, f = results["int8"], results["fp16"]
        lines.append(f"INT8 / FP16: req/s {i['req_s'] / f['req_s']:.2f}x, peak worker memory "
                     f"{i['peak_rss_mb'] / f['peak_rss_mb']:.2f}x")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=1500)
    ap.add_argument("--output-len", type=int, default=500)
    ap.add_argument("--long-prompt", type=int, default=6000)
    ap.add_argument("--decoding", type=int, default=16)
    ap.add_argument("--targets", default="int8,fp16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--workdir", type=Path)
    a = ap.parse_args(argv)
    a.num_prompts = a.clients  # one wave: every client sends one request
    a.warmups = 2  # the engines warmed up, without a second wave of long requests
    bundle = a.bundle.resolve()
    context = BundleInfo.read(bundle).max_seq_len
    if max(a.input_len + 1 + a.output_len, a.long_prompt + 4) > context:
        ap.error(f"--input-len + --output-len or --long-prompt exceed the bundle's context ({context} tokens)")
    variants = [t for t in a.targets.split(",") if t]
    if set(variants) - {"int8", "fp16"}:
        ap.error(f"--targets: int8 and/or fp16, not {a.targets}")
    tmp = a.workdir or Path(tempfile.mkdtemp(prefix="bench-long-"))
    tmp.mkdir(parents=True, exist_ok=True)
    os.environ.update(vllm_env())
    print(f"bundle {bundle} (context {context}); {a.clients} clients x ({a.input_len} + {a.output_len}) tokens; "
          f"a {a.long_prompt}-token prompt beside {a.decoding} decoding; {os.cpu_count()} cores "
          f"({platform.processor() or platform.machine()}); logs in {tmp}", flush=True)
    results = bench(bundle, a, tmp, variants)
    print("\n" + table(results))
    report = {"bundle": str(bundle), "context_tokens": context, "cores": os.cpu_count(), "results": results,
              "settings": {k: getattr(a, k) for k in ("clients", "input_len", "output_len", "long_prompt", "decoding")}}
    if a.json:
        a.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
