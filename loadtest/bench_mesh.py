"""Monarch mesh scaling: rollout sequences/s of the local and vLLM engines at procs 1 and 2, calibration
wall time and the mesh start-up cost, side by side in one run (ratios printed, nothing asserted).

Rollouts never stop early (no EOS), so every sequence has exactly the requested new tokens. A vLLM row's
time includes starting one engine per actor (the mesh starts one per rollouts call).

Run: ``.venv/bin/python -m policy_bundle.loadtest.bench_mesh [--quick] [--models random-100m] [--engines local]``.
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import torch

from policy_bundle.build.calibrate.mesh import calibration_mesh, mesh_calibrate, mesh_samples
from policy_bundle.build.config.build_config import load_config
from policy_bundle.loadtest.bench_models import bench_models
from policy_bundle.quantize.runtime.vllm_launch import vllm_available

warnings.filterwarnings("ignore")
OLD_LOCAL_RATE = 0.6  # seq/s: 64 rollouts x 32 tokens of a 135M Llama on 2 procs before batched decoding (issue 14)


def workload(name: str, policy_dir: Path, quick: bool):
    g = torch.Generator().manual_seed(0)
    from policy_bundle.quantize.model.hf_weights import load_hf_config

    vocab = load_hf_config(policy_dir).vocab_size
    if name == "reference":
        n_prompts, n_seqs, seq_len, new = 256, 512, 12, 6
    else:  # the measure: 64 rollouts x 32 new tokens
        n_prompts, n_seqs, seq_len, new = (16, 64, 64, 8) if quick else (64, 256, 64, 32)
    prompts = [torch.randint(3, vocab, (8,), generator=g).tolist() for _ in range(n_prompts)]
    batches = [torch.randint(3, vocab, (32, seq_len), generator=g) for _ in range(n_seqs // 32)]
    return prompts, batches, new


def run(policy_dir: Path, procs: int, engine: str, prompts, batches, new: int) -> dict:
    """Start-up, rollouts and (local engine only: it does not depend on the engine) calibration seconds."""
    cfg = load_config(Path("build/configs/main.yaml"),
                      (f"calibration.procs={procs}", f"prompts.max_new_tokens={new}", "policy.max_seq_len=128",
                       f"samples.engine={engine}"))
    t0 = time.perf_counter()
    with calibration_mesh(cfg, policy_dir) as mesh:
        out = {"startup": time.perf_counter() - t0}
        t = time.perf_counter()
        mesh_samples(mesh, prompts, eos=None)
        out["rollouts"] = time.perf_counter() - t
        if engine == "local":
            t = time.perf_counter()
            mesh_calibrate(mesh, batches)
            out["calibration"] = time.perf_counter() - t
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", nargs="+", default=list(bench_models()), help="reference, random-100m")
    ap.add_argument("--engines", nargs="+", default=["local", "vllm"])
    args = ap.parse_args()
    engines = [e for e in args.engines if e != "vllm" or vllm_available(honour_switch=False)]
    for name in args.models:
        path = bench_models()[name]
        prompts, batches, new = workload(name, path, args.quick)
        res = {(e, p): run(path, p, e, prompts, batches, new) for e in engines for p in (1, 2)}
        tokens = sum(b.numel() for b in batches)
        print(f"\n== {name}: {len(prompts)} rollouts x {new} new tokens; calibration {tokens} tokens (local rows)")
        print(f"{'engine':8s} {'procs':>5s} {'startup s':>10s} {'rollouts s':>11s} {'seq/s':>7s} "
              f"{'vs ' + str(OLD_LOCAL_RATE):>8s} {'calibration s':>14s}")
        for (e, p), r in res.items():
            rate = len(prompts) / r["rollouts"]
            calib = f"{r['calibration']:14.2f}" if "calibration" in r else f"{'-':>14s}"
            print(f"{e:8s} {p:5d} {r['startup']:10.2f} {r['rollouts']:11.2f} {rate:7.2f} "
                  f"{rate / OLD_LOCAL_RATE:7.1f}x {calib}")


if __name__ == "__main__":
    main()
