"""llm-compressor's ``oneshot`` on an HF directory: SmoothQuant then GPTQ, W8A8 (int8 weights per channel, int8
activations per token, dynamic), ``lm_head`` kept in float; the compressed-tensors directory vLLM reads.

Run by ``loadtest/bench_llmcompressor.py`` in a virtual environment of its own (llm-compressor pins a
compressed-tensors and a transformers other than the project's), so it imports nothing of the project:

    .venv-llmc/bin/python loadtest/llmc_oneshot.py SOURCE_DIR OUT_DIR CALIBRATION.json [--max-len 512]

CALIBRATION.json holds ``{"sequences": [[token ids], ...]}``: the sequences the bundle's build calibrated on.
"""

from __future__ import annotations

import argparse
import json
import threading
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source")
    ap.add_argument("out")
    ap.add_argument("calibration")
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--smoothing", type=float, default=0.8)
    ap.add_argument("--ignore", default="lm_head", help="comma-separated linears kept in float")
    args = ap.parse_args()

    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from llmcompressor.modifiers.smoothquant import SmoothQuantModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    seqs = [s[: args.max_len] for s in json.loads(open(args.calibration).read())["sequences"]]
    ds = Dataset.from_dict({"input_ids": seqs, "attention_mask": [[1] * len(s) for s in seqs]})
    model = AutoModelForCausalLM.from_pretrained(args.source, torch_dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(args.source)
    recipe = [SmoothQuantModifier(smoothing_strength=args.smoothing),
              GPTQModifier(targets="Linear", scheme="W8A8", ignore=args.ignore.split(","))]
    t0, done = time.monotonic(), threading.Event()

    def beat() -> None:  # oneshot prints per layer, not on a clock
        while not done.wait(30):
            print(f"[llmc] oneshot running: {time.monotonic() - t0:.0f} s", flush=True)

    threading.Thread(target=beat, daemon=True).start()
    oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=args.max_len, num_calibration_samples=len(seqs))
    done.set()
    model.save_pretrained(args.out, save_compressed=True)
    tok.save_pretrained(args.out)
    print(json.dumps({"oneshot_s": round(time.monotonic() - t0, 1), "samples": len(seqs)}), flush=True)


if __name__ == "__main__":
    main()
