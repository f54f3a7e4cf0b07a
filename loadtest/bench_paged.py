"""The INT8 TorchScript's decode step on caches of its own per sequence (``step_seqs``, what the server runs) against
one dense cache of slots x the longest sequence (``decode_batch``, what it ran before), side by side in one run, one
intra-op thread (the served engine's): step time, KV bytes held, and whether the logits are the same. Printed, never
asserted.

    .venv/bin/python -m policy_bundle.loadtest.bench_paged --bundle BUNDLE [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


# (label, each row's position): rows of like lengths (the dense cache's best case), and one long row beside short ones
CASES = [("8 x ~1000", [1000 + 37 * i for i in range(8)]), ("16 x ~1500", [1500 + 37 * i for i in range(16)]),
         ("32 x ~500", [500 + 13 * i for i in range(32)]), ("1 x 6000 + 8 x 100", [6000] + [100 + 9 * i for i in range(8)])]


def run(bundle: Path, repeats: int) -> dict:
    import torch

    from policy_bundle.quantize.runtime.script_runner import load_torchscript
    from policy_bundle.quantize.runtime.slots import KV_BLOCK

    torch.set_num_threads(1)
    module = load_torchscript(bundle / "int8" / "policy.ts")
    k1, v1 = module.new_cache(1, 1)
    per_position = k1.numel() * k1.element_size() * 2
    out = {"bundle": str(bundle), "cases": []}
    with torch.no_grad():
        for label, pos in CASES:
            b = len(pos)
            tok = torch.randint(5, 1000, (b, 1), generator=torch.Generator().manual_seed(b))
            p = torch.tensor(pos)
            slots = 1 << (b - 1).bit_length()  # the dense cache's slots: a power of two, each of the longest's blocks
            dense_len = -(-(max(pos) + 1) // KV_BLOCK) * KV_BLOCK
            k, v = module.new_cache(b, dense_len)
            own = [module.new_cache(1, -(-(q + 1) // KV_BLOCK) * KV_BLOCK) for q in pos]

            def dense():
                return module.decode_batch(tok, p, k, v)

            def seqs():
                return module.step_seqs(tok, p, [], [], [c[0] for c in own], [c[1] for c in own])
            times = {"dense": [], "seqs": []}
            for _ in range(repeats + 1):  # interleaved, the first round a warm-up
                for name, fn in (("dense", dense), ("seqs", seqs)):
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
            same = bool(torch.equal(dense(), seqs()))
            row = {"case": label, "rows": b,
                   "dense_ms": 1000 * statistics.median(times["dense"][1:]),
                   "seqs_ms": 1000 * statistics.median(times["seqs"][1:]),
                   "dense_kv_mb": slots * dense_len * per_position / 1e6,
                   "seqs_kv_mb": sum(c[0].shape[3] for c in own) * per_position / 1e6, "logits_equal": same}
            row["time_ratio"] = row["seqs_ms"] / row["dense_ms"]
            row["kv_ratio"] = row["seqs_kv_mb"] / row["dense_kv_mb"]
            print(f"[paged] {label}: step {row['seqs_ms']:.1f} ms per-sequence vs {row['dense_ms']:.1f} dense "
                  f"({row['time_ratio']:.2f}x); KV {row['seqs_kv_mb']:.0f} MB vs {row['dense_kv_mb']:.0f} "
                  f"({row['kv_ratio']:.2f}x); logits equal: {same}", flush=True)
            out["cases"].append(row)
    return out


def main() -> None:
    from policy_bundle.loadtest.results_doc import markdown, table, write_tables

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", type=Path, help="write the table here (docs/results/NAME.json)")
    args = ap.parse_args()
    out = run(args.bundle, args.repeats)
    lead = (f"bundle `{args.bundle.name}`, one decode step of the INT8 TorchScript at one thread, interleaved medians "
            f"of {args.repeats}")
    tab = table(["rows and their positions", "step, per sequence", "step, dense", "time", "KV held, per sequence",
                 "KV held, dense", "KV", "logits"],
                [[c["case"], f"{c['seqs_ms']:.1f} ms", f"{c['dense_ms']:.1f} ms", f"{c['time_ratio']:.2f}x",
                  f"{c['seqs_kv_mb']:.0f} MB", f"{c['dense_kv_mb']:.0f} MB", f"{c['kv_ratio']:.2f}x",
                  "bitwise equal" if c["logits_equal"] else "DIFFERENT"] for c in out["cases"]])
    print(lead + "\n" + markdown(tab))
    if args.json:
        print(f"figures: {write_tables(args.json, 'bench_paged', lead, [tab], cases=out['cases'])}")


if __name__ == "__main__":
    main()
