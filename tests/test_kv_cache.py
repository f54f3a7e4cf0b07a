"""The INT8 artifact's KV cache in 16 bits (float16 by default, or bfloat16): half float32's bytes a token, chosen at
build time (``recipe.kv_cache``), measured by the gate and recorded in the manifest. Attention over a bfloat16 cache has
two kernels (bfloat16 products where oneDNN has them, PyTorch's fused attention in bfloat16 elsewhere), over a float16
one the fused kernel: all stay close to float32 attention, and a row's result is the same alone or batched in each (the served engine's batching: tests/test_kv_budget.py, tests/test_batching.py)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from cli_helpers import SMALL, run_cli
from policy_bundle.build.errors import EXIT_REFUSED
from policy_bundle.bundle.info import BundleInfo
from policy_bundle.quantize.model.blocks import attend_narrow
from policy_bundle.quantize.model.hf_weights import init_random_policy
from policy_bundle.quantize.model.policy import full_logits, kv_bytes_per_token, set_kv_cache
from policy_bundle.quantize.model.policy_config import PolicyConfig

CFG = PolicyConfig(family="llama", vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                   intermediate_size=128, max_seq_len=512)


def _attention_case(rows: int, positions: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, 2, 6, 32, generator=g)  # 2 kv heads, 3 query heads each, 2 query positions
    k = torch.randn(rows, 2, positions, 32, generator=g)
    v = torch.randn(rows, 2, positions, 32, generator=g)
    seen = torch.arange(positions).view(1, 1, 1, -1) <= torch.arange(rows).view(-1, 1, 1, 1) * 37 + 100
    mask = torch.zeros(rows, 1, 1, positions).masked_fill_(~seen, float("-inf"))
    return q, k, v, mask, seen


@pytest.mark.parametrize("native", [True, False], ids=["bf16-products", "fused-bf16"])
def test_attention_over_a_bfloat16_cache_is_close_to_float32_and_the_same_alone_or_batched(native):
    # without oneDNN's bfloat16 kernels the products still run (slowly, through PyTorch's own): the kernel is checked
    # for correctness on every CPU, whichever one this CPU serves with
    q, k, v, mask, seen = _attention_case(4, 700)
    kb, vb = k.bfloat16(), v.bfloat16()
    exact = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out = attend_narrow(q, kb, vb, mask, native)
    assert out.dtype == torch.float32
    err = (out - exact).abs().max().item()
    assert err < 0.02, err
    # the negative control: a cache read without its mask is far off
    assert (attend_narrow(q, kb, vb, torch.zeros_like(mask), native) - exact).abs().max().item() > 10 * err
    # garbage past a row's positions changes nothing, and a row is the same alone as in its batch
    kb2 = kb.masked_fill(~seen.transpose(-1, -2).expand(-1, 2, -1, 32), 1e4)
    vb2 = vb.masked_fill(~seen.transpose(-1, -2).expand(-1, 2, -1, 32), -1e4)
    batched = attend_narrow(q, kb2, vb2, mask, native)
    assert torch.equal(batched, out)
    for r in range(4):
        alone = attend_narrow(q[r:r + 1], kb2[r:r + 1], vb2[r:r + 1], mask[r:r + 1], native)
        assert torch.equal(alone, batched[r:r + 1])


@pytest.mark.parametrize("native", [True, False], ids=["bf16-products", "fused-bf16"])
def test_attention_over_more_whole_blocks_of_masked_cache_gives_the_same_bits(native):
    """A step attends over ``attention_len`` positions (a multiple of 32) of whatever cache it is handed: a longer
    cache whose extra positions are masked (garbage in them) gives the same result, bitwise, as the short one."""
    q, k, v, mask, _ = _attention_case(2, 256)
    kb, vb = k.bfloat16(), v.bfloat16()
    seen = (torch.arange(256) < 160).view(1, 1, 1, -1)
    mask = torch.zeros(2, 1, 1, 256).masked_fill_(~seen, float("-inf"))
    short = attend_narrow(q, kb[:, :, :160], vb[:, :, :160], mask[..., :160], native)
    for n in (192, 256):
        garbage_k = kb[:, :, :n].clone()
        garbage_k[:, :, 160:] = 3e3
        longer = attend_narrow(q, garbage_k, vb[:, :, :n], mask[..., :n], native)
        assert torch.equal(longer, short), (native, n, (longer - short).abs().max())


def test_a_policy_with_a_bfloat16_cache_halves_its_bytes_and_stays_close_to_float32():
    policy = init_random_policy(CFG, seed=1).eval()
    tokens = torch.randint(0, CFG.vocab_size, (2, 120), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        f32 = full_logits(policy, tokens)
        assert policy.new_cache(1, 8)[0].dtype == torch.float32
        scripted = torch.jit.script(set_kv_cache(policy, "bfloat16"))
        k, v = scripted.new_cache(1, 8)
        bf16 = full_logits(scripted, tokens)
    assert k.dtype == v.dtype == torch.bfloat16
    assert kv_bytes_per_token(policy, "bfloat16") * 2 == kv_bytes_per_token(policy, "float32") == 2 * 2 * 2 * 32 * 4
    diff = (bf16 - f32).abs().max().item()
    assert 0 < diff < 0.05 * f32.abs().max().item()  # rounded keys and values: other logits, close ones
    with pytest.raises(ValueError, match="kv_cache: 'int4'"):
        set_kv_cache(policy, "int4")


def test_a_float16_cache_costs_the_bytes_of_bfloat16_and_is_closer_to_float32():
    """float16 keeps three more mantissa bits than bfloat16 in the same two bytes: the build's default cache. On this
    random policy its logits sit an order of magnitude closer to the float32 cache's than bfloat16's do (SmolLM2-135M's
    held-out golden items: KL 8.3e-7 against 5.5e-5, ``loadtest/bench_kv_precision.py``); bfloat16 is the control."""
    policy = init_random_policy(CFG, seed=1).eval()
    tokens = torch.randint(0, CFG.vocab_size, (2, 120), generator=torch.Generator().manual_seed(2))
    out = {}
    with torch.no_grad():
        f32 = full_logits(policy, tokens)
        for dtype in ("bfloat16", "float16"):
            scripted = torch.jit.script(set_kv_cache(policy, dtype))
            assert scripted.new_cache(1, 8)[0].dtype == getattr(torch, dtype)
            out[dtype] = (full_logits(scripted, tokens) - f32).abs().max().item()
    assert kv_bytes_per_token(policy, "float16") == kv_bytes_per_token(policy, "bfloat16")
    assert 0 < out["float16"] < out["bfloat16"] / 4, out


def test_a_gate_metric_that_is_not_a_number_fails_the_gate():
    """An overflowing cache (float16 past 65504) turns logits into NaN: every comparison with NaN is false, so a gate
    written as ``value > limit`` would have passed it."""
    from policy_bundle.quantize.fidelity.scores import FidelityReport, GateThresholds, evaluate_gate

    t = GateThresholds()
    good = FidelityReport(items=1, tokens=1, top1_agreement=1.0, kl_mean=0.0, kl_p99=0.0)
    assert evaluate_gate(good, t).passed
    for field in ("top1_agreement", "kl_mean", "kl_p99"):
        bad = FidelityReport(items=1, tokens=1, **{**{"top1_agreement": 1.0, "kl_mean": 0.0, "kl_p99": 0.0}, field: float("nan")})
        verdict = evaluate_gate(bad, t)
        assert not verdict.passed and any(field in f and "nan" in f for f in verdict.failures), verdict


def test_the_build_ships_the_cache_its_recipe_names_and_records_it(small_bundle, tmp_path):
    """The default build's TorchScript allocates a float16 cache and its manifest says so; ``recipe.kv_cache=float32``
    builds a float32 one (the negative control), and the gate's teacher-forced KL sees the difference."""
    out = tmp_path / "f32"
    res = run_cli("build", "--config", "build/configs/main.yaml", "--out", str(out), *SMALL,
                  "--set", "recipe.kv_cache=float32", "--set", "export.onnx=false", "--set", "register.bentoml=false")
    assert res.returncode == 0, res.stderr[-3000:]
    kl = {}
    for bundle, dtype in ((small_bundle, "float16"), (out, "float32")):
        info = BundleInfo.read(bundle)
        assert info.kv_cache["dtype"] == dtype
        module = torch.jit.load(str(bundle / "int8" / "policy.ts"))
        k, _ = module.new_cache(1, 32)
        assert k.dtype == getattr(torch, dtype)
        assert info.kv_cache["bytes_per_token"] == 2 * k.numel() // 32 * k.element_size()
        report = json.loads((bundle / "gate_report.json").read_text())
        kl[dtype] = report["metrics"]["kl_mean"]
    assert kl["float16"] != kl["float32"]


def test_a_cache_dtype_the_recipe_does_not_know_is_refused_naming_the_field(tmp_path):
    res = run_cli("build", "--config", "build/configs/main.yaml", "--out", str(tmp_path / "x"),
                  "--set", "recipe.kv_cache=int4")
    assert res.returncode == EXIT_REFUSED, res.stderr[-2000:]
    last = res.stderr.strip().splitlines()[-1]
    assert "recipe.kv_cache" in last and "float16" in last and "Traceback" not in res.stderr
