"""Disjoint prompt sets: the calibration prompts and the golden prompts (task prompts, a user file or the
shipped general set), the golden items with their FP32 completions, and the golden set's split into the
float-layer search part and the part held out for the gate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

from policy_bundle.build.config.build_config import BuildConfig, is_task_policy, resolve_defaults
from policy_bundle.build.config.defaults import GENERAL_SEARCH, TASK_GOLDEN_POOL, prompts_path, read_prompts_file
from policy_bundle.build.errors import ConfigError
from policy_bundle.quantize.reference import task
from policy_bundle.quantize.fidelity.scores import GoldenItem


@dataclass
class PromptSplit:
    calibration: List[str]
    golden: List[str]
    golden_answers: Optional[List[str]]  # None when the policy has no task


def split_prompts(cfg: BuildConfig) -> PromptSplit:
    """Disjoint calibration and golden prompts (task prompts, a user file, or the shipped set)."""
    if cfg.policy.kind == "auto" or cfg.calibration.samples is None or cfg.calibration.golden is None:
        cfg = resolve_defaults(cfg)  # a build passes its resolved config; a script may pass its own
    n_cal, n_gold = cfg.calibration.samples, cfg.calibration.golden
    if is_task_policy(cfg):
        # the task has prompts to spare: the gate gets all n_gold (its granularity as asked) and the float-layer
        # search as many more of its own (split_golden alternates them)
        if 2 * n_gold > TASK_GOLDEN_POOL:
            raise ConfigError(f"calibration.golden: {n_gold} exceeds {TASK_GOLDEN_POOL // 2} (the gate's items and as "
                              f"many for the float-layer search come from the {TASK_GOLDEN_POOL} task prompts held out "
                              "of every rollout)")
        gold = task.golden_set(2 * n_gold)
        return PromptSplit(task.rollout_prompts(n_cal), [g.prompt for g in gold], [g.answer for g in gold])
    path = prompts_path(cfg.prompts.file)
    prompts = read_prompts_file(path)
    if len(prompts) < 3:
        raise ConfigError(f"prompts.file: {path} needs at least 3 prompts (calibration and a golden set of 2)")
    # The golden set takes the tail, exactly as many as asked; calibration cycles over the rest.
    if n_gold > len(prompts) - 1:
        raise ConfigError(f"calibration.golden: {n_gold} exceeds {len(prompts) - 1}, the most {path} can give "
                          f"({len(prompts)} prompts, one at least kept for calibration); lower it or add prompts")
    cal_pool = prompts[:-n_gold]
    cal = [cal_pool[i % len(cal_pool)] for i in range(n_cal)]
    return PromptSplit(cal, prompts[-n_gold:], None)


def golden_items(prompts: PromptSplit, prompt_ids: List[List[int]], completions: List[List[int]]) -> List[GoldenItem]:
    answers = prompts.golden_answers or [None] * len(prompts.golden)
    return [
        GoldenItem(prompt=p, prompt_ids=list(ids), completion_ids=list(c), answer=a)
        for p, ids, c, a in zip(prompts.golden, prompt_ids, completions, answers)
    ]


GOLDEN_SPLIT_RULE = ("golden items alternate: the 1st, 3rd, 5th, ... are held out for the gate (its verdict, the "
                     "reported fidelity, golden.jsonl); the 2nd, 4th, ... are what the float-layer search ranks and "
                     f"bisects on, up to its share (a prompts file's search: at most {GENERAL_SEARCH} items); every "
                     "item past them is held out too")


@dataclass
class GoldenSplit:
    """The golden set in two disjoint parts, so the gate never judges on prompts the search was tuned on."""

    search: List[GoldenItem]  # the float-layer search's ranking and bisection
    gate: List[GoldenItem]  # held out: the final verdict, every reported fidelity, golden.jsonl

    def summary(self) -> dict:
        return {"search": len(self.search), "gate": len(self.gate), "rule": GOLDEN_SPLIT_RULE}


def split_golden(golden: Sequence[GoldenItem], search: Optional[int] = None) -> GoldenSplit:
    """Every other item to the search, up to ``search`` items (unset: half, rounded down); the rest to the gate."""
    s = len(golden) // 2 if search is None else max(1, min(search, len(golden) // 2))
    return GoldenSplit(search=list(golden[1 : 2 * s : 2]), gate=list(golden[0 : 2 * s : 2]) + list(golden[2 * s :]))


def search_share(cfg: BuildConfig) -> Optional[int]:
    """The float-layer search's share of the golden items: half for a task policy (the gate's N and N more of its
    own), at most ``GENERAL_SEARCH`` of a prompts file's."""
    return None if is_task_policy(cfg) else GENERAL_SEARCH
