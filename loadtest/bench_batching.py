"""The INT8 engine alone: one sequence at a time (token-interleaved) vs continuous batching.

Both on the same TorchScript artifact, side by side in one run, each engine in its own process (two
engines' threads with several intra-op threads each, in one process, slowed each other's decode ~5x through
torch's intra-op thread pools; the batched engine's ``--lanes`` are decode threads of one intra-op thread each).
No HTTP: it drives the engine in process, one of the benchmarks the floors test lets import serve/.

Per concurrency level (closed-loop callers, greedy, ``--new-tokens`` each): generated tokens/s,
requests/s and the inter-token latency p50 / p99 a caller sees. Printed, never asserted.
Run: ``.venv/bin/python -m policy_bundle.loadtest.bench_batching --artifact bundles/reference/int8/policy.ts``
(or ``--bundle DIR``; a real LM: ``--bundle bundles/smollm2``; ``--json OUT``: the table as docs/results/ keeps it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import torch

from policy_bundle.bundle.layout import BundleLayout
from policy_bundle.quantize.percentile import percentile
from policy_bundle.quantize.runtime.script_runner import load_torchscript
from policy_bundle.serve.variants.batching import policy_engine
from policy_bundle.serve.variants.engines import CachedPolicyEngine, SamplingParams


async def level(engine, prompts: List[List[int]], clients: int, seconds: float, new_tokens: int) -> dict:
    itl: List[float] = []
    tokens = requests = 0
    deadline = time.monotonic() + seconds

    async def user(i: int) -> None:
        nonlocal tokens, requests
        n = i
        while time.monotonic() < deadline:
            last = time.perf_counter()
            params = SamplingParams(max_tokens=new_tokens)  # no stop token: every request makes new_tokens
            async for _ in engine.generate(prompts[n % len(prompts)], params):
                now = time.perf_counter()
                itl.append(now - last)
                last = now
                tokens += 1
            requests += 1
            n += clients

    t0 = time.perf_counter()
    await asyncio.gather(*[user(i) for i in range(clients)])
    wall = time.perf_counter() - t0
    return {"clients": clients, "tok_s": tokens / wall, "req_s": requests / wall,
            "itl_p50_ms": 1000 * statistics.median(itl), "itl_p99_ms": 1000 * percentile(itl, 0.99)}


def artifact_path(args) -> Path:
    """``--artifact``, or the INT8 TorchScript of ``--bundle``."""
    return args.artifact or BundleLayout(args.bundle).int8_torchscript


def measure(args) -> List[dict]:
    """One engine's levels, in this process."""
    artifact = artifact_path(args)
    cfg = json.loads((artifact.parent / "config.json").read_text())
    ctx = args.prompt_len + args.new_tokens
    module = load_torchscript(artifact)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, cfg["vocab_size"], (args.prompt_len,), generator=g).tolist() for _ in range(64)]
    if args.engine == "sequential":
        engine = CachedPolicyEngine(module, ctx, "sequential", threads=args.threads)
    else:  # "batched": one decode thread; "lanes": --lanes of them
        lanes = 1 if args.engine == "batched" else args.lanes
        engine = policy_engine(module, ctx, args.engine, threads=args.threads, lanes=lanes)
    asyncio.run(level(engine, prompts, 2, 1.0, args.new_tokens))  # warm-up
    return [asyncio.run(level(engine, prompts, int(c), args.seconds, args.new_tokens)) for c in args.levels.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path)
    ap.add_argument("--artifact", type=Path)
    ap.add_argument("--levels", default="1,4,16,32")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--json", type=Path, help="write the table here (docs/results/NAME.json)")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads of the decode thread (engine_threads)")
    ap.add_argument("--lanes", type=int, default=1,
                    help="the batched engine's decode lanes (engine_lanes; 0: one per --threads usable cores)")
    ap.add_argument("--engine", choices=("sequential", "batched", "lanes"), help=argparse.SUPPRESS)  # the child's part
    args = ap.parse_args()
    if args.engine:
        print(json.dumps(measure(args)))
        return
    names = ["sequential", "batched"] + (["lanes"] if args.lanes != 1 else [])
    results = {}
    for name in names:
        out = subprocess.run([sys.executable, "-m", "policy_bundle.loadtest.bench_batching", *sys.argv[1:],
                              "--engine", name], capture_output=True, text=True, check=True).stdout
        results[name] = json.loads(out.strip().splitlines()[-1])
    from policy_bundle.loadtest.results_doc import markdown, table, write_tables

    artifact = artifact_path(args)
    lead = (f"`{artifact.parent.parent.name}`'s INT8 TorchScript, {args.prompt_len}-token prompts, {args.new_tokens} new "
            f"tokens, {args.seconds:g} s per level, {args.threads} intra-op thread(s) per decode thread, each engine in "
            f"its own process" + (f", lanes: {args.lanes or 'one per usable core'}" if len(names) > 2 else ""))
    labels = {"sequential": "one at a time", "batched": "batched, 1 lane", "lanes": "batched, lanes"}
    columns = ["clients"] + [f"{labels[n]}: tok/s (ITL p50 / p99 ms)" for n in names] + ["batched / one at a time"]
    columns += ["lanes / 1 lane"] if len(names) > 2 else []
    rows = []
    for level_rows in zip(*(results[n] for n in names)):
        cells = [f"{r['tok_s']:.1f} ({r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f})" for r in level_rows]
        ratios = [f"{level_rows[1]['tok_s'] / level_rows[0]['tok_s']:.2f}x"]
        ratios += [f"{level_rows[2]['tok_s'] / level_rows[1]['tok_s']:.2f}x"] if len(level_rows) > 2 else []
        rows.append([level_rows[0]["clients"], *cells, *ratios])
    b = results["batched"]
    notes = [f"Batched, 1 lane: {b[-1]['clients']} clients against {b[0]['clients']} = "
             f"{b[-1]['tok_s'] / b[0]['tok_s']:.2f}x tokens/s."]
    tab = table(columns, rows)
    print(lead + "\n" + markdown(tab) + "\n".join(notes))
    if args.json:
        print(f"figures: {write_tables(args.json, 'bench_batching', lead, [tab], notes, levels=results)}")


if __name__ == "__main__":
    main()
