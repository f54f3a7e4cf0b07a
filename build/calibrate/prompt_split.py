"""Disjoint prompt sets: the calibration prompts and the golden prompts (task prompts, a user file or the
shipped general set), the golden items with their FP32 completions, and the golden set's split into the
float-layer search part and the part held out for the gate."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import List, Optional, Sequence

from policy_bundle.build.config.build_config import BuildConfig, check_batch_size
from policy_bundle.build.errors import ConfigError
from policy_bundle.build.config.build_config import is_task_policy
from policy_bundle.quantize.reference import task
from policy_bundle.quantize.fidelity.scores import GoldenItem

GENERAL_PROMPTS = Path(__file__).parents[1] / "prompts" / "general.txt"
DEFAULT_TASK_GOLDEN = 128  # calibration.golden unset, task prompts
TASK_GOLDEN_POOL = 1000  # the golden prompts task.rollout_prompts keeps out of every rollout (golden_set(1000))
# Defaults of the fields a config leaves unset (None), by policy kind (``resolve_defaults``):
TASK_NEW_TOKENS = 8  # a task answer is a few tokens (the reference task's sums)
GENERAL_NEW_TOKENS = 32  # a general LM: enough tokens per golden item for top-1, KL and greedy to mean something
# Golden items from a prompts file: what the file has beyond GENERAL_CALIBRATION prompts, up to GENERAL_GOLDEN, and
# at least half a smaller file. The float-layer search takes at most GENERAL_SEARCH of them (every other item of the
# first 2 x GENERAL_SEARCH), the gate every other one: the shipped set (245 prompts) gives 145 calibration prompts (its
# head) and 100 golden items (its tail), 20 to search on and 80 held out. A held-out item costs a held-out round about 0.5 s on SmolLM2-135M
# (teacher-forced, then greedy on the scripted candidate) and the artifact checks about 1.5 s more; a search item costs
# every ranking and bisection step. With 20 held-out items (627 scored tokens on
# SmolLM2-135M) one standard error of top-1 near 0.985 was 0.005, and of greedy agreement near 0.55, 0.11: the default
# build's verdict turned on a token or an item.
GENERAL_GOLDEN = 100
GENERAL_CALIBRATION = 40
GENERAL_SEARCH = 20
DEFAULT_SAMPLES = 256  # calibration samples (task prompts and rollout dumps; a prompts file: each prompt once)


def read_prompts_file(path: Path) -> List[str]:
    """JSONL records with a ``prompt`` field, or plain text with one prompt per line."""
    if not path.is_file():
        raise ConfigError(f"prompts.file: {str(path)!r} does not exist")
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("{"):
            try:
                prompts.append(str(json.loads(line)["prompt"]))
            except (json.JSONDecodeError, KeyError):
                raise ConfigError(f"prompts.file: {path}:{n} is not a JSON record with a 'prompt' field") from None
        else:
            prompts.append(line)
    if not prompts:
        raise ConfigError(f"prompts.file: {path} holds no prompts")
    return prompts


@dataclass
class PromptSplit:
    calibration: List[str]
    golden: List[str]
    golden_answers: Optional[List[str]]  # None when the policy has no task


def resolve_defaults(cfg: BuildConfig) -> BuildConfig:
    """The config with the fields it leaves unset (None) filled in for this policy, as the manifest records them.

    ``policy.kind`` auto becomes task or general (``is_task_policy``), so every later stage and a bundle's
    stored config read the decision instead of probing the source again.
    A task policy: ``prompts.max_new_tokens`` 8, ``calibration.samples`` 256, ``calibration.golden``
    DEFAULT_TASK_GOLDEN (the gate's items; ``split_prompts`` gives the float-layer search as many more).
    A general LM on a prompts file (the shipped general set by default): 32 new tokens per
    item, ``default_general_golden`` golden items, and every other prompt once as calibration (at most 256: a
    repeated prompt's greedy rollout is the same sequence again, work that adds nothing). Set fields are kept.
    """
    task = is_task_policy(cfg)  # decided here, once: the resolved config carries it (policy.kind)
    if cfg.policy.kind == "auto":
        cfg = replace(cfg, policy=replace(cfg.policy, kind="task" if task else "general"))
    p, c = cfg.prompts, cfg.calibration
    if p.max_new_tokens is None:
        p = replace(p, max_new_tokens=TASK_NEW_TOKENS if task else GENERAL_NEW_TOKENS)
    if task and c.golden is None:
        c = replace(c, golden=DEFAULT_TASK_GOLDEN)
    if not task and (c.golden is None or (c.samples is None and not cfg.samples.jsonl)):
        n = len(read_prompts_file(_prompts_path(cfg)))
        c = replace(c, golden=default_general_golden(n) if c.golden is None else c.golden)
        if c.samples is None and not cfg.samples.jsonl:
            c = replace(c, samples=min(DEFAULT_SAMPLES, max(1, n - c.golden)))
    if c.samples is None:
        c = replace(c, samples=DEFAULT_SAMPLES)
    return check_batch_size(replace(cfg, prompts=p, calibration=c))


def default_general_golden(n: int) -> int:
    """Golden items from a prompts file of ``n`` prompts when ``calibration.golden`` is unset: those beyond
    ``GENERAL_CALIBRATION`` calibration prompts, up to ``GENERAL_GOLDEN``, and at least half the file (at least 2)."""
    return max(min(n // 2, GENERAL_GOLDEN), min(GENERAL_GOLDEN, n - GENERAL_CALIBRATION), 2)


def _prompts_path(cfg: BuildConfig) -> Path:
    return Path(cfg.prompts.file) if cfg.prompts.file else GENERAL_PROMPTS


def split_prompts(cfg: BuildConfig) -> PromptSplit:
    """Disjoint calibration and golden prompts (task prompts, a user file, or the shipped set)."""
    cfg = resolve_defaults(cfg)
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
    path = _prompts_path(cfg)
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
