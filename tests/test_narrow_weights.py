"""A 16-bit source is not widened whole: its decoder layers' linears stay bfloat16/float16 (mapped from the file) and
each block widens its own for its call. Widening is exact, so every result (logits, decode, the int8 plan, the
converted and scripted policy, the smoothed copy) is bitwise that of the source's float32 copy; a converted policy
holds no 16-bit tensor, and the source policy is left as loaded."""

from __future__ import annotations

import pytest
import torch

from policy_bundle.quantize.calibration import linear_stats as ls
from policy_bundle.quantize.model.blocks import NARROW, widened
from policy_bundle.quantize.export.exporters import script_int8
from policy_bundle.quantize.calibration.layer_stream import embed_batches
from policy_bundle.quantize.model.hf_weights import init_random_policy, load_policy, save_hf_weights
from policy_bundle.quantize.runtime.decode import greedy_generate_batch
from policy_bundle.quantize.model.policy import PolicyConfig, full_logits
from policy_bundle.quantize.runtime.decode import greedy_generate
from policy_bundle.quantize.recipes import RecipeConfig, selected_linears
from policy_bundle.quantize.calibration.smooth import (apply_smoothing, collect_channel_absmax, make_outlier_model,
                                                       smoothing_scales)
from policy_bundle.quantize.w8a8.plan import build_plan
from policy_bundle.quantize.w8a8.stream import merge_plans, plan_layers

CFG = PolicyConfig(family="qwen2", vocab_size=96, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16,
                   intermediate_size=128, max_seq_len=64, attention_bias=True)
FLOAT_LINEAR = "layers.1.mlp.down_proj"


@pytest.fixture(scope="module", params=["bfloat16", "float16"])
def sources(request, tmp_path_factory):
    """The same weights twice: stored 16-bit, and stored as their exact float32 widening."""
    dtype = getattr(torch, request.param)
    policy = make_outlier_model(init_random_policy(CFG, seed=3), channels=2, factor=20.0)
    with torch.no_grad():
        for p in policy.parameters():
            p.copy_(p.to(dtype).float())
    tmp = tmp_path_factory.mktemp(request.param)
    save_hf_weights(policy, CFG, tmp / "narrow", dtype)
    save_hf_weights(policy, CFG, tmp / "wide", torch.float32)
    return load_policy(tmp / "narrow"), load_policy(tmp / "wide"), dtype


def tokens(seed: int, shape=(3, 20)) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def test_only_the_layers_linears_stay_16_bit_and_their_blocks_widen_them(sources):
    narrow, wide, dtype = sources
    kept = {n for n, p in narrow.named_parameters() if p.dtype == dtype}
    linears = {n + ".weight" for n, m in narrow.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("layers.")}
    assert kept == linears and len(kept) == 7 * CFG.n_layers  # embedding, head, norms and biases widened at load
    assert all(block.narrow for block in narrow.layers) and not any(block.narrow for block in wide.layers)
    assert not any(p.dtype in NARROW for p in wide.parameters())


def test_the_outputs_are_bitwise_the_float32_copys(sources):
    narrow, wide, _ = sources
    with torch.no_grad():
        assert torch.equal(full_logits(narrow, tokens(0)), full_logits(wide, tokens(0)))
        prompt = tokens(1, (1, 9))[0].tolist()
        assert greedy_generate(narrow, prompt, 12) == greedy_generate(wide, prompt, 12)
        prompts = [tokens(2 + i, (1, 5 + 2 * i))[0].tolist() for i in range(3)]  # the batched decode: forward_rows
        assert greedy_generate_batch(narrow, prompts, 10) == greedy_generate_batch(wide, prompts, 10)


def test_a_block_runs_its_16_bit_weights_only_widened_and_keeps_them(sources):
    narrow, _, dtype = sources
    block = narrow.layers[0]
    before = block.mlp.up_proj.weight
    with widened(block):
        assert block.mlp.up_proj.weight.dtype == torch.float32
    assert block.mlp.up_proj.weight is before and block.narrow
    block.narrow = False  # negative control: without the widening a 16-bit weight meets float32 inputs
    try:
        with pytest.raises(RuntimeError):
            full_logits(narrow, tokens(0))
    finally:
        block.narrow = True


