"""Recipe families as frozen config types with a handler each (quantize/recipe_types.py, build/gate/families.py): every
scheme has one family, the type survives ``replace``, a type refuses another family's scheme, the build's
candidates arrive typed and each reaches its family's handler, and nothing in build/ asks a recipe its family."""

import ast
from dataclasses import replace
from pathlib import Path

import pytest

from cli_helpers import ROOT

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


FAMILY_FLAGS = ("per_token",)  # the recipe's family flag: its config type's handler is asked instead


def scheme_string_checks(folder: Path) -> list:
    """Places in ``folder`` that ask a recipe its family instead of going through its family's handler
    (``build/gate/families.py``, looked up by the frozen config type of ``quantize/recipe_types.py``): a read of
    ``per_token``, ``base_mode`` compared with a string, or ``scheme`` with a w8a8 name (``scheme == "auto"`` is
    a config choice, not a family; ``base_mode`` as a key, a torch.ao mode's description, is no family check)."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(folder.parent)}:{node.lineno}" if hasattr(node, "lineno") else ""
            if isinstance(node, ast.Attribute) and node.attr in FAMILY_FLAGS:
                found.append(where)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in ("endswith", "startswith")
                  and any(isinstance(a, ast.Constant) and "w8a8" in str(a.value) for a in node.args)):
                found.append(where)  # scheme.endswith("w8a8")
            elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                                                       for op in node.ops):
                sides = [node.left, *node.comparators]
                attrs = {s.attr for s in sides if isinstance(s, ast.Attribute)}
                strings = [s.value for s in sides if isinstance(s, ast.Constant) and isinstance(s.value, str)]
                if strings and ("base_mode" in attrs or ("scheme" in attrs and any("w8a8" in v for v in strings))):
                    found.append(where)
    return sorted(set(found))


def test_build_reaches_a_recipe_family_only_through_its_handler():
    assert not scheme_string_checks(ROOT / "build")


def test_the_family_check_catches_a_family_flag_or_a_scheme_string_comparison(tmp_path):
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "x.py").write_text("def f(r):\n    return r.per_token or r.base_mode != 'w8a8'\n")
    (tmp_path / "build" / "y.py").write_text("def g(cfg):\n    return 'smooth-w8a8' == cfg.recipe.scheme\n")
    (tmp_path / "build" / "z.py").write_text("def h(cfg):\n    return cfg.recipe.scheme == 'auto'\n")  # a choice
    (tmp_path / "build" / "w.py").write_text("def k(r):\n    return handler(r).gate(r)\n")  # the handler: fine
    (tmp_path / "build" / "v.py").write_text("def m(s):\n    return s.endswith('w8a8')\n")
    assert scheme_string_checks(tmp_path / "build") == ["build/v.py:2", "build/x.py:2", "build/y.py:2"]
