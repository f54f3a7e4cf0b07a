"""Calibration shared by the recipe candidates, each piece computed once: observer states of the plain
and the smoothed policy (torch.ao recipes), linear statistics and quantization plans (w8a8 recipes); the
families' handlers (``build/gate/families.py``) ask for the pieces their candidates need.

On the Monarch mesh when the build has one, else in this process.
"""

from __future__ import annotations

from dataclasses import replace

from policy_bundle.build.config.build_config import BuildConfig
from policy_bundle.build.progress import bar, log
from policy_bundle.build import build_faults
from policy_bundle.quantize import recipes
from policy_bundle.quantize.calibration import observers
from policy_bundle.quantize.model.policy import Policy


def calibrate_observers(mesh, prepared, batches) -> observers.ObserverState:
    """Observer state over all calibration batches: sharded over the Monarch mesh or in-process."""
    if mesh is not None:
        from policy_bundle.build.calibrate.mesh import mesh_calibrate

        return mesh_calibrate(mesh, batches)
    b = bar(len(batches), "calibrate", "batch")
    for batch in batches:
        recipes.calibrate(prepared, [batch])
        b.update(1)
    b.close()
    return observers.observer_state(prepared)


class CalibratedModels:
    """Prepared + calibrated models, one per smoothing choice, computed once and shared by candidates."""

    def __init__(self, cfg: BuildConfig, mesh, policy: Policy, batches: list):
        self.cfg, self.mesh, self.policy, self.batches = cfg, mesh, policy, batches
        self.scales = None
        self.cache: dict = {}
        self.stats: dict = {}  # w8a8: the statistics kept of each plan's calibration, per plan key
        self.plans: dict = {}  # w8a8: plan per (smooth, rounding, ...)
        self.layer_plans: dict = {}  # w8a8: layer_key -> (the plan key that streamed them, the last layer's output)
        self.rankings: dict = {}  # w8a8: the fallback's sensitivity ranking per (layer_key, linears ranked)

    def linear_stats(self, recipe: recipes.RecipeConfig):
        """The statistics kept of the recipe's calibration (thresholds, channel maxima, outlier rows; no Hessians)."""
        self.plan(recipe)
        return self.stats[plan_key(replace(recipe, vocab_rows="float32"))]

    def plan(self, recipe: recipes.RecipeConfig):
        from policy_bundle.build.calibrate.w8a8_statistics import replan_head, rows_flags, stream_plan

        # the rows' format changes no statistic, threshold or weight but the head's (int12 rounds it to nearest when it
        # converts: GPTQ's head weight is then unused)
        twin = replace(recipe, vocab_rows="float32")
        key, base = plan_key(recipe), plan_key(twin)
        if base not in self.plans:
            layers = layer_key(twin)
            if layers in self.layer_plans:  # another candidate streamed the same decoder layers: plan its head alone
                donor, last = self.layer_plans[layers]
                self.plans[base], self.stats[base] = replan_head(self.policy, self.plans[donor], self.stats[donor],
                                                                 last, twin)
            else:
                self.plans[base], self.stats[base], last = stream_plan(self.mesh, self.policy, self.batches, twin)
                self.layer_plans[layers] = (base, last)
        if key not in self.plans:
            int16_rows, int12_rows = rows_flags(recipe)
            self.plans[key] = replace(self.plans[base], int16_rows=int16_rows, int12_rows=int12_rows)
            if recipe.vocab_rows != "float32" and recipe.lm_head_topk > 0:
                log(f"[w8a8] vocabulary rows in {recipe.vocab_rows} (the float32 rows' plan, reused)")
        return self.plans[key]

    def smoothing_scales(self, alpha: float):
        from policy_bundle.quantize.calibration.smooth import collect_channel_absmax, smoothing_scales

        if self.mesh is not None:
            from policy_bundle.build.calibrate.mesh import mesh_channel_stats

            stats = mesh_channel_stats(self.mesh, self.batches)
        else:
            stats = collect_channel_absmax(self.policy, self.batches)
        self.scales = smoothing_scales(self.policy, stats, alpha)
        return self.scales

    def get(self, smooth: bool):
        """(prepared, observer state) of the plain or the smoothed policy."""
        if smooth not in self.cache:
            from policy_bundle.quantize.calibration.smooth import apply_smoothing

            base = apply_smoothing(self.policy, self.scales) if smooth else self.policy
            prepared = recipes.prepare(base, self.cfg.recipe_config())
            if smooth and self.mesh is not None:
                from policy_bundle.build.calibrate.mesh import mesh_apply_smoothing

                mesh_apply_smoothing(self.mesh, self.scales)
            state = build_faults.scaled(calibrate_observers(self.mesh, prepared, self.batches))
            observers.load_observer_state(prepared, state)
            self.cache[smooth] = (prepared, state)
        return self.cache[smooth]


def plan_key(recipe: recipes.RecipeConfig) -> tuple:
    return (recipe.smooth, recipe.rounding, recipe.outlier_ratio, recipe.smooth_alphas, recipe.gptq_damp,
            recipe.skip, recipe.overrides, recipe.lm_head_topk, recipe.rotation_block, recipe.vocab_rows)


HEAD_NAMES = ("embed_tokens", "lm_head")


def layer_key(recipe: recipes.RecipeConfig) -> tuple:
    """What decides a w8a8 plan's decoder layers: ``plan_key`` less what only the head and the embedding read (those
    two named in ``skip`` or ``fp32_layers``, the head's top-k, the vocabulary rows). The default candidates
    ``smooth-w8a8 skip=[embed_tokens]`` and ``smooth-w8a8`` differ in the head alone: one layer stream serves both."""
    def layer_names(names: tuple) -> tuple:
        return tuple(n for n in names if n not in HEAD_NAMES)

    return plan_key(replace(recipe, skip=layer_names(recipe.skip), fp32_layers=layer_names(recipe.fp32_layers),
                            lm_head_topk=0, vocab_rows="float32"))
