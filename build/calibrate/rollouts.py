"""Where build data comes from: the policy source, prompts, rollouts, golden set, calibration batches."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import torch
from torch import Tensor

from policy_bundle.build.config import BuildConfig
from policy_bundle.build.errors import ConfigError, UnsupportedPolicyError
from policy_bundle.build.progress import Throttled
from policy_bundle.bundle.info import encode_prompt, load_tokenizer, read_golden_jsonl, write_golden_jsonl  # noqa: F401
from policy_bundle.quantize import task
from policy_bundle.quantize.fidelity import GoldenItem
from policy_bundle.quantize.decode import greedy_generate_batch
from policy_bundle.quantize.model import UnsupportedModelError
from policy_bundle.quantize.hf_weights import load_hf_config

GENERAL_PROMPTS = Path(__file__).parent / "prompts" / "general.txt"
DEFAULT_TASK_GOLDEN = 128  # calibration.golden unset, task prompts
TASK_GOLDEN_POOL = 1000  # the golden prompts task.rollout_prompts keeps out of every rollout (golden_set(1000))


def resolve_policy_dir(cfg: BuildConfig, log: Callable[[str], None] = print) -> Path:
    """The HF directory of the FP32 policy: the embedded reference policy, a user path, or the HF directory
    converted (once, into the cache) from a torchtitan checkpoint."""
    if cfg.policy.torchtitan is not None:
        from policy_bundle.build.torchtitan_checkpoint import resolve_torchtitan_source
        from policy_bundle.quantize.reference import default_cache_dir

        return resolve_torchtitan_source(Path(cfg.policy.source).expanduser(), cfg.policy.torchtitan,
                                         default_cache_dir(), log=log)
    if cfg.policy.source == "reference":
        from policy_bundle.quantize.reference import ensure_reference_policy

        return ensure_reference_policy(log=log)
    path = Path(cfg.policy.source).expanduser()
    if not path.exists():
        raise ConfigError(f"policy.source: {str(path)!r} does not exist")
    if not path.is_dir():
        raise ConfigError(f"policy.source: {str(path)!r} is not a directory")
    try:
        load_hf_config(path)
    except UnsupportedModelError as exc:  # e.g. GPT-2
        raise UnsupportedPolicyError(f"policy.source: {exc}") from None
    if not list(path.glob("*.safetensors")):
        raise UnsupportedPolicyError(f"policy.source: {path} holds no *.safetensors weights")
    return path


def is_task_policy(cfg: BuildConfig) -> bool:
    """The reference policy, a directory derived from it (marked by its reference.json), or a torchtitan
    checkpoint with the task's tokenizer, scored on the task unless the config names its own prompts."""
    if cfg.prompts.file is not None:
        return False
    if cfg.policy.torchtitan is not None:
        return cfg.policy.torchtitan.tokenizer == "reference"
    return cfg.policy.source == "reference" or (Path(cfg.policy.source) / "reference.json").is_file()




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


def split_prompts(cfg: BuildConfig) -> PromptSplit:
    """Disjoint calibration and golden prompts (task prompts, a user file, or the shipped set)."""
    n_cal, n_gold = cfg.calibration.samples, cfg.calibration.golden
    if is_task_policy(cfg):
        # the task has prompts to spare: the gate gets all n_gold (its granularity as asked) and the float-layer
        # search as many more of its own (split_golden alternates them)
        n_gold = DEFAULT_TASK_GOLDEN if n_gold is None else n_gold
        if 2 * n_gold > TASK_GOLDEN_POOL:
            raise ConfigError(f"calibration.golden: {n_gold} exceeds {TASK_GOLDEN_POOL // 2} (the gate's items and as "
                              f"many for the float-layer search come from the {TASK_GOLDEN_POOL} task prompts held out "
                              "of every rollout)")
        gold = task.golden_set(2 * n_gold)
        return PromptSplit(task.rollout_prompts(n_cal), [g.prompt for g in gold], [g.answer for g in gold])
    path = Path(cfg.prompts.file) if cfg.prompts.file else GENERAL_PROMPTS
    prompts = read_prompts_file(path)
    if len(prompts) < 3:
        raise ConfigError(f"prompts.file: {path} needs at least 3 prompts (calibration and a golden set of 2)")
    # The golden set takes the tail, exactly as many as asked; calibration cycles over the rest.
    n_gold = max(2, len(prompts) // 4) if n_gold is None else n_gold
    if n_gold > len(prompts) - 1:
        raise ConfigError(f"calibration.golden: {n_gold} exceeds {len(prompts) - 1}, the most {path} can give "
                          f"({len(prompts)} prompts, one at least kept for calibration); lower it or add prompts")
    cal_pool = prompts[:-n_gold]
    cal = [cal_pool[i % len(cal_pool)] for i in range(n_cal)]
    return PromptSplit(cal, prompts[-n_gold:], None)


@torch.no_grad()
def local_rollouts(
    policy, prompt_ids: Sequence[List[int]], max_new_tokens: int, eos: Optional[int], tick: Callable[[], None] = lambda: None,
    batch_size: int = 16,
) -> List[List[int]]:
    """Greedy completions from our own KV-cache generate, ``batch_size`` sequences per decode step."""
    return greedy_generate_batch(policy, prompt_ids, max_new_tokens, eos, batch_size, done=lambda i: tick())


def vllm_rollouts(policy_dir: Path, prompt_ids: Sequence[List[int]], max_new_tokens: int,
                  eos: Optional[int]) -> List[List[int]]:
    """Greedy completions from a vLLM engine (the CPU build here, CUDA vLLM on GPUs), token ids only; like
    ``local_rollouts`` they stop after ``eos`` (kept) or ``max_new_tokens``, and never stop with ``eos`` None."""
    try:
        from vllm import LLM, SamplingParams
    except ImportError as exc:
        raise ConfigError(f"rollouts.engine: 'vllm' but vllm cannot be imported ({exc})") from None
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    llm = LLM(model=str(policy_dir), dtype="float32", enforce_eager=True, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, detokenize=False, ignore_eos=eos is None,
                            stop_token_ids=None if eos is None else [eos])
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompt_ids], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def read_rollouts_jsonl(path: Path, tok) -> List[List[int]]:
    """Calibration sequences from TorchForge-style ``{"prompt", "completion"}`` records."""
    if not path.is_file():
        raise ConfigError(f"rollouts.jsonl: {str(path)!r} does not exist")
    seqs = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            prompt, completion = str(rec["prompt"]), str(rec["completion"])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ConfigError(f"rollouts.jsonl: {path}:{n} needs 'prompt' and 'completion' fields") from None
        seqs.append(encode_prompt(tok, prompt) + tok(completion, add_special_tokens=False)["input_ids"])
    if not seqs:
        raise ConfigError(f"rollouts.jsonl: {path} holds no records")
    return seqs


