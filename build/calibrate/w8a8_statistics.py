"""The build side of the w8a8 recipes: statistics on the mesh (or in-process), the plan, its summary.

Statistics travel as small tensors except the Hessians (a [in, in] float64 matrix per input group),
so on the mesh the second pass runs over a few decoder layers per call and the controller merges
each chunk before asking for the next.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Tuple

from torch import Tensor, nn

from policy_bundle.build.progress import Throttled, log, set_status
from policy_bundle.quantize.calibration import linear_stats as ls
from policy_bundle.quantize.recipe_types import typed
from policy_bundle.quantize.recipes import RecipeConfig, kept_float, selected_linears
from policy_bundle.quantize.w8a8.plan import W8A8Plan, build_plan, plan_sensitivity

LAYERS_PER_CALL = 4  # Hessians of 4 SmolLM2-135M layers are ~110 MB per shard


def _layer_of(group: str, n_layers: int) -> int:
    return n_layers - 1 if group == ls.HEAD_GROUP else int(group.split(".")[1])


def collect_stats(mesh, policy: nn.Module, batches: Sequence[Tensor], recipe: RecipeConfig) -> ls.LinearStats:
    """Two passes (token max, then group statistics), sharded over the mesh actors when there is one."""
    hessians = recipe.rounding == "gptq"
    if mesh is None:
        token_absmax = ls.collect_token_absmax(policy, batches)
        thresholds = ls.outlier_thresholds(token_absmax, recipe.outlier_ratio)
        return ls.collect_group_stats(policy, batches, thresholds, hessians=hessians)
    from policy_bundle.build.calibrate.mesh import shard

    shards = shard(batches, len(mesh.workers))
    sizes = [sum(len(b) for b in s) for s in shards]
    token_absmax = ls.merge_token_absmax(mesh.run_shards("token_absmax", [(s,) for s in shards], sizes, "samples"))
    thresholds = ls.outlier_thresholds(token_absmax, recipe.outlier_ratio)
    n_layers = len(policy.layers)
    stats: ls.LinearStats = {}
    for first in range(0, n_layers, LAYERS_PER_CALL):
        chunk = range(first, min(n_layers, first + LAYERS_PER_CALL))
        part = {g: t for g, t in thresholds.items() if _layer_of(g, n_layers) in chunk}
        parts = mesh.run_shards("group_stats", [(s, part, hessians) for s in shards], sizes, "samples")
        stats.update(ls.merge_group_stats(parts))
        log(f"[w8a8] statistics: layers {chunk.stop}/{n_layers} merged")
    return stats


def stream_plan(mesh, policy: nn.Module, batches: Sequence[Tensor], recipe: RecipeConfig
                ) -> Tuple[W8A8Plan, ls.LinearStats, List[Tensor]]:
    """The recipe's plan, the statistics a build keeps and the last layer's float output (the head's input), one
    decoder layer at a time (``quantize.w8a8.stream``): in this process, or as a pipeline over the mesh's actors, each
    holding only its share of the layers and passing its output to the next. Progress: a line per layer at most
    every 20 s with the rate and an ETA."""
    from policy_bundle.quantize.calibration.layer_stream import embed_batches
    from policy_bundle.quantize.w8a8.stream import layer_shares, merge_plans, plan_layers

    n = len(policy.layers)
    tick = Throttled()
    hidden = embed_batches(policy, batches)
    if mesh is None:
        def progress(index: int, msg: str) -> None:
            done = n + 1 if index < 0 else index + 1
            tick(done, n + 1, f"[w8a8] layers quantized, {'head' if index < 0 else f'layer {index}'}: {msg}")

        part = plan_layers(policy, range(n), hidden, recipe, progress=progress)
        plan, stats, last = merge_plans([part.plan], recipe), part.stats, part.hidden
    else:
        from policy_bundle.build.calibrate.mesh import mesh_plan_layers

        parts = mesh_plan_layers(mesh, layer_shares(n, len([w for w in mesh.workers if w.alive])), hidden, recipe)
        plan, stats = merge_plans([p[0] for p in parts], recipe), {k: v for p in parts for k, v in p[1].items()}
        last = parts[-1][2]
    log(f"[w8a8] plan: {len(plan.weights)} linears, {recipe.rounding} rounding, one layer at a time"
        + (f" over {len(mesh.workers)} mesh actors" if mesh is not None else "")
        + (", smoothing alpha searched per group" if recipe.smooth else "")
        + (f", inputs Hadamard-rotated in blocks up to {recipe.rotation_block}" if recipe.rotation_block else "")
        + (", token embedding in int8" if plan.int8_embedding else ""))
    return plan, stats, last


def replan_head(policy: nn.Module, plan: W8A8Plan, stats: ls.LinearStats, last: List[Tensor], recipe: RecipeConfig
                ) -> Tuple[W8A8Plan, ls.LinearStats]:
    """``recipe``'s plan from another candidate's (``plan``, ``stats``) whose decoder layers ``recipe`` plans the same
    way (``calibrated.layer_key``): its layers' entries kept, the head planned again from ``last`` (the last layer's
    float output), as ``stream_plan`` would plan it. Seconds instead of streaming every layer again."""
    from policy_bundle.quantize.w8a8.stream import merge_plans, plan_layers, without_head

    head = plan_layers(policy, [], last, recipe, head=True)
    kept = {k: v for k, v in stats.items() if k != ls.HEAD_GROUP}
    merged = merge_plans([without_head(plan), head.plan], recipe)
    log(f"[w8a8] plan: {len(merged.weights)} linears, the decoder layers' plan of an earlier candidate reused, the "
        f"head planned again ({'int8' if 'lm_head' in merged.weights else 'float'})")
    return merged, {**kept, **head.stats}


def rows_flags(recipe: RecipeConfig) -> Tuple[bool, bool]:
    """``recipe.vocab_rows`` as the plan's (``int16_rows``, ``int12_rows``)."""
    return recipe.vocab_rows == "int16", recipe.vocab_rows == "int12"


