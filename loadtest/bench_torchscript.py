"""The INT8 TorchScript file run by a consumer with only torch, against the project's own loader: greedy decode tok/s
(batch 1), each in a fresh process, side by side in one run.

    .venv/bin/python -m policy_bundle.loadtest.bench_torchscript --bundle BUNDLE [--tokens 128] [--json OUT]

Rows: the project's loader (``load_torchscript``: weights packed after the load, the graph executor's optimisations
off); the manifest's recipe (``artifacts.int8_torchscript_usage``: torch alone); a plain ``torch.jit.load`` with the
executor's optimisations left on (what a consumer who skips the recipe gets).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

RUN = r"""
import json, sys, time, torch
path, mode, new, prompt = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
torch.set_num_threads(1)
if mode == "project":
    from policy_bundle.quantize.runtime.script_runner import load_torchscript
    m = load_torchscript(path)
    ctx = torch.jit.optimized_execution(True)  # load_torchscript turns them off per call itself
else:
    torch.backends.quantized.engine = "fbgemm"
    m = torch.jit.load(path)
    ctx = torch.jit.optimized_execution(mode != "recipe")
total = min(len(prompt) + new, int(m.max_seq_len) if hasattr(m, "max_seq_len") else len(prompt) + new)
with torch.no_grad(), ctx:
    k, v = m.new_cache(1, (total + 31) // 32 * 32)
    logits = m.prefill(torch.tensor([prompt]), k, v)
    t0, out = time.perf_counter(), []
    for pos in range(len(prompt), total):
        nxt = int(logits[0, -1].argmax())
        out.append(nxt)
        logits = m.decode(torch.tensor([[nxt]]), pos, k, v)
    dt = time.perf_counter() - t0
print(json.dumps({"tok_s": len(out) / dt, "tokens": out}))
"""

MODES = (("project", "the project's loader (`load_torchscript`)"),
         ("recipe", "torch alone, the manifest's recipe (`artifacts.int8_torchscript_usage`)"),
         ("plain", "torch alone, graph optimisations left on"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--json", type=Path, help="write the table here (docs/results/NAME.json)")
    args = ap.parse_args(argv)
    path = args.bundle / "int8" / "policy.ts"
    with (args.bundle / "golden.jsonl").open() as f:  # the golden set's first prompt
        prompt = json.loads(f.readline())["prompt_ids"]
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode, _ in MODES:
            flags = [] if mode == "project" else ["-I"]  # the consumer's process: the project off sys.path
            res = subprocess.run([sys.executable, *flags, "-c", RUN, str(path.resolve()), mode, str(args.tokens),
                                  json.dumps(prompt)],
                                 cwd=tmp if mode != "project" else None, capture_output=True, text=True,
                                 env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=3600)
            if res.returncode != 0:
                print(f"{mode}: failed: {res.stderr[-1500:]}", file=sys.stderr)
                return 1
            rows[mode] = json.loads(res.stdout.strip().splitlines()[-1])
    from policy_bundle.loadtest.results_doc import markdown, table, write_tables

    base = rows["project"]["tok_s"]
    lead = (f"bundle `{args.bundle.name}`, batch-1 greedy decode of {args.tokens} new tokens at one thread, each row in "
            "a fresh process (the two torch-only rows with `python -I` outside the checkout, the project never "
            "imported)")
    tab = table(["how it is run", "decode tok/s", "vs the project's loader", "same tokens"],
                [[label, round(rows[mode]["tok_s"], 1), f"{rows[mode]['tok_s'] / base:.2f}x",
                  rows[mode]["tokens"] == rows["project"]["tokens"]] for mode, label in MODES])
    print(lead + "\n" + markdown(tab))
    if args.json:
        print(f"figures: {write_tables(args.json, 'bench_torchscript', lead, [tab], argv=argv)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
