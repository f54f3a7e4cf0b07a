"""Decode speed deep in the context: batch-1 decode tok/s at context positions 128, 2048 and 7000, the bundle's INT8
TorchScript (as the server runs it: ``load_torchscript``, a KV cache grown by blocks) against its FP16 weights in vLLM
(float16 and bfloat16, the model's own context), each engine in a fresh process, side by side in one run; and the KV
bytes a token costs in each.

    .venv/bin/python -m policy_bundle.loadtest.bench_context --bundle BUNDLE [--positions 128,2048,7000] [--tokens 32]
        [--gguf SRC.gguf]   # llama.cpp Q8_0 too, where llama-cpp-python is installed (not in the default install)
        [--also-cache float32,bfloat16]   # the INT8 file with its KV cache switched to these dtypes too

A position's figure: a prompt of that many tokens prefilled, then ``--tokens`` decode steps timed (vLLM: the time of a
``tokens``-token generation less a one-token one), median of ``--repeats``; the INT8 file's prefill of that prompt is
timed too (its own line).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _prompt(n: int, vocab: int) -> list:
    import torch

    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def int8_worker(bundle: Path, positions: list, tokens: int, repeats: int, kv_cache: str = "") -> dict:
    import torch

    from policy_bundle.bundle.info import BundleInfo
    from policy_bundle.quantize.runtime.script_runner import load_torchscript
    from policy_bundle.quantize.runtime.slots import KV_BLOCK, LONG_PROMPT_CHUNK, SlotBatch

    torch.set_num_threads(1)  # the served engine's decode thread (engine_threads: 1)
    module = load_torchscript(bundle / "int8" / "policy.ts")
    if kv_cache:  # another cache than the file's (the same weights and kernels): what the cache's dtype costs
        module._c.setattr("kv_cache", kv_cache)
    ctx = BundleInfo.read(bundle).max_seq_len
    vocab = int(json.loads((bundle / "int8" / "config.json").read_text())["vocab_size"])
    out = {}
    for pos in positions:
        times, fills = [], []
        for _ in range(repeats + 1):
            batch = SlotBatch(module, min(ctx, pos + tokens + 1), 1, KV_BLOCK)
            prompt = _prompt(pos, vocab)
            t0 = time.perf_counter()
            with torch.no_grad():
                for start in range(0, pos, LONG_PROMPT_CHUNK):  # the server's long-prompt chunks
                    logits = batch.prefill(prompt[start:start + LONG_PROMPT_CHUNK], start)
            fills.append(time.perf_counter() - t0)
            batch.join(0)
            nxt = int(logits.argmax())
            t0 = time.perf_counter()
            with torch.no_grad():
                for _ in range(tokens):
                    nxt = int(batch.step([nxt])[0].argmax())
            times.append(time.perf_counter() - t0)
        out[str(pos)] = tokens / statistics.median(times[1:])
        out[f"prefill {pos}"] = pos / statistics.median(fills[1:])
    out["kv_bytes_per_token"] = SlotBatch(module, 32, 1, KV_BLOCK).bytes_per_position()
    return out


def vllm_worker(bundle: Path, dtype: str, positions: list, tokens: int, repeats: int) -> dict:
    from policy_bundle.quantize.model.hf_weights import load_hf_config
    from policy_bundle.quantize.runtime.vllm_launch import apply_vllm_env_defaults, offline_llm

    apply_vllm_env_defaults()
    from vllm import SamplingParams

    cfg = load_hf_config(bundle / "fp16")
    llm = offline_llm(bundle / "fp16", dtype, max(positions) + tokens + 32, skip_tokenizer_init=True)
    out = {}
    for pos in positions:
        prompt = {"prompt_token_ids": _prompt(pos, cfg.vocab_size)}

        def gen(n):
            t0 = time.perf_counter()
            llm.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True, temperature=0, detokenize=False),
                         use_tqdm=False)
            return time.perf_counter() - t0
        gen(tokens)  # warm-up
        full = statistics.median(gen(tokens) for _ in range(repeats))
        one = statistics.median(gen(1) for _ in range(repeats))
        out[str(pos)] = (tokens - 1) / max(full - one, 1e-9)
    out["kv_bytes_per_token"] = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 2  # keys and values, 16-bit
    return out


def llama_worker(bundle: Path, gguf: Path, positions: list, tokens: int, repeats: int) -> dict:
    """llama.cpp (``llama-cpp-python``, one thread, its default float16 KV cache) on a Q8_0 GGUF written from the
    GGUF the bundle's FP32 source was dequantized from (``loadtest/gguf_peer.py``); prompt evaluated untimed, then
    ``tokens`` greedy decode steps timed, as the other engines."""
    import tempfile

    import llama_cpp
    import numpy as np

    from policy_bundle.loadtest.gguf_peer import _plain_buffers, amx_cpu, write_gguf
    from policy_bundle.quantize.model.hf_weights import load_hf_config

    cfg = load_hf_config(bundle / "fp16")
    with tempfile.TemporaryDirectory() as tmp:
        path = write_gguf(gguf, Path(tmp) / "peer-Q8_0.gguf", "Q8_0")
        with _plain_buffers() if amx_cpu() else contextlib.nullcontext():  # AMX buffers crash on batches (gguf_peer)
            llm = llama_cpp.Llama(model_path=str(path), n_ctx=max(positions) + tokens + 32, n_batch=512, n_threads=1,
                                  n_threads_batch=1, verbose=False, seed=0)
        out = {}
        for pos in positions:
            times = []
            for _ in range(repeats + 1):
                llm.reset()
                llm.eval(_prompt(pos, cfg.vocab_size))
                t0 = time.perf_counter()
                for _ in range(tokens):
                    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
                    llm.eval([int(np.argmax(logits))])
                times.append(time.perf_counter() - t0)
            out[str(pos)] = tokens / statistics.median(times[1:])
    out["kv_bytes_per_token"] = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 2  # keys and values, float16
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--positions", default="128,2048,7000")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--also-cache", default="", help="comma-separated KV cache dtypes (float32, bfloat16, float16) to run "
                    "the INT8 TorchScript with too (the same file, its cache switched): what the file's cache costs or "
                    "saves against them")
    ap.add_argument("--gguf", type=Path, help="the GGUF the bundle's FP32 source was dequantized from (the SmolLM2 "
                    "fixture: policy_bundle.loadtest.real_lm.gguf_path()): adds llama.cpp Q8_0 where llama-cpp-python "
                    "is installed")
    ap.add_argument("--json", type=Path, help="also write the figures here (docs/results/NAME.json: "
                    "loadtest/results_doc.py renders them into docs/benchmarks.md)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    positions = [int(p) for p in args.positions.split(",")]
    if args.worker:
        if args.worker.startswith("int8"):
            fig = int8_worker(args.bundle, positions, args.tokens, args.repeats, args.worker.partition(":")[2])
        elif args.worker == "llama.cpp":
            fig = llama_worker(args.bundle, args.gguf, positions, args.tokens, args.repeats)
        else:
            fig = vllm_worker(args.bundle, args.worker, positions, args.tokens, args.repeats)
        print(json.dumps(fig))
        return 0
    also = [f"int8:{d}" for d in args.also_cache.split(",") if d]
    engines = ["int8"] + also + ([] if args.no_vllm else
                                                                             ["float16", "bfloat16"])
    if args.gguf:
        from policy_bundle.loadtest.gguf_peer import llama_cpp_available

        if llama_cpp_available():
            engines.append("llama.cpp")
        else:
            print("llama.cpp skipped: llama-cpp-python is not installed (loadtest/gguf_peer.py)", file=sys.stderr)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    figures = {}
    for engine in engines:
        res = subprocess.run([sys.executable, "-m", "policy_bundle.loadtest.bench_context", "--bundle", str(args.bundle),
                              "--positions", args.positions, "--tokens", str(args.tokens), "--repeats",
                              str(args.repeats), "--worker", engine,
                              *(["--gguf", str(args.gguf)] if args.gguf else [])], capture_output=True, text=True, env=env,
                             timeout=3600)
        if res.returncode != 0:
            print(f"{engine}: failed: {res.stderr[-2000:]}", file=sys.stderr)
            continue
        figures[engine] = json.loads(res.stdout.strip().splitlines()[-1])
    if args.json:
        from policy_bundle.loadtest.results_doc import write_result

        write_result(args.json, "bench_context", {"positions": positions, "tokens": args.tokens,
                                                  "repeats": args.repeats, "engines": figures})
    names = {"int8": "INT8 TorchScript (1 thread)", "float16": "vLLM FP16", "bfloat16": "vLLM BF16",
             **{e: f"INT8 TorchScript, {e.partition(':')[2]} KV cache (1 thread)" for e in also},
             "llama.cpp": "llama.cpp Q8_0 (1 thread, f16 cache)"}
    print(f"decode tok/s at batch 1 by context position ({args.bundle}; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores)")
    print("| engine | " + " | ".join(f"pos {p}" for p in positions) + f" | pos {positions[-1]} vs {positions[0]} | "
          "KV bytes/token |")
    print("|---|" + "---|" * (len(positions) + 2))
    for engine, fig in figures.items():
        cells = " | ".join(f"{fig[str(p)]:.1f}" for p in positions)
        print(f"| {names[engine]} | {cells} | {fig[str(positions[-1])] / fig[str(positions[0])]:.2f}x | "
              f"{fig['kv_bytes_per_token']} |")
    prefill = {e: f for e, f in figures.items() if f"prefill {positions[0]}" in f}
    if prefill:
        print("prefill tok/s of the prompt before each position (512-token chunks, as the server's): " + "; ".join(
            f"{names[e]}: " + " / ".join(f"{f[f'prefill {p}']:.0f}" for p in positions) for e, f in prefill.items()))
    if "int8" in figures and "llama.cpp" in figures:
        print("INT8 / llama.cpp Q8_0: " + ", ".join(
            f"pos {p} {figures['int8'][str(p)] / figures['llama.cpp'][str(p)]:.2f}x" for p in positions))
    if "int8" in figures and "float16" in figures:
        print("INT8 / vLLM FP16: " + ", ".join(f"pos {p} {figures['int8'][str(p)] / figures['float16'][str(p)]:.2f}x"
                                               for p in positions))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
