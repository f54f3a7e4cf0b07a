"""The two variants as one pool: health (probed by a loop, cached for readers), down/up state, the
request timeout, the dropped-connection retry and fail-over, for plain and streamed requests alike;
and admission, counted for every call the router makes (client, shadow, golden canary)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import AsyncIterator, Awaitable, Callable, Dict, List, Optional, Tuple, TypeVar

from policy_bundle.serve import wire
from policy_bundle.serve.schemas import ApiError

log = logging.getLogger("policy_bundle.router")
VARIANTS = ("int8", "fp16")
T = TypeVar("T")


def other_variant(name: str) -> str:
    return "fp16" if name == "int8" else "int8"


class VariantDown(RuntimeError):
    """The variant a request waited for was marked down by the health loop."""


class StreamFailed(RuntimeError):
    """A variant's stream reported an error in-band, or was cut off."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.error_code = status


def client_error(exc: BaseException) -> Optional[ApiError]:
    """A variant's 4xx answer (a request it refuses) as the client's error: not a variant failure. A 429 (its engine's
    KV memory did not come free in time) keeps its status, with ``Retry-After``."""
    code = int(getattr(exc, "error_code", 0) or 0)
    if 400 <= code < 500:
        text = str(exc)[:500]
        param = next((f for f in ("logit_bias", "top_logprobs", "presence_penalty", "frequency_penalty", "max_tokens",
                                  "kv_cache") if f in text), "prompt")  # the field the variant's check names
        if code == 429:
            return ApiError(429, f"{param}: {text}", param, code="rate_limited", headers={"Retry-After": "2"})
        return ApiError(400, f"{param}: refused by the variant: {text}", param, code="invalid_request_error")
    return None


async def cancelled(task: asyncio.Future, grace_s: float = 5.0) -> None:
    """Cancel ``task`` and wait (at most ``grace_s``) until it has stopped, whatever it raised: a cancelled
    ``__anext__`` still running would make the generator's ``aclose()`` a RuntimeError."""
    task.cancel()
    await asyncio.wait({task}, timeout=grace_s)
    if task.done() and not task.cancelled():
        task.exception()  # retrieved: no "exception was never retrieved" warning


async def close_streams(*streams, tries: int = 40) -> None:
    """``aclose()`` each async generator; a failure to close is logged, never raised (its request is over).
    A generator whose cancelled step is still unwinding ("already running") is closed once it has."""
    for stream in streams:
        for attempt in range(tries):
            try:
                await stream.aclose()
            except RuntimeError as exc:
                if "already running" in str(exc) and attempt < tries - 1:
                    await asyncio.sleep(0.05)
                    continue
                log.warning("closing a stream failed: %s: %s", type(exc).__name__, exc)
            except Exception as exc:  # noqa: BLE001 - closing is cleanup: it must not turn an answer into a 500
                log.warning("closing a stream failed: %s: %s", type(exc).__name__, exc)
            break


class Admission:
    """In-flight calls against a cap: the check and the count are one step (no await between them).

    Background calls (shadow, golden canary) count too, but at most ``background_cap`` of them at once, so
    that with ``max_inflight`` = client concurrency + ``background_slots`` clients never meet a 429 that
    the canary caused."""

    def __init__(self, cap: int, background_cap: int, on_change: Callable[[int, int], None]):
        self.cap, self.background_cap, self.on_change = cap, background_cap, on_change
        self.inflight = self.background = self.peak = self.background_peak = 0

    def try_acquire(self, background: bool = False, count: int = 1) -> bool:
        """``count`` slots at once (a request with ``n`` choices holds ``n``), or none."""
        if self.inflight + count > self.cap or (background and self.background + count > self.background_cap):
            return False
        self.inflight += count
        self.background += count if background else 0
        self.peak = max(self.peak, self.inflight)
        self.background_peak = max(self.background_peak, self.background)
        self.on_change(self.inflight, self.peak)
        return True

    def release(self, background: bool = False, count: int = 1) -> None:
        self.inflight -= count
        self.background -= count if background else 0
        self.on_change(self.inflight, self.peak)


