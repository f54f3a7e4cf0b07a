"""The int8 token embedding (``quantize.w8a8.head.Int8Embedding``): a tied model's int8 head shares its rows with it
and rescores from them, so no float copy of the vocabulary is left, in the file or in memory."""

import copy
from dataclasses import replace

import pytest
import torch

from policy_bundle.quantize.calibration import linear_stats as ls
from policy_bundle.quantize.export.exporters import export_torchscript
from policy_bundle.quantize.model.hf_weights import init_random_policy
from policy_bundle.quantize.model.policy import PolicyConfig, full_logits
from policy_bundle.quantize.recipes import RecipeConfig, selected_linears
from policy_bundle.quantize.w8a8.rotation import rotation_matrix
from policy_bundle.quantize.runtime.script_runner import load_torchscript
from policy_bundle.quantize.w8a8.linear import Int8TokenLinear
from policy_bundle.quantize.w8a8.head import Int8Embedding, Int8RescoredHead
from policy_bundle.quantize.w8a8.plan import build_plan

CFG = PolicyConfig(family="llama", vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                   intermediate_size=128, max_seq_len=48, tie_embeddings=True)


def tied_head(rot_block=64, topk=16):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(512, 64)
    head = torch.nn.Linear(64, 512, bias=False)
    head.weight = emb.weight
    w = head.weight.detach() @ rotation_matrix(64, rot_block) if rot_block else head.weight.detach()
    from policy_bundle.quantize.w8a8.linear import quantize_weight

    q, s = quantize_weight(w)
    lin = Int8TokenLinear(q, s, None, 0.0, rot_block=rot_block, share_weight=True)
    return emb, Int8RescoredHead(lin, torch.zeros(0, 0), topk)


@pytest.mark.parametrize("rot_block", [0, 64])
def test_the_embedding_reads_the_heads_int8_rows_turned_back_from_the_rotation(rot_block):
    emb, head = tied_head(rot_block)
    int8_emb = Int8Embedding.tied_to(head.int8)
    assert int8_emb.weight_int8.data_ptr() == head.rows_int8.data_ptr() == head.int8.fbgemm.shared.data_ptr()
    ids = torch.tensor([[0, 5, 511, 5], [7, 8, 9, 10]])
    out = int8_emb(ids)
    deq = head.int8.fbgemm.shared.float() * head.int8.scales.unsqueeze(1)
    if rot_block:
        deq = deq @ rotation_matrix(64, rot_block).t()
    assert out.shape == (2, 4, 64) and torch.allclose(out, deq[ids], atol=1e-6)
    rel = float((out - emb(ids)).norm() / emb(ids).norm())
    assert rel < 0.02  # int8 rows: about 1 % on random rows
    assert torch.equal(torch.jit.script(int8_emb)(ids), out)
    for b in range(2):  # a token's row alone is its row in any batch (the batched decode equals the unbatched)
        for t in range(4):
            assert torch.equal(int8_emb(ids[b:b + 1, t:t + 1])[0, 0], out[b, t])


def test_rescoring_from_int8_rows_scores_the_top_k_with_the_int8_weight_and_float_inputs():
    emb, head = tied_head(64)
    x = torch.randn(6, 64)
    out = head(x)
    w = head.int8.dequantized_weight()  # the int8 rows as the kernel sees them, rotation undone
    top = out.topk(4, dim=-1).indices
    assert torch.allclose(out.gather(1, top), (x @ w.t()).gather(1, top), atol=1e-4)
    exact = x @ emb.weight.detach().t()
    assert torch.equal(out.argmax(-1), exact.argmax(-1))
    # the plain int8 logits (activations quantized too) are what the top-k replaced
    assert not torch.allclose(out.gather(1, top), head.int8(x).gather(1, top), atol=1e-4)
    rows = [head(r.unsqueeze(0)) for r in x]  # a row's logits alone are its logits in the batch
    assert torch.equal(torch.cat(rows), out)


def test_a_head_without_float_rows_must_share_its_int8_weight():
    _, head = tied_head(64)
    plain = Int8TokenLinear(head.int8.int8_weight(), head.int8.scales, None, 0.0, rot_block=64)
    with pytest.raises(ValueError, match="share"):
        Int8RescoredHead(plain, torch.zeros(0, 0), 16)
    with pytest.raises(ValueError, match="share_weight"):
        Int8Embedding.tied_to(plain)


