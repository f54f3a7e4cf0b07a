"""FP32 eager vs INT8 TorchScript vs INT8 onnxruntime, side by side in one run (ratios, not asserts).

Per model: decode tokens/s at batch 1 (prefill, then one token per step; onnxruntime has no KV
cache, so its "decode" recomputes the sequence each token), forward throughput at batch 8, and
artifact sizes. Run: ``.venv/bin/python -m loadtest.bench_int8 [--quick]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

from loadtest.bench_models import bench_models
from quantize import recipes
from quantize.export import export_onnx_int8, export_torchscript
from quantize.model import load_policy

warnings.filterwarnings("ignore")


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


@torch.no_grad()
def decode_tps(policy, prompt_len: int, new_tokens: int, vocab: int, repeats: int) -> float:
    """Tokens/s of the decode loop alone (prefill untimed), median over ``repeats`` fresh caches."""
    prompt = torch.randint(3, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(repeats + 1):
        k, v = policy.new_cache(1, prompt_len + new_tokens)
        logits = policy.prefill(prompt, k, v)
        t = time.perf_counter()
        for i in range(new_tokens):
            logits = policy.decode(logits[:, -1:].argmax(-1), prompt_len + i, k, v)
        times.append(time.perf_counter() - t)
    return new_tokens / statistics.median(times[1:])


def onnx_decode_tps(sess, prompt_len: int, new_tokens: int, vocab: int, repeats: int) -> float:
    ids = torch.randint(3, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(0)).numpy()

    def run():
        seq = ids
        for _ in range(new_tokens):
            logits = sess.run(None, {"input_ids": seq})[0]
            seq = __import__("numpy").concatenate([seq, logits[:, -1:].argmax(-1)], axis=1)

    return new_tokens / median_time(run, repeats)


@torch.no_grad()
def forward_tps(fn, batch: int, seq: int, vocab: int, repeats: int) -> float:
    x = torch.randint(3, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    return batch * seq / median_time(lambda: fn(x), repeats)


def bench(name: str, policy_dir: Path, args) -> None:
    import onnxruntime as ort

    policy = load_policy(policy_dir, max_seq_len=128)
    vocab = policy.embed_tokens.num_embeddings
    seq = min(64, policy.max_seq_len - 1)
    prompt_len = min(16, seq // 2)
    new_tokens = min(args.new_tokens, policy.max_seq_len - prompt_len - 1)
    g = torch.Generator().manual_seed(2)
    calib = [torch.randint(3, vocab, (8, seq), generator=g) for _ in range(4)]
    recipe = recipes.RecipeConfig(scheme="static")
    prepared = recipes.prepare(policy, recipe)
    recipes.calibrate(prepared, calib)
    int8 = recipes.convert(prepared, recipe)
    with tempfile.TemporaryDirectory() as tmp:
        ts_path = export_torchscript(int8, Path(tmp) / "policy.ts")
        scripted = torch.jit.load(str(ts_path))
        onnx_path = export_onnx_int8(policy, Path(tmp), calib, keep_float=["lm_head"])
        sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
        fp32_bytes = sum(p.numel() * 4 for p in policy.parameters())
        sizes = {"fp32 weights": fp32_bytes, "int8 torchscript": ts_path.stat().st_size,
                 "int8 onnx": onnx_path.stat().st_size}
        r = args.repeats
        dec = {
            "fp32 eager": decode_tps(policy, prompt_len, new_tokens, vocab, r),
            "int8 torchscript": decode_tps(scripted, prompt_len, new_tokens, vocab, r),
            "int8 onnxruntime (no cache)": onnx_decode_tps(sess, prompt_len, new_tokens, vocab, r),
        }
        fwd = {
            "fp32 eager": forward_tps(lambda x: policy(x, 0, *policy.new_cache(x.shape[0], x.shape[1])), 8, seq, vocab, r),
            "int8 torchscript": forward_tps(lambda x: scripted(x, 0, *scripted.new_cache(x.shape[0], x.shape[1])), 8, seq, vocab, r),
            "int8 onnxruntime": forward_tps(lambda x: sess.run(None, {"input_ids": x.numpy()}), 8, seq, vocab, r),
        }
    params = sum(p.numel() for p in policy.parameters()) / 1e6
    print(f"\n== {name} ({params:.1f}M params; decode: prompt {prompt_len}, {new_tokens} new tokens; forward: batch 8 x {seq})")
    base_d, base_f = dec["fp32 eager"], fwd["fp32 eager"]
    print(f"{'variant':30s} {'decode tok/s (b=1)':>20s} {'ratio':>7s} {'forward tok/s (b=8)':>21s} {'ratio':>7s}")
    for (k, d), f in zip(dec.items(), fwd.values()):
        print(f"{k:30s} {d:20.1f} {d / base_d:7.2f} {f:21.1f} {f / base_f:7.2f}")
    print("sizes: " + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sizes.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="reference policy only, 2 repeats")
    args = ap.parse_args()
    torch.manual_seed(0)
    models = bench_models()
    if args.quick:
        models, args.repeats = {"reference": models["reference"]}, 2
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, quantized engine x86")
    for name, path in models.items():
        bench(name, path, args)


if __name__ == "__main__":
    main()
