"""Monarch mesh scaling: rollout and calibration wall time for procs 1 vs 2 on the same data, and the
mesh start-up cost, side by side in one run (ratios printed, nothing asserted).

Run: ``.venv/bin/python -m policy_bundle.loadtest.bench_mesh [--quick]``.
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import torch

from policy_bundle.build.config import load_config
from policy_bundle.build.mesh import calibration_mesh, mesh_calibrate, mesh_rollouts
from policy_bundle.loadtest.bench_models import bench_models

warnings.filterwarnings("ignore")


def workload(name: str, policy_dir: Path, quick: bool):
    g = torch.Generator().manual_seed(0)
    from policy_bundle.quantize.model import load_hf_config

    vocab = load_hf_config(policy_dir).vocab_size
    if name == "reference":
        n_prompts, n_seqs, seq_len, new = 256, 512, 12, 6
    else:
        n_prompts, n_seqs, seq_len, new = (8, 64, 64, 8) if quick else (24, 256, 64, 16)
    prompts = [torch.randint(3, vocab, (8,), generator=g).tolist() for _ in range(n_prompts)]
    batches = [torch.randint(3, vocab, (32, seq_len), generator=g) for _ in range(n_seqs // 32)]
    return prompts, batches, new


def run(policy_dir: Path, procs: int, prompts, batches, new: int) -> dict:
    cfg = load_config(Path("build/configs/reference.yaml"),
                      (f"calibration.procs={procs}", f"prompts.max_new_tokens={new}", "policy.max_seq_len=128"))
    t0 = time.perf_counter()
    with calibration_mesh(cfg, policy_dir) as mesh:
        startup = time.perf_counter() - t0
        t = time.perf_counter()
        mesh_rollouts(mesh, prompts, eos=None)
        rollout = time.perf_counter() - t
        t = time.perf_counter()
        mesh_calibrate(mesh, batches)
        calib = time.perf_counter() - t
    return {"startup": startup, "rollouts": rollout, "calibration": calib}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    for name, path in bench_models().items():
        prompts, batches, new = workload(name, path, args.quick)
        res = {p: run(path, p, prompts, batches, new) for p in (1, 2)}
        tokens = sum(b.numel() for b in batches)
        print(f"\n== {name}: {len(prompts)} rollout prompts x {new} new tokens, calibration {tokens} tokens")
        print(f"{'':22s} {'procs=1':>10s} {'procs=2':>10s} {'speed-up':>9s}")
        for k in ("startup", "rollouts", "calibration"):
            a, b = res[1][k], res[2][k]
            print(f"{k + ' (s)':22s} {a:10.2f} {b:10.2f} {a / b:9.2f}x")


if __name__ == "__main__":
    main()
