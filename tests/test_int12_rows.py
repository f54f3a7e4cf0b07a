"""The vocabulary rows in int12 (``recipe.vocab_rows: int12``, ``quantize.w8a8.head.quantize_rows_int12``): a
rescored int8 head's own int8 rows (nearest rounding) plus a 4-bit residual per element are what its top-k rescoring
and a tied token embedding read: no float copy of the vocabulary is left, 1.5 bytes an element in the file, each row
within 1/3810 of its largest value (15 times finer than the int8 rows alone)."""

import copy
from dataclasses import replace

import pytest
import torch

from policy_bundle.quantize.export.exporters import export_torchscript
from policy_bundle.quantize.model.hf_weights import init_random_policy
from policy_bundle.quantize.recipes import RecipeConfig
from policy_bundle.quantize.w8a8.linear import Int8TokenLinear, quantize_weight
from policy_bundle.quantize.w8a8.head import (Int8Embedding, Int8RescoredHead, Int16Embedding, int12_rows,
                                              quantize_rows_int12)

from test_int8_embedding import CFG, check_loaded, plan_for


@pytest.mark.parametrize("dim", [64, 63])
def test_int12_rows_are_within_a_3810th_of_each_rows_largest_value_and_15_times_finer_than_int8(dim):
    w = torch.randn(300, dim) * torch.linspace(0.01, 5.0, 300).unsqueeze(1)
    w[7] = 0.0  # an all-zero row stays zero
    q, s, residual = quantize_rows_int12(w)
    q8, s8 = quantize_weight(w)
    assert torch.equal(q, q8) and torch.equal(s, s8)  # the int8 part is nearest int8 itself
    assert residual.dtype == torch.uint8 and residual.shape == (300, (dim + 1) // 2)
    ids = torch.arange(300)
    back = int12_rows(q, residual, ids) * s.unsqueeze(1)
    amax = w.abs().amax(dim=1, keepdim=True)
    assert bool(((back - w).abs() <= amax / 3810 * 1.01).all()) and torch.equal(back[7], torch.zeros(dim))
    int8_err = (q.float() * s.unsqueeze(1) - w).abs().mean()
    assert float((back - w).abs().mean()) < float(int8_err) / 10  # the negative control: int8 alone is far coarser
    assert torch.equal(int12_rows(q, torch.zeros(0, 0, dtype=torch.uint8), ids), q.float())  # no residual: int8
    some = torch.tensor([5, 299, 5])
    assert torch.equal(int12_rows(q, residual, some), int12_rows(q, residual, ids)[some])  # rows stand alone


def test_a_tied_policy_reads_one_int12_vocabulary_for_its_embedding_and_its_rescoring(tmp_path):
    policy = init_random_policy(CFG, seed=3)
    plan, names = plan_for(policy)
    plan.int8_embedding = False
    floats = plan.convert(policy, names)  # the control: float32 rows, the embedding's own weight
    plan.int12_rows = True
    rows12 = plan.convert(policy, names)
    head, emb = rows12.lm_head, rows12.embed_tokens
    assert isinstance(head, Int8RescoredHead) and isinstance(emb, Int8Embedding)
    assert head.float_weight.numel() == 0 and head.residual.numel() > 0
    assert emb.weight_int8.data_ptr() == head.rows_int8.data_ptr() and emb.residual.data_ptr() == head.residual.data_ptr()
    weight = policy.embed_tokens.weight
    ids = torch.randint(0, CFG.vocab_size, (2, 16))
    with torch.no_grad():  # the rows are of the rotated weight: each is within 1/3810 of its largest value there,
        rot_max = head.int8.rotate(weight).abs().amax(dim=1)[ids]  # and the rotation back keeps the error's length
    err12 = (emb(ids) - policy.embed_tokens(ids)).abs()
    assert bool((err12.norm(dim=-1) <= rot_max / 3810 * CFG.dim ** 0.5 * 1.01 + 1e-6).all())
    plan.int12_rows, plan.int8_embedding = False, True
    int8 = plan.convert(policy, names)  # the negative control: the int8 rows alone
    assert float((int8.embed_tokens(ids) - policy.embed_tokens(ids)).abs().mean()) > 8 * float(err12.mean())
    with torch.no_grad():
        x = torch.randn(6, CFG.dim)
        exact = x @ weight.t()
        out = head(x)
        top = out.topk(4, dim=-1).indices
        assert torch.allclose(out.gather(1, top), exact.gather(1, top), atol=2e-3)  # rescored from int12 rows
    a = export_torchscript(copy.deepcopy(floats), tmp_path / "float32-rows.ts")
    b = export_torchscript(copy.deepcopy(rows12), tmp_path / "int12-rows.ts")
    vocab_fp32 = CFG.vocab_size * CFG.dim * 4
    # the float vocabulary (4 bytes an element) gives way to the 4-bit residual (half a byte): the int8 rows were
    # in the file already, as the head's weight
    assert b.stat().st_size < a.stat().st_size - 0.8 * vocab_fp32
    loaded = check_loaded(b, rows12, ids)  # and a row decodes alone as in a batch
    m = loaded.module
    assert m.embed_tokens.residual.untyped_storage().data_ptr() == m.lm_head.residual.untyped_storage().data_ptr()


@pytest.mark.parametrize("field, embedding, rows", [("int12_rows", Int8Embedding, "residual"),
                                                  ("int16_rows", Int16Embedding, "rows16")])
def test_an_untied_policy_gets_its_rows_for_each_matrix_and_a_float_tied_head_keeps_its_float_embedding(
        field, embedding, rows):
    untied = init_random_policy(replace(CFG, tie_embeddings=False), seed=3)
    plan, names = plan_for(untied)
    plan.int8_embedding = field == "int12_rows"  # int12: an untied embedding follows its own skip setting
    setattr(plan, field, True)
    conv = plan.convert(untied, names)
    assert isinstance(conv.embed_tokens, embedding) and getattr(conv.lm_head, rows).numel() > 0
    emb_rows, head_rows = getattr(conv.embed_tokens, rows), getattr(conv.lm_head, rows)
    assert emb_rows.numel() > 0 and emb_rows.data_ptr() != head_rows.data_ptr()  # each matrix its own rows
    tied = init_random_policy(CFG, seed=3)
    plan, names = plan_for(tied)
    plan.int8_embedding = False
    setattr(plan, field, True)
    kept = plan.convert(tied, [n for n in names if n != "lm_head"])  # the head a float fallback layer
    assert isinstance(kept.embed_tokens, torch.nn.Embedding)
    plan.head_topk = 0  # a plain int8 head: no rows to rescore, so the tied embedding stays float
    assert isinstance(plan.convert(tied, names).embed_tokens, torch.nn.Embedding)
    # the int8 embedding, where asked, wins: its rows are the head's int8 ones
    plan.head_topk, plan.int8_embedding = 16, True
    assert type(plan.convert(tied, names).embed_tokens).__name__ == "Int8Embedding"


def test_an_untied_embedding_kept_float_by_skip_stays_float_beside_an_int12_head():
    untied = init_random_policy(replace(CFG, tie_embeddings=False), seed=3)
    plan, names = plan_for(untied)
    plan.int8_embedding, plan.int12_rows = False, True  # skip=[embed_tokens]: the embedding is not the head's rows
    conv = plan.convert(untied, names)
    assert isinstance(conv.embed_tokens, torch.nn.Embedding) and conv.lm_head.residual.numel() > 0
    assert torch.equal(conv.embed_tokens.weight, untied.embed_tokens.weight)
    q, _, residual = quantize_rows_int12(torch.randn(8, 6))
    none = torch.zeros(0, dtype=torch.long)
    assert int12_rows(q, residual, none).shape == (0, 6)  # no rows asked, none given (no reshape error)


def test_the_recipe_field_takes_int12_and_a_residual_needs_the_heads_int8_rows():
    assert RecipeConfig(scheme="smooth-w8a8", vocab_rows="int12").vocab_rows == "int12"
    q, s, residual = quantize_rows_int12(torch.randn(32, 16))
    shared = Int8TokenLinear(q, s, None, 0.0, share_weight=True)
    assert Int8RescoredHead(shared, torch.zeros(0, 0), 4, residual=residual).residual.shape == (32, 8)
    with pytest.raises(ValueError, match="residual"):
        Int8RescoredHead(Int8TokenLinear(q, s, None, 0.0), torch.randn(32, 16), 4, residual=residual)
    with pytest.raises(ValueError, match="residual"):
        Int8RescoredHead(shared, torch.zeros(0, 0), 4, residual=residual[:5])
    with pytest.raises(ValueError, match="residual"):
        Int8RescoredHead(shared, torch.zeros(0, 0), 4, residual=residual[:, :3])


def test_int12_rows_read_by_table_are_the_unpacked_floats_bitwise():
    """``int12_rows`` looks each byte's two residuals up in a [256, 2] table: the same floats as unpacking the nibbles
    and forming ``(code - 7) / 15`` did, for every code, at an odd width too."""
    for dim in (576, 63):
        q, _, residual = quantize_rows_int12(torch.randn(300, dim, generator=torch.Generator().manual_seed(dim)))
        ids = torch.arange(300).flip(0)
        packed = residual.index_select(0, ids).to(torch.int32)
        res = torch.stack([torch.bitwise_right_shift(packed, 4), torch.bitwise_and(packed, 15)], dim=-1)
        res = res.view(300, 2 * packed.shape[1])[:, :dim].float()
        unpacked = q.index_select(0, ids).float() + (res - 7.0) / 15.0  # unpacked by hand: the reference
        assert torch.equal(int12_rows(q, residual, ids), unpacked)
    every = torch.arange(256, dtype=torch.uint8).view(128, 2)  # every byte value once
    assert torch.equal(int12_rows(torch.zeros(128, 4, dtype=torch.int8), every, torch.arange(128)).flatten(),
                       torch.stack([every.flatten() // 16, every.flatten() % 16], -1).flatten().float().sub(7.0).div(15.0))


@pytest.mark.parametrize("vocab", [49152, 49153, 4096])
def test_top_indices_over_block_maxima_find_the_k_largest_values(vocab):
    """The rescored head's candidates (``top_indices``): the k largest values of each row, as ``topk`` finds them,
    from the k blocks with the largest maxima; with ties at the k-th value (either tied index may be kept), a NaN
    row, and a vocabulary that is not a whole number of blocks or too small for them (``topk`` itself)."""
    from policy_bundle.quantize.w8a8.head import top_indices

    out = torch.randn(6, vocab, generator=torch.Generator().manual_seed(vocab))
    out[2] = torch.randint(0, 4, (vocab,), generator=torch.Generator().manual_seed(1)).float()  # many ties
    out[3, 100:110] = float("nan")
    got = top_indices(out, 64)
    assert got.shape == (6, 64) and all(len(set(r)) == 64 for r in got.tolist())
    want = out.topk(64, dim=-1).values
    picked = out.gather(1, got)
    assert torch.equal(picked.sort(-1).values[[0, 1, 2, 4, 5]], want.sort(-1).values[[0, 1, 2, 4, 5]])
    assert torch.isnan(picked[3]).sum() == 10 and set(range(100, 110)) <= set(got[3].tolist())
    for i in range(6):  # a row's candidates do not depend on the other rows
        assert torch.equal(top_indices(out[i : i + 1], 64), got[i : i + 1])
