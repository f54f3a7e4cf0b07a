"""Recipe families as frozen config types with a handler each (quantize/recipe_types.py, build/gate/families.py): every
scheme has one family, the type survives ``replace``, a type refuses another family's scheme, the build's
candidates arrive typed and each reaches its family's handler."""

from dataclasses import replace

import pytest

from policy_bundle.build.config.build_config import load_config
from policy_bundle.build.gate.families import TorchAoFamily, W8A8Family, by_family, handler
from policy_bundle.quantize.recipe_types import TorchAoRecipe, W8A8Recipe, typed
from policy_bundle.quantize.recipes import SCHEMES, RecipeConfig, RecipeError


@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_scheme_has_exactly_one_family_and_its_handler(scheme):
    recipe = typed(RecipeConfig(scheme=scheme))
    expected = W8A8Recipe if scheme.endswith("w8a8") else TorchAoRecipe
    assert type(recipe) is expected and typed(recipe) is recipe
    assert isinstance(handler(recipe), W8A8Family if expected is W8A8Recipe else TorchAoFamily)
    assert isinstance(handler(RecipeConfig(scheme=scheme)), type(handler(recipe)))  # untyped: typed on lookup
    assert expected.onnx_carries_activations is (expected is TorchAoRecipe)


def test_replace_keeps_the_family_and_a_type_refuses_another_familys_scheme():
    w8a8 = W8A8Recipe(scheme="smooth-w8a8")
    kept = replace(w8a8, fp32_layers=("layers.0.mlp.down_proj",), rounding="nearest")
    assert type(kept) is W8A8Recipe and kept.fp32_layers == ("layers.0.mlp.down_proj",)
    with pytest.raises(RecipeError, match="recipe.scheme.*'static' is not a W8A8Recipe scheme"):
        replace(w8a8, scheme="static")
    with pytest.raises(RecipeError, match="recipe.scheme.*'w8a8' is not a TorchAoRecipe scheme"):
        TorchAoRecipe(scheme="w8a8")
    assert TorchAoRecipe(scheme="smooth-dynamic").smooth  # the control: its own scheme is fine
    with pytest.raises(RecipeError, match="recipe.gptq_damp"):  # RecipeConfig's own limits still hold
        W8A8Recipe(scheme="w8a8", gptq_damp=2.0)


def test_the_build_candidates_arrive_typed_and_group_by_family_in_order():
    cfg = load_config(None, ("recipe.scheme=auto",
                             "recipe.auto_candidates=[smooth-w8a8, static, 'w8a8 rounding=nearest', dynamic]"))
    candidates = [cfg.recipe_config(c) for c in cfg.recipe.candidates()]
    assert [type(c) for c in candidates] == [W8A8Recipe, TorchAoRecipe, W8A8Recipe, TorchAoRecipe]
    groups = by_family(candidates)
    assert [type(h) for h, _ in groups] == [W8A8Family, TorchAoFamily]
    assert [[c.scheme for c in members] for _, members in groups] == [["smooth-w8a8", "w8a8"], ["static", "dynamic"]]
    assert groups[0][1][1].rounding == "nearest"
    assert type(cfg.recipe_config()) is W8A8Recipe  # the section's base recipe: the first candidate's scheme
