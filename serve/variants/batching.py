"""Continuous batching for the INT8 TorchScript policy (and our FP policy module, its fallback).

One decode thread owns the model and its sequences, each on a KV cache of its own that grows by ``KV_BLOCK``
positions as the sequence does (quantize's ``SlotBatch``, the build's batched rollouts' too). Each step it admits
newcomers (their prompts prefilled into caches of their own; while others are decoding, at most ``prefill_chunk``
prompt tokens per step, a long prompt in chunks across steps, so running streams keep flowing), then advances every
active request by one token with the artifact's ``step_seqs``: each row at its own position, on its own cache
(``decode`` when there is one row). A finished or cancelled request leaves at once and its cache's blocks go back.
Sampling, seeds, stop tokens and logprobs stay per request (``pick_token`` with the request's own generator; a step's
greedy rows together, each as alone: ``greedy_picks``), so a greedy request gets the tokens it gets alone.

Newcomers' prompt chunks go into the step's own forward (``step_seqs``), every row's logits bitwise as apart
(SmolLM2-135M INT8, 1 thread: 16 rows plus two 6-token prompts took 96 ms in one forward, 68 + 2 x 37 ms apart).

``Lanes`` runs several such engines on one loaded module, one decode thread each (one intra-op thread each by
default), and hands each request to the least loaded: on a CPU where one decode thread at one intra-op thread leaves
cores idle, the others decode too, with the arithmetic the build's gate decoded with (a row's tokens do not depend on
its lane or its batch).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Deque, List, Optional, Tuple

import torch

from policy_bundle.quantize.percentile import percentile
from policy_bundle.quantize.runtime.slots import KV_BLOCK, LONG_PROMPT_CHUNK, SlotBatch
from policy_bundle.serve.variants.engines import (CapacityError, SamplingParams, Step, check_threads,
                                                  decode_thread_setup, greedy_picks, last_position_logits, pick_token)
from policy_bundle.serve.variants.lanes import Lanes, lane_count

log = logging.getLogger("policy_bundle.serve")
MiB = 2**20


def auto_kv_budget() -> int:
    """``kv_cache_bytes: 0``: the KV space the FP16 variant's vLLM is given (``VLLM_CPU_KVCACHE_SPACE``, GiB; 1 as this
    project starts vLLM), so the two sides of an A/B split hold the same KV memory and a comparison between them
    compares the engines, not their budgets; at most a tenth of the memory this process may use (its cgroup's limit or
    the machine's available memory; that tenth at least 256 MiB) and 8 GiB."""
    from policy_bundle.quantize.runtime.memory import memory_limit
    from policy_bundle.quantize.runtime.vllm_launch import vllm_kv_space_bytes

    limit, _ = memory_limit()
    space = vllm_kv_space_bytes(fallback=True) or 0  # not a number: vLLM refuses it; the budget takes the default
    if space <= 0:  # vLLM's own default space (0: unset) says nothing of a budget: a tenth of memory alone
        space = 8 * 1024 * MiB
    return int(min(8 * 1024 * MiB, space, max(256 * MiB, (limit or 0) // 10)))


class KvBudget:
    """The KV-cache bytes a torch engine's lanes may hold together. A lane holds the footprint of its worst case
    (every sequence it admitted at its prompt + max_tokens, in whole blocks) before it admits one more, and lowers it
    as they leave; each sequence's cache grows by blocks as it does, never past its own worst case."""

    def __init__(self, limit: int):
        self.limit = int(limit)
        self._held: dict = {}
        self._waiting: dict = {}  # lane -> when the request it asks for (its first in line) arrived
        self._lock = threading.Lock()

    def hold(self, lane: str, nbytes: int, since: Optional[float] = None) -> bool:
        """Hold ``nbytes`` for ``lane`` (in place of what it held): False, and nothing changed, when that is more than
        it held and either the lanes' total would pass the limit or, first come first served across lanes, another
        lane waits for a request that arrived before ``since`` (when this one arrived; None: no request asks). A lane
        refused for a request waits for it from then on, until it holds it or ``withdraw``s."""
        with self._lock:
            if nbytes > self._held.get(lane, 0):
                others = sum(v for k, v in self._held.items() if k != lane)
                earlier = since is not None and any(t < since for k, t in self._waiting.items() if k != lane)
                if earlier or others + nbytes > self.limit:
                    if since is not None:
                        self._waiting[lane] = since
                    return False
            if since is not None:
                self._waiting.pop(lane, None)
            self._held[lane] = nbytes
            return True

    def withdraw(self, lane: str) -> None:
        """``lane`` waits for nothing any more (its request was refused, cancelled or needs no more memory)."""
        with self._lock:
            self._waiting.pop(lane, None)

    def waiting(self) -> int:
        with self._lock:
            return len(self._waiting)

    def held(self) -> int:
        with self._lock:
            return sum(self._held.values())


@dataclass(eq=False)
class _EngineRequest:
    prompt: List[int]
    params: SamplingParams
    total: int  # prompt + new tokens, capped by the context
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    gen: Optional[torch.Generator] = None
    queued_at: float = field(default_factory=time.monotonic)
    filled: int = 0  # prompt tokens already in the cache (chunked prefill)
    last: int = 0  # the token the next decode step feeds
    produced: int = 0
    history: List[int] = field(default_factory=list)  # its tokens so far (presence / frequency penalties)
    cancelled: bool = False
    done: bool = field(default=False)

    def emit(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is gone: nobody is listening
            self.cancelled = True


def _leaves(r: _EngineRequest) -> bool:
    """A finished or cancelled request leaves the batch (its slot is released)."""
    return r.done or r.cancelled


class BatchedEngine:
    """``generate(prompt_ids, params)`` like every engine; all requests share one batched decode."""

    def __init__(self, module, max_seq_len: int, name: str, max_batch: int = 32, prefill_chunk: int = 64,
                 threads: int = 1, kv: Optional[KvBudget] = None, kv_wait_s: float = 20.0,
                 first_token_s: Optional[float] = None, step_hook: Optional[Callable[[int], None]] = None):
        self.module, self.max_seq_len, self.name = module, max_seq_len, name
        self.max_batch, self.prefill_chunk = max(1, max_batch), max(1, prefill_chunk)
        self.step_hook = step_hook  # run on the decode thread before each step (``serve.serving_faults``)
        self.last_step_at = time.monotonic()  # when the decode thread last finished a step (or found work, idle)
        # what the running step may take, so that a long legitimate step (a 512-token prompt chunk on one thread: about
        # 3 s on SmolLM2-135M) is not taken for a hang: the tokens in it x seconds a token, or a whole step, whichever
        # is longer (each the slowest lately, decaying 5 % a step)
        self.step_tokens, self.s_per_token, self.step_s = 0, 0.0, 0.0
        self._pending: Deque[_EngineRequest] = deque()
        self._cv = threading.Condition()
        # rows: the active requests; with a KV budget the cache grows by blocks within it (``_fits``, ``_settle``)
        self.kv, self.kv_wait_s = kv, kv_wait_s
        self.slots: SlotBatch[_EngineRequest] = SlotBatch(module, max_seq_len, self.max_batch, KV_BLOCK)
        self.kv_refused = 0  # requests that waited kv_wait_s for KV memory and got a 429
        # a request without its first token after this long (queued, or prefilling behind others) gets a 429: the
        # engine is busy, not broken, and says so before the router's own timeout would count it as the variant's
        # failure (None: no limit)
        self.first_token_s = first_token_s
        self.busy_refused = 0
        self.waits: Deque[float] = deque(maxlen=256)  # recent requests' seconds from arrival to their first chunk
        self._filling: Optional[_EngineRequest] = None  # a newcomer whose prompt is part-way into slot len(slots)
        self._chunked: List[_EngineRequest] = []  # newcomers whose chunks are in the forward now running (failed with it)
        self._waits_for_kv = False  # this step left the lane's first request waiting for KV memory
        self.fused = self.slots.can_fuse()
        self.fused_chunks = 0  # prompt chunks that went into a step's own forward
        self.peak_batch = 0
        self.steps = 0
        self.loop_errors = 0
        self.threads = check_threads(threads)  # intra-op threads of the decode thread (``engines.decode_thread_setup``)
        self._thread = threading.Thread(target=self._run, name=f"{name}-batch", daemon=True)
        self._thread.start()

    # ---- the caller's side (event loop) ----

    async def generate(self, prompt_ids: List[int], params: SamplingParams) -> AsyncIterator[Step]:
        if not prompt_ids:  # checked here, not in the shared forward: it would fail every row of that step
            raise ValueError("prompt_ids: empty (at least one token)")
        total = min(len(prompt_ids) + params.max_tokens, self.max_seq_len)
        if total <= len(prompt_ids):
            return
        need = self.slots.footprint(1, total) if self.kv is not None else 0
        if self.kv is not None and need > self.kv.limit:
            raise CapacityError(f"max_tokens: {len(prompt_ids)} prompt tokens + max_tokens {params.max_tokens} need "
                                f"{need / MiB:.0f} MiB of KV cache, more than the engine's whole budget "
                                f"({self.kv.limit / MiB:.0f} MiB, kv_cache_bytes); ask for fewer tokens", 400)
        req = _EngineRequest(list(prompt_ids), params, total, asyncio.get_running_loop(), asyncio.Queue(),
                       torch.Generator().manual_seed(params.seed) if params.seed is not None else None)
        with self._cv:
            self._pending.append(req)
            self._cv.notify()
        try:
            first = True
            while True:
                item = await (self._first_item(req) if first else req.queue.get())
                first = False
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            req.cancelled = True  # a caller that stops early (client gone) frees its slot at the next step

    async def _first_item(self, req: _EngineRequest):
        """The request's first item within ``first_token_s``; else a 429 (its slot, if it had one, freed)."""
        if not self.first_token_s:
            return await req.queue.get()
        try:
            return await asyncio.wait_for(req.queue.get(), self.first_token_s)
        except asyncio.TimeoutError:
            req.cancelled = True
            self.busy_refused += 1
            ahead = len(self._pending) + len(self.slots)
            raise CapacityError(f"busy: no first token in {self.first_token_s:g}s ({ahead} request(s) queued or "
                                "decoding on this engine); retry later", 429) from None

    def stats(self) -> dict:
        """Slots and counts, and what the router's health check reads: how long work has waited on the decode thread
        for a step (0 while idle) and whether that thread is alive."""
        busy = bool(len(self.slots) or self._pending or self._filling is not None)
        return {"active": len(self.slots), "pending": len(self._pending), "kv_blocks": self.slots.blocks,
                "max_batch": self.max_batch, "peak_batch": self.peak_batch, "steps": self.steps,
                "fused_chunks": self.fused_chunks, "kv_allocated_bytes": self.slots.allocated_bytes(),
                "kv_positions": self.slots.length, "kv_refused": self.kv_refused, "busy_refused": self.busy_refused,
                "kv_bytes_per_token": self.slots.bytes_per_position(),
                "kv_held_bytes": self.kv.held() if self.kv else None, "kv_budget_bytes": self.kv.limit if self.kv else None,
                "queue_wait_s": _quantiles(list(self.waits)),
                "last_step_age_s": round(time.monotonic() - self.last_step_at, 3) if busy else 0.0,
                "step_allowance_s": round(self.step_allowance_s(), 3) if busy else 0.0,
                "decode_thread_alive": self._thread.is_alive()}

    def score(self, batch: List[List[int]]) -> List[List[float]]:
        return last_position_logits(self.module, batch)

    # ---- the decode thread ----

    def _run(self) -> None:
        decode_thread_setup(self.threads)
        while True:
            try:
                with self._cv:
                    if not self._pending and not len(self.slots) and self._filling is None:
                        while not self._pending and not len(self.slots) and self._filling is None:
                            self._cv.wait()
                        self.last_step_at = time.monotonic()  # work arrived: its wait starts now
                self._admit_and_step()
                self._stepped()
                if not len(self.slots) and self._filling is None and self._pending:
                    with self._cv:  # the newcomers wait for KV memory other lanes hold: look again shortly
                        self._cv.wait(0.05)
            except Exception as exc:  # noqa: BLE001 - fail the requests in flight, keep the loop alive
                self.loop_errors += 1
                failed = self.slots.rows + ([self._filling] if self._filling else []) + self._chunked
                log.error("%s: batched decode failed (%s: %s); failing %d request(s)", self.name,
                          type(exc).__name__, exc, len(failed))
                for r in failed:
                    r.emit(RuntimeError(f"{type(exc).__name__}: {exc}"))
                self.slots.clear()
                self._filling, self._chunked = None, []
                self._settle()

    def _stepped(self) -> None:
        """A step (or a round of prefills) ended: its seconds a token update the allowance the next one gets."""
        now = time.monotonic()
        if self.step_tokens:
            took = now - self.last_step_at
            self.s_per_token = max(0.95 * self.s_per_token, took / self.step_tokens)
            self.step_s = max(0.95 * self.step_s, took)
        self.last_step_at, self.step_tokens = now, 0

    def step_allowance_s(self) -> float:
        """Twice what the running step should take by recent steps (0 between steps)."""
        return 2.0 * max(self.step_tokens * self.s_per_token, self.step_s) if self.step_tokens else 0.0

    def _chunks(self) -> List[Tuple[_EngineRequest, int, int]]:
        """This step's prompt chunks ``(request, start, end)``, one free slot each, at most ``prefill_chunk`` tokens in
        all: the part-prefilled prompt's next, then newcomers'. A prompt is cut only where it is longer than
        ``prefill_chunk``, and then at multiples of it (an idle engine takes its first prompt whole): a float layer's
        sums over a prompt's rows depend on how many there are, so a prompt cut where other traffic left the budget
        got another continuation than whole, as the gate decodes it (SmolLM2-135M INT8, its 80 held-out prompts served
        16 at a time: 2 of them). Such a prompt waits a step instead."""
        taken: List[Tuple[_EngineRequest, int, int]] = []
        budget, idle = self.prefill_chunk, not len(self.slots)
        self._waits_for_kv = False
        try:
            return self._take_chunks(taken, budget, idle)
        finally:
            if self.kv is not None and not self._waits_for_kv:
                self.kv.withdraw(self.name)  # no request of this lane waits for KV memory (any more)

    def _take_chunks(self, taken: List[Tuple[_EngineRequest, int, int]], budget: int, idle: bool
                     ) -> List[Tuple[_EngineRequest, int, int]]:
        while budget > 0 and len(self.slots) + len(taken) < self.max_batch:
            r = self._filling
            self._filling = None
            if r is None:
                with self._cv:
                    r = self._pending.popleft() if self._pending else None
            if r is None:
                break
            if r.cancelled:
                if r.filled:  # the part-prefilled prompt: its cache goes back
                    self.slots.unstage()
                continue
            fits = True if r.filled else self._fits(r, taken)
            if fits is None:  # refused (it waited kv_wait_s)
                continue
            if not fits:  # first in line for KV memory: the ones behind it wait too (no long prompt starves)
                self._waits_for_kv = True
                with self._cv:
                    self._pending.appendleft(r)
                break
            rest = len(r.prompt) - r.filled
            if rest <= budget or (idle and not taken and rest <= LONG_PROMPT_CHUNK):
                end = len(r.prompt)
            elif idle and not taken:  # a long prompt on an idle engine: its next LONG_PROMPT_CHUNK tokens
                end = r.filled + LONG_PROMPT_CHUNK
            elif not taken:  # the whole budget: a long prompt's next prefill_chunk tokens
                end = r.filled + budget
            else:  # it would be cut where this step's budget runs out: it goes first next step
                if r.filled:
                    self._filling = r
                else:
                    with self._cv:
                        self._pending.appendleft(r)
                break
            if not r.filled:
                self.waits.append(time.monotonic() - r.queued_at)
            taken.append((r, r.filled, end))
            budget -= end - r.filled
            if end < len(r.prompt):
                break
        return taken

    def _admit_and_step(self) -> None:
        """This step's prompt chunks (``_chunks``) and the rows' next tokens: in one forward where the module can
        (``SlotBatch.step_and_prefill``: the module's ``step_seqs``), else a prefill call per chunk, then the step. A newcomer whose prompt is
        complete joins the rows with its first token."""
        self._grow_rows()
        taken = self._chunks()
        self.step_tokens = len(self.slots) + sum(end - start for _, start, end in taken)
        if self.fused and taken:
            try:  # a failed allocation (out of memory) fails the newcomers only
                self.slots.stage([(r.prompt[a:b], a) for r, a, b in taken])
            except Exception as exc:  # noqa: BLE001 - these requests' failure, not the batch's
                self.slots.unstage()
                for r, _, _ in taken:
                    r.emit(_prefill_failed(len(self.slots), exc))
                taken = []
        if not self.fused or not taken:
            for r, start, end in taken:
                try:  # a failed allocation (out of memory) fails this request only
                    logits = self.slots.prefill(r.prompt[start:end], start)
                except Exception as exc:  # noqa: BLE001 - this request's failure, not the batch's
                    self.slots.unstage()
                    r.emit(_prefill_failed(len(self.slots), exc))
                    continue
                self._before_step()
                self._took(r, end, logits)
            self._settle()
            if len(self.slots):
                self._step()
            return
        rows = list(self.slots.rows)
        self._chunked = [r for r, _, _ in taken]
        row_logits, chunk_logits = self.slots.step_and_prefill([r.last for r in rows],
                                                               [(r.prompt[a:b], a) for r, a, b in taken])
        self._chunked = []
        self.steps += bool(rows)
        self.fused_chunks += len(taken)
        self._before_step()
        self._advance_rows(rows, row_logits)
        for (r, _, end), logits in zip(taken, chunk_logits):
            self._took(r, end, logits)
        self.peak_batch = max(self.peak_batch, len(self.slots))
        self._settle()

    def _grow_rows(self) -> None:
        """Every row's cache grows for this step where it needs to (a block more each 256 positions); a row whose cache
        cannot grow (out of memory) fails and leaves alone, and the others step on."""
        failed = self.slots.grow_rows()
        for i, exc in failed:
            r = self.slots.rows[i]
            r.done = True
            r.emit(RuntimeError(f"KV cache growth failed at position {self.slots.pos[i]}: {type(exc).__name__}: {exc}"))
        if failed:
            self.slots.release([i for i, _ in failed])
            self._settle()

    def _took(self, r: _EngineRequest, end: int, logits) -> None:
        """``r``'s prompt is in its slot up to ``end``: the rest waits for the next step, or it joins the rows."""
        r.filled = end
        if end < len(r.prompt):
            self._filling = r
        else:
            self.slots.join(r)
            self._advance(r, logits)

    def _step(self) -> None:
        rows = self.slots.rows
        self.peak_batch = max(self.peak_batch, len(rows))
        logits = self.slots.step([r.last for r in rows])
        self.steps += 1
        self._before_step()
        self._advance_rows(rows, logits)
        self._settle()

    def _advance_rows(self, rows: List[_EngineRequest], logits) -> None:
        """``_advance`` of each row; the greedy rows' tokens picked in one call (``greedy_picks``)."""
        steps = greedy_picks(logits, [None if r.cancelled else r.params for r in rows])
        for i, r in enumerate(rows):
            self._advance(r, logits[i], steps.get(i))

    def _advance(self, r: _EngineRequest, logits, step: Optional[Step] = None) -> None:
        """Pick the request's next token (or take ``step``, picked already), hand it over; mark it done when it ends."""
        if r.cancelled:
            r.done = True
            return
        try:
            step = step if step is not None else pick_token(logits, r.params, r.gen, r.history)
        except Exception as exc:  # noqa: BLE001 - e.g. non-finite logits: this request fails, the batch goes on
            r.done = True
            r.emit(RuntimeError(f"sampling failed: {type(exc).__name__}: {exc}"))
            return
        r.last, r.produced = step.token_id, r.produced + 1
        if not r.params.plain:
            r.history.append(step.token_id)
        r.emit(step)
        if step.token_id == r.params.stop_token_id or len(r.prompt) + r.produced >= r.total:
            r.done = True
            r.emit(None)

    def _admitted(self) -> List[_EngineRequest]:
        """The requests holding KV memory: the rows and a part-prefilled newcomer."""
        return self.slots.rows + ([self._filling] if self._filling is not None else [])

    def _worst_case(self, requests: List[_EngineRequest]) -> int:
        """The KV bytes ``requests`` may come to: each its prompt + max_tokens, in whole blocks."""
        return sum(self.slots.footprint(1, q.total) for q in requests)

    def _fits(self, r: _EngineRequest, taken: List[Tuple[_EngineRequest, int, int]]) -> Optional[bool]:
        """Whether ``r`` may join (with this step's ``taken`` chunks): with a KV budget, the lanes' worst case with it
        must fit, and the budget is held for it now. One that has waited ``kv_wait_s`` gets a 429 instead (None)."""
        if self.kv is None:
            return True
        if self.kv.hold(self.name, self._worst_case(self._admitted() + [t[0] for t in taken] + [r]), r.queued_at):
            return True
        if time.monotonic() - r.queued_at >= self.kv_wait_s:
            self.kv.withdraw(self.name)
            self.kv_refused += 1
            r.cancelled = True
            r.emit(CapacityError(f"kv_cache: no KV memory came free for this request in {self.kv_wait_s:g}s "
                                 f"(budget {self.kv.limit / MiB:.0f} MiB, {len(self._admitted())} sequences hold it); "
                                 "retry later", 429))
            return None
        return False

    def _settle(self) -> None:
        """Finished and cancelled rows leave (their caches' blocks go back); with a KV budget, what the lane holds
        falls to what the rest may still need."""
        self.slots.drop(_leaves)
        if self.kv is not None:  # (a request ``_fits`` held memory for may have failed or been put back since)
            self.kv.hold(self.name, self._worst_case(self._admitted()))

    def _before_step(self) -> None:
        if self.step_hook is not None:
            self.step_hook(self.steps)


def _quantiles(values: List[float]) -> dict:
    """The median and 99th percentile of ``values`` (nearest rank), rounded; empty when there are none."""
    return {q: round(percentile(values, float(q)), 4) for q in ("0.5", "0.99")} if values else {}


def _prefill_failed(rows: int, exc: BaseException) -> RuntimeError:
    return RuntimeError(f"prefill failed ({rows} sequences decoding): {type(exc).__name__}: {exc}")


def policy_engine(module, max_seq_len: int, name: str, max_batch: int = 32, prefill_chunk: int = 64, threads: int = 1,
                  lanes: int = 1, kv_cache_bytes: Optional[int] = None, kv_wait_s: float = 20.0,
                  first_token_s: Optional[float] = None,
                  step_hooks: Callable[..., Optional[Callable[[int], None]]] = lambda name, hang_too=True: None):
    """The batched engine when the module has ``decode_batch`` (artifacts since batched decode), in ``lanes`` lanes
    (``Lanes``; 0: one per ``threads`` usable cores) that share ``max_batch`` between them (so their KV caches hold no
    more slots than one lane's would), else the one-sequence-at-a-time engine, with one log line naming why."""
    from policy_bundle.serve.variants.engines import CachedPolicyEngine

    if hasattr(module, "decode_batch"):
        total = max(1, max_batch)
        n = lane_count(lanes, threads, total)
        sizes = [total // n + (i < total % n) for i in range(n)]
        kv = None
        if kv_cache_bytes is not None:  # one budget over every lane (0: ``auto_kv_budget``)
            kv = KvBudget(kv_cache_bytes or auto_kv_budget())
            log.info("%s: KV cache budget %.0f MiB over %d lane(s), grown by %d positions", name, kv.limit / MiB, n,
                     KV_BLOCK)
        names = [name if n == 1 else f"{name}-lane{i}" for i in range(n)]
        engines = [BatchedEngine(module, max_seq_len, lane, max_batch=size, prefill_chunk=prefill_chunk,
                                 threads=threads, kv=kv, kv_wait_s=kv_wait_s, first_token_s=first_token_s,
                                 step_hook=step_hooks(lane))
                   for lane, size in zip(names, sizes)]
        if n == 1:
            return engines[0]
        log.info("%s: %d decode lanes of %d intra-op thread(s), %s sequences at most", name, n, threads,
                 " + ".join(map(str, sizes)))
        return Lanes(engines, name)
    log.warning("%s: the artifact has no decode_batch (exported before batched decode): decoding one "
                "sequence at a time; rebuild the bundle for continuous batching", name)
    # the sequential engine takes ``slow`` only: its steps are counted per request, on a pool thread
    return CachedPolicyEngine(module, max_seq_len, name + "-sequential", threads,
                              step_hooks(name + "-sequential", False))