def make_plan(policy: nn.Module, stats: ls.LinearStats, recipe: RecipeConfig) -> W8A8Plan:
    tick = Throttled()
    groups = ls.input_groups(policy)
    names = selected_linears(policy, recipe)
    count = [0]

    def progress(msg: str) -> None:
        count[0] += 1
        tick(min(count[0], 2 * len(groups)), 2 * len(groups) if recipe.smooth else len(groups), f"[w8a8] {msg}")

    plan = build_plan(policy, stats, groups, names, smooth=recipe.smooth, alphas=recipe.smooth_alphas,
                      rounding=recipe.rounding, gptq_damp=recipe.gptq_damp, outlier_ratio=recipe.outlier_ratio,
                      head_topk=recipe.lm_head_topk, max_rot_block=recipe.rotation_block, progress=progress)
    plan.int8_embedding = not kept_float("embed_tokens", recipe)
    plan.int16_rows, plan.int12_rows = rows_flags(recipe)
    log(f"[w8a8] plan: {len(names)} linears in {len(groups)} input groups, {recipe.rounding} rounding"
        + (", smoothing alpha searched per group" if recipe.smooth else "")
        + (f", inputs Hadamard-rotated in blocks up to {recipe.rotation_block}" if recipe.rotation_block else "")
        + (", token embedding in int8" if plan.int8_embedding else ""))
    return plan


def rank_sensitivity(policy: nn.Module, plan: W8A8Plan, names: Sequence[str], probe: Tensor,
                     status: Callable[[str], str] = lambda s: s) -> List[Tuple[str, float]]:
    """Every linear's probe KL alone in int8 (``quantize.fidelity.sensitivity``), most sensitive first, in this
    process: the
    controller holds the float model anyway, and each linear runs only from its own layer up (the probe's layer
    inputs are computed once), so no mesh actor maps the whole model for it. A progress line at most every 20 s."""
    tick = Throttled()

    def progress(done: int, total: int, worst: str, kl: float) -> None:
        set_status(status(f"sensitivity {done}/{total} linears, most sensitive so far {worst} (KL {kl:.3g})"))
        tick(done, total, f"[gate] sensitivity: linears done, most sensitive so far {worst} (KL {kl:.3g})")

    return plan_sensitivity(policy, plan, names, probe, progress=progress)


def stats_summary(stats: ls.LinearStats) -> Dict[str, dict]:
    """Per input group: rows seen, outlier threshold and the largest channel max |x| (for the manifest)."""
    return {g: {"rows": s.rows, "outlier_threshold": s.threshold,
                "outlier_rows": 0 if s.outliers is None else int(s.outliers.shape[0]),
                "channel_absmax_max": float(s.channel_absmax.max()) if s.channel_absmax is not None else None}
            for g, s in stats.items()}


def w8a8_summary(recipe: RecipeConfig, plan: W8A8Plan) -> dict:
    return {"activations": ("uint8 per token at run time, a scale and zero point per row as fbgemm's dynamic "
                            "quantization (fbgemm's int8 GEMM); inputs Hadamard-rotated where rotation_block allows; rows "
                            "over a calibrated threshold keep their largest channels in float"),
            "weights": f"int8 symmetric per output channel, {plan.rounding} rounding",
            "outlier_ratio": recipe.outlier_ratio, "lm_head_topk": recipe.lm_head_topk, "rounding": recipe.rounding, "gptq_damp": recipe.gptq_damp,
            "smooth_alphas": {g: a for g, a in plan.alphas.items()} if recipe.smooth else None,
            "embedding": embedding_note(plan),
            "vocab_rows": recipe.vocab_rows}


def embedding_note(plan: W8A8Plan) -> str:
    """The manifest's word on the token embedding's format (``W8A8Plan.convert`` decides it)."""
    if plan.int12_rows and plan.head_topk > 0:
        return ("int12 rows (int8, a scale per row, and a 4-bit residual per element): a tied model's rescored int8 "
                "head's own rows, nearest rounding, which its rescoring reads too; float where a tied head stays "
                "float; an untied embedding in int12 unless skipped (then float)")
    if plan.int8_embedding:
        return ("int8 rows, a scale per row: a tied model's int8 head's own rows (its rescoring reads them too), or "
                "an untied embedding's own; float where a tied head stays float")
    if plan.int16_rows:
        return ("int16 rows, a scale per row, shared with the int8 head's top-k rescoring where tied; float where a "
                "tied head stays float or is not rescored (lm_head_topk 0)")
    return "float"


def onnx_recipe_note(recipe: RecipeConfig) -> str:
    base = "onnxruntime static QDQ: per-tensor uint8 activations (MinMax), per-channel int8 weights"
    if not typed(recipe).onnx_carries_activations:
        return (base + "; a weaker recipe than the shipped TorchScript's (no per-token scales, smoothing or "
                "GPTQ rounding), gated on its own: left out (artifacts.int8_onnx_skipped) when it misses the gate")
    return base + "; the same calibration set as the TorchScript artifact"
