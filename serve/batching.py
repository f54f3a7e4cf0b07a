"""Continuous batching for the INT8 TorchScript policy (and our FP policy module, its fallback).

One decode thread owns the model and a KV cache of ``capacity`` slots (quantize's ``SlotBatch``, the
build's batched rollouts' too). Each step it admits newcomers (their prompts prefilled into free
slots; while others are decoding, at most ``prefill_chunk`` prompt tokens per step, a long prompt in
chunks across steps, so running streams keep flowing), then advances every active request by one
token with the artifact's ``decode_batch(tokens [B, 1], pos [B], k, v)``: each row at its own
position (``decode`` when there is one row). A finished or
cancelled request leaves at once; the last row moves into its slot, so the active rows are always
slots ``0..n-1`` and a step runs on a view of the cache, never on a copy. Sampling, seeds, stop
tokens and logprobs stay per request (``pick_token`` with the request's own generator), so a greedy
request gets the tokens it gets alone.

``Lanes`` runs several such engines on one loaded module, one decode thread each (one intra-op thread each by
default), and hands each request to the least loaded: on a CPU where one decode thread at one intra-op thread leaves
cores idle, the others decode too, with the arithmetic the build's gate decoded with (a row's tokens do not depend on
its lane or its batch).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Deque, List, Optional

import torch

from policy_bundle.quantize.slots import SlotBatch
from policy_bundle.serve.engines import (SamplingParams, Step, check_threads, decode_thread_setup, last_position_logits,
                                         pick_token)

log = logging.getLogger("policy_bundle.serve")


@dataclass(eq=False)
class _Request:
    prompt: List[int]
    params: SamplingParams
    total: int  # prompt + new tokens, capped by the context
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    gen: Optional[torch.Generator] = None
    filled: int = 0  # prompt tokens already in the cache (chunked prefill)
    last: int = 0  # the token the next decode step feeds
    produced: int = 0
    cancelled: bool = False
    done: bool = field(default=False)

    def emit(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is gone: nobody is listening
            self.cancelled = True


def _leaves(r: _Request) -> bool:
    """A finished or cancelled request leaves the batch (its slot is released)."""
    return r.done or r.cancelled


class BatchedEngine:
    """``generate(prompt_ids, params)`` like every engine; all requests share one batched decode."""

    def __init__(self, module, max_seq_len: int, name: str, max_batch: int = 32, prefill_chunk: int = 64,
                 threads: int = 1):
        from policy_bundle.bundle.faults import active_fault

        self.module, self.max_seq_len, self.name = module, max_seq_len, name
        self.max_batch, self.prefill_chunk = max(1, max_batch), max(1, prefill_chunk)
        fault = active_fault("slow")
        self.delay_s = fault.factor if fault else 0.0  # test-only fault: seconds per step
        self._pending: Deque[_Request] = deque()
        self._cv = threading.Condition()
        self.slots: SlotBatch[_Request] = SlotBatch(module, max_seq_len, self.max_batch)  # rows: the active requests
        self._filling: Optional[_Request] = None  # a newcomer whose prompt is part-way into slot len(slots)
        self.peak_batch = 0
        self.steps = 0
        self.loop_errors = 0
        self.threads = check_threads(threads)  # intra-op threads of the decode thread (``engines.decode_thread_setup``)
        self._thread = threading.Thread(target=self._run, name=f"{name}-batch", daemon=True)
        self._thread.start()

    # ---- the caller's side (event loop) ----

    async def generate(self, prompt_ids: List[int], params: SamplingParams) -> AsyncIterator[Step]:
        total = min(len(prompt_ids) + params.max_tokens, self.max_seq_len)
        if total <= len(prompt_ids):
            return
        req = _Request(list(prompt_ids), params, total, asyncio.get_running_loop(), asyncio.Queue(),
                       torch.Generator().manual_seed(params.seed) if params.seed is not None else None)
        with self._cv:
            self._pending.append(req)
            self._cv.notify()
        try:
            while True:
                item = await req.queue.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            req.cancelled = True  # a caller that stops early (client gone) frees its slot at the next step

    def stats(self) -> dict:
        return {"active": len(self.slots), "pending": len(self._pending), "capacity": self.slots.capacity,
                "max_batch": self.max_batch, "peak_batch": self.peak_batch, "steps": self.steps}

    def score(self, batch: List[List[int]]) -> List[List[float]]:
        return last_position_logits(self.module, batch)

    # ---- the decode thread ----

    def _run(self) -> None:
        decode_thread_setup(self.threads)
        while True:
            try:
                with self._cv:
                    while not self._pending and not len(self.slots) and self._filling is None:
                        self._cv.wait()
                self._admit()
                if len(self.slots):
                    self._step()
            except Exception as exc:  # noqa: BLE001 - fail the requests in flight, keep the loop alive
                self.loop_errors += 1
                log.error("%s: batched decode failed (%s: %s); failing %d request(s)", self.name,
                          type(exc).__name__, exc, len(self.slots))
                for r in self.slots.rows + ([self._filling] if self._filling else []):
                    r.emit(RuntimeError(f"{type(exc).__name__}: {exc}"))
                self.slots.clear()
                self._filling = None

    def _next_newcomer(self) -> Optional[_Request]:
        if len(self.slots) >= self.max_batch:
            return None
        with self._cv:
            while self._pending:
                r = self._pending.popleft()
                if not r.cancelled:
                    return r
        return None

    def _admit(self) -> None:
        """Prefill newcomers into slot ``len(slots)``: all of them when nothing is decoding, else at
        most ``prefill_chunk`` prompt tokens this step (the rest of a long prompt waits for the next)."""
        budget = self.prefill_chunk if len(self.slots) else None
        while budget is None or budget > 0:
            r = self._filling or self._next_newcomer()
            self._filling = None
            if r is None:
                break
            if r.cancelled:
                continue
            start, n = r.filled, len(r.prompt)
            end = n if budget is None else min(n, start + budget)
            try:  # a failed allocation (out of memory) fails this request only
                if self.slots.grow(len(self.slots) + 1):
                    log.info("%s: KV cache grown to %d slots of %d tokens", self.name, self.slots.capacity,
                             self.max_seq_len)
                logits = self.slots.prefill(r.prompt[start:end], start)
            except Exception as exc:  # noqa: BLE001 - this request's failure, not the batch's
                r.emit(RuntimeError(f"prefill failed (KV cache of {self.slots.capacity} slots): "
                                    f"{type(exc).__name__}: {exc}"))
                continue
            self._sleep_for_fault()
            r.filled = end
            if budget is not None:
                budget -= end - start
            if end < n:
                self._filling = r
                break
            self.slots.join(r)
            self._advance(r, logits)
        self.slots.drop(_leaves)

    def _step(self) -> None:
        rows = self.slots.rows
        self.peak_batch = max(self.peak_batch, len(rows))
        logits = self.slots.step([r.last for r in rows])
        self.steps += 1
        self._sleep_for_fault()
        for r, row_logits in zip(rows, logits):
            self._advance(r, row_logits)
        self.slots.drop(_leaves)

    def _advance(self, r: _Request, logits) -> None:
        """Pick the request's next token from its logits row and hand it over; mark it done when it ends."""
        if r.cancelled:
            r.done = True
            return
        try:
            step = pick_token(logits, r.params, r.gen)
        except Exception as exc:  # noqa: BLE001 - e.g. non-finite logits: this request fails, the batch goes on
            r.done = True
            r.emit(RuntimeError(f"sampling failed: {type(exc).__name__}: {exc}"))
            return
        r.last, r.produced = step.token_id, r.produced + 1
        r.emit(step)
        if step.token_id == r.params.stop_token_id or len(r.prompt) + r.produced >= r.total:
            r.done = True
            r.emit(None)

    def _sleep_for_fault(self) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)