def whole_plan(model, data, recipe):
    stats = ls.collect_group_stats(model, data, ls.outlier_thresholds(ls.collect_token_absmax(model, data), 8.0))
    return build_plan(model, stats, ls.input_groups(model), selected_linears(model, recipe), smooth=True,
                      alphas=recipe.smooth_alphas, rounding="gptq", gptq_damp=0.01, outlier_ratio=8.0,
                      max_rot_block=recipe.rotation_block)


def streamed_plan(model, data, recipe):  # the build's: one layer at a time
    part = plan_layers(model, range(CFG.n_layers), embed_batches(model, data), recipe)
    return merge_plans([part.plan], recipe)


@pytest.mark.parametrize("planner", [whole_plan, streamed_plan])
def test_the_plan_and_the_converted_policy_are_bitwise_the_float32_copys(sources, planner):
    narrow, wide, dtype = sources
    recipe = RecipeConfig(scheme="smooth-w8a8", rounding="gptq")
    data = [tokens(10 + i, (2, 16)) for i in range(3)]
    scripted = []
    for model in (narrow, wide):
        names = selected_linears(model, recipe)
        plan = planner(model, data, recipe)
        int8 = plan.convert(model, [n for n in names if n != FLOAT_LINEAR])
        assert not any(t.dtype in NARROW for t in [*int8.parameters(), *int8.buffers()])
        scripted.append((plan, script_int8(int8)))
    (pn, sn), (pw, sw) = scripted
    assert pn.weights.keys() == pw.weights.keys()
    assert all(torch.equal(pn.weights[k][0], pw.weights[k][0]) and torch.equal(pn.weights[k][1], pw.weights[k][1])
               for k in pn.weights)
    with torch.no_grad():
        assert torch.equal(full_logits(sn, tokens(20)), full_logits(sw, tokens(20)))
    assert narrow.layers[1].mlp.down_proj.weight.dtype == dtype and all(b.narrow for b in narrow.layers)


def test_the_smoothed_copy_is_bitwise_the_float32_copys_and_leaves_the_source(sources):
    narrow, wide, dtype = sources
    data = [tokens(30 + i, (2, 16)) for i in range(2)]
    smoothed = [apply_smoothing(m, smoothing_scales(m, collect_channel_absmax(m, data), 0.5)) for m in (narrow, wide)]
    for (name, a), (_, b) in zip(smoothed[0].named_parameters(), smoothed[1].named_parameters()):
        assert a.dtype == torch.float32 and torch.equal(a, b), name
    with torch.no_grad():
        assert torch.equal(full_logits(smoothed[0], tokens(5)), full_logits(smoothed[1], tokens(5)))
    assert all(p.dtype == dtype for n, p in narrow.named_parameters() if n.endswith("proj.weight"))


def test_threads_running_one_narrow_policy_each_get_the_float32_copys_logits(sources):
    narrow, wide, _ = sources
    from concurrent.futures import ThreadPoolExecutor

    with torch.no_grad():
        want = [full_logits(wide, tokens(40 + i)) for i in range(8)]
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda i: full_logits(narrow, tokens(40 + i)), range(8)))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_narrow_policy_runs_in_and_out_of_inference_mode_and_nested(sources):
    """The kept float32 buffers are normal tensors (a first call under ``torch.inference_mode`` does not make them
    inference tensors that a later call could not copy into), and a block run inside another's widened call (a hook)
    gets buffers of its own: the outer block's weights are not overwritten mid-call."""
    narrow, wide, _ = sources
    from policy_bundle.quantize.model import blocks

    blocks._SCRATCH.clear()
    with torch.inference_mode():
        full_logits(narrow, tokens(50))
    with torch.no_grad():
        assert torch.equal(full_logits(narrow, tokens(51)), full_logits(wide, tokens(51)))
    seen = []

    def inner(module, args):  # block 0's MLP runs block 1 on its own input
        x = args[0]
        seen.append(narrow.layers[1].forward(x, *narrow._chunk_tables(x.shape[1], 0, narrow.new_cache(x.shape[0], 32)[0]),
                                             0, *(c[1] for c in narrow.new_cache(x.shape[0], 32))))

    handle = narrow.layers[0].mlp.register_forward_pre_hook(inner)
    try:
        with torch.no_grad():
            assert torch.equal(full_logits(narrow, tokens(52)), full_logits(wide, tokens(52)))
    finally:
        handle.remove()
    assert seen
