"""Staged INT8 rollout of one bundle pair: steps with pause durations, analysis verdicts, operator commands.

The state lives in the rollout database (``state``, serve/rollout/state.py), one row per bundle pair. Every change is a
compare-and-set from the version this replica last read: an analysis verdict applies only to the state its
window was observed under (a verdict another replica beat is dropped, never applied twice), and an operator
command re-reads and retries, so replicas never undo each other. Each replica re-reads the state every
``sync_interval_s`` and so obeys a transition made on any replica.

The database can be away. A replica that starts without it serves FP16 only (status ``database-unreachable``) and
adopts the state once it answers. While it is away, a stop (an operator's rollback or abort, or the rollback
``failure_limit`` failed analyses decide) applies on this replica at once, the safe direction, and is written
over whatever the row holds when the database is back. A row older than the one this replica last saw (a restored
backup) is adopted with one log line instead of failing every compare-and-set.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from dataclasses import asdict, replace
from typing import List, Optional

from policy_bundle.serve.rollout.state import BundlePair, Event, RolloutDatabase, StateConflict, StoreUnavailable
from policy_bundle.serve.rollout.outage import DatabaseOutage
from policy_bundle.serve.rollout.types import ACTIONS, ANALYSED, STOPPED, RolloutConfig, RolloutState

UNREACHABLE = "database-unreachable"  # the status of a replica that started without its database: FP16 only
STOPS = ("rollback", "abort")

log = logging.getLogger("policy_bundle.router")


class RolloutController(DatabaseOutage):
    """This replica's view of one pair's rollout; every change goes through the database first."""

    def __init__(self, db: RolloutDatabase, pair: BundlePair, cfg: RolloutConfig, replica: str = ""):
        self.db, self.pair, self.cfg, self.replica = db, pair, cfg, replica
        self.lock = threading.Lock()
        self.flush_lock = threading.Lock()
        self.pending: deque = deque(maxlen=10000)  # notes not yet written (the database was down)
        self.local_stop: Optional[Event] = None  # a stop applied here while the database was away, to be written
        self.offline_failures = 0  # failed analyses this replica could not write (the database away)
        self.unreachable_since: Optional[float] = None
        try:
            loaded = db.load(pair)
        except StoreUnavailable as exc:
            log.error("the rollout database cannot be reached (%s): serving FP16 only until it answers", exc)
            self.resumed, self.state, self.version = False, RolloutState(status=UNREACHABLE), 0
            self.unreachable_since = time.time()
            return
        self._adopt(loaded)

    def _adopt(self, loaded: Optional[tuple]) -> None:
        self.resumed = loaded is not None
        self.state, self.version = (RolloutState.from_body(loaded[0]), loaded[1]) if loaded else (RolloutState(), 0)
        if not loaded and self.cfg.auto_start:
            self._create()

    def _create(self) -> None:
        now = time.time()
        first = RolloutState(weight=self.cfg.steps[0].weight, step_index=0, status=self._status_at(0),
                             step_entered_at=now, updated_at=now)
        event = Event(now, "start", 0.0, first.weight, f"rollout of {self.pair.label} started at the first step",
                      {}, self.replica)
        if self.db.create(self.pair, asdict(first), event) is None:  # another replica started it
            self.refresh()
        else:
            self.state, self.version = first, 1

    def analysing(self) -> bool:
        return self.state.status in ANALYSED

    def stopped(self) -> bool:
        return self.state.status in (*STOPPED, UNREACHABLE) or (self.state.status == "paused" and self.state.paused_from in STOPPED)

    def epoch(self) -> tuple:
        """What an analysis window's evidence depends on: the traffic split and when this step began. Bookkeeping
        transitions (waiting, a failed analysis counted) bump the version but not this."""
        return self.state.step_index, self.state.weight, self.state.step_entered_at

    # -- reading -------------------------------------------------------------------------------
    def refresh(self) -> bool:
        """Re-read the shared state; True when another replica (or an operator there) changed it, or the database
        came back (its state adopted, or this replica's stop written over it)."""
        if self.unreachable_since is not None:
            if not self._reach():
                return False
            if self.local_stop is None:
                self.flush()
                return True
        if self.local_stop is not None:
            return self._write_local_stop()
        loaded = self.db.load(self.pair)
        self.flush()
        with self.lock:  # only a newer row: a commit made here while the row was read must not be undone
            if loaded is not None and loaded[1] < self.version:
                again = self.db.load(self.pair)  # under the lock: no commit of ours lies between
                if again is not None and again[1] < self.version:
                    log.warning("the rollout row of %s went back from version %d to %d (a restored database?): "
                                "adopting it", self.pair.label, self.version, again[1])
                    self.state, self.version = RolloutState.from_body(again[0]), again[1]
                    return True
                return False
            if loaded is None or loaded[1] == self.version:
                return False
            self.state, self.version = RolloutState.from_body(loaded[0]), loaded[1]
            return True

    # -- writing -------------------------------------------------------------------------------
    def _commit(self, event: str, reason: str, metrics: dict, **changes) -> None:
        """One compare-and-set from ``self.version``; memory changes only after the database did."""
        now = time.time()
        if "step_index" in changes and changes["step_index"] != self.state.step_index:
            changes.setdefault("step_entered_at", now)
        new = replace(self.state, updated_at=now, **changes)
        e = Event(now, event, self.state.weight, new.weight, reason, metrics, self.replica)
        if self.version == 0:  # no rollout yet (auto_start: false): an operator's command creates it
            if self.db.create(self.pair, asdict(new), e) is None:
                raise StateConflict("another replica created this pair's rollout first")
            self.version = 1
        else:
            self.version = self.db.transition(self.pair, self.version, asdict(new), e)
        self.state = new

    def _status_at(self, index: int) -> str:
        return "awaiting-promote" if self.cfg.steps[index].indefinite else "progressing"

    def _to_step(self, index: int, event: str, reason: str, metrics: dict, **changes) -> None:
        index = max(0, min(index, len(self.cfg.steps) - 1))
        self._commit(event, reason, metrics, weight=self.cfg.steps[index].weight, step_index=index,
                     status=changes.pop("status", self._status_at(index)), **changes)

    def apply(self, verdict: str, reasons: List[str], metrics: dict, observed: Optional[tuple] = None) -> bool:
        """Apply one window's verdict to the state it was observed under (``observed``, an ``epoch``); False when
        the traffic split had moved on (the verdict is dropped: the next window decides) or nothing changed. A
        conflict with another replica's bookkeeping (same epoch) is re-read and decided again."""
        for _ in range(5):
            with self.lock:
                if observed is not None and observed != self.epoch():
                    return False
                if self.state.status not in ANALYSED:  # operator pause, rollback, promoted: hands off
                    return False
                try:
                    return self._decide(verdict, "; ".join(reasons), metrics)
                except StateConflict:
                    log.info("verdict %s: another replica changed the rollout first; re-read", verdict)
                except StoreUnavailable:
                    if verdict != "fail":
                        raise
                    return self._failed_offline("; ".join(reasons))
            self.refresh()
        return False

    def _decide(self, verdict: str, why: str, metrics: dict) -> bool:
        s, cfg = self.state, self.cfg
        counters: dict = {}  # consecutive_errors is reset by a golden run that measured (``measured``), not here
        if verdict == "fail":
            failures = s.consecutive_failures + 1
            if failures >= cfg.failure_limit:
                self._commit("rollback", f"{cfg.failure_limit} failed analyses: {why}", metrics, weight=0.0,
                             status="rolled-back", step_index=-1, consecutive_failures=0)
            else:
                self._commit("analysis-failed", why, metrics, consecutive_failures=failures,
                             consecutive_inconclusive=0, **counters)
            return True
        if verdict == "inconclusive":
            n = s.consecutive_inconclusive + 1
            if n >= cfg.inconclusive_limit:
                self._commit("pause", f"{n} inconclusive analyses in a row ({why}): an operator decides", metrics,
                             status="paused", paused_from=s.status, consecutive_inconclusive=0, **counters)
            else:
                self._commit("waiting", f"inconclusive: {why}", metrics, consecutive_inconclusive=n,
                             status="waiting" if s.status == "progressing" else s.status, **counters)
            return True
        reset = dict(consecutive_failures=0, consecutive_inconclusive=0, **counters)
        step = cfg.steps[max(s.step_index, 0)]
        dwell = time.time() - s.step_entered_at
        if s.status in ("held", "awaiting-promote") or dwell < step.pause_s:  # passing analyses keep the weight
            if any((s.consecutive_failures, s.consecutive_inconclusive)) or s.status == "waiting":
                self._commit("analysis-passed", f"analysis passed; stays at {s.weight:g} %", metrics, **reset,
                             status="progressing" if s.status == "waiting" else s.status)
                return True
            return False
        if s.step_index + 1 >= len(cfg.steps):
            self._commit("promoted", "all steps passed", metrics, status="promoted", **reset)
        else:
            self._to_step(s.step_index + 1, "promote", "analysis passed", metrics, **reset)
        return True

    def error(self, reason: str) -> None:
        """A metric source failed to measure (a golden canary run raised): ``consecutive_error_limit`` in a row
        abort the rollout, as a broken analysis must not keep traffic on an unjudged policy."""
        with self.lock:
            if self.state.status not in ANALYSED:
                return
            n = self.state.consecutive_errors + 1
            try:
                if n >= self.cfg.consecutive_error_limit:
                    self._commit("abort", f"{n} metric-source errors in a row: {reason}", {}, weight=0.0,
                                 status="aborted", step_index=-1, consecutive_errors=0)
                else:
                    self._commit("analysis-error", reason, {}, consecutive_errors=n)
                return
            except StateConflict:  # another replica moved first: re-read; the next failed run counts again
                log.info("metric-source error not recorded: another replica changed the rollout first")
        self.refresh()

    def measured(self) -> None:
        """A golden canary run measured: the metric source works again."""
        if self.state.consecutive_errors and self.state.status in ANALYSED:
            with self.lock:
                try:
                    self._commit("analysis-measured", "the golden canary measured again", {}, consecutive_errors=0)
                    return
                except StateConflict:  # re-read; the next golden run that measures resets it
                    log.info("error count not reset: another replica changed the rollout first")
            self.refresh()

    def note(self, event: str, reason: str, metrics: dict) -> None:
        """Record something that happened without a transition (e.g. variant failures), in any status. Only
        queued here (callers may sit on the event loop): the next refresh (every sync tick) writes it, and keeps
        it while the database is down."""
        self.pending.append(Event(time.time(), event, self.state.weight, self.state.weight, reason, metrics,
                                  self.replica))

    def flush(self) -> None:
        """Write the queued notes; one writer at a time, and exactly what was written leaves the queue."""
        with self.flush_lock:
            batch = list(self.pending)
            if not batch:
                return
            try:
                self.db.append(self.pair, batch)
            except StoreUnavailable as exc:
                log.warning("%d rollout note(s) kept until the database is back: %s", len(batch), exc)
                return
            for _ in batch:
                self.pending.popleft()

    # -- operator commands ---------------------------------------------------------------------
    def command(self, action: str, weight: Optional[float] = None, reason: str = "operator") -> RolloutState:
        """An operator's command on the newest state (re-read, applied, retried if a replica moved first)."""
        if action not in ACTIONS:
            raise ValueError(f"action: {action!r} is not one of {', '.join(ACTIONS)}")
        for attempt in range(50):
            try:
                self.refresh()
                with self.lock:
                    try:
                        self._operate(action, weight, reason)
                        return self.state
                    except StateConflict:
                        log.info("%s: another replica changed the rollout first; retrying on the newest state", action)
            except StoreUnavailable:
                if action not in STOPS:  # only the safe direction goes ahead without the database
                    raise
                with self.lock:
                    self._stop_locally(action, reason)
                return self.state
            time.sleep(random.uniform(0, 0.005 * min(attempt + 1, 8)))  # replicas racing: back off, re-read
        raise StateConflict(f"{action}: the rollout state kept changing under this command; try again")

    def _operate(self, action: str, weight: Optional[float], reason: str) -> None:
        s, last = self.state, len(self.cfg.steps) - 1
        if action == "promote":
            if s.status in (*STOPPED, "not-started"):
                raise ValueError(f"action: promote needs a rollout in progress (it is {s.status}; restart it first)")
            if s.step_index >= last:
                self._commit("promote", reason, {}, weight=self.cfg.steps[last].weight, step_index=last,
                             status="promoted")
            else:  # into an indefinite step: it waits for the next promote
                self._to_step(s.step_index + 1, "promote", reason, {}, paused_from="")
        elif action == "pause":
            if s.status not in ANALYSED:
                raise ValueError(f"action: pause needs a rollout in progress (it is {s.status}; restart it first)")
            self._commit("pause", reason, {}, status="paused", paused_from=s.status)
        elif action == "resume":
            if s.status != "paused":
                raise ValueError(f"action: resume needs a paused rollout (it is {s.status})")
            back = s.paused_from if s.paused_from in ANALYSED else self._status_at(max(s.step_index, 0))
            self._commit("resume", reason, {}, status="progressing" if back == "waiting" else back,
                         consecutive_inconclusive=0, paused_from="")
        elif action in ("rollback", "abort"):
            self._commit(action, reason, {}, weight=0.0, status="rolled-back" if action == "rollback" else "aborted",
                         step_index=-1)
        elif action == "set-weight":
            idx = max([i for i, st in enumerate(self.cfg.steps) if st.weight <= weight] or [-1])
            self._commit("set-weight", reason, {}, weight=float(weight), status="held", step_index=idx,
                         consecutive_failures=0)
        else:  # restart
            self._to_step(0, "start", reason, {}, consecutive_failures=0, consecutive_inconclusive=0,
                          consecutive_errors=0, step_entered_at=time.time())

