"""The live canary: what each analysis window saw (requests, errors, latencies, shadow pairs, golden runs),
the golden-set run through both variants (``quantize.fidelity.scores``'s metrics, thresholds from the bundle),
the analysis that drives the rollout, and the supervised loops that run them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from typing import Awaitable, Callable, Dict, List

from policy_bundle.bundle.info import BundleInfo
from policy_bundle.quantize.runtime.text import ids_to_text
from policy_bundle.serve.router.pool import VARIANTS, Admission, VariantPool, other_variant
from policy_bundle.serve.rollout.analysis import LATENCY_SAMPLES, GoldenTally, Window, analyse
from policy_bundle.serve.rollout.machine import RolloutController
from policy_bundle.serve.rollout.state import StoreUnavailable

log = logging.getLogger("policy_bundle.router")


class LiveCanary:
    def __init__(self, pool: VariantPool, admission: Admission, controller: RolloutController, info: BundleInfo,
                 tok, settings, metrics):
        self.pool, self.admission, self.controller, self.info = pool, admission, controller, info
        self.tok, self.settings, self.metrics = tok, settings, metrics
        self.golden = info.golden()
        self.golden_cursor = 0
        self.tally = GoldenTally(len(self.golden))
        self.window = Window(controller.epoch())
        self.tasks: Dict[str, asyncio.Task] = {}
        self.background: set = set()  # shadow calls in flight (a reference keeps each task alive)
        self.excluded = {"int8": 0, "fp16": 0}  # requests (and failures) of forced variants: not rollout evidence

    # -- recording -----------------------------------------------------------------------------
    def record(self, variant: str, seconds: float, tokens: int, evidence: bool = True) -> None:
        """A served request in the metrics; in the window too unless it is not ``evidence`` (a variant forced by the
        admin token: benchmarks and drills choose the variant, and their requests must not promote or roll back)."""
        if evidence:
            self.window.requests[variant] += 1
            lat = self.window.latencies[variant]
            lat.append(seconds)
            del lat[:-LATENCY_SAMPLES]
        else:
            self.excluded[variant] += 1
        self.metrics.requests.labels(variant=variant).inc()
        self.metrics.latency.labels(variant=variant).observe(seconds)
        self.metrics.tokens.labels(variant=variant).inc(tokens)

    def record_error(self, variant: str, exc: BaseException, evidence: bool = True) -> None:
        log.warning("variant %s failed: %s: %s", variant, type(exc).__name__, str(exc)[:200])
        if evidence:
            self.window.requests[variant] += 1
            self.window.errors[variant] += 1
        else:
            self.excluded[variant] += 1
        self.metrics.errors.labels(variant=variant).inc()

    # -- shadow --------------------------------------------------------------------------------
    def maybe_shadow(self, served: str, kwargs: dict, primary_ids: List[int], eligible: bool) -> None:
        """Send a sample of greedy requests to the other variant too; skipped (never queued) at the cap."""
        if not eligible or random.random() >= self.settings.rollout.shadow_fraction:
            return
        if other_variant(served) in self.pool.down or not self.admission.try_acquire(background=True):
            return
        self.metrics.background.labels(kind="shadow").inc()
        task = asyncio.create_task(self._shadow(served, kwargs, primary_ids))
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def _shadow(self, served: str, kwargs: dict, primary_ids: List[int]) -> None:
        other = other_variant(served)
        try:
            res = await self.pool.call(other, **kwargs)
        except Exception as exc:  # noqa: BLE001 - shadow failures count, the client already has its answer
            self.record_error(other, exc)
            return
        finally:
            self.admission.release(background=True)
        same = res["token_ids"] == primary_ids
        self.window.requests[other] += 1  # as a failed one counts a request and an error (its latency is no client's)
        self.window.shadow_pairs += 1
        self.window.shadow_same += int(same)
        self.metrics.shadow.labels(outcome="same" if same else "different").inc()

    # -- golden set ----------------------------------------------------------------------------
    async def run_golden(self) -> dict:
        """Golden items through both variants, compared with the build's FP32 completions (same metric code)."""
        from policy_bundle.quantize.reference import task
        from policy_bundle.quantize.fidelity.scores import FidelityReport, completion_metrics

        n = min(self.settings.rollout.golden_items, len(self.golden))
        if n == 0:
            raise RuntimeError("the bundle has no golden set")
        index = [(self.golden_cursor + i) % len(self.golden) for i in range(n)]
        items = [self.golden[i] for i in index]
        self.golden_cursor += n
        outs, run = {}, {"now": 0, "peak": 0}  # this run's calls in flight (its own high-water mark)
        for name in VARIANTS:
            outs[name] = [r["token_ids"] for r in await asyncio.gather(*[self._counted(self.pool.call(
                name, prompt_ids=it.prompt_ids, max_tokens=self.info.max_new_tokens, temperature=0.0,
                stop_token_id=self.tok.eos_token_id), run) for it in items])]
        reward = task.reward if self.info.has_task else None
        ref = [it.completion_ids for it in items]
        nan = float("nan")
        summaries = {name: completion_metrics(FidelityReport(n, 0, nan, nan, nan), items, ref, outs[name],
                                              lambda ids: ids_to_text(self.tok, ids), reward).summary() for name in VARIANTS}
        int8, fp16 = summaries["int8"], summaries["fp16"]
        same = [a == b for a, b in zip(ref, outs["int8"])]
        out = {"items": n, "max_in_flight": run["peak"], "greedy_agreement": int8["greedy_agreement"],
               "greedy_same": sum(same), "fp16_greedy_agreement": fp16["greedy_agreement"],
               "reward_int8": int8.get("reward_candidate"), "reward_fp16": fp16.get("reward_candidate")}
        deltas = [None] * n
        if out["reward_int8"] is not None and out["reward_fp16"] is not None:
            out["reward_delta"] = out["reward_int8"] - out["reward_fp16"]
            # per item, for the delta's confidence bound (``analysis._golden_verdict``)
            deltas = [reward(it.prompt, ids_to_text(self.tok, a)) - reward(it.prompt, ids_to_text(self.tok, b))
                      for it, a, b in zip(items, outs["int8"], outs["fp16"])]
        out["per_item"] = [[i, s, d] for i, s, d in zip(index, same, deltas)]
        return out

    def record_golden(self, run: dict) -> dict:
        """A golden run's items into the tally (``analysis.GoldenTally``), whose summary this window is judged on."""
        summary = self.tally.add(run["per_item"])
        window = self.window  # one read: an analysis may swap windows meanwhile (then the next run records it)
        window.golden = summary
        return summary

    async def _counted(self, call: Awaitable, run: dict):
        """Golden calls count against the in-flight cap as background calls (they wait for room, never skip)."""
        while not self.admission.try_acquire(background=True):
            await asyncio.sleep(0.02)
        self.metrics.background.labels(kind="golden").inc()
        run["now"] += 1
        run["peak"] = max(run["peak"], run["now"])
        try:
            return await call
        finally:
            run["now"] -= 1
            self.admission.release(background=True)

    # -- analysis ------------------------------------------------------------------------------
    def analyse_now(self) -> dict:
        """Judge this replica's window. A failing window counts against whatever state is current (INT8
        misbehaved, at any weight); a passing or inconclusive one only against the traffic split it was
        observed under, so a window that straddles a step change (another replica's promote, an operator's
        command) never promotes twice: it is dropped as ``stale`` and the next window decides. An
        inconclusive window is not thrown away: it stays open and the next analysis judges it together with
        what came after (a few shadow pairs per window at 5 % never bound the flip rate on their own). With the
        database down a failing window still counts (``RolloutController._failed_offline``: at the limit INT8 stops
        here at once); any other is kept for the next tick."""
        with contextlib.suppress(StoreUnavailable):  # else judged on this replica's state (the controller keeps
            self.controller.refresh()                # what it cannot write)
        window, self.window = self.window, Window(self.controller.epoch())
        verdict, reasons, metrics = analyse(window, self.settings.rollout, self.info.thresholds)
        try:
            if verdict != "fail" and window.epoch != self.controller.epoch():
                verdict, reasons = "stale", ["the rollout moved during this window (another replica or an operator)"]
            elif self.controller.analysing() and verdict != "idle":
                self.controller.apply(verdict, reasons, metrics, observed=None if verdict == "fail" else window.epoch)
                self.metrics.verdicts.labels(verdict=verdict).inc()
                if verdict == "inconclusive" and window.epoch == self.controller.epoch():
                    # more evidence needed at this split: the next analysis judges this window and what follows
                    self.window = window.extended(self.window)
                else:
                    self.window = Window(self.controller.epoch())
        except StoreUnavailable:
            self.window = window  # judged again once the database is back
            raise
        failures = {v: n for v, n in window.errors.items() if n}
        if failures:  # crashes and timeouts are history even when the rollout is paused or done
            self.controller.note("variant-errors", ", ".join(f"{n} {v} failure(s)" for v, n in failures.items())
                                 + " in the last window (requests retried on the other variant)", metrics)
        self.controller.flush()
        self.metrics.set_rollout(self.controller.state)
        if window.shadow_pairs:
            self.metrics.shadow_agreement.set(window.shadow_same / window.shadow_pairs)
        return {"verdict": verdict, "reasons": reasons, "metrics": metrics}

    async def golden_tick(self) -> None:
        if not self.controller.analysing():
            return
        try:
            self.record_golden(await self.run_golden())
        except Exception as exc:  # noqa: BLE001 - a broken metric source (the variants' own failures count in the pool)
            log.warning("golden canary run failed: %s", exc)
            await asyncio.to_thread(self.controller.error, f"golden canary run failed: {type(exc).__name__}: {exc}"[:300])
            return
        await asyncio.to_thread(self.controller.measured)

    async def analysis_tick(self) -> None:
        await asyncio.to_thread(self.analyse_now)

    def new_window(self) -> None:
        """The state changed (a command here, a transition elsewhere): later evidence is at the new weight."""
        if self.window.epoch != self.controller.epoch():
            self.window = Window(self.controller.epoch())

    async def sync_tick(self) -> None:
        """Re-read the shared state (a transition made on another replica is obeyed within one tick) and write
        notes the database missed; a changed state starts a new window."""
        if await asyncio.to_thread(self.controller.refresh):
            self.new_window()
            log.info("rollout state changed elsewhere: INT8 at %.1f%% (%s)", self.controller.state.weight,
                     self.controller.state.status)
        self.metrics.set_rollout(self.controller.state)

    # -- supervised loops ----------------------------------------------------------------------
    def ensure_loops(self, loops: Dict[str, tuple], first: Dict[str, float]) -> None:
        """Start each ``name -> (interval_s, tick)`` loop (its first tick after ``first[name]`` seconds, else
        one interval), and start again any that has ended."""
        for name, (interval, tick) in loops.items():
            task = self.tasks.get(name)
            if task is None or task.done():
                if task is not None:
                    log.error("%s loop had stopped; restarted", name)
                self.tasks[name] = asyncio.create_task(self._loop(name, interval, tick, first.get(name, interval)))

    async def _loop(self, name: str, interval: float, tick: Callable[[], Awaitable[None]], delay: float) -> None:
        """Run ``tick`` every ``interval`` seconds; an exception is logged and counted, never the end of it."""
        while True:
            await asyncio.sleep(delay)
            delay = interval
            try:
                await tick()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a loop that dies silently stops rollbacks: keep going
                log.exception("%s loop: %s: %s (the loop continues)", name, type(exc).__name__, exc)
                self.metrics.loop_errors.labels(loop=name).inc()
