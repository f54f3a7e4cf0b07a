"""``step_and_prefill``: a decode step's rows and newcomers' prompt chunks in one forward give every row the logits,
and write the cache, exactly as the separate ``decode_batch`` / ``decode`` and ``next_logits`` calls do; the served
engine takes that path on an artifact that has it and the separate calls on one that has not."""

from __future__ import annotations

import pytest
import torch

from policy_bundle.quantize.calibration import linear_stats as ls
from policy_bundle.quantize.model.blocks import attention_len
from policy_bundle.quantize.export.exporters import script_int8
from policy_bundle.quantize.model.hf_weights import init_random_policy
from policy_bundle.quantize.model.policy import PolicyConfig
from policy_bundle.quantize.recipes import RecipeConfig, selected_linears
from policy_bundle.quantize.calibration.smooth import make_outlier_model
from policy_bundle.quantize.w8a8.linear import Int8TokenLinear, RowStableLinear
from policy_bundle.quantize.w8a8.plan import build_plan

CFG = PolicyConfig(family="llama", vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                   intermediate_size=128, max_seq_len=96)
FLOAT_LINEAR = "layers.1.mlp.down_proj"  # kept in float: that MLP runs per part, the other batched
# (rows decoding: their prompt lengths; prompt chunks: their lengths; whether the first chunk continues a part-filled
# prompt from position 5)
CASES = [([5, 9, 7], [6, 4], False), ([5, 9, 7], [6, 4], True), ([5], [6], False), ([5], [6], True),
         ([], [6, 3, 11], False), ([], [6, 3, 11], True), ([12, 3], [1], False), ([40, 3, 8, 2, 30], [6, 7], True),
         ([5, 9], [20, 3], False),  # a chunk longer than the float layer's rows_per_call
         ([4] * 17, [6], False)]  # more decode rows than it takes in one call


@pytest.fixture(scope="module")
def int8_policy():
    policy = make_outlier_model(init_random_policy(CFG, seed=1), channels=2, factor=50.0)
    recipe = RecipeConfig(scheme="smooth-w8a8", rounding="nearest", skip=("embed_tokens",))  # an int8 LM head
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 64, (4, 12 + i), generator=g) for i in range(6)]
    stats = ls.collect_group_stats(policy, data, ls.outlier_thresholds(ls.collect_token_absmax(policy, data), 8.0))
    names = selected_linears(policy, recipe)
    plan = build_plan(policy, stats, ls.input_groups(policy), names, smooth=True, alphas=recipe.smooth_alphas,
                      rounding="nearest", gptq_damp=0.01, outlier_ratio=8.0, max_rot_block=recipe.rotation_block)
    int8 = plan.convert(policy, [n for n in names if n != FLOAT_LINEAR])
    scripted = script_int8(int8)
    assert isinstance(int8.get_submodule(FLOAT_LINEAR), RowStableLinear)
    assert [m.batchable for m in int8.layers.modules() if hasattr(m, "fused_gate_up")] == [True, False]
    assert all(m.batchable_gate_up for m in int8.layers.modules() if hasattr(m, "fused_gate_up"))
    assert int8.get_submodule(FLOAT_LINEAR).rows_per_call >= 2  # the decode rows in chunks
    assert all(m.batchable_qkv and m.batchable_o for m in int8.modules() if hasattr(m, "batchable_qkv"))
    assert isinstance(int8.layers[0].mlp.gate_up_proj, Int8TokenLinear) and isinstance(int8.lm_head, Int8TokenLinear)
    return scripted


def run_case(module, rows, chunk_lens, continued, seed=0):
    """The same state twice: the separate calls on one cache, ``step_and_prefill`` on its copy. Returns both logits
    [rows + chunks, V] and both caches."""
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(3, CFG.vocab_size, (1, n), generator=g)

    with torch.no_grad():
        k, v = module.new_cache(max(8, len(rows) + len(chunk_lens)), 64)
        for i, n in enumerate(rows):
            s = attention_len(n, 64)
            module.next_logits(ids(n), 0, k[:, i : i + 1, :, :s], v[:, i : i + 1, :, :s])
        b = len(rows)
        chunks = [(ids(n), 0) for n in chunk_lens]
        if continued:  # positions 0..4 of slot b hold the first chunk of that prompt already
            module.next_logits(ids(5), 0, k[:, b : b + 1, :, :32], v[:, b : b + 1, :, :32])
            chunks[0] = (chunks[0][0], 5)
        tokens = torch.randint(3, CFG.vocab_size, (b, 1), generator=g)
        pos = torch.tensor(rows, dtype=torch.long)
        k2, v2 = k.clone(), v.clone()
        apart = []
        if b:
            s = attention_len(max(rows) + 1, 64)
            step = module.decode(tokens, rows[0], k[:, :1, :, :s], v[:, :1, :, :s]) if b == 1 else \
                module.decode_batch(tokens, pos, k[:, :b, :, :s], v[:, :b, :, :s])
            apart.append(step[:, 0])
        for j, (c, start) in enumerate(chunks):
            s = attention_len(start + c.shape[1], 64)
            apart.append(module.next_logits(c, start, k[:, b + j : b + j + 1, :, :s], v[:, b + j : b + j + 1, :, :s])[:, -1])
        s = attention_len(max([p + 1 for p in rows] + [st + c.shape[1] for c, st in chunks]), 64)
        m = b + len(chunks)
        fused = module.step_and_prefill(tokens, pos, [c for c, _ in chunks], [st for _, st in chunks],
                                        k2[:, :m, :, :s], v2[:, :m, :, :s])[:, 0]
    return torch.cat(apart), fused, (k, v), (k2, v2)


@pytest.mark.parametrize("rows,chunk_lens,continued", CASES)
def test_an_int8_step_with_prompt_chunks_equals_the_separate_calls_bitwise(int8_policy, rows, chunk_lens, continued):
    apart, fused, (k, v), (k2, v2) = run_case(int8_policy, rows, chunk_lens, continued)
    assert fused.shape == apart.shape == (len(rows) + len(chunk_lens), CFG.vocab_size)
    assert torch.equal(fused, apart) and torch.equal(k, k2) and torch.equal(v, v2)


def test_a_float_policy_step_with_prompt_chunks_equals_the_separate_calls():
    """A float policy (the FP fallback engine's) runs every projection per part; its float LM head over more rows
    rounds apart from fewer (not bitwise there), its cache is written bitwise alike."""
    scripted = torch.jit.script(init_random_policy(CFG, seed=2).eval())
    for rows, chunk_lens, continued in CASES:
        apart, fused, (k, v), (k2, v2) = run_case(scripted, rows, chunk_lens, continued)
        assert torch.allclose(fused, apart, rtol=0, atol=1e-5) and torch.equal(fused.argmax(-1), apart.argmax(-1))
        assert torch.equal(k, k2) and torch.equal(v, v2)
    # negative control: a chunk written from the wrong position gives other logits
    apart, _, _, _ = run_case(scripted, [5], [6], True)
    _, shifted, _, _ = run_case(scripted, [5], [6], False)
    assert not torch.allclose(apart[1], shifted[1], atol=1e-3)
