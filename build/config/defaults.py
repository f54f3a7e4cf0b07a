"""The defaults of the build config's fields that depend on the policy (``build_config.resolve_defaults`` fills them
in once, when a build starts), and the prompts file they are counted from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

from policy_bundle.build.errors import ConfigError

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


def default_general_golden(n: int) -> int:
    """Golden items from a prompts file of ``n`` prompts when ``calibration.golden`` is unset: those beyond
    ``GENERAL_CALIBRATION`` calibration prompts, up to ``GENERAL_GOLDEN``, and at least half the file (at least 2)."""
    return max(min(n // 2, GENERAL_GOLDEN), min(GENERAL_GOLDEN, n - GENERAL_CALIBRATION), 2)


def prompts_path(file: Optional[str]) -> Path:
    """``prompts.file``, or the shipped general set where it is unset."""
    return Path(file) if file else GENERAL_PROMPTS
