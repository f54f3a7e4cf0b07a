"""The one decode loop: prefill a prompt into a fresh KV cache, then one cached decode step per token.

Used by greedy generation (build rollouts, the accuracy gate), the decode-speed measurements (the
build's ``auto`` recipe choice, the benchmarks) and the serving engine. ``module`` is anything with
the Policy interface: the eager ``Policy`` or the exported INT8 TorchScript module,
which all expose ``new_cache(batch, total)``, ``prefill(ids, k, v)`` and ``decode(token, pos, k, v)``.
Batched greedy generation runs on a ``SlotBatch`` (``slots.py``), like the serving engine's batches; it also
calls ``next_logits`` (or ``module(ids, start, k, v)``) for prompts and ``step_seqs`` for the rows, each on a cache of its
own.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Protocol, Sequence, TypeVar

import torch
from torch import Tensor

from policy_bundle.quantize.model.blocks import cache_len_for
from policy_bundle.quantize.runtime.slots import SlotBatch


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
    k, v = module.new_cache(1, cache_len_for(total))  # whole attention blocks (``blocks.attention_len``)
    logits = module.prefill(torch.tensor([list(prompt_ids)]), k, v)
    for pos in range(len(prompt_ids), total):
        step = pick(logits[0, -1])
        yield step
        if step.token_id == stop_token_id or pos + 1 >= total:
            return
        logits = module.decode(torch.tensor([[step.token_id]]), pos, k, v)


# The intra-op threads a served torch engine decodes with by default (serve's ``engine_threads``), and the build's
# greedy gate therefore: a decode step's float rounding depends on the thread count (the rotations' small GEMMs,
# attention), so the gate measured at the build's 2 threads what the 1-thread service does not compute (SmolLM2-135M:
# 3 of 20 greedy continuations differed), and a row's answer stays the same beside other rows only at one thread.
DECODE_THREADS = 1


class threads:
    """``with threads(n):`` torch's intra-op threads are ``n`` inside, as before after. ``torch.set_num_threads`` sets
    the process's intra-op pool (and the default of threads that start meanwhile), so no other thread should run torch
    work in the block: the build's gate runs its greedy decodes on one thread, nothing beside them."""

    def __init__(self, n: int):
        self.n, self.before = n, 0

    def __enter__(self) -> "threads":
        self.before = torch.get_num_threads()
        torch.set_num_threads(self.n)
        return self

    def __exit__(self, *exc) -> None:
        torch.set_num_threads(self.before)


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
        deque(steps, maxlen=0)  # run the remaining decode steps, keeping none
        times.append(time.perf_counter() - t)
    return new_tokens / statistics.median(times[warmup:])


@torch.no_grad()
def greedy_generate_batch(module, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                          eos_token_id: Optional[int] = None, batch_size: int = 16,
                          done: Callable[[int], None] = lambda i: None) -> list[list[int]]:
    """``greedy_generate`` for many prompts, up to ``batch_size`` sequences per decode step (a
    ``SlotBatch``): prompts enter shortest first, and the next prompt takes a finished sequence's place
    at once. Only for modules whose rows do not see each other (float policies, per-token or static
    int8), whose greedy tokens do not depend on the batch. ``done(i)`` is called as sequence ``i``
    finishes."""
    outs: list[list[int]] = [[] for _ in prompts]
    if max_new_tokens <= 0 or not prompts:
        for i in range(len(prompts)):
            done(i)
        return outs

    def finished(i: int) -> bool:
        return outs[i][-1] == eos_token_id or len(outs[i]) >= max_new_tokens

    waiting = deque(sorted(range(len(prompts)), key=lambda i: len(prompts[i])))
    batch: SlotBatch[int] = SlotBatch(module, max(len(p) for p in prompts) + max_new_tokens, batch_size)
    while waiting or len(batch):
        while waiting and len(batch) < batch.max_capacity:
            i = waiting.popleft()
            outs[i].append(int(batch.prefill(prompts[i]).argmax()))
            if finished(i):
                batch.unstage()  # its cache goes at once
                done(i)
            else:
                batch.join(i)
        if len(batch):
            logits = batch.step([outs[i][-1] for i in batch.rows])
            for i, token in zip(batch.rows, logits.argmax(-1).tolist()):
                outs[i].append(token)
                if finished(i):
                    done(i)
            batch.drop(finished)
    return outs
