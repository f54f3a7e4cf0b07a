"""The compressed-tensors W8A8 checkpoint (int8-vllm/): its config is compressed-tensors' own schema, and its
weights are exactly the plan's int8 weights and scales on top of the smoothed float policy."""

import json

import torch
from safetensors.torch import load_file

from policy_bundle.quantize.calibration import linear_stats as ls
from policy_bundle.quantize.model.policy import PolicyConfig
from policy_bundle.quantize.model.hf_weights import init_random_policy
from policy_bundle.quantize.recipes import RecipeConfig, selected_linears
from policy_bundle.quantize.calibration.smooth import make_outlier_model
from policy_bundle.quantize.export.w8a8_checkpoint import export_w8a8_checkpoint, hf_name
from policy_bundle.quantize.w8a8.plan import build_plan

CFG = PolicyConfig(family="llama", vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                   intermediate_size=128, max_seq_len=48)


def smooth_w8a8_plan():
    policy = make_outlier_model(init_random_policy(CFG, seed=1), channels=2, factor=50.0)
    recipe = RecipeConfig(scheme="smooth-w8a8", rounding="gptq")
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 64, (4, 12 + i), generator=g) for i in range(6)]
    stats = ls.collect_group_stats(policy, data, ls.outlier_thresholds(ls.collect_token_absmax(policy, data), 8.0))
    names = selected_linears(policy, recipe)
    plan = build_plan(policy, stats, ls.input_groups(policy), names, smooth=True, alphas=recipe.smooth_alphas,
                      rounding="gptq", gptq_damp=0.01, outlier_ratio=8.0)
    return policy, plan, names


def test_checkpoint_config_parses_back_and_weights_dequantize_to_the_plans(tmp_path):
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    policy, plan, names = smooth_w8a8_plan()
    assert plan.scales, "the plan smooths at least one group"
    fallback = "layers.0.self_attn.q_proj"  # the gate kept it in float
    quantized = [n for n in names if n != fallback]
    smoothed = plan.convert(policy, [])
    floating = export_w8a8_checkpoint(smoothed, CFG, {n: plan.weights[n] for n in quantized}, tmp_path, tmp_path / "ck",
                                      torch.float16)
    hf = json.loads((tmp_path / "ck" / "config.json").read_text())
    qc = QuantizationConfig.model_validate(hf["quantization_config"])
    scheme = qc.config_groups["group_0"]
    assert (qc.quant_method, qc.format, qc.quantization_status) == ("compressed-tensors", "int-quantized", "compressed")
    assert (scheme.weights.num_bits, scheme.weights.type, scheme.weights.strategy, scheme.weights.symmetric,
            scheme.weights.dynamic) == (8, "int", "channel", True, False)
    assert (scheme.input_activations.strategy, scheme.input_activations.dynamic,
            scheme.input_activations.symmetric) == ("token", True, False)  # a zero point per token, as ours
    # vLLM runs q/k/v as one matmul: a float q_proj keeps its block's k_proj and v_proj in float too
    assert set(qc.ignore) == {"lm_head", *(f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj"))}
    assert [hf_name(n) for n in floating] == qc.ignore
    tensors = load_file(str(tmp_path / "ck" / "model.safetensors"))
    for name in quantized:
        if hf_name(name) in qc.ignore:
            continue
        q, s = plan.weights[name]
        w = tensors[hf_name(name) + ".weight"]
        assert w.dtype == torch.int8 and torch.equal(w, q)
        deq = dequantize(w, tensors[hf_name(name) + ".weight_scale"], args=scheme.weights, dtype=torch.float32)
        assert torch.equal(deq, q.float() * s.float().unsqueeze(1))
    # the smoothing lives in the float weights the checkpoint carries (norms, v_proj/up_proj rows)
    norm = "model.layers.0.input_layernorm.weight"
    assert torch.equal(tensors[norm], smoothed.layers[0].input_layernorm.weight.half())
    assert not torch.equal(tensors[norm], policy.layers[0].input_layernorm.weight.half())
    k_float = tensors["model.layers.0.self_attn.k_proj.weight"]
    assert k_float.dtype == torch.float16 and torch.equal(k_float, smoothed.layers[0].self_attn.k_proj.weight.half())


def test_the_checkpoint_streamed_from_the_unsmoothed_policy_is_the_one_from_a_smoothed_copy(tmp_path):
    """The build writes int8-vllm/ from the float policy, each tensor smoothed as it is written
    (``smoothed_tensors``): every tensor and the config are those written from the plan's smoothed float copy, with
    rotations (their signs folded into norms and up_proj rows, their transforms added) and a biased family (Qwen2:
    its rotated q/k/v rounded from the unrotated smoothed weight)."""
    from policy_bundle.quantize.w8a8.plan import smoothed_tensors

    cfg = PolicyConfig(family="qwen2", vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                       intermediate_size=128, max_seq_len=48, attention_bias=True)
    policy = make_outlier_model(init_random_policy(cfg, seed=2), channels=2, factor=50.0)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 64, (4, 12 + i), generator=g) for i in range(4)]
    stats = ls.collect_group_stats(policy, data, ls.outlier_thresholds(ls.collect_token_absmax(policy, data), 8.0))
    names = selected_linears(policy, RecipeConfig(scheme="smooth-w8a8", rounding="gptq"))
    plan = build_plan(policy, stats, ls.input_groups(policy), names, smooth=True, alphas=[0.5], rounding="gptq",
                      gptq_damp=0.01, outlier_ratio=8.0, max_rot_block=512)
    assert plan.scales and plan.rot_blocks
    int8 = {n: plan.weights[n] for n in names if n != "layers.1.mlp.gate_proj"}
    copied = export_w8a8_checkpoint(plan.convert(policy, []), cfg, int8, tmp_path, tmp_path / "copy", torch.bfloat16,
                                    plan.rot_blocks)
    streamed = export_w8a8_checkpoint(policy, cfg, int8, tmp_path, tmp_path / "stream", torch.bfloat16,
                                      plan.rot_blocks, smoothed_tensors(policy, plan.scales))
    assert streamed == copied
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("copy", "stream"))
    assert a.keys() == b.keys() and any(k.endswith("_input.weight") for k in a)
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "copy" / "config.json").read_text()) == \
        json.loads((tmp_path / "stream" / "config.json").read_text())
    # negative control: unsmoothed float weights are not those
    plain = export_w8a8_checkpoint(policy, cfg, int8, tmp_path, tmp_path / "plain", torch.bfloat16, plan.rot_blocks)
    c = load_file(str(tmp_path / "plain" / "model.safetensors"))
    assert plain == copied and not torch.equal(c["model.layers.0.input_layernorm.weight"],
                                               a["model.layers.0.input_layernorm.weight"])
