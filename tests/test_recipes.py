"""Recipes: static/dynamic INT8 conversion, exact observer merge, TorchScript export equals eager."""

import random

import pytest
import torch

from policy_bundle.quantize import recipes
from policy_bundle.quantize.calibration import observers
from policy_bundle.quantize.export.exporters import export_torchscript
from policy_bundle.quantize.model.policy import PolicyConfig, full_logits
from policy_bundle.quantize.runtime.decode import greedy_generate
from policy_bundle.quantize.model.hf_weights import init_random_policy

CFG = PolicyConfig(family="llama", vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                   intermediate_size=128, max_seq_len=48)


@pytest.fixture(scope="module")
def policy():
    return init_random_policy(CFG, seed=1)


def batches(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (4, 10 + i), generator=g) for i in range(n)]


def calibrated(policy, recipe, data):
    prepared = recipes.prepare(policy, recipe)
    recipes.calibrate(prepared, data)
    return prepared


def test_default_filters_keep_embeddings_and_lm_head_in_float(policy):
    names = recipes.selected_linears(policy, recipes.RecipeConfig())
    assert "lm_head" not in names and len(names) == 7 * CFG.n_layers


def test_fp32_layers_are_left_out_of_quantization(policy):
    recipe = recipes.RecipeConfig(fp32_layers=("layers.1.mlp.down_proj",))
    int8 = recipes.convert(calibrated(policy, recipe, batches()), recipe)
    assert isinstance(int8.layers[1].mlp.down_proj, torch.nn.Linear)
    assert type(int8.layers[0].mlp.down_proj).__name__ == "QuantizedLinearSlot"


@pytest.mark.parametrize("scheme", ["static", "dynamic"])
def test_int8_policy_tracks_fp32(policy, scheme):
    recipe = recipes.RecipeConfig(scheme=scheme)
    int8 = recipes.convert(calibrated(policy, recipe, batches()), recipe)
    x = torch.randint(0, 64, (2, 16))
    agree = (full_logits(policy, x).argmax(-1) == full_logits(int8, x).argmax(-1)).float().mean()
    assert agree >= 0.8


@pytest.mark.parametrize("scheme", ["static", "dynamic"])
def test_torchscript_generation_equals_eager_int8(policy, scheme, tmp_path):
    recipe = recipes.RecipeConfig(scheme=scheme)
    int8 = recipes.convert(calibrated(policy, recipe, batches()), recipe)
    loaded = torch.jit.load(str(export_torchscript(int8, tmp_path / "p.ts")))
    prompt = [3, 14, 15, 9, 26]
    assert greedy_generate(loaded, prompt, 20) == greedy_generate(int8, prompt, 20)
    k, v = loaded.new_cache(1, 30)
    logits = loaded.prefill(torch.tensor([prompt]), k, v)
    step = loaded.decode(logits[:, -1:].argmax(-1), len(prompt), k, v)
    assert step.shape == (1, 1, CFG.vocab_size)


def test_merge_of_sharded_observers_is_exact_and_order_free(policy):
    recipe = recipes.RecipeConfig()
    data = batches(8)
    whole = observers.observer_state(calibrated(policy, recipe, data))
    shards = [observers.observer_state(calibrated(policy, recipe, data[i : i + 3])) for i in range(0, 8, 3)]
    for order in (shards, shards[::-1], random.Random(0).sample(shards, len(shards))):
        merged = observers.merge_observer_states(order)
        assert merged.keys() == whole.keys()
        for k in whole:
            assert torch.equal(merged[k][0], whole[k][0]) and torch.equal(merged[k][1], whole[k][1])


def test_loaded_merged_state_gives_identical_quantized_parameters(policy):
    recipe = recipes.RecipeConfig()
    data = batches(6)
    direct = recipes.convert(calibrated(policy, recipe, data), recipe)
    target = recipes.prepare(policy, recipe)
    parts = [observers.observer_state(calibrated(policy, recipe, data[i : i + 2])) for i in range(0, 6, 2)]
    observers.load_observer_state(target, observers.merge_observer_states(parts))
    merged = recipes.convert(target, recipe)
    a, b = recipes.quantized_parameters(direct), recipes.quantized_parameters(merged)
    assert a.keys() == b.keys() and len(a) == 14 * CFG.n_layers
    assert all(torch.equal(a[m][f], b[m][f]) for m in a for f in a[m])


def test_unknown_scheme_names_the_field():
    with pytest.raises(recipes.RecipeError, match="recipe.scheme: 'int4'"):
        recipes.RecipeConfig(scheme="int4")


def test_only_per_tensor_dynamic_activations_make_rows_depend_on_each_other():
    from policy_bundle.quantize.recipes import RecipeConfig

    assert RecipeConfig(scheme="static").rows_independent and RecipeConfig(scheme="smooth-w8a8").rows_independent
    assert RecipeConfig(scheme="weight-only").rows_independent
    assert not RecipeConfig(scheme="dynamic").rows_independent
    assert not RecipeConfig(scheme="smooth-dynamic").rows_independent
    assert not RecipeConfig(scheme="static", overrides=(("down_proj", "dynamic"),)).rows_independent
