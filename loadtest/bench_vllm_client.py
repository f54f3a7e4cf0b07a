"""vLLM's own serving benchmark client against the router (INT8 pinned, FP16 pinned) and against a plain
``vllm serve`` of the bundle's ``fp16/`` directory, side by side in one run (printed, never asserted).

The client is ``vllm.benchmarks.serve`` (what ``vllm bench serve`` runs), called in-process: backend
``openai`` (streamed ``/v1/completions`` with ``stream_options.include_usage`` and ``ignore_eos``),
dataset ``random`` drawn from the bundle's own tokenizer (``--tokenizer <bundle>/fp16``), greedy,
``--max-concurrency`` per level. Each run's result JSON (``--save-result``) is read back and reduced to
request throughput, output tok/s, TTFT p50/p99 and ITL p50/p99.

Targets:
- ``int8`` / ``fp16``: ``bentoml serve policy_bundle.serve.router.service:PolicyRouter`` for the bundle, every
  request forced onto one variant (``x-policy-variant`` + the admin token, the client's ``--header``);
  the router's ``/metrics`` counters confirm which variant served them. Golden canary and shadow calls
  are off, so the variant's own requests are what is measured.
- ``vllm-direct``: ``python -m vllm.entrypoints.openai.api_server`` on ``<bundle>/fp16`` (float16,
  ``max-model-len`` = the bundle's context, eager mode like the router's FP16 engine), loopback only.

The bundle must be in the BentoML store (``policy-bundle build`` registers it); one that is not is
registered under the version a build would give it. Run:
``.venv/bin/python -m policy_bundle.loadtest.bench_vllm_client --bundle bundles/reference [--json out.json]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import httpx

from policy_bundle.bundle.info import BundleInfo
from policy_bundle.bundle.layout import BundleLayout
from policy_bundle.bundle.manifest import manifest_hash
from policy_bundle.loadtest.servers import ROOT, Server
from policy_bundle.quantize.runtime.vllm_launch import serve_cli_args, vllm_env

TOKEN = "bench-admin-token"
MODEL = "policy"  # the router's served model name (serve/settings.py); vllm-direct serves the same name
TARGETS = ("int8", "fp16", "vllm-direct")
FIELDS = {"req_s": "request_throughput", "out_tok_s": "output_throughput", "ttft_p50_ms": "median_ttft_ms",
          "ttft_p99_ms": "p99_ttft_ms", "itl_p50_ms": "median_itl_ms", "itl_p99_ms": "p99_itl_ms"}


def store_version(bundle: Path) -> str:
    """The bundle's store version (``<name>-<manifest hash[:12]>``, as a build registers it); registered
    here if the store lacks it."""
    import bentoml

    from policy_bundle.build.artifacts.register import register_bundle

    name = json.loads(BundleLayout(bundle).manifest.read_text())["config"]["name"]
    sha = manifest_hash(bundle)
    version = f"{name}-{sha[:12]}"
    try:
        bentoml.models.get(f"policy-int8:{version}")
        bentoml.models.get(f"policy-fp16:{version}")
    except bentoml.exceptions.NotFound:
        print(f"registering {bundle} as policy-int8/policy-fp16:{version}")
        register_bundle(bundle, version, sha)
    return version


def client_args(port: int, tokenizer: Path, concurrency: int, a, result_dir: Path, name: str,
                headers: Dict[str, str]) -> argparse.Namespace:
    """The argparse namespace ``vllm bench serve`` would build from these flags."""
    from vllm.benchmarks import serve as bench

    parser = argparse.ArgumentParser()
    bench.add_cli_args(parser)
    argv = ["--backend", "openai", "--host", "127.0.0.1", "--port", str(port), "--endpoint", "/v1/completions",
            "--model", MODEL, "--tokenizer", str(tokenizer), "--dataset-name", "random",
            "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len),
            "--num-prompts", str(a.num_prompts), "--max-concurrency", str(concurrency), "--request-rate", "inf",
            "--temperature", "0", "--seed", str(a.seed), "--num-warmups", str(getattr(a, "warmups", min(concurrency, a.num_prompts))),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--disable-tqdm",
            "--save-result", "--save-detailed", "--result-dir", str(result_dir), "--result-filename", f"{name}.json"]
    if headers:  # one --header with every pair: the flag is nargs="*", a second --header replaces the first
        argv += ["--header", *(f"{k}={v}" for k, v in headers.items())]
    return parser.parse_args(argv)


def run_client(port: int, tokenizer: Path, concurrency: int, a, result_dir: Path, name: str,
               headers: Dict[str, str], log: Path) -> dict:
    """One client run in this process (its console report goes to ``log``); the saved result JSON, reduced."""
    from vllm.benchmarks import serve as bench

    args = client_args(port, tokenizer, concurrency, a, result_dir, name, headers)
    with log.open("a") as f, contextlib.redirect_stdout(f):
        print(f"\n===== {name}")
        bench.main(args)
    res = json.loads((result_dir / f"{name}.json").read_text())
    row = {k: res.get(src) for k, src in FIELDS.items()}
    row.update(concurrency=concurrency, completed=res["completed"], failed=res["failed"],
               output_tokens=res["total_output_tokens"], duration_s=res["duration"],
               loadavg_1m=os.getloadavg()[0])  # the cores are shared: how busy the machine was
    errors = [e for e in res.get("errors", []) if e]
    if errors:
        row["first_error"] = errors[0][-300:]
    return row


def served_by_variant(url: str) -> Dict[str, float]:
    """``policy_requests_total`` per variant from the router's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^policy_requests_total\{[^}]*variant="(\w+)"[^}]*\}\s+(\S+)', text, re.M)}


