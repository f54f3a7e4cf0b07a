"""One layer-sensitivity implementation for both recipe families (quantize/fidelity/sensitivity.py): a linear swapped
for a
broken copy is ranked first, an exact copy scores zero, the float module is back afterwards, and the torch.ao and
w8a8 rankings score the same linears."""

import copy

import pytest
import torch

from policy_bundle.quantize import recipes
from policy_bundle.quantize.model.hf_weights import load_policy
from policy_bundle.quantize.fidelity.sensitivity import SwapSensitivity, layer_sensitivity, sensitivity_probe

BROKEN = "layers.0.mlp.down_proj"


def probe_of(policy, seed=0):
    g = torch.Generator().manual_seed(seed)
    return sensitivity_probe([torch.randint(0, policy.embed_tokens.num_embeddings, (4, 24), generator=g)])


def test_a_broken_linear_ranks_first_and_an_exact_copy_scores_zero(reference_dir):
    policy = load_policy(reference_dir)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    names = recipes.selected_linears(policy, recipes.RecipeConfig())

    def quantized(name, float_module):
        twin = copy.deepcopy(float_module)
        if name == BROKEN:  # the negative control: one scale x50, as the build's injected fault does
            with torch.no_grad():
                twin.weight.mul_(50.0)
        return twin

    ranking = layer_sensitivity(policy, names, quantized, probe_of(policy))
    assert [n for n, _ in ranking][0] == BROKEN and ranking[0][1] > 0.01
    assert sorted(n for n, _ in ranking) == sorted(names)
    assert all(kl < 1e-9 for n, kl in ranking if n != BROKEN)  # an exact copy moves nothing
    assert all(torch.equal(v, policy.state_dict()[k]) for k, v in before.items())  # float modules back in place


def test_scores_from_each_layers_cached_input_equal_whole_forward_scores(reference_dir):
    """A linear of layer i is scored from the probe's float input of layer i: the reference logits are bitwise the
    whole forward's, and every w8a8 linear's score equals the one a whole forward per linear gives."""
    import torch.nn.functional as F

    from policy_bundle.build.calibrate.w8a8_statistics import collect_stats, make_plan
    from policy_bundle.quantize.model.policy import full_logits
    from policy_bundle.quantize.w8a8.plan import unsmoothed_swap

    policy = load_policy(reference_dir)
    g = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, policy.embed_tokens.num_embeddings, (8, 24), generator=g)]
    recipe = recipes.RecipeConfig(scheme="w8a8", rounding="nearest", skip=("embed_tokens",))
    plan = make_plan(policy, collect_stats(None, policy, batches, recipe), recipe)
    probe = sensitivity_probe(batches)
    cached = SwapSensitivity(policy, probe)
    assert cached.inputs is not None and len(cached.inputs) == len(policy.layers) + 1
    with torch.no_grad():
        assert torch.equal(cached.ref, F.log_softmax(full_logits(policy, probe).double(), dim=-1))

    class Whole(SwapSensitivity):
        def _start(self, name):
            return None

    whole = Whole(policy, probe)
    swap = unsmoothed_swap(policy, plan)
    names = recipes.selected_linears(policy, recipe)
    assert "lm_head" in names and any(n.startswith("layers.0.") for n in names)
    for name in names:
        a, b = cached.score(name, swap), whole.score(name, swap)
        assert a == pytest.approx(b, rel=1e-9, abs=1e-15), name
        assert a > 0, name  # every int8 linear moves the logits a little: the cached path is not a no-op


def test_the_float_module_is_restored_when_a_swapped_forward_fails(reference_dir):
    policy = load_policy(reference_dir)
    scorer = SwapSensitivity(policy, probe_of(policy))
    original = policy.get_submodule(BROKEN)

    class Fails(torch.nn.Module):
        def forward(self, x):
            raise RuntimeError("broken kernel")

    with pytest.raises(RuntimeError, match="broken kernel"):
        scorer.score(BROKEN, lambda name, f: Fails())
    assert policy.get_submodule(BROKEN) is original


def test_torch_ao_and_w8a8_rankings_score_the_same_linears_on_one_probe(reference_dir):
    from policy_bundle.build.calibrate.w8a8_statistics import collect_stats, make_plan
    from policy_bundle.build.gate.fallback import torch_ao_sensitivity
    from policy_bundle.quantize.w8a8.plan import plan_sensitivity

    policy = load_policy(reference_dir)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, policy.embed_tokens.num_embeddings, (8, 24), generator=g) for _ in range(2)]
    probe = sensitivity_probe(batches)
    static = recipes.RecipeConfig(scheme="static")
    prepared = recipes.prepare(policy, static)
    recipes.calibrate(prepared, batches)
    ao = torch_ao_sensitivity(prepared, static, probe, lambda *_: None)
    w8a8 = recipes.RecipeConfig(scheme="w8a8", rounding="nearest")
    plan = make_plan(policy, collect_stats(None, policy, batches, w8a8), w8a8)
    per_token = plan_sensitivity(policy, plan, recipes.selected_linears(policy, w8a8), probe)
    assert sorted(n for n, _ in ao) == sorted(n for n, _ in per_token) == sorted(recipes.selected_linears(policy, static))
    assert all(kl >= 0 for _, kl in ao + per_token) and ao[0][1] > 0 and per_token[0][1] > 0
