"""The streaming detokenizer's cost per token at an answer's 2000th token: one decode of the whole sequence per token
(the router before) against ``TextStream``'s incremental decode, side by side in one run (nothing asserted).

Run: ``.venv/bin/python -m policy_bundle.loadtest.bench_detok [--tokenizer DIR] [--tokens 2000] [--json OUT]``
(default: the SmolLM2-135M fixture's tokenizer, ``python -m policy_bundle.loadtest.real_lm``; ``--json``: the table
as docs/results/ keeps it, ``loadtest/results_doc.py``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from statistics import median


def per_token_us(push, ids, last: int) -> float:
    """Median microseconds of ``push`` over the ``last`` tokens of ``ids`` (all pushed, in order)."""
    times = []
    for n, i in enumerate(ids):
        t0 = time.perf_counter()
        push(i)
        if n >= len(ids) - last:
            times.append(time.perf_counter() - t0)
    return median(times) * 1e6


def main() -> None:
    from policy_bundle.bundle.info import load_tokenizer
    from policy_bundle.loadtest.results_doc import markdown, table, write_tables
    from policy_bundle.quantize.runtime.text import ids_to_text
    from policy_bundle.serve.router.openai_api import TextStream

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", type=Path, default=Path.home() / ".cache/policy-bundle/smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--json", type=Path, help="write the table here (docs/results/NAME.json)")
    args = ap.parse_args()
    tok = load_tokenizer(args.tokenizer)
    text = " ".join(["The policy reasons step by step: 12 + 34 = 46, naïve café 日本語 🙂."] * 400)
    ids = tok(text, add_special_tokens=False)["input_ids"][: args.tokens]
    seen: list = []

    def whole(i):  # the router before: the whole sequence decoded at every token
        seen.append(i)
        return ids_to_text(tok, seen)

    stream = TextStream(tok, ["</answer>"])
    old, new = per_token_us(whole, ids, 100), per_token_us(stream.push, ids, 100)
    stream.finish()
    lead = (f"tokenizer `{args.tokenizer.name}`, {len(ids)} tokens, per-token cost over the last 100 (median), both "
            "in one run")
    tab = table(["decode", f"us per token at ~{len(ids)}"],
                [["the whole sequence at every token", round(old)],
                 ["`TextStream` with `tokenizers`' `DecodeStream` (each token once)", round(new)]])
    notes = [f"Incremental against whole: {new / old:.3f}x; the texts are equal: "
             f"{'yes' if stream.text == ids_to_text(tok, ids) else 'NO'}."]
    print(lead + "\n" + markdown(tab) + "\n".join(notes))
    if args.json:
        print(f"figures: {write_tables(args.json, 'bench_detok', lead, [tab], notes)}")


if __name__ == "__main__":
    main()
