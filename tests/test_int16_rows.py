"""The vocabulary rows in int16 (``recipe.vocab_rows: int16``, ``quantize.w8a8.head.Int16Embedding``): a rescored
int8 head's top-k rescoring and the token embedding read one int16 copy of the vocabulary (a scale per row), half the
float32 copy's bytes in the file and in memory, each row within 1/65534 of its largest value."""

import copy

import pytest
import torch

from policy_bundle.quantize.export.exporters import export_torchscript
from policy_bundle.quantize.model.hf_weights import init_random_policy
from policy_bundle.quantize.recipes import RecipeConfig, RecipeError
from policy_bundle.quantize.w8a8.head import Int8RescoredHead, Int16Embedding, gather_int16, quantize_rows_int16

from test_int8_embedding import CFG, check_loaded, plan_for


def test_int16_rows_are_within_a_65534th_of_each_rows_largest_value():
    w = torch.randn(300, 64) * torch.linspace(0.01, 5.0, 300).unsqueeze(1)
    w[7] = 0.0  # an all-zero row stays zero
    q, s = quantize_rows_int16(w)
    assert q.dtype == torch.int16 and s.shape == (300,)
    back = gather_int16(q, s, torch.arange(300))
    bound = w.abs().amax(dim=1, keepdim=True) / 65534 * 1.01  # half a code, and float32 rounding of w / scale
    assert bool(((back - w).abs() <= bound).all()) and torch.equal(back[7], torch.zeros(64))
    assert not torch.equal(back, w)  # the negative control: not the float rows themselves


def test_a_tied_policy_holds_one_int16_vocabulary_for_its_embedding_and_its_rescoring(tmp_path):
    policy = init_random_policy(CFG, seed=3)
    plan, names = plan_for(policy)
    plan.int8_embedding = False
    floats = plan.convert(policy, names)  # the control: float32 rows, the embedding's own weight
    assert isinstance(floats.embed_tokens, torch.nn.Embedding) and floats.lm_head.float_weight.numel() > 0
    plan.int16_rows = True
    rows16 = plan.convert(policy, names)
    head, emb = rows16.lm_head, rows16.embed_tokens
    assert isinstance(head, Int8RescoredHead) and isinstance(emb, Int16Embedding)
    assert head.float_weight.numel() == 0 and head.rows_int8.numel() == 0
    assert emb.rows16.data_ptr() == head.rows16.data_ptr() and emb.scales16.data_ptr() == head.scales16.data_ptr()
    ids = torch.randint(0, CFG.vocab_size, (2, 16))
    ref = policy.embed_tokens(ids)
    assert float((emb(ids) - ref).abs().max()) <= float(policy.embed_tokens.weight.abs().max()) / 65534 * 1.01
    with torch.no_grad():
        x = torch.randn(6, CFG.dim)
        exact = x @ policy.embed_tokens.weight.t()
        out = head(x)
        top = out.topk(4, dim=-1).indices
        assert torch.allclose(out.gather(1, top), exact.gather(1, top), atol=1e-4)  # rescored from near-exact rows
        assert torch.equal(out.argmax(-1), exact.argmax(-1))
        assert torch.equal(torch.cat([head(r.unsqueeze(0)) for r in x]), out)  # a row alone is its row in a batch
    a = export_torchscript(copy.deepcopy(floats), tmp_path / "float32-rows.ts")
    b = export_torchscript(copy.deepcopy(rows16), tmp_path / "int16-rows.ts")
    vocab_fp32 = CFG.vocab_size * CFG.dim * 4
    assert b.stat().st_size < a.stat().st_size - 0.45 * vocab_fp32  # half the vocabulary's bytes, saved once
    loaded = check_loaded(b, rows16, ids)
    assert (loaded.module.embed_tokens.rows16.untyped_storage().data_ptr()
            == loaded.module.lm_head.rows16.untyped_storage().data_ptr())



def test_the_recipe_field_defaults_to_int12_takes_float32_or_int16_and_refuses_the_rest_by_name():
    assert RecipeConfig(scheme="smooth-w8a8").vocab_rows == "int12"  # the default
    for rows in ("float32", "int16", "int12"):
        assert RecipeConfig(scheme="smooth-w8a8", vocab_rows=rows).vocab_rows == rows
    with pytest.raises(RecipeError, match="recipe.vocab_rows"):
        RecipeConfig(scheme="smooth-w8a8", vocab_rows="int8")
    with pytest.raises(RecipeError, match="recipe.vocab_rows"):
        RecipeConfig(scheme="smooth-w8a8", vocab_rows="int4")


def test_rescoring_rows_need_their_scales():
    from policy_bundle.quantize.w8a8.linear import Int8TokenLinear, quantize_weight

    q, s = quantize_weight(torch.randn(32, 16))
    lin = Int8TokenLinear(q, s, None, 0.0)
    rows16, scales16 = quantize_rows_int16(torch.randn(32, 16))
    assert Int8RescoredHead(lin, torch.zeros(0, 0), 4, rows16, scales16).rows16.shape == (32, 16)
    for bad in ((rows16, None), (None, scales16), (rows16, scales16[:5])):
        with pytest.raises(ValueError, match="scales"):
            Int8RescoredHead(lin, torch.zeros(0, 0), 4, *bad)


def test_int16_and_int12_rows_candidates_reuse_the_float_rows_plan(monkeypatch):
    """The rows' format changes no statistic, weight or threshold: a ``vocab_rows=int16`` candidate takes the plan
    already made for its float32 twin, with ``int16_rows`` set, instead of searching and rounding again."""
    from policy_bundle.build.calibrate import calibrated as cal
    from policy_bundle.build.calibrate import w8a8_statistics
    from policy_bundle.quantize.w8a8.plan import W8A8Plan

    made = []
    monkeypatch.setattr(w8a8_statistics, "stream_plan", lambda *a: made.append(a) or (W8A8Plan({}, {}, {}, {}), None, None))
    models = cal.CalibratedModels.__new__(cal.CalibratedModels)
    models.plans, models.stats, models.layer_plans = {}, {}, {}
    models.mesh = models.policy = models.batches = None
    float_rows = models.plan(RecipeConfig(scheme="smooth-w8a8", vocab_rows="float32"))
    int16 = models.plan(RecipeConfig(scheme="smooth-w8a8", vocab_rows="int16"))
    int12 = models.plan(RecipeConfig(scheme="smooth-w8a8", vocab_rows="int12"))
    assert len(made) == 1 and not float_rows.int16_rows and int16.int16_rows and not int16.int12_rows
    assert int12.int12_rows and not int12.int16_rows and not float_rows.int12_rows
    assert int16.weights is float_rows.weights is int12.weights  # the same int8 weights, not a second rounding