def screen_odd_samples(cfg: BuildConfig, policy, seqs: List[List[int]], tok,
                       log: Callable[[str], None] = print) -> tuple[List[List[int]], dict]:
    """Calibration sequences whose activation range stands out (``calibration.outlier_sigma``), reported
    and, with ``calibration.drop_outliers``, left out. Returns the sequences to calibrate on and the
    manifest's record of what was found."""
    from policy_bundle.quantize.odd_samples import odd_samples, sample_absmax
    from policy_bundle.quantize.recipes import selected_linears

    c = cfg.calibration
    record = {"sigma": c.outlier_sigma, "rule": "max |x| at a linear input > others' mean + sigma x others' std "
              "(leave-one-out)", "dropped": False, "samples": []}
    if c.outlier_sigma <= 0:
        return seqs, record
    layers, every = selected_linears(policy, cfg.recipe_config()), Throttled()
    ranges = sample_absmax(policy, [s[: cfg.policy.max_seq_len] for s in seqs], layers,
                           done=lambda n: every(n, len(seqs), "[calibration] odd-sample screen: samples done"))
    odd = odd_samples(ranges, layers, c.outlier_sigma)
    for o in odd[:10]:
        text = tok.decode(seqs[o.index][:24]).replace("\n", " ")
        log(f"[calibration] odd sample {o.index}: max |x| {o.absmax:.3g} at {o.layer}, {o.sigmas:.1f} std above "
            f"the other samples' mean {o.others_mean:.3g}: {text!r}" + (" (dropped)" if c.drop_outliers else ""))
    if len(odd) > 10:
        log(f"[calibration] ... {len(odd) - 10} more odd samples (see the manifest's calibration.odd_samples)")
    record["samples"] = [o.as_dict() for o in odd]
    if odd and c.drop_outliers:
        left = len(seqs) - len(odd)
        if left < min(c.batch_size, len(seqs)):
            raise ConfigError(f"calibration.drop_outliers: dropping {len(odd)} odd samples would leave {left} of "
                              f"{len(seqs)}, fewer than calibration.batch_size ({c.batch_size}); raise "
                              f"calibration.outlier_sigma ({c.outlier_sigma:g})")
        bad = {o.index for o in odd}
        record["dropped"] = True
        seqs = [s for i, s in enumerate(seqs) if i not in bad]
    return seqs, record


def calibration_batches(seqs: Sequence[List[int]], batch_size: int, max_len: int) -> List[Tensor]:
    """Length-sorted batches, each truncated to its shortest member: no pad token reaches an observer.

    The batches depend only on the data, never on how they are later sharded over processes.
    """
    order = sorted(range(len(seqs)), key=lambda i: (len(seqs[i]), seqs[i]))
    batches = []
    for s in range(0, len(order), batch_size):
        chunk = [seqs[i][:max_len] for i in order[s : s + batch_size]]
        t = min(len(c) for c in chunk)
        batches.append(torch.tensor([c[:t] for c in chunk], dtype=torch.long))
    return batches


def golden_items(prompts: PromptSplit, prompt_ids: List[List[int]], completions: List[List[int]]) -> List[GoldenItem]:
    answers = prompts.golden_answers or [None] * len(prompts.golden)
    return [
        GoldenItem(prompt=p, prompt_ids=list(ids), completion_ids=list(c), answer=a)
        for p, ids, c, a in zip(prompts.golden, prompt_ids, completions, answers)
    ]


GOLDEN_SPLIT_RULE = ("golden items alternate: the 1st, 3rd, 5th, ... are held out for the gate (its verdict, the "
                     "reported fidelity, golden.jsonl); the 2nd, 4th, ... are what the float-layer search ranks and "
                     "bisects on")


@dataclass
class GoldenSplit:
    """The golden set in two disjoint parts, so the gate never judges on prompts the search was tuned on."""

    search: List[GoldenItem]  # the float-layer search's ranking and bisection
    gate: List[GoldenItem]  # held out: the final verdict, every reported fidelity, golden.jsonl

    def summary(self) -> dict:
        return {"search": len(self.search), "gate": len(self.gate), "rule": GOLDEN_SPLIT_RULE}


def split_golden(golden: Sequence[GoldenItem]) -> GoldenSplit:
    return GoldenSplit(search=list(golden[1::2]), gate=list(golden[::2]))
