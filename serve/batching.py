"""Continuous batching for the INT8 TorchScript policy (and our FP policy module, its fallback).

One decode thread owns the model and a KV cache of ``capacity`` slots. Each step it admits
newcomers (their prompts prefilled into free slots; while others are decoding, at most
``prefill_chunk`` prompt tokens per step, a long prompt in chunks across steps, so running streams
keep flowing), then advances every active request by one token with the artifact's
``decode_batch(tokens [B, 1], pos [B], k, v)``: each row at its own position. A finished or
cancelled request leaves at once; the last row moves into its slot, so the active rows are always
slots ``0..n-1`` and a step runs on a view of the cache, never on a copy. Sampling, seeds, stop
tokens and logprobs stay per request (``pick_token`` with the request's own generator), so a greedy
request gets the tokens it gets alone.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Deque, List, Optional

import torch

from policy_bundle.serve.engines import SamplingParams, Step, last_position_logits, pick_token

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
    pos: int = 0  # where ``last`` is written by the next decode step
    last: int = 0
    produced: int = 0
    cancelled: bool = False
    done: bool = field(default=False)

    def emit(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is gone: nobody is listening
            self.cancelled = True


class BatchedEngine:
    """``generate(prompt_ids, params)`` like every engine; all requests share one batched decode."""

    def __init__(self, module, max_seq_len: int, name: str, max_batch: int = 32, prefill_chunk: int = 64):
        from policy_bundle.bundle.faults import active_fault

        self.module, self.max_seq_len, self.name = module, max_seq_len, name
        self.max_batch, self.prefill_chunk = max(1, max_batch), max(1, prefill_chunk)
        fault = active_fault("slow")
        self.delay_s = fault.factor if fault else 0.0  # test-only fault: seconds per step
        self._pending: Deque[_Request] = deque()
        self._cv = threading.Condition()
        self._active: List[_Request] = []
        self._filling: Optional[_Request] = None  # a newcomer whose prompt is part-way into slot len(active)
        self._k = self._v = None
        self.capacity = 0
        self.peak_batch = 0
        self.steps = 0
        self.loop_errors = 0
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
        return {"active": len(self._active), "pending": len(self._pending), "capacity": self.capacity,
                "max_batch": self.max_batch, "peak_batch": self.peak_batch, "steps": self.steps}

    def score(self, batch: List[List[int]]) -> List[List[float]]:
        return last_position_logits(self.module, batch)

    # ---- the decode thread ----

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            try:
                with self._cv:
                    while not self._pending and not self._active and self._filling is None:
                        self._cv.wait()
                self._admit()
                if self._active:
                    self._step()
            except Exception as exc:  # noqa: BLE001 - fail the requests in flight, keep the loop alive
                self.loop_errors += 1
                log.error("%s: batched decode failed (%s: %s); failing %d request(s)", self.name,
                          type(exc).__name__, exc, len(self._active))
                for r in self._active + ([self._filling] if self._filling else []):
                    r.emit(RuntimeError(f"{type(exc).__name__}: {exc}"))
                self._active, self._filling = [], None

    def _next_newcomer(self) -> Optional[_Request]:
        if len(self._active) >= self.max_batch:
            return None
        with self._cv:
            while self._pending:
                r = self._pending.popleft()
                if not r.cancelled:
                    return r
        return None

    def _admit(self) -> None:
        """Prefill newcomers into slot ``len(active)``: all of them when nothing is decoding, else at
        most ``prefill_chunk`` prompt tokens this step (the rest of a long prompt waits for the next)."""
        budget = self.prefill_chunk if self._active else None
        while budget is None or budget > 0:
            r = self._filling or self._next_newcomer()
            self._filling = None
            if r is None:
                break
            if r.cancelled:
                continue
            slot = len(self._active)
            start, n = r.filled, len(r.prompt)
            end = n if budget is None else min(n, start + budget)
            try:
                self._ensure_capacity(slot + 1)  # a failed allocation (out of memory) fails this request only
                logits = self.module(torch.tensor([r.prompt[start:end]]), start, self._k[:, slot:slot + 1, :, :end],
                                     self._v[:, slot:slot + 1, :, :end])
            except Exception as exc:  # noqa: BLE001 - this request's failure, not the batch's
                r.emit(RuntimeError(f"prefill failed (KV cache of {self.capacity} slots): {type(exc).__name__}: {exc}"))
                continue
            self._sleep_for_fault()
            r.filled = end
            if budget is not None:
                budget -= end - start
            if end < n:
                self._filling = r
                break
            r.pos = n
            self._active.append(r)
            self._advance(r, logits[0, -1])
        self._drop_finished()

    def _step(self) -> None:
        rows = self._active
        n = len(rows)
        self.peak_batch = max(self.peak_batch, n)
        tokens = torch.tensor([[r.last] for r in rows])
        pos = torch.tensor([r.pos for r in rows], dtype=torch.long)
        s = max(r.pos for r in rows) + 1
        k, v = self._k[:, :n, :, :s], self._v[:, :n, :, :s]
        # one row: the single-sequence decode (the same arithmetic, minus decode_batch's gathers)
        logits = self.module.decode(tokens, rows[0].pos, k, v) if n == 1 else self.module.decode_batch(tokens, pos, k, v)
        self.steps += 1
        self._sleep_for_fault()
        for i, r in enumerate(rows):
            r.pos += 1
            self._advance(r, logits[i, 0])
        self._drop_finished()

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
        if step.token_id == r.params.stop_token_id or r.pos + 1 >= r.total:
            r.done = True
            r.emit(None)

    def _drop_finished(self) -> None:
        """Remove done and cancelled rows; the last row moves into each freed slot (its filled positions only)."""
        rows = self._active
        fill_slot = len(rows)
        for i in range(len(rows) - 1, -1, -1):
            if not (rows[i].done or rows[i].cancelled):
                continue
            last = len(rows) - 1
            if i != last:
                filled = rows[last].pos
                self._k[:, i, :, :filled] = self._k[:, last, :, :filled]
                self._v[:, i, :, :filled] = self._v[:, last, :, :filled]
                rows[i] = rows[last]
            rows.pop()
        if self._filling is not None and fill_slot != len(rows):  # the part-prefilled newcomer follows the rows
            filled = self._filling.filled
            self._k[:, len(rows), :, :filled] = self._k[:, fill_slot, :, :filled]
            self._v[:, len(rows), :, :filled] = self._v[:, fill_slot, :, :filled]

    def _ensure_capacity(self, n: int) -> None:
        if n <= self.capacity:
            return
        cap = min(self.max_batch, max(4, 1 << (n - 1).bit_length()))
        k, v = self.module.new_cache(cap, self.max_seq_len)
        if self._k is not None:
            k[:, : self.capacity] = self._k
            v[:, : self.capacity] = self._v
        self._k, self._v, self.capacity = k, v, cap
        log.info("%s: KV cache grown to %d slots of %d tokens", self.name, cap, self.max_seq_len)

    def _sleep_for_fault(self) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)


def policy_engine(module, max_seq_len: int, name: str, max_batch: int = 32, prefill_chunk: int = 64):
    """The batched engine when the module has ``decode_batch`` (artifacts since batched decode), else
    the one-sequence-at-a-time engine, with one log line naming why."""
    from policy_bundle.serve.engines import CachedPolicyEngine

    if hasattr(module, "decode_batch"):
        return BatchedEngine(module, max_seq_len, name, max_batch=max_batch, prefill_chunk=prefill_chunk)
    log.warning("%s: the artifact has no decode_batch (exported before batched decode): decoding one "
                "sequence at a time; rebuild the bundle for continuous batching", name)
    return CachedPolicyEngine(module, max_seq_len, name + "-sequential")
