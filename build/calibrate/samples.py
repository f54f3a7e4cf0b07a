"""Calibration sequences: greedy rollouts of the FP32 policy (our batched generate, or vLLM), or read from
a rollout dump; the odd-sample screen; the calibration batches."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import torch
from torch import Tensor

from policy_bundle.build.config.build_config import BuildConfig
from policy_bundle.build.errors import ConfigError
from policy_bundle.build.progress import Throttled
from policy_bundle.bundle.info import encode_prompt
from policy_bundle.quantize.runtime.decode import greedy_generate_batch
from policy_bundle.quantize.runtime.vllm_launch import apply_vllm_env_defaults, offline_engine


@torch.no_grad()
def local_samples(
    policy, prompt_ids: Sequence[List[int]], max_new_tokens: int, eos: Optional[int], tick: Callable[[], None] = lambda: None,
    batch_size: int = 16,
) -> List[List[int]]:
    """Greedy completions from our own KV-cache generate, ``batch_size`` sequences per decode step."""
    return greedy_generate_batch(policy, prompt_ids, max_new_tokens, eos, batch_size, done=lambda i: tick())


def vllm_samples(policy_dir: Path, prompt_ids: Sequence[List[int]], max_new_tokens: int,
                  eos: Optional[int]) -> List[List[int]]:
    """Greedy completions from a vLLM engine (the CPU build here, CUDA vLLM on GPUs), token ids only; like
    ``local_samples`` they stop after ``eos`` (kept) or ``max_new_tokens``, and never stop with ``eos`` None."""
    apply_vllm_env_defaults()
    try:
        from vllm import SamplingParams
    except ImportError as exc:
        raise ConfigError(f"samples.engine: 'vllm' but vllm cannot be imported ({exc})") from None
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, detokenize=False, ignore_eos=eos is None,
                            stop_token_ids=None if eos is None else [eos])
    with offline_engine(policy_dir, "float32") as llm:
        outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompt_ids], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def read_samples_jsonl(path: Path, tok) -> List[List[int]]:
    """Calibration sequences from TorchForge-style ``{"prompt", "completion"}`` records."""
    if not path.is_file():
        raise ConfigError(f"samples.jsonl: {str(path)!r} does not exist")
    seqs = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            prompt, completion = str(rec["prompt"]), str(rec["completion"])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ConfigError(f"samples.jsonl: {path}:{n} needs 'prompt' and 'completion' fields") from None
        seqs.append(encode_prompt(tok, prompt) + tok(completion, add_special_tokens=False)["input_ids"])
    if not seqs:
        raise ConfigError(f"samples.jsonl: {path} holds no records")
    return seqs


def screen_odd_samples(cfg: BuildConfig, policy, seqs: List[List[int]], tok,
                       log: Callable[[str], None] = print) -> tuple[List[List[int]], dict]:
    """Calibration sequences whose activation range stands out (``calibration.outlier_sigma``), reported
    and, with ``calibration.drop_outliers``, left out. Returns the sequences to calibrate on and the
    manifest's record of what was found."""
    from policy_bundle.quantize.calibration.odd_samples import odd_samples, sample_absmax
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
