"""Per-actor memory of the w8a8 layer plan on the calibration mesh: each Monarch actor in a memory cgroup of its own
(cgroup v1 or v2; root), optionally limited to a share of the weights, and its peak resident set, anonymous memory and
cgroup usage printed per rank (nothing asserted). The policy is a randomly initialised Qwen3 of a real shape
(``bench_build.make_policy``); the calibration set ``--samples`` random sequences of 40 to 89 tokens.

    .venv/bin/python -m policy_bundle.loadtest.bench_mesh_memory --shape 0.3b --procs 2 [--limit-x 0.6]

With ``--limit-x X`` each actor's cgroup is limited to X times the weights file; an actor the kernel kills there has
its share re-run on another actor (the mesh's own recovery), which the output reports.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Dict, List, Optional

import torch

from policy_bundle.build.calibrate.mesh import calibration_mesh
from policy_bundle.build.calibrate.samples import calibration_batches
from policy_bundle.build.calibrate.w8a8_statistics import stream_plan
from policy_bundle.build.config.build_config import load_config
from policy_bundle.loadtest.bench_build import SHAPES, make_policy
from policy_bundle.loadtest.real_lm import smollm2_dir
from policy_bundle.quantize.model.hf_weights import load_policy


def rollup(pid: int) -> tuple:
    """(RSS, anonymous) bytes of ``pid``; zeros once it is gone."""
    try:
        lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]
    except OSError:
        return 0, 0
    v = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in lines if ln.endswith("kB")}
    return v.get("Rss", 0), v.get("Anonymous", 0)


class ActorCgroup:
    """A memory cgroup holding one process, limited to ``limit`` bytes (None: unlimited)."""

    def __init__(self, pid: int, limit: Optional[int]):
        v2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
        base = Path("/sys/fs/cgroup") if v2 else Path("/sys/fs/cgroup/memory")
        self.dir, self.v2 = base / f"policy-bundle-actor-{uuid.uuid4().hex[:8]}", v2
        self.dir.mkdir()
        if limit is not None:
            (self.dir / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(str(limit))
        (self.dir / "cgroup.procs").write_text(str(pid))

    def peak(self) -> int:
        return int((self.dir / ("memory.peak" if self.v2 else "memory.max_usage_in_bytes")).read_text())

    def ooms(self) -> int:
        if self.v2:
            events = dict(ln.split() for ln in (self.dir / "memory.events").read_text().splitlines())
            return int(events.get("oom_kill", 0))
        ctl = dict(ln.split() for ln in (self.dir / "memory.oom_control").read_text().splitlines())
        return int(ctl.get("oom_kill", 0))

    def remove(self) -> None:
        for pid in (self.dir / "cgroup.procs").read_text().split():
            (self.dir.parent / "cgroup.procs").write_text(pid)
        self.dir.rmdir()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="0.3b")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--samples", type=int, default=145)
    ap.add_argument("--limit-x", type=float, default=None, help="each actor's limit, times the weights file")
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "policy-bundle" / "bench-build")
    args = ap.parse_args()
    source = make_policy(args.shape, args.dtype, args.work / f"qwen3-{args.shape}-{args.dtype}", Path(smollm2_dir()))
    weights = sum(f.stat().st_size for f in source.glob("*.safetensors"))
    cfg = load_config("build/configs/main.yaml", (f"calibration.procs={args.procs}", "calibration.timeout_s=1800"))
    policy = load_policy(source, max_seq_len=512)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 49000, (40 + (i * 7) % 50,), generator=g).tolist() for i in range(args.samples)]
    batches = calibration_batches(seqs, 16, 512)
    limit = None if args.limit_x is None else int(args.limit_x * weights)
    peaks: Dict[int, List[int]] = {}
    stop = threading.Event()

    def sample(workers) -> None:
        while not stop.is_set():
            for w in workers:
                rss, anon = rollup(w.pid)
                p = peaks.setdefault(w.rank, [0, 0])
                p[0], p[1] = max(p[0], rss), max(p[1], anon)
            time.sleep(0.1)

    groups: Dict[int, ActorCgroup] = {}
    with calibration_mesh(cfg, source) as mesh:
        try:
            started = {w.rank: rollup(w.pid)[0] for w in mesh.workers}
            for w in mesh.workers:
                groups[w.rank] = ActorCgroup(w.pid, limit)
            sampler = threading.Thread(target=sample, args=(list(mesh.workers),), daemon=True)
            sampler.start()
            t0 = time.monotonic()
            stream_plan(mesh, policy, batches, recipe=cfg.recipe_config("smooth-w8a8"))
            seconds = time.monotonic() - t0
            stop.set()
            sampler.join()
            print(f"\n{args.shape} {args.dtype} ({weights / 1e9:.2f} GB), {len(policy.layers)} layers, {args.procs} actors, "
                  f"{args.samples} samples, limit {'none' if limit is None else f'{limit / 1e9:.2f} GB ({args.limit_x}x)'}"
                  f": layer plan in {seconds:.0f} s, live actors after it {sum(w.alive for w in mesh.workers)}")
            print("| rank | RSS at start | peak RSS | peak anonymous | cgroup peak (charged after the move) | OOM kills |")
            print("|---|---|---|---|---|---|")
            for rank, cg in groups.items():
                rss, anon = peaks.get(rank, [0, 0])
                print(f"| {rank} | {started[rank] / 1e9:.2f} GB | {rss / 1e9:.2f} GB | {anon / 1e9:.2f} GB | "
                      f"{cg.peak() / 1e9:.2f} GB | {cg.ooms()} |")
        finally:
            stop.set()
            for cg in groups.values():
                cg.remove()
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")
    print(f"CPU: {cpu}, {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
