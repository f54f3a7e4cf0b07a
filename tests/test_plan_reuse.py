"""Candidates that differ in the head alone share one layer stream (build/calibrate/calibrated.py): the default
``auto`` list's ``smooth-w8a8 skip=[embed_tokens]`` (int8 head) and ``smooth-w8a8`` (float head) plan the same decoder
layers, so the second candidate plans only its head, from the last layer's output the first stream kept. The plan is
bitwise the one a stream of its own makes; a candidate whose layers differ streams again (the negative control)."""

import torch

from policy_bundle.build.calibrate import w8a8_statistics
from policy_bundle.build.calibrate.calibrated import CalibratedModels, layer_key
from policy_bundle.build.config.build_config import config_from_dict
from policy_bundle.quantize.model.hf_weights import load_policy


def same_plan(a, b) -> None:
    assert a.weights.keys() == b.weights.keys() and a.weights
    for n, (q, s) in a.weights.items():
        assert torch.equal(q, b.weights[n][0]) and torch.equal(s, b.weights[n][1]), n
    assert a.thresholds == b.thresholds and a.alphas == b.alphas and a.rot_blocks == b.rot_blocks
    assert a.scales.keys() == b.scales.keys() and all(torch.equal(v, b.scales[g]) for g, v in a.scales.items())
    assert (a.int8_embedding, a.head_topk, a.int16_rows, a.int12_rows, a.rounding) == \
        (b.int8_embedding, b.head_topk, b.int16_rows, b.int12_rows, b.rounding)


def test_a_candidate_differing_in_the_head_alone_reuses_the_layer_stream(reference_dir, monkeypatch):
    cfg = config_from_dict({"policy": {"source": str(reference_dir)}, "recipe": {"scheme": "auto"}})
    int8_head, float_head = (cfg.recipe_config(c) for c in ("smooth-w8a8 skip=[embed_tokens]", "smooth-w8a8"))
    assert "lm_head" in float_head.skip and "lm_head" not in int8_head.skip  # the shipped list: they differ in the head
    assert layer_key(int8_head) == layer_key(float_head)
    nearest = cfg.recipe_config("smooth-w8a8 rounding=nearest")
    assert layer_key(nearest) != layer_key(float_head)

    policy = load_policy(reference_dir, max_seq_len=64)
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, policy.embed_tokens.num_embeddings, (8, 30), generator=g) for _ in range(2)]
    streamed = []
    real = w8a8_statistics.stream_plan
    monkeypatch.setattr(w8a8_statistics, "stream_plan", lambda *a: streamed.append(a[-1]) or real(*a))

    shared = CalibratedModels(cfg, None, policy, batches)
    first, second = shared.plan(int8_head), shared.plan(float_head)
    assert len(streamed) == 1  # the float-head candidate streamed no layer
    assert "lm_head" in first.weights and "lm_head" not in second.weights
    alone = CalibratedModels(cfg, None, policy, batches)
    same_plan(second, alone.plan(float_head))
    same_plan(first, CalibratedModels(cfg, None, policy, batches).plan(int8_head))
    assert shared.linear_stats(float_head).keys() == alone.linear_stats(float_head).keys()
    streamed.clear()
    shared.plan(nearest)
    assert len(streamed) == 1  # other layers: streamed again
