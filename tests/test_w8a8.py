"""The w8a8 recipes' parts: per-token int8 linear, outlier rows, GPTQ rounding, statistics merge, plan."""

import copy

import pytest
import torch

from policy_bundle.quantize.calibration import linear_stats as ls
from policy_bundle.quantize.w8a8.gptq import gptq_quantize
from policy_bundle.quantize.model.policy import PolicyConfig, full_logits
from policy_bundle.quantize.runtime.decode import greedy_generate
from policy_bundle.quantize.model.hf_weights import init_random_policy
from policy_bundle.quantize.recipes import RecipeConfig, RecipeError, selected_linears
from policy_bundle.quantize.calibration.smooth import make_outlier_model
from policy_bundle.quantize.w8a8.linear import (OUTLIER_CHANNELS, Int8TokenLinear, fuse_projections, quantize_weight,
                                                rotation_block, rotation_matrix)
from policy_bundle.quantize.w8a8.head import Int8RescoredHead
from policy_bundle.quantize.w8a8.plan import build_plan

CFG = PolicyConfig(family="llama", vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                   intermediate_size=128, max_seq_len=48)


def batches(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (4, 12 + i), generator=g) for i in range(n)]


def test_per_token_scales_keep_a_quiet_token_exact_beside_a_loud_one():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32, bias=True)
    m = Int8TokenLinear.from_float(lin)
    x = torch.randn(2, 64) * 0.01
    x[0, 5] = 1000.0  # a massive activation in row 0 must not coarsen row 1's scale
    assert torch.equal(m(x)[1], m(x[1:])[0])  # row 1 is quantized as if it were alone
    exact = x[1] @ m.dequantized_weight().t() + lin.bias
    assert torch.allclose(m(x)[1], exact, rtol=0, atol=0.02 * float(exact.abs().max()))


def test_outlier_rows_keep_their_largest_channels_in_float():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(3, 64)
    x[1, :] *= 200.0
    x[1, 7] = 5000.0
    m = Int8TokenLinear.from_float(lin, outlier_threshold=1000.0)
    plain = Int8TokenLinear.from_float(lin)  # no threshold: the loud row is quantized whole
    float_path = x[1] @ m.dequantized_weight().t()
    err = lambda out: float((out - float_path).abs().max() / float_path.abs().max())  # noqa: E731
    assert err(m(x)[1]) < 0.01 and err(plain(x)[1]) > 5 * err(m(x)[1])
    idx = x[1].abs().topk(OUTLIER_CHANNELS).indices  # what the split computes: those channels in float ...
    big = torch.zeros(64).index_copy(0, idx, x[1, idx])
    expect = plain.rows((x[1] - big).unsqueeze(0))[0] + big @ m.dequantized_weight().t()  # ... the rest in int8
    assert torch.allclose(m(x)[1], expect, rtol=1e-5, atol=1e-3)
    assert torch.equal(m(x)[[0, 2]], plain(x)[[0, 2]])  # quiet rows: untouched


def test_fused_projections_equal_the_separate_ones():
    policy = init_random_policy(CFG, seed=3)
    names = [n for n, mod in policy.named_modules() if isinstance(mod, torch.nn.Linear) and n != "lm_head"]
    int8 = copy.deepcopy(policy)
    for n in names:
        parent, _, child = n.rpartition(".")
        setattr(int8.get_submodule(parent), child, Int8TokenLinear.from_float(policy.get_submodule(n), rot_block=16))
    fused = copy.deepcopy(int8)
    assert fuse_projections(fused) == 2 * CFG.n_layers
    x = torch.randint(0, 64, (2, 16))
    assert torch.equal(full_logits(fused, x), full_logits(int8, x))
    assert greedy_generate(torch.jit.script(fused), [3, 14, 15], 10) == greedy_generate(int8, [3, 14, 15], 10)
    one_float = copy.deepcopy(int8)  # a group with a float member stays unfused
    one_float.layers[0].self_attn.k_proj = policy.layers[0].self_attn.k_proj
    assert fuse_projections(one_float) == 2 * CFG.n_layers - 1