class VariantPool:
    def __init__(self, services: Dict[str, object], settings, note: Callable[[str, str, dict], None],
                 on_error: Callable[[str, BaseException, bool], None], metrics, expected_manifest: Optional[str] = None):
        self.services, self.settings, self.note, self.on_error, self.metrics = services, settings, note, on_error, metrics
        self.expected_manifest = expected_manifest  # the router's pair: a variant serving another build is not ready
        self.health: Dict[str, dict] = {n: {"ready": False, "error": "not probed yet"} for n in VARIANTS}
        self.engines: Dict[str, str] = {}  # variant -> the engine its last health reported
        self.down: set = set()
        self.ever_ready: set = set()
        self.probe_failures: Dict[str, int] = {}
        self.down_events: Dict[str, asyncio.Event] = {}
        self.was_fully_ready = False  # both variants were ready on their expected engines at some probe

    # -- health --------------------------------------------------------------------------------
    async def _probe(self, name: str) -> dict:
        try:
            return await self._retry_dropped(lambda: asyncio.wait_for(self.services[name].to_async.health(),
                                                                      self.settings.health_timeout_s))
        except Exception as exc:  # noqa: BLE001 - a dead variant is a state to report, not raise
            return {"ready": False, "error": f"{type(exc).__name__}: {exc}"[:300],
                    "timed_out": isinstance(exc, asyncio.TimeoutError)}

    async def refresh(self) -> Dict[str, dict]:
        """Probe both variants; update the cached health and the down/up state (with history events)."""
        results = dict(zip(VARIANTS, await asyncio.gather(*[self._probe(n) for n in VARIANTS])))
        for name, health in results.items():
            health["probed_at"] = round(time.time(), 3)
            sha = health.get("manifest_sha256")
            if self.expected_manifest and sha and sha != self.expected_manifest:  # a variant restarted on a newer build
                health.update(ready=False, error=f"serves manifest {sha[:12]}, not the router's pair "
                                                 f"{self.expected_manifest[:12]} (restart the router with one build)")
            stalled = self._stalled(health)
            if stalled:  # the probe answers, the engine does not: as good as a probe that timed out
                health.update(ready=False, error=stalled, timed_out=True, stalled=True)
            ready = bool(health.get("ready"))
            self.probe_failures[name] = 0 if ready else self.probe_failures.get(name, 0) + 1
            if ready:
                self.ever_ready.add(name)
            # Down once a variant that was ready stops answering its probe (a SIGKILLed worker: the arbiter
            # keeps its socket open, so the probe times out), or refuses connections 3 probes in a row.
            down = not ready and (health.get("timed_out") or self.probe_failures[name] >= 3)
            if down and name in self.ever_ready and name not in self.down:
                self.down.add(name)
                self.note("variant-down", f"{name}: {health.get('error')}", {"variant": name})
            elif ready and name in self.down:
                self.down.discard(name)
                self.down_events[name] = asyncio.Event()
                self.note("variant-up", f"{name}: ready again", {"variant": name})
            if name in self.down and health.get("timed_out"):
                self.down_events.setdefault(name, asyncio.Event()).set()  # fail waiting requests over now
        self.health = results
        for name, health in results.items():
            self.metrics.set_variant(name, bool(health.get("ready")) and name not in self.down, health.get("batch"))
        self.was_fully_ready = self.was_fully_ready or self.fully_ready()
        self.metrics.fp16_fallback.set(1.0 if results["fp16"].get("fallback") else 0.0)
        self._report_engines(results)
        return results

    def _stalled(self, health: dict) -> Optional[str]:
        """Why a variant whose health endpoint answers cannot serve: its engine is dead, its decode thread died, or
        work has waited ``health_timeout_s`` with no decode step (a hung kernel, a deadlock). None when it can."""
        if health.get("engine_state") == "dead":
            return "its engine stopped (vLLM's engine core is dead)"
        batch = health.get("batch") or {}
        if batch.get("decode_thread_alive") is False:
            return "its decode thread died"
        waiting = batch.get("active", 0) + batch.get("pending", 0)
        age = batch.get("last_step_age_s") or 0.0
        # a step that runs long because it is large (a long prompt's chunk) is not a hang: it gets twice what its
        # tokens took lately (``step_allowance_s``) beyond health_timeout_s
        limit = self.settings.health_timeout_s + (batch.get("step_allowance_s") or 0.0)
        if waiting and age > limit:
            return f"stalled: no decode step for {age:.1f}s while {waiting} request(s) wait"
        return None

    def _report_engines(self, results: Dict[str, dict]) -> None:
        """policy_variant_engine: 1 for each variant's engine; a replaced engine's series goes to 0."""
        for name, health in results.items():
            engine = health.get("engine")
            if engine and engine != self.engines.get(name):
                if name in self.engines:
                    self.metrics.engine.labels(variant=name, engine=self.engines[name]).set(0.0)
                self.metrics.engine.labels(variant=name, engine=engine).set(1.0)
                self.engines[name] = engine

    def fully_ready(self) -> bool:
        """Both variants ready, each on the engine it is meant to run."""
        return all(h.get("ready") and h.get("expected_engine", True) for h in self.health.values())

    def ready(self) -> bool:
        """Ready to take traffic: both variants fully ready at least once (a router that never came up whole, a
        variant on a fallback engine it was not meant to run, is a deployment to look at), then while either one
        is ready and not down: fail-over serves every request when one restarts (``degraded`` says which)."""
        return self.fully_ready() or (self.was_fully_ready and any(
            self.health[n].get("ready") for n in VARIANTS if n not in self.down))

    def degraded(self) -> List[str]:
        """The variants that cannot serve now (down, or not ready)."""
        return [n for n in VARIANTS if n in self.down or not self.health[n].get("ready")]

    # -- calls ---------------------------------------------------------------------------------
    async def _retry_dropped(self, make_call):
        """Once more if the connection was dropped under the call: BentoML's dependency client closes its
        session under in-flight calls (bentoml/BentoML#5540, #5544) and idle keep-alive connections race
        with the server closing them; generation is pure, so a retry is safe."""
        import aiohttp

        try:
            return await make_call()
        except aiohttp.ClientConnectionError:
            return await make_call()

    async def _unless_down(self, name: str, call):
        """``call`` within the request timeout, given up as soon as the health loop marks ``name`` down."""
        down = self.down_events.setdefault(name, asyncio.Event())
        task, waiter = asyncio.ensure_future(call), asyncio.ensure_future(down.wait())
        try:
            done, _ = await asyncio.wait({task, waiter}, timeout=self.settings.request_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the request itself is cancelled (client gone): so is its call
            task.cancel()
            raise
        finally:
            waiter.cancel()
        if task in done:
            return task.result()
        await cancelled(task)  # a stream's step must have stopped before its generator can be closed
        if waiter in done:
            raise VariantDown(f"{name} failed its health probe while this request waited for it")
        raise asyncio.TimeoutError(f"{name} did not answer in {self.settings.request_timeout_s}s")

    async def call(self, name: str, **kwargs) -> dict:
        """A plain (non-streaming) generation; the variant stops it a second after this router would have given up
        on it (``deadline_s``), so a timed-out or failed-over call does not decode on to ``max_tokens``."""
        deadline = self.settings.request_timeout_s + 1.0 if self.settings.request_timeout_s else None
        return await self._retry_dropped(
            lambda: self._unless_down(name, self.services[name].to_async.generate(**kwargs, deadline_s=deadline)))

    def order(self, preferred: str, forced: bool) -> List[str]:
        """Preferred first (unless it is down and the other is not), the other as fail-over unless forced."""
        if forced:
            return [preferred]
        other = other_variant(preferred)
        if preferred in self.down and other not in self.down:
            self.metrics.rerouted.labels(variant=preferred).inc()
            return [other, preferred]
        return [preferred, other]

    async def _fail_over(self, preferred: str, forced: bool, attempt: Callable[[str], Awaitable[T]]) -> Tuple[str, T]:
        """``attempt(name)`` on each variant in ``order`` until one answers. A variant's 4xx is the client's
        error, raised at once; any other failure is reported (``on_error``) and the next variant tried."""
        last: Optional[BaseException] = None
        for name in self.order(preferred, forced):
            try:
                return name, await attempt(name)
            except Exception as exc:  # noqa: BLE001 - any variant failure is retried on the other
                refused = client_error(exc)
                if refused is not None:
                    raise refused from None
                last = exc
                self.on_error(name, exc, not forced)  # a forced variant's failure is no rollout evidence
        raise _unavailable(last)

    async def generate(self, preferred: str, forced: bool, choices: List[dict]) -> Tuple[str, List[dict]]:
        """Every choice's generation, side by side on one variant (the variant batches them); the whole request
        fails over together, so one variant answers all of its choices."""
        return await self._fail_over(preferred, forced, lambda name: _all([self.call(name, **kw) for kw in choices]))

    async def open_stream(self, preferred: str, forced: bool,
                          choices: List[dict]) -> Tuple[str, List[Tuple[Optional[dict], AsyncIterator[dict]]]]:
        """The first step of every choice's stream from the first variant that gives them all (fail-over before
        any token is sent, with the same down check, timeout and dropped-connection retry as plain calls); then
        the rest, one stream per choice. A variant that opens some of them and fails another has its opened
        streams closed."""
        async def opened(name: str):
            tasks = [asyncio.ensure_future(self._retry_dropped(lambda kw=kw: self._first_step(name, kw)))
                     for kw in choices]
            try:
                return await _all(tasks)
            except BaseException:
                await close_streams(*[t.result()[1] for t in tasks
                                      if t.done() and not t.cancelled() and t.exception() is None])
                raise
        return await self._fail_over(preferred, forced, opened)

    async def _first_step(self, name: str, kwargs: dict) -> Tuple[Optional[dict], AsyncIterator[dict]]:
        """A new stream from ``name`` and its first step; the stream is closed if that fails (nothing was sent)."""
        steps = self._steps(name, kwargs)
        try:
            return await self.next_step(name, steps), steps
        except Exception:
            await close_streams(steps)
            raise

    async def _steps(self, name: str, kwargs: dict) -> AsyncIterator[dict]:
        """A variant's stream as steps; its in-band error line, or an end without the end marker (a worker
        that died mid-stream), raises."""
        reader = wire.LineReader()

        async def lines():
            async with contextlib.aclosing(self.services[name].to_async.stream(**kwargs)) as chunks:
                async for chunk in chunks:
                    for step in reader.feed(chunk):
                        yield step
            for step in reader.finish():
                yield step
        try:
            async with contextlib.aclosing(lines()) as steps:
                async for step in steps:
                    if "error" in step:
                        raise StreamFailed(f"{name}: {step['error']}", step.get("status", 500))
                    if step.get("done"):
                        return
                    yield step
        except wire.CutOff as exc:
            raise StreamFailed(f"{name}: {exc} (cut off)", 502) from None
        raise StreamFailed(f"{name}: the stream ended without its end marker (cut off)", 502)

    async def next_step(self, name: str, steps: AsyncIterator[dict]) -> Optional[dict]:
        """The next step of a started stream (None at its end), bounded like any call."""
        try:
            return await self._unless_down(name, steps.__anext__())
        except StopAsyncIteration:
            return None


async def interleaved(gens: list) -> AsyncIterator:
    """The items of several async generators as each comes (the next of each is awaited side by side); on the
    first failure, or when closed, the others' pending steps are cancelled and every generator is closed."""
    nexts = {asyncio.ensure_future(g.__anext__()): g for g in gens}
    try:
        while nexts:
            done, _ = await asyncio.wait(nexts, return_when=asyncio.FIRST_COMPLETED)
            for task in [t for t in nexts if t in done]:  # in the generators' order when several are done
                gen = nexts.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                nexts[asyncio.ensure_future(gen.__anext__())] = gen
                yield item
    finally:
        for task in nexts:
            await cancelled(task)
        for gen in gens:
            with contextlib.suppress(Exception):
                await gen.aclose()


async def _all(calls) -> list:
    """Every call's result in order; at the first failure the others are cancelled (and awaited) and it is
    raised."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except BaseException:
        for t in tasks:
            await cancelled(t)
        raise
    failed = next((t for t in tasks if t in done and not t.cancelled() and t.exception() is not None), None)
    if failed is not None:
        for t in pending:
            await cancelled(t)
        raise failed.exception()
    return [t.result() for t in tasks]


def _unavailable(last: Optional[BaseException]) -> ApiError:
    what = f" (last: {type(last).__name__})" if last is not None else ""
    return ApiError(503, f"no variant could answer{what}", code="service_unavailable", headers={"Retry-After": "1"})
