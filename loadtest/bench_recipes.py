"""Recipes side by side on the outlier reference model and a random 135M Llama-shaped model.

Per recipe: top-1 agreement and KL mean/p99 vs FP32 on held-out sequences, task reward where the
model has a task, layers kept in float, and INT8 TorchScript decode tok/s at batch 1 with its ratio
to HF transformers FP32 ``generate`` measured in the same run. Printed, never asserted.
Run: ``.venv/bin/python -m loadtest.bench_recipes [--quick]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from build.data import calibration_batches, load_tokenizer, local_rollouts
from loadtest.bench_models import outlier_reference_dir, random_135m_dir
from quantize import recipes, task
from quantize.fidelity import GoldenItem, measure_fidelity
from quantize.model import load_policy
from quantize.smooth import apply_smoothing, collect_channel_absmax, smoothing_scales

warnings.filterwarnings("ignore")
RECIPES = ["static", "smooth-static", "dynamic", "smooth-dynamic", "weight-only",
           "smooth-dynamic+down_proj:weight-only"]


def hf_generate_tps(path, new_tokens: int, repeats: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    x = torch.ones(1, 8, dtype=torch.long)
    times = []
    with torch.no_grad():
        for _ in range(repeats + 1):
            t = time.perf_counter()
            model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            times.append(time.perf_counter() - t)
    return new_tokens / statistics.median(times[1:])


def ts_decode_tps(int8, new_tokens: int, repeats: int) -> float:
    scripted = torch.jit.script(int8)
    times = []
    with torch.no_grad():
        for _ in range(repeats + 3):
            k, v = scripted.new_cache(1, 8 + new_tokens)
            logits = scripted.prefill(torch.ones(1, 8, dtype=torch.long), k, v)
            t = time.perf_counter()
            for i in range(new_tokens):
                logits = scripted.decode(logits[:, -1:].argmax(-1), 8 + i, k, v)
            times.append(time.perf_counter() - t)
    return new_tokens / statistics.median(times[3:])


def workload(name, path, quick):
    policy = load_policy(path, max_seq_len=96)
    if name == "outlier-reference":
        tok = load_tokenizer(path)
        ids = [tok(p)["input_ids"] for p in task.rollout_prompts(64 if quick else 256)]
        seqs = [a + b for a, b in zip(ids, local_rollouts(policy, ids, 6, tok.eos_token_id))]
        gold = task.golden_set(64 if quick else 200)
        gids = [tok(g.prompt)["input_ids"] for g in gold]
        golden = [GoldenItem(g.prompt, i, c, g.answer)
                  for g, i, c in zip(gold, gids, local_rollouts(policy, gids, 6, tok.eos_token_id))]
        kw = dict(max_new_tokens=6, eos_token_id=tok.eos_token_id, reward=task.reward,
                  decode=lambda x: tok.decode(x, skip_special_tokens=True))
        return policy, calibration_batches(seqs, 32, 96), golden, kw
    g = torch.Generator().manual_seed(0)
    vocab = policy.embed_tokens.num_embeddings
    batches = [torch.randint(3, vocab, (8, 64), generator=g) for _ in range(2 if quick else 8)]
    prompts = [torch.randint(3, vocab, (24,), generator=g).tolist() for _ in range(8 if quick else 24)]
    golden = [GoldenItem("", p, c) for p, c in zip(prompts, local_rollouts(policy, prompts, 16, None))]
    kw = dict(max_new_tokens=16, eos_token_id=None, reward=None, decode=lambda x: "")
    return policy, batches, golden, kw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    repeats = 2 if args.quick else 5
    for name, path in (("outlier-reference", outlier_reference_dir()), ("random-135m", random_135m_dir())):
        policy, batches, golden, kw = workload(name, path, args.quick)
        new = min(32, policy.max_seq_len - 9)  # the reference policy's context is 32 tokens
        hf = hf_generate_tps(path, new, repeats)
        stats = collect_channel_absmax(policy, batches)
        smoothed = apply_smoothing(policy, smoothing_scales(policy, stats, 0.65))
        print(f"\n== {name}: {sum(p.numel() for p in policy.parameters()) / 1e6:.1f}M params, max |activation| "
              f"{max(float(v.max()) for v in stats.values()):.0f}; HF FP32 generate {hf:.1f} tok/s ({new} new tokens)")
        print(f"{'recipe':38s} {'top-1':>7s} {'KL mean':>9s} {'KL p99':>8s} {'reward':>7s} {'tok/s':>7s} {'vs HF':>6s}  float layers")
        for spec in RECIPES:
            scheme, _, override = spec.partition("+")
            overrides = (tuple(override.split(":")),) if override else ()
            recipe = recipes.RecipeConfig(scheme=scheme, overrides=overrides)
            prepared = recipes.prepare(smoothed if recipe.smooth else policy, recipe)
            recipes.calibrate(prepared, batches)
            int8 = recipes.convert(prepared, recipe)
            rep = measure_fidelity(policy, int8, golden, **kw)
            tps = ts_decode_tps(int8, new, repeats)
            floats = [n for n, m in overrides if m == "fp32"] or ["embed_tokens", "lm_head"]
            reward = f"{rep.reward_candidate:.3f}" if rep.reward_candidate is not None else "n/a"
            print(f"{spec:38s} {rep.top1_agreement:7.4f} {rep.kl_mean:9.5f} {rep.kl_p99:8.4f} {reward:>7s} "
                  f"{tps:7.1f} {tps / hf:6.2f}  {', '.join(floats)}")


if __name__ == "__main__":
    main()