def test_hadamard_rotation_is_orthogonal_and_shrinks_the_error_of_loud_channels():
    assert [rotation_block(n, 512) for n in (576, 1536, 6, 7)] == [64, 512, 2, 0]
    r = rotation_matrix(576, 64)
    assert torch.allclose(r @ r.t(), torch.eye(576), atol=1e-5)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)  # the linear's weights: not the global generator's state after whichever test ran before
    lin = torch.nn.Linear(576, 256, bias=True)
    x = torch.randn(16, 576, generator=g)
    x[:, [3, 100, 101]] *= 60.0  # a few loud channels in every row (not outlier rows: no threshold)
    exact = lin(x).detach()
    err = lambda m: float((m(x) - exact).pow(2).sum() / exact.pow(2).sum())  # noqa: E731
    rotated, plain = Int8TokenLinear.from_float(lin, rot_block=64), Int8TokenLinear.from_float(lin)
    assert err(rotated) < 0.5 * err(plain), (err(rotated), err(plain))
    # rounding moves each rotated element by <= scale / 2; rotating back keeps each row's L2 norm of that error
    row_err = (rotated.dequantized_weight() - lin.weight).norm(dim=1)
    assert (row_err <= rotated.scales * 576 ** 0.5 / 2 + 1e-6).all()
    not_undone = (rotated.int8_weight().float() * rotated.scales.unsqueeze(1) - lin.weight).norm(dim=1)
    assert (not_undone > rotated.scales * 576 ** 0.5 / 2).all()  # the bound tells a missing back-rotation
    assert torch.equal(torch.jit.script(rotated)(x), rotated(x))
    assert torch.equal(rotated(x[:1]), rotated(x)[:1])  # fbgemm's two entry points: still equal


def test_int8_token_linear_scripts_and_matches_eager():
    lin = torch.nn.Linear(64, 48, bias=True)
    m = Int8TokenLinear.from_float(lin, outlier_threshold=3.0)
    x = torch.randn(2, 5, 64)
    x[0, 0] *= 10
    assert torch.equal(torch.jit.script(m)(x), m(x))


def test_gptq_beats_nearest_rounding_on_correlated_inputs():
    g = torch.Generator().manual_seed(0)
    mix = torch.randn(96, 96, generator=g)
    x = torch.randn(2048, 96, generator=g) @ mix  # correlated input channels
    w = torch.randn(64, 96, generator=g)
    q_n, s_n = quantize_weight(w)
    q_g, s_g = gptq_quantize(w, x.t().double() @ x.double())
    err = lambda q, s: float((x @ (w - q.float() * s.unsqueeze(1)).t()).pow(2).mean())  # noqa: E731
    assert q_g.dtype == torch.int8 and torch.equal(s_g, s_n)
    assert err(q_g, s_g) < 0.8 * err(q_n, s_n)


def test_sharded_statistics_merge_to_the_whole():
    policy = make_outlier_model(init_random_policy(CFG, seed=1), channels=2, factor=50.0)
    data = batches()
    whole_tam = ls.collect_token_absmax(policy, data)
    parts_tam = [ls.collect_token_absmax(policy, data[:3]), ls.collect_token_absmax(policy, data[3:])]
    merged_tam = ls.merge_token_absmax(parts_tam)
    assert all(torch.equal(whole_tam[g], merged_tam[g]) for g in whole_tam)
    th = ls.outlier_thresholds(whole_tam, 4.0)
    whole = ls.collect_group_stats(policy, data, th)
    merged = ls.merge_group_stats([ls.collect_group_stats(policy, data[:3], th),
                                   ls.collect_group_stats(policy, data[3:], th)])
    for g, s in whole.items():
        assert s.rows == merged[g].rows
        assert torch.equal(s.channel_absmax, merged[g].channel_absmax)
        assert torch.allclose(s.hessian, merged[g].hessian, rtol=1e-10)


