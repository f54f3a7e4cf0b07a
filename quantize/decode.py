"""The one decode loop: prefill a prompt into a fresh KV cache, then one cached decode step per token.

Used by greedy generation (build rollouts, the accuracy gate), the decode-speed measurements (the
build's ``auto`` recipe choice, the benchmarks) and the serving engine. ``module`` is anything with
the Policy interface: the eager ``Policy``, ``CastPolicy`` or the exported INT8 TorchScript module,
which all expose ``new_cache(batch, total)``, ``prefill(ids, k, v)`` and ``decode(token, pos, k, v)``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Protocol, Sequence, TypeVar

import torch
from torch import Tensor


class Picked(Protocol):
    """What a ``pick`` function returns: at least the chosen token's id (e.g. serve's ``Step``)."""

    token_id: int


@dataclass(frozen=True)
class GreedyStep:
    token_id: int
    logits: Tensor  # [V], the last position's logits the token was picked from


def greedy_pick(logits: Tensor) -> GreedyStep:
    return GreedyStep(int(logits.argmax()), logits)


P = TypeVar("P", bound=Picked)


@torch.no_grad()
def decode_steps(
    module,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    pick: Callable[[Tensor], P] = greedy_pick,
    stop_token_id: Optional[int] = None,
    max_seq_len: Optional[int] = None,
) -> Iterator[P]:
    """Yield ``pick(logits)`` for each new token, ``logits`` being the last position's [V] logits.

    Stops after ``max_new_tokens`` tokens, after ``stop_token_id`` (yielded), or when the sequence
    reaches ``max_seq_len``. The first step costs the prefill, every later one a single decode; no
    decode runs for a token that will not be yielded.
    """
    total = len(prompt_ids) + max_new_tokens
    if max_seq_len is not None:
        total = min(total, max_seq_len)
    if total <= len(prompt_ids):
        return
    k, v = module.new_cache(1, total)
    logits = module.prefill(torch.tensor([list(prompt_ids)]), k, v)
    for pos in range(len(prompt_ids), total):
        step = pick(logits[0, -1])
        yield step
        if step.token_id == stop_token_id or pos + 1 >= total:
            return
        logits = module.decode(torch.tensor([[step.token_id]]), pos, k, v)


def greedy_generate(module, prompt: Sequence[int], max_new_tokens: int, eos_token_id: Optional[int] = None) -> list[int]:
    """Greedy completion token ids (the stop token included when it is produced)."""
    return [s.token_id for s in decode_steps(module, prompt, max_new_tokens, stop_token_id=eos_token_id)]


def decode_tokens_per_s(module, prompt_ids: Sequence[int], new_tokens: int, repeats: int = 3, warmup: int = 1) -> float:
    """Batch-1 tokens/s of the decode steps alone (prefill untimed), median of ``repeats`` fresh caches
    after ``warmup`` runs (TorchScript's profiling executor optimises the graph on early calls)."""
    times = []
    for _ in range(repeats + warmup):
        steps = decode_steps(module, prompt_ids, new_tokens + 1)
        next(steps)  # the prefill and the first token
        t = time.perf_counter()
        for _ in steps:
            pass
        times.append(time.perf_counter() - t)
    return new_tokens / statistics.median(times[warmup:])
