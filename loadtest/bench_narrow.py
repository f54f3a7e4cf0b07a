"""What keeping a 16-bit source's layers 16-bit costs and saves, side by side in one run: the policy loaded as the
build loads it (``narrow``: its decoder layers' linears stay bfloat16, mapped, each block widening its own for its
call) and widened whole to float32 at load (``whole``: the build before), each in a fresh process on the same
machine. Each process loads the policy, runs a teacher-forced batch (the gate's and the ranking's kind of forward)
and a batched greedy decode (the rollouts' kind), and reports its resident set after each and its peak, the time of
each, and a digest of the logits and tokens, which must match between the two (widening is exact).

    .venv/bin/python -m policy_bundle.loadtest.bench_narrow --shape 1.7b
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import subprocess
import sys
import time
from pathlib import Path


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def child(source: Path, mode: str, batch: int, tokens: int, new: int) -> dict:
    import torch

    from policy_bundle.quantize.model.blocks import widen_narrow
    from policy_bundle.quantize.runtime.decode import greedy_generate_batch
    from policy_bundle.quantize.model.hf_weights import load_policy
    from policy_bundle.quantize.model.policy import full_logits

    torch.set_num_threads(2)
    out: dict = {"mode": mode}
    t = time.perf_counter()
    policy = load_policy(source, max_seq_len=1024)
    if mode == "whole":
        widen_narrow(policy)
    out["load_s"], out["load_rss"] = time.perf_counter() - t, rss()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, policy.embed_tokens.num_embeddings, (batch, tokens), generator=g)
    t = time.perf_counter()
    with torch.no_grad():
        logits = full_logits(policy, ids)
    out["forward_s"], out["forward_rss"] = time.perf_counter() - t, rss()
    digest = hashlib.sha256(logits.numpy().tobytes())
    del logits
    prompts = [ids[i, : 16 + 8 * i].tolist() for i in range(batch)]
    t = time.perf_counter()
    done = greedy_generate_batch(policy, prompts, new, batch_size=batch)
    out["decode_s"], out["decode_rss"] = time.perf_counter() - t, rss()
    digest.update(json.dumps(done).encode())
    out["digest"] = digest.hexdigest()[:16]
    out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1.7b", help="a bench_build shape (a random Qwen3 saved in bfloat16)")
    ap.add_argument("--source", type=Path, default=None, help="a 16-bit HF directory instead of a random shape")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128, help="teacher-forced positions per row")
    ap.add_argument("--new", type=int, default=16, help="greedy tokens per decoded row")
    ap.add_argument("--child", choices=["narrow", "whole"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "policy-bundle" / "bench-build")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.source, args.child, args.batch, args.tokens, args.new)))
        return
    source = args.source
    if source is None:
        from policy_bundle.loadtest.bench_build import make_policy
        from policy_bundle.loadtest.real_lm import smollm2_dir

        source = make_policy(args.shape, "bfloat16", args.work / f"qwen3-{args.shape}-bfloat16", smollm2_dir())
    rows = []
    for mode in ("narrow", "whole"):
        print(f"[bench_narrow] {mode}: loading {source} in a fresh process", file=sys.stderr, flush=True)
        run = subprocess.run([sys.executable, "-m", "policy_bundle.loadtest.bench_narrow", "--source", str(source),
                              "--child", mode, "--batch", str(args.batch), "--tokens", str(args.tokens),
                              "--new", str(args.new)], capture_output=True, text=True, check=True)
        rows.append(json.loads(run.stdout.strip().splitlines()[-1]))
    gb = lambda b: f"{b / 2**30:.2f}"  # noqa: E731
    print(f"source: {source} ({sum(f.stat().st_size for f in Path(source).glob('*.safetensors')) / 2**30:.2f} GB), "
          f"batch {args.batch} x {args.tokens} teacher-forced, {args.batch} x {args.new} greedy")
    print("| mode | load: s / RSS GB | teacher-forced: s / RSS GB | greedy decode: s / RSS GB | peak RSS GB | digest |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['load_s']:.1f} / {gb(r['load_rss'])} | {r['forward_s']:.1f} / {gb(r['forward_rss'])}"
              f" | {r['decode_s']:.1f} / {gb(r['decode_rss'])} | {gb(r['peak_rss'])} | {r['digest']} |")
    n, w = rows
    print(f"narrow / whole: peak RSS {n['peak_rss'] / w['peak_rss']:.2f}x, teacher-forced time "
          f"{n['forward_s'] / w['forward_s']:.2f}x, decode time {n['decode_s'] / w['decode_s']:.2f}x; "
          f"outputs {'bitwise equal' if n['digest'] == w['digest'] else 'DIFFER'}")


if __name__ == "__main__":
    main()
