"""The policy model matches HF transformers (logits and KV-cache greedy generation) per family."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from policy_bundle.quantize.runtime.decode import greedy_generate
from policy_bundle.quantize.model.hf_weights import load_hf_config, load_policy
from policy_bundle.quantize.model.policy import UnsupportedModelError, full_logits

FAMILIES = {
    "llama-gqa": (LlamaConfig, {}),
    "llama-tied": (LlamaConfig, {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    "llama3-rope": (LlamaConfig, {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 32}}),
    "qwen2-bias": (Qwen2Config, {}),
    "qwen3-qknorm": (Qwen3Config, {"head_dim": 24}),
}


def hf_model(name, tmp_path):
    cls, extra = FAMILIES[name]
    torch.manual_seed(0)
    cfg = cls(vocab_size=101, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=64, eos_token_id=None, **{"num_key_value_heads": 2, **extra})
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers(family, tmp_path):
    hf = hf_model(family, tmp_path)
    ours = load_policy(tmp_path)
    x = torch.randint(0, 101, (3, 17))
    with torch.no_grad():
        diff = (hf(x).logits - full_logits(ours, x)).abs().max().item()
    assert diff <= 1e-4


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_kv_cache_greedy_generation_matches_transformers(family, tmp_path):
    hf = hf_model(family, tmp_path)
    ours = load_policy(tmp_path)
    prompt = torch.randint(0, 101, (1, 9))
    with torch.no_grad():
        expected = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False)
    assert len(expected[0, 9:]) == 12
    assert greedy_generate(ours, prompt[0].tolist(), 12) == expected[0, 9:].tolist()


def test_torchscript_fp32_policy_equals_eager(tmp_path):
    hf_model("qwen3-qknorm", tmp_path)
    ours = load_policy(tmp_path)
    scripted = torch.jit.script(ours)
    x = torch.randint(0, 101, (2, 11))
    assert torch.equal(full_logits(scripted, x), full_logits(ours, x))
    assert greedy_generate(scripted, x[0].tolist(), 8) == greedy_generate(ours, x[0].tolist(), 8)


def test_rotary_and_attention_mask_rewrites_equal_hf_forms_bitwise():
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from policy_bundle.quantize.model.blocks import additive_mask, rope

    g = torch.Generator().manual_seed(0)
    x, freqs = torch.randn(2, 3, 5, 24, generator=g), torch.randn(5, 12, generator=g)
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    hf = x * cos + torch.cat((-x[..., 12:], x[..., :12]), -1) * sin  # transformers' rotate_half form
    assert torch.equal(rope(x, cos, torch.cat((-freqs.sin(), freqs.sin()), -1)), hf)
    assert not torch.equal(rope(x, cos, sin), hf)  # the negated half is what makes it so
    allowed = torch.rand(5, 7, generator=g) > 0.4
    allowed[:, 0] = True
    q, k, v = (torch.randn(2, 3, n, 24, generator=g) for n in (5, 7, 7))
    assert torch.equal(sdpa(q, k, v, attn_mask=additive_mask(allowed, torch.float32)), sdpa(q, k, v, attn_mask=allowed))


def test_gpt2_directory_is_rejected_by_name(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_hf_config(tmp_path)
