"""Memory of the gate's teacher-forced measurement: the golden set's logits held whole and compared at once (as the
gate did) against the reference kept in a file and compared a batch at a time
(``quantize/fidelity/reference_logits.py``).

Each mode runs in a fresh process on the same golden items (the shipped prompt set's 100 golden prompts, each with a
32-token completion), measuring one INT8 candidate (every decoder linear w8a8: int8 weights, per-token int8 activations) the way
the gate does: the FP32 reference logits once, then three teacher-forced measurements. Printed: the process's peak
resident set, its wall time and the two modes' ratio; the metrics must agree.

Run: ``.venv/bin/python -m policy_bundle.loadtest.bench_gate_memory [--policy DIR]`` (default: the SmolLM2-135M
fixture, ``python -m policy_bundle.loadtest.real_lm``).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from policy_bundle.loadtest.results_doc import cpu, cpu_text

ROUNDS = 3


def _golden(policy_dir: Path, n: int):
    from policy_bundle.bundle.info import encode_prompt, load_tokenizer
    from policy_bundle.quantize.fidelity.scores import GoldenItem

    tok = load_tokenizer(policy_dir)
    prompts = (Path(__file__).resolve().parents[1] / "build" / "prompts" / "general.txt").read_text().splitlines()
    prompts = [p for p in prompts if p.strip()][-n:]
    g = torch.Generator().manual_seed(0)
    return [GoldenItem(prompt=p, prompt_ids=encode_prompt(tok, p), completion_ids=torch.randint(
        3, tok.vocab_size, (32,), generator=g).tolist()) for p in prompts]


def run_mode(mode: str, policy_dir: Path, items: int) -> dict:
    from policy_bundle.quantize.fidelity.scores import compare_logits, policy_logits_fn, teacher_forced_logits
    from policy_bundle.quantize.model.hf_weights import load_policy
    from policy_bundle.quantize.fidelity.reference_logits import ReferenceLogits, compare_streamed
    from policy_bundle.quantize.w8a8.linear import Int8TokenLinear

    torch.set_num_threads(2)
    golden = _golden(policy_dir, items)
    policy = load_policy(policy_dir, max_seq_len=max(len(g.prompt_ids) + 32 for g in golden) + 1)
    cand = load_policy(policy_dir, max_seq_len=policy.max_seq_len)
    for name, mod in list(cand.layers.named_modules()):
        if isinstance(mod, torch.nn.Linear):
            cand.layers.set_submodule(name, Int8TokenLinear.from_float(mod))
    t0 = time.monotonic()
    if mode == "whole":
        ref = teacher_forced_logits(policy_logits_fn(policy), golden, max_tokens=32 << 20)
        for _ in range(ROUNDS):
            top1, kl = compare_logits(ref, teacher_forced_logits(policy_logits_fn(cand), golden, max_tokens=32 << 20))
    else:
        ref = ReferenceLogits.compute(policy_logits_fn(policy), golden)
        for _ in range(ROUNDS):
            top1, kl = compare_streamed(ref, policy_logits_fn(cand), golden)
    return {"mode": mode, "seconds": time.monotonic() - t0, "peak_rss_gb": resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss / 1e6, "top1": top1, "kl_mean": float(kl.mean()), "tokens": int(kl.numel())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", type=Path, default=Path.home() / ".cache/policy-bundle/smollm2-135m-instruct")
    ap.add_argument("--items", type=int, default=100)
    ap.add_argument("--mode", choices=["whole", "streamed"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:
        print(json.dumps(run_mode(args.mode, args.policy, args.items)))
        return
    rows = {}
    for mode in ("whole", "streamed"):
        out = subprocess.run([sys.executable, "-m", "policy_bundle.loadtest.bench_gate_memory", "--policy",
                              str(args.policy), "--items", str(args.items), "--mode", mode],
                             check=True, capture_output=True, text=True).stdout
        rows[mode] = json.loads(out.strip().splitlines()[-1])
    print(f"policy {args.policy.name}, {args.items} golden items x 32 scored tokens, {ROUNDS} teacher-forced "
          f"measurements of an int8 candidate; CPU {cpu_text(cpu())}")
    print("| mode | peak RSS (GB) | wall (s) | top-1 | KL mean |\n|---|---|---|---|---|")
    for r in rows.values():
        print(f"| {r['mode']} | {r['peak_rss_gb']:.2f} | {r['seconds']:.1f} | {r['top1']:.4f} | {r['kl_mean']:.5f} |")
    w, s = rows["whole"], rows["streamed"]
    print(f"streamed / whole: peak RSS {s['peak_rss_gb'] / w['peak_rss_gb']:.2f}x, wall {s['seconds'] / w['seconds']:.2f}x;"
          f" metrics equal: {abs(s['top1'] - w['top1']) < 1e-9 and abs(s['kl_mean'] - w['kl_mean']) < 1e-9}")


if __name__ == "__main__":
    main()