class VllmServer(Server):
    """``vllm serve`` (the OpenAI API server module; the ``vllm`` CLI entry point is not installed here)."""

    ready_path = "/health"

    def __init__(self, model_dir: Path, context: int, log: Path):
        self.model_dir, self.context = model_dir, context
        super().__init__(vllm_env(), log)

    def command(self, target: str) -> list:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                *serve_cli_args(self.model_dir, "float16", self.context), "--served-model-name", MODEL,
                "--host", "127.0.0.1", "--port", str(self.port)]


def bench_router(bundle: Path, a, levels: List[int], tmp: Path, variants: List[str]) -> Dict[str, list]:
    version = store_version(bundle)
    (tmp / "router.yaml").write_text(json.dumps({
        "max_inflight": max(levels) + 4,  # the client's concurrency + the background slots
        "rollout": {"golden_interval_s": 36000, "analysis_interval_s": 36000, "shadow_fraction": 0.0}}))
    env = {"POLICY_BUNDLE_ADMIN_TOKEN": TOKEN, "POLICY_BUNDLE_STATE_DIR": str(tmp / "state"),
           "POLICY_BUNDLE_ROUTER_CONFIG": str(tmp / "router.yaml"), "POLICY_BUNDLE_VERSION": version, **vllm_env()}
    t0 = time.monotonic()
    server = Server(env, tmp / "router.log").wait_ready(600)
    out: Dict[str, list] = {}
    tokenizer_dir = BundleLayout(bundle).fp16_dir
    try:
        status = httpx.get(f"{server.url}/status", timeout=30).json()
        engines = {v: status["variants"][v]["engine"] for v in ("int8", "fp16")}
        print(f"router up in {time.monotonic() - t0:.0f} s ({version}; engines {engines}, "
              f"context {status['context_tokens']} tokens)", flush=True)
        for variant in variants:
            before = served_by_variant(server.url)
            rows = []
            for c in levels:
                rows.append(run_client(server.port, tokenizer_dir, c, a, tmp / "results", f"{variant}-c{c}",
                                       {"x-policy-variant": variant, "x-admin-token": TOKEN}, tmp / "client.log"))
                print(f"  {variant:11s} c={c:<3d} done ({rows[-1]['completed']}/{a.num_prompts} ok)", flush=True)
            after = served_by_variant(server.url)
            served = {v: after.get(v, 0) - before.get(v, 0) for v in ("int8", "fp16")}
            for r in rows:
                r.update(engine=engines[variant], served_by=served)
            other = "fp16" if variant == "int8" else "int8"
            if served[other] or not served[variant]:
                raise RuntimeError(f"the requests pinned to {variant} were served by {served} (router /metrics)")
            out[variant] = rows
    finally:
        server.stop()
    return out


