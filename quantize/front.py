"""The front of the library, in torchao's shape: ``quantize(policy, config, statistics)`` turns a float policy into its
INT8 policy for the scheme ``config`` names, dispatching on the config's frozen family type (``recipe_types``) to
that family's handler. What the statistics are is the family's:

- ``TorchAoRecipe`` (static, dynamic, weight-only, smoothed or not): the policy prepared with ``recipes.prepare``
  and calibrated with ``recipes.calibrate`` (its observers hold the activation ranges; it is the policy too:
  torch.ao converts the prepared model, so ``policy`` may be that same model);
- ``W8A8Recipe`` (w8a8, smooth-w8a8): the ``w8a8.plan.W8A8Plan`` made from the calibration's linear statistics
  (``w8a8.plan.build_plan``, or ``w8a8.stream`` one decoder layer at a time).

``float_layers`` keeps those linears in float on top of the recipe's own ``fp32_layers`` (the accuracy fallback asks
for one conversion per set it tries; neither family touches the calibration data again).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Dict, Sequence, Type

from torch import nn

from policy_bundle.quantize import recipes
from policy_bundle.quantize.recipe_types import TorchAoRecipe, W8A8Recipe, family_of
from policy_bundle.quantize.w8a8.plan import W8A8Plan

Handler = Callable[[nn.Module, recipes.RecipeConfig, Any, Sequence[str]], nn.Module]


def _torch_ao(policy: nn.Module, config: recipes.RecipeConfig, prepared: nn.Module,
              float_layers: Sequence[str]) -> nn.Module:
    if float_layers:
        config = replace(config, fp32_layers=tuple(config.fp32_layers) + tuple(float_layers))
    return recipes.convert(prepared, config)


def _w8a8(policy: nn.Module, config: recipes.RecipeConfig, plan: W8A8Plan, float_layers: Sequence[str]) -> nn.Module:
    if not isinstance(plan, W8A8Plan):
        raise TypeError(f"a {type(config).__name__} quantizes from a W8A8Plan, not {type(plan).__name__}")
    kept = set(float_layers)
    return plan.convert(policy, [n for n in recipes.selected_linears(policy, config) if n not in kept])


HANDLERS: Dict[Type[recipes.RecipeConfig], Handler] = {TorchAoRecipe: _torch_ao, W8A8Recipe: _w8a8}


def quantize(policy: nn.Module, config: recipes.RecipeConfig, statistics: Any,
             float_layers: Sequence[str] = ()) -> nn.Module:
    """The INT8 policy of ``config``'s scheme from ``statistics`` (see the module's docstring), with ``float_layers``
    kept in float as well as the recipe's ``fp32_layers``."""
    return family_of(config, HANDLERS)(policy, config, statistics, float_layers)