@pytest.mark.parametrize("scheme,rounding", [("w8a8", "nearest"), ("smooth-w8a8", "gptq")])
def test_w8a8_plan_tracks_fp32_and_exports_to_torchscript(scheme, rounding, tmp_path):
    policy = make_outlier_model(init_random_policy(CFG, seed=1), channels=2, factor=50.0)
    recipe = RecipeConfig(scheme=scheme, rounding=rounding)
    data = batches()
    stats = ls.collect_group_stats(policy, data, ls.outlier_thresholds(ls.collect_token_absmax(policy, data), 8.0))
    names = selected_linears(policy, recipe)
    plan = build_plan(policy, stats, ls.input_groups(policy), names, smooth=recipe.smooth,
                      alphas=recipe.smooth_alphas, rounding=rounding, gptq_damp=0.01, outlier_ratio=8.0,
                      max_rot_block=recipe.rotation_block)
    int8 = plan.convert(policy, names)
    assert sum(isinstance(m, Int8TokenLinear) for m in int8.modules()) == len(names)
    assert plan.rot_blocks and set(plan.rot_blocks.values()) == {64, 128}  # the default: inputs Hadamard-rotated
    x = torch.randint(0, 64, (2, 16))
    agree = (full_logits(policy, x).argmax(-1) == full_logits(int8, x).argmax(-1)).float().mean()
    assert agree >= 0.8  # a random model: near-tied logits
    scripted = torch.jit.script(int8)
    torch.jit.save(scripted, str(tmp_path / "p.ts"))
    loaded = torch.jit.load(str(tmp_path / "p.ts"))
    assert greedy_generate(loaded, [3, 14, 15, 9], 12) == greedy_generate(int8, [3, 14, 15, 9], 12)
    with torch.no_grad():  # a prefill's logits (the head on the last row alone) are that row of the full forward's
        full = loaded(x, 0, *loaded.new_cache(2, 16))  # (within rounding: this head is float, whose GEMM and GEMV
        k, v = loaded.new_cache(2, 16)                 # round apart; an int8 row is the same alone: test_real_lm_quick)
        assert torch.allclose(loaded.prefill(x, k, v), full[:, -1:], rtol=0, atol=1e-5)
        k2, v2 = loaded.new_cache(2, 16)
        loaded.prefill(x[:, :9], k2, v2)
        assert torch.allclose(loaded.next_logits(x[:, 9:], 9, k2, v2), full[:, -1:], rtol=0, atol=1e-5)
        assert not torch.allclose(loaded.next_logits(x[:, 9:], 9, *loaded.new_cache(2, 16)), full[:, -1:], atol=1e-3)
    kept = plan.convert(policy, names[1:])  # the fallback re-converts without the data
    assert isinstance(kept.get_submodule(names[0]), torch.nn.Linear)
    from policy_bundle.quantize.w8a8.linear import RowStableLinear, stabilize_float_linears

    head = kept.lm_head
    assert stabilize_float_linears(kept) >= 1 and isinstance(kept.get_submodule(names[0]), RowStableLinear)
    assert kept.lm_head is head and stabilize_float_linears(policy) == 0  # the head, and a float policy, as they are


@pytest.mark.parametrize("field,value,msg", [
    ("rounding", "stochastic", "recipe.rounding"),
    ("outlier_ratio", -1.0, "recipe.outlier_ratio"),
    ("smooth_alphas", (0.5, 1.5), "recipe.smooth_alphas"),
    ("gptq_damp", 0.0, "recipe.gptq_damp"),
    ("rotation_block", 48, "recipe.rotation_block"),
])
def test_bad_w8a8_knobs_name_the_field(field, value, msg):
    with pytest.raises(RecipeError, match=msg):
        RecipeConfig(scheme="w8a8", **{field: value})


def test_w8a8_does_not_mix_with_torch_ao_modes():
    with pytest.raises(RecipeError, match="cannot be mixed"):
        RecipeConfig(scheme="smooth-w8a8", overrides=(("down_proj", "dynamic"),))


def test_rescored_head_gives_exact_float_logits_for_its_top_k():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(500, 32)
    head = torch.nn.Linear(32, 500, bias=False)
    head.weight = emb.weight  # tied, as in SmolLM2
    x = torch.randn(6, 32)
    rescored = Int8RescoredHead(Int8TokenLinear.from_float(head), head.weight.detach(), topk=16)
    exact = x @ head.weight.t()
    out = rescored(x)
    assert torch.equal(out.argmax(-1), exact.argmax(-1))
    top = out.topk(4, dim=-1).indices
    assert torch.allclose(out.gather(1, top), exact.gather(1, top), atol=1e-5)
    assert rescored.float_weight.data_ptr() == emb.weight.data_ptr()  # shared with the embedding, not copied
    assert torch.equal(torch.jit.script(rescored)(x), out)


def test_rescored_head_gives_a_row_the_same_logits_alone_or_in_any_batch():
    """Batched greedy decoding equals unbatched with an int8 head: one row and many (fbgemm's two entry points, 16 rows
    at a time past 16) give each row the same logits, bitwise."""
    torch.manual_seed(1)
    head = torch.nn.Linear(32, 500, bias=False)
    rescored = Int8RescoredHead(Int8TokenLinear.from_float(head), head.weight.detach(), topk=16)
    scripted = torch.jit.script(rescored)
    x = torch.randn(2, 75, 32)  # 150 rows: nine full chunks of 16 and a part
    out = scripted(x)
    assert out.shape == (2, 75, 500)
    alone = torch.cat([scripted(row) for row in x.reshape(-1, 1, 32)]).reshape(2, 75, 500)
    assert torch.equal(out, alone)
    assert torch.equal(out, rescored.scored(x.reshape(150, 32)).reshape(2, 75, 500))  # chunked = one pass
    assert torch.equal(out, rescored(x))