def plan_for(policy):
    recipe = RecipeConfig(scheme="smooth-w8a8", skip=())
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, CFG.vocab_size, (4, 12 + i), generator=g) for i in range(4)]
    stats = ls.collect_group_stats(policy, data, ls.outlier_thresholds(ls.collect_token_absmax(policy, data), 8.0))
    names = selected_linears(policy, recipe)
    plan = build_plan(policy, stats, ls.input_groups(policy), names, smooth=True, alphas=recipe.smooth_alphas,
                      rounding="gptq", gptq_damp=0.01, outlier_ratio=8.0, head_topk=16, max_rot_block=512)
    return plan, names


def test_a_tied_policy_exports_without_a_float_vocabulary_and_loads_to_the_same_logits(tmp_path):
    policy = init_random_policy(CFG, seed=3)
    plan, names = plan_for(policy)
    assert "lm_head" in names
    plan.int8_embedding = False
    floats = plan.convert(policy, names)  # the control: the float embedding, the head's float rows tied to it
    assert isinstance(floats.embed_tokens, torch.nn.Embedding) and floats.lm_head.float_weight.numel() > 0
    plan.int8_embedding = True
    int8 = plan.convert(policy, names)
    assert isinstance(int8.embed_tokens, Int8Embedding) and int8.lm_head.float_weight.numel() == 0
    assert int8.embed_tokens.weight_int8.data_ptr() == int8.lm_head.rows_int8.data_ptr()
    x = torch.randint(0, CFG.vocab_size, (2, 16))
    with torch.no_grad():
        ref, got = full_logits(policy, x), full_logits(int8, x)
    assert float((ref.argmax(-1) == got.argmax(-1)).float().mean()) >= 0.8  # a random model: near-tied logits
    a = export_torchscript(copy.deepcopy(floats), tmp_path / "float-emb.ts")
    b = export_torchscript(copy.deepcopy(int8), tmp_path / "int8-emb.ts")
    vocab_fp32 = CFG.vocab_size * CFG.dim * 4
    # the float vocabulary gone, its int8 rows the head's own (no second copy)
    assert b.stat().st_size < a.stat().st_size - 0.7 * vocab_fp32
    loaded = check_loaded(b, int8, x)
    assert (loaded.module.embed_tokens.weight_int8.untyped_storage().data_ptr()
            == loaded.module.lm_head.rows_int8.untyped_storage().data_ptr())


def check_loaded(path, eager, x):
    """The exported ``path`` loaded back: ``eager``'s logits on ``x`` [2, 16], a row decoding alone as in a batch."""
    loaded = load_torchscript(path)
    with torch.no_grad():
        assert torch.equal(loaded(x, 0, *loaded.new_cache(2, 16)), full_logits(eager, x))
        k, v = loaded.new_cache(2, 32)
        loaded.prefill(x, k, v)
        tok, pos = torch.tensor([[3], [4]]), torch.tensor([16, 16])
        both = loaded.decode_batch(tok, pos, k, v)
        k1, v1 = loaded.new_cache(1, 32)
        loaded.prefill(x[1:], k1, v1)
        assert torch.equal(loaded.decode(tok[1:], 16, k1, v1), both[1:])  # a row alone as in the batch
    return loaded


def test_the_embedding_stays_float_where_the_tied_head_does():
    policy = init_random_policy(CFG, seed=3)
    plan, names = plan_for(policy)
    plan.int8_embedding = True
    kept = plan.convert(policy, [n for n in names if n != "lm_head"])  # the head a float fallback layer
    assert isinstance(kept.embed_tokens, torch.nn.Embedding)


def test_an_untied_embedding_is_quantized_on_its_own():
    policy = init_random_policy(replace(CFG, tie_embeddings=False), seed=3)
    plan, names = plan_for(policy)
    plan.int8_embedding = True
    int8 = plan.convert(policy, names)
    assert isinstance(int8.embed_tokens, Int8Embedding) and int8.embed_tokens.rot_b == 0
    assert int8.lm_head.float_weight.numel() > 0  # the untied head's float rows are its own weight
    ids = torch.tensor([[1, 2, 3]])
    ref = policy.embed_tokens(ids)
    assert float((int8.embed_tokens(ids) - ref).norm() / ref.norm()) < 0.02


@pytest.mark.parametrize("skip,fp32,kept", [((), (), False), (("embed_tokens",), (), True), (("embed*",), (), True),
                                            (("lm_head",), (), False), ((), ("embed_tokens",), True)])
def test_skip_patterns_decide_the_int8_embedding_as_they_decide_linears(skip, fp32, kept):
    from policy_bundle.quantize.recipes import kept_float

    assert kept_float("embed_tokens", RecipeConfig(scheme="smooth-w8a8", skip=skip, fp32_layers=fp32)) is kept