def bench_direct(bundle: Path, a, levels: List[int], tmp: Path, context: int) -> list:
    t0 = time.monotonic()
    fp16_dir = BundleLayout(bundle).fp16_dir
    server = VllmServer(fp16_dir, context, tmp / "vllm-serve.log").wait_ready(600)
    try:
        print(f"vllm serve up in {time.monotonic() - t0:.0f} s", flush=True)
        rows = []
        for c in levels:
            rows.append(run_client(server.port, fp16_dir, c, a, tmp / "results", f"vllm-direct-c{c}", {},
                                   tmp / "client.log"))
            rows[-1]["engine"] = "vllm serve"
            print(f"  vllm-direct c={c:<3d} done ({rows[-1]['completed']}/{a.num_prompts} ok)", flush=True)
        return rows
    finally:
        server.stop()


def table(results: Dict[str, list]) -> str:
    head = (f"{'target':12s} {'conc':>4s} {'ok':>5s} {'req/s':>7s} {'out tok/s':>9s} {'TTFT p50':>9s} "
            f"{'TTFT p99':>9s} {'ITL p50':>8s} {'ITL p99':>8s} {'load':>5s}   (ms; load = 1-min load average after)")
    lines = [head]
    for target, rows in results.items():
        for r in rows:
            def ms(k):
                return f"{r[k]:.1f}" if r.get(k) is not None else "-"
            lines.append(f"{target:12s} {r['concurrency']:4d} {r['completed']:2d}/{r['completed'] + r['failed']:<2d} "
                         f"{r['req_s']:7.2f} {r['out_tok_s']:9.1f} {ms('ttft_p50_ms'):>9s} {ms('ttft_p99_ms'):>9s} "
                         f"{ms('itl_p50_ms'):>8s} {ms('itl_p99_ms'):>8s} {r['loadavg_1m']:5.1f}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, default=ROOT / "bundles" / "reference")
    ap.add_argument("--concurrency", default="1,8,32", help="comma-separated --max-concurrency levels")
    ap.add_argument("--num-prompts", type=int, default=32, help="requests per level")
    ap.add_argument("--input-len", type=int, default=8, help="random prompt tokens")
    ap.add_argument("--output-len", type=int, default=16, help="tokens generated per request (ignore_eos)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--targets", default=",".join(TARGETS), help=f"a subset of {','.join(TARGETS)}")
    ap.add_argument("--json", type=Path, help="also write the table here")
    ap.add_argument("--workdir", type=Path, help="logs and raw client results (default: a temporary folder)")
    a = ap.parse_args(argv)
    bundle = a.bundle.resolve()
    levels = [int(c) for c in a.concurrency.split(",")]
    targets = [t for t in a.targets.split(",") if t]
    unknown = set(targets) - set(TARGETS)
    if unknown:
        ap.error(f"--targets: unknown {sorted(unknown)} (known: {', '.join(TARGETS)})")
    context = BundleInfo.read(bundle).max_seq_len
    if a.input_len + 1 + a.output_len > context:  # +1: the BOS the tokenizer may add
        ap.error(f"--input-len {a.input_len} + BOS + --output-len {a.output_len} exceed the bundle's context "
                 f"({context} tokens)")
    tmp = a.workdir or Path(tempfile.mkdtemp(prefix="bench-vllm-client-"))
    tmp.mkdir(parents=True, exist_ok=True)
    os.environ.update(vllm_env())
    print(f"bundle {bundle} (context {context}); {a.num_prompts} random prompts of {a.input_len} tokens, "
          f"{a.output_len} new tokens each (ignore_eos, greedy), concurrency {levels}; "
          f"{os.cpu_count()} cores; logs in {tmp}", flush=True)
    results: Dict[str, list] = {}
    variants = [t for t in ("int8", "fp16") if t in targets]
    if variants:
        results.update(bench_router(bundle, a, levels, tmp, variants))
    if "vllm-direct" in targets:
        results["vllm-direct"] = bench_direct(bundle, a, levels, tmp, context)
    print("\n" + table(results))
    for v in variants:
        served = results[v][0]["served_by"]
        print(f"router /metrics: the {v} runs were served by {served}")
    report = {"bundle": str(bundle), "context_tokens": context, "cores": os.cpu_count(),
              "settings": {"num_prompts": a.num_prompts, "input_len": a.input_len, "output_len": a.output_len,
                           "concurrency": levels, "dataset": "random", "backend": "openai", "temperature": 0},
              "results": results, "logs": str(tmp)}
    if a.json:
        a.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