def test_exported_int8_head_keeps_its_float_rows_tied_to_the_embedding(tmp_path):
    from dataclasses import replace

    from policy_bundle.quantize.export.exporters import export_torchscript

    policy = init_random_policy(replace(CFG, tie_embeddings=True), seed=4)
    int8 = copy.deepcopy(policy)
    int8.lm_head = Int8RescoredHead(Int8TokenLinear.from_float(int8.lm_head), int8.lm_head.weight.detach(), topk=8)
    x = torch.randint(0, 64, (1, 12))
    before = full_logits(int8, x)
    loaded = torch.jit.load(str(export_torchscript(int8, tmp_path / "p.ts")))
    emb, rows = loaded.embed_tokens.weight, loaded.lm_head.float_weight
    assert rows.untyped_storage().data_ptr() == emb.untyped_storage().data_ptr()  # one copy in the file and in RAM
    assert torch.equal(full_logits(loaded, x), before)


def test_exported_int8_policy_is_for_inference_without_a_no_grad_block(tmp_path):
    from policy_bundle.quantize.export.exporters import export_torchscript

    policy = init_random_policy(CFG, seed=5)
    int8 = copy.deepcopy(policy)
    for n in [n for n, mod in policy.named_modules() if isinstance(mod, torch.nn.Linear) and n != "lm_head"]:
        parent, _, child = n.rpartition(".")
        setattr(int8.get_submodule(parent), child, Int8TokenLinear.from_float(policy.get_submodule(n), rot_block=16))
    int8.eval()
    x = torch.randint(0, 64, (1, 6))
    assert full_logits(int8, x).requires_grad  # the control: the eager policy's parameters ask for gradients
    loaded = torch.jit.load(str(export_torchscript(int8, tmp_path / "p.ts")))
    assert not any(p.requires_grad for p in loaded.parameters())
    assert not any(m.training for m in loaded.modules())  # the fused q/k/v and gate/up too (new modules)
    k, v = loaded.new_cache(1, 8)
    out = loaded.prefill(x, k, v)  # no torch.no_grad() here: a plain caller records no autograd graph
    assert not out.requires_grad and out.grad_fn is None


def test_the_front_dispatches_each_family_and_keeps_float_layers_on_request():
    """``quantize(policy, config, statistics)``: a w8a8 config converts its plan, a torch.ao config its prepared model,
    each with the asked linears left float; a w8a8 config handed torch.ao statistics is refused, naming both."""
    from policy_bundle.quantize import recipes
    from policy_bundle.quantize.front import quantize
    from policy_bundle.quantize.recipe_types import typed

    policy = init_random_policy(CFG, seed=1)
    data = batches()
    w8a8 = typed(RecipeConfig(scheme="w8a8", rounding="nearest"))
    stats = ls.collect_group_stats(policy, data, ls.outlier_thresholds(ls.collect_token_absmax(policy, data), 8.0))
    names = selected_linears(policy, w8a8)
    plan = build_plan(policy, stats, ls.input_groups(policy), names, smooth=False, alphas=w8a8.smooth_alphas,
                      rounding="nearest", gptq_damp=0.01, outlier_ratio=8.0, max_rot_block=w8a8.rotation_block)
    int8 = quantize(policy, w8a8, plan, float_layers=names[:1])
    assert isinstance(int8.get_submodule(names[0]), torch.nn.Linear)
    assert all(isinstance(int8.get_submodule(n), Int8TokenLinear) for n in names[1:])

    static = typed(RecipeConfig(scheme="static"))
    prepared = recipes.prepare(policy, static)
    recipes.calibrate(prepared, data)
    ao = quantize(prepared, static, prepared, float_layers=names[:1])
    assert type(ao.get_submodule(names[0])) is torch.nn.Linear
    assert type(ao.get_submodule(names[1])) is not torch.nn.Linear  # a quantized module
    with pytest.raises(TypeError, match="W8A8Recipe quantizes from a W8A8Plan, not"):
        quantize(policy, w8a8, prepared)
