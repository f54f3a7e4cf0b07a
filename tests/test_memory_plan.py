"""The memory plan counts what each process holds: a source is mapped once (its pages shared by every process that
maps it); a 16-bit source's decoder layers stay 16-bit, one widened per call, and only its embedding and head are
widened to float32 at load, in the controller and in every actor that loads the whole model (for rollouts)."""

import pytest

from policy_bundle.build.config.build_config import load_config
from policy_bundle.build.source.memory_plan import BuildMemoryError, check_memory, plan_memory


def tiny_qwen3(out, dtype):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=65536, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).to(getattr(torch, dtype)).save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mem")
    return {d: tiny_qwen3(tmp / d, d) for d in ("float32", "bfloat16")}


def plan(source, procs):
    return plan_memory(load_config(None, (f"policy.source={source}",)), source, 1024, procs)


def test_a_16_bit_sources_layers_are_planned_at_16_bits_and_its_head_widened_in_each_actor(sources):
    fp32, bf16 = plan(sources["float32"], 2), plan(sources["bfloat16"], 2)
    head = 65536 * 64 * 4  # the tied embedding, widened
    layers = fp32.weights - head
    assert bf16.weights == layers // 2 + head  # the layers at 16 bits in the controller
    assert bf16.actors > fp32.actors and bf16.actors - fp32.actors <= 2 * head  # each actor widens the head alone
    assert bf16.peak < fp32.peak + 2 * head
    assert plan(sources["bfloat16"], 0).actors == 0


def test_a_bf16_build_on_actors_that_cannot_fit_is_refused_in_one_line(sources, monkeypatch):
    bf16, in_process = plan(sources["bfloat16"], 2), plan(sources["bfloat16"], 0)
    monkeypatch.setenv("POLICY_BUNDLE_MEMORY_LIMIT", str((bf16.peak + in_process.peak) / 2 / 2**30))
    check_memory(plan(sources["bfloat16"], 0))  # fits without actors
    with pytest.raises(BuildMemoryError, match=r"memory: this build would need about .* GB at its peak .* actors"):
        check_memory(plan(sources["bfloat16"], 2))


def test_the_plan_counts_the_gates_teacher_forced_batch_not_the_golden_sets_logits(sources):
    """The gate's logits are a batch of TEACHER_FORCED_TOKENS positions (the reference's are in a file): at a
    vocabulary of 65536 that batch, with the KL's double copies, outweighs this tiny policy's weights."""
    from policy_bundle.quantize.fidelity.reference_logits import TEACHER_FORCED_TOKENS

    p = plan(sources["float32"], 0)
    assert p.gate_batch == TEACHER_FORCED_TOKENS * 65536 * 20
    assert p.peak >= p.weights + p.int8_model + p.gate_batch
    assert "gate batch 1.25 GB" in p.line()
