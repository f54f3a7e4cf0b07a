"""The recipe families as frozen config types, torchao's shape (``quantize_(model, config)`` dispatches one
handler per config type): a caller registers a handler per type and looks it up with ``family_of``.

- ``TorchAoRecipe``: eager ``torch.ao.quantization`` (``recipes.prepare`` -> ``calibrate`` -> ``convert``):
  static, dynamic and weight-only, smoothed or not; per-tensor activation scales, which onnxruntime's static
  INT8 carries too.
- ``W8A8Recipe``: per-token int8 activations at run time (``quantize.w8a8.linear``): linear statistics ->
  ``w8a8.plan.build_plan`` -> ``plan.convert``; no per-tensor ONNX carries them.

Both keep every ``RecipeConfig`` field (a config file names one recipe section whatever the family); the type
says which fields its handler reads. ``typed`` is the one place where a scheme name decides the family.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, ClassVar, Dict, Tuple, Type, TypeVar

from policy_bundle.quantize.config.schema import config_model
from policy_bundle.quantize.recipes import SCHEMES, RecipeConfig, RecipeError

W8A8_SCHEMES = ("w8a8", "smooth-w8a8")


@config_model("recipe", RecipeError)
class _FamilyRecipe(RecipeConfig):
    """A family's config type: ``RecipeConfig``'s checks, and a scheme of the family's own."""

    schemes: ClassVar[Tuple[str, ...]] = ()
    onnx_carries_activations: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.scheme not in self.schemes:
            raise RecipeError("recipe.scheme", f"{self.scheme!r} is not a {type(self).__name__} scheme "
                              f"({list(self.schemes)})")


@config_model("recipe", RecipeError)
class TorchAoRecipe(_FamilyRecipe):
    schemes: ClassVar[Tuple[str, ...]] = tuple(s for s in SCHEMES if s not in W8A8_SCHEMES)
    onnx_carries_activations: ClassVar[bool] = True  # onnxruntime's static QDQ keeps per-tensor scales too


@config_model("recipe", RecipeError)
class W8A8Recipe(_FamilyRecipe):
    schemes: ClassVar[Tuple[str, ...]] = W8A8_SCHEMES
    onnx_carries_activations: ClassVar[bool] = False  # per-token scales: onnxruntime's static INT8 has none


def _values(recipe: RecipeConfig) -> Dict[str, Any]:
    return {f.name: getattr(recipe, f.name) for f in fields(recipe)}


def typed(recipe: RecipeConfig) -> RecipeConfig:
    """``recipe`` as its family's frozen config type (itself when it already is one)."""
    cls = W8A8Recipe if recipe.scheme in W8A8_SCHEMES else TorchAoRecipe
    return recipe if type(recipe) is cls else cls(**_values(recipe))


def recipe_of(base: RecipeConfig, **changes: Any) -> RecipeConfig:
    """``base`` with ``changes`` (a scheme of another family among them) as the result's family type."""
    return typed(RecipeConfig(**{**_values(base), **changes}))


H = TypeVar("H")


def family_of(recipe: RecipeConfig, handlers: Dict[Type[RecipeConfig], H]) -> H:
    """The handler registered for the recipe's config type (an untyped ``RecipeConfig`` is typed first)."""
    return handlers[type(typed(recipe))]