class Lanes:
    """``generate`` on whichever of several ``BatchedEngine`` lanes (one decode thread each, on one shared module)
    has the fewest requests of its own; ties go to the first, so a lone client always decodes on lane 0.

    Measured on SmolLM2-135M's INT8 policy (2 cores, one intra-op thread per lane, 6-token prompts, 8 new tokens,
    ``serve/bench_batching.py --lanes 0``, each engine in its own process): 2 lanes against 1 made 104.6 against 59.5
    tok/s at 2 clients, 162.2 against 104.6 at 8 and 248.4 against 136.0 at 32; at 1 client the same. One decode
    thread cannot use a second core: its intra-op threads stay at one (``engine_threads``: the arithmetic the gate
    decoded with)."""

    def __init__(self, engines: List[BatchedEngine], name: str):
        self.lanes, self.name = engines, name
        self._load = [0] * len(engines)  # requests handed to each lane and not yet finished (or dropped)
        self._lock = threading.Lock()  # callers on several event loops or threads (BentoML's workers)

    async def generate(self, prompt_ids: List[int], params: SamplingParams) -> AsyncIterator[Step]:
        with self._lock:
            lane = min(range(len(self.lanes)), key=self._load.__getitem__)
            self._load[lane] += 1
        try:
            async for step in self.lanes[lane].generate(prompt_ids, params):
                yield step
        finally:
            with self._lock:
                self._load[lane] -= 1

    def stats(self) -> dict:
        """The lanes' counts summed (their peak batch: the largest), and each lane's own under ``per_lane``."""
        per = [e.stats() for e in self.lanes]
        total = {k: sum(s[k] for s in per) for k in ("active", "pending", "capacity", "steps")}
        return {**total, "max_batch": sum(s["max_batch"] for s in per), "peak_batch": max(s["peak_batch"] for s in per),
                "lanes": len(per), "per_lane": per}

    def score(self, batch: List[List[int]]) -> List[List[float]]:
        return self.lanes[0].score(batch)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity; the machine's count where there is no affinity call)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def lane_count(lanes: int, threads: int) -> int:
    """``engine_lanes``: 0 means one decode thread per ``threads`` usable cores (at least one)."""
    return lanes if lanes > 0 else max(1, usable_cores() // max(1, threads))


def policy_engine(module, max_seq_len: int, name: str, max_batch: int = 32, prefill_chunk: int = 64, threads: int = 1,
                  lanes: int = 1):
    """The batched engine when the module has ``decode_batch`` (artifacts since batched decode), in ``lanes`` lanes
    (``Lanes``; 0: one per ``threads`` usable cores) that share ``max_batch`` between them (so their KV caches hold no
    more slots than one lane's would), else the one-sequence-at-a-time engine, with one log line naming why."""
    from policy_bundle.serve.engines import CachedPolicyEngine

    if hasattr(module, "decode_batch"):
        total = max(1, max_batch)
        n = min(lane_count(lanes, threads), total)
        sizes = [total // n + (i < total % n) for i in range(n)]
        engines = [BatchedEngine(module, max_seq_len, name if n == 1 else f"{name}-lane{i}", max_batch=size,
                                 prefill_chunk=prefill_chunk, threads=threads) for i, size in enumerate(sizes)]
        if n == 1:
            return engines[0]
        log.info("%s: %d decode lanes of %d intra-op thread(s), %s sequences at most", name, n, threads,
                 " + ".join(map(str, sizes)))
        return Lanes(engines, name)
    log.warning("%s: the artifact has no decode_batch (exported before batched decode): decoding one "
                "sequence at a time; rebuild the bundle for continuous batching", name)
    return CachedPolicyEngine(module, max_seq_len, name + "-sequential", threads)
