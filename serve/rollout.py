"""Staged INT8 rollout: state and history in SQLite, analysis windows, promote / pause / roll back.

The store's interface is narrow (load state, save state + append event, read history) so a shared
store can replace SQLite when the router runs on more than one host.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import List, Optional, Tuple

from policy_bundle.quantize.fidelity import FidelityReport, GateThresholds, evaluate_gate


@dataclass(frozen=True)
class RolloutConfig:
    steps: Tuple[float, ...] = (1.0, 5.0, 25.0, 50.0, 100.0)  # % of traffic on INT8
    analysis_interval_s: float = 30.0
    min_samples: int = 20  # INT8-served requests (or golden items) an analysis needs
    failure_limit: int = 2  # failed analyses in a row before rolling back to 0 %
    max_error_rate: float = 0.05
    max_p99_latency_ratio: float = 3.0  # INT8 p99 / FP16 p99
    thresholds: Optional[GateThresholds] = None  # None: the bundle's own gate thresholds
    shadow_fraction: float = 0.2
    golden_interval_s: float = 60.0
    golden_items: int = 16
    auto_start: bool = True


@dataclass
class RolloutState:
    weight: float = 0.0  # % of traffic to INT8
    step_index: int = -1
    # not-started | progressing | waiting (inconclusive data) | held (operator weight; analyses still roll
    # back, never promote) | paused (operator: hands off) | promoted | rolled-back
    status: str = "not-started"
    consecutive_failures: int = 0
    updated_at: float = 0.0


@dataclass
class Event:
    ts: float
    event: str
    from_weight: float
    to_weight: float
    reason: str
    metrics: dict


class RolloutStore:
    """SQLite: one state row and an append-only history."""

    def __init__(self, state_dir: Path):
        state_dir.mkdir(parents=True, exist_ok=True)
        self.path = state_dir / "rollout.sqlite"
        self.lock = threading.Lock()
        self.db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("CREATE TABLE IF NOT EXISTS state (id INTEGER PRIMARY KEY CHECK (id = 1), body TEXT)")
        self.db.execute("CREATE TABLE IF NOT EXISTS history (id INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL, "
                        "event TEXT, from_weight REAL, to_weight REAL, reason TEXT, metrics TEXT)")

    def load(self) -> Optional[RolloutState]:
        row = self.db.execute("SELECT body FROM state WHERE id = 1").fetchone()
        return RolloutState(**json.loads(row[0])) if row else None

    def save(self, state: RolloutState, event: Optional[Event] = None) -> None:
        """State and its event in one transaction: a crash never keeps one without the other."""
        with self.lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                self.db.execute("INSERT OR REPLACE INTO state (id, body) VALUES (1, ?)", (json.dumps(asdict(state)),))
                if event:
                    self.db.execute("INSERT INTO history (ts, event, from_weight, to_weight, reason, metrics) "
                                    "VALUES (?, ?, ?, ?, ?, ?)", (event.ts, event.event, event.from_weight,
                                                                  event.to_weight, event.reason, json.dumps(event.metrics)))
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                raise

    def history(self, limit: int = 1000) -> List[Event]:
        """The newest ``limit`` events, oldest first."""
        rows = self.db.execute("SELECT ts, event, from_weight, to_weight, reason, metrics FROM history "
                               "ORDER BY id DESC LIMIT ?", (limit,)).fetchall()
        return [Event(r[0], r[1], r[2], r[3], r[4], json.loads(r[5])) for r in reversed(rows)]

    def count(self) -> int:
        return self.db.execute("SELECT COUNT(*) FROM history").fetchone()[0]


@dataclass
class Window:
    """What one analysis interval saw, per variant, plus shadow and golden comparisons."""

    requests: dict = field(default_factory=lambda: {"int8": 0, "fp16": 0})
    errors: dict = field(default_factory=lambda: {"int8": 0, "fp16": 0})
    latencies: dict = field(default_factory=lambda: {"int8": [], "fp16": []})
    shadow_pairs: int = 0
    shadow_same: int = 0
    golden: Optional[dict] = None  # latest golden-set canary metrics (fidelity summary)


def p99(values: List[float]) -> Optional[float]:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(0.99 * len(s)))]


def analyse(window: Window, cfg: RolloutConfig, bundle_thresholds: GateThresholds) -> Tuple[str, List[str], dict]:
    """('pass' | 'fail' | 'inconclusive', reasons, metrics) for one window. Golden runs are judged by the
    build's gate (``quantize.fidelity.evaluate_gate``) with the bundle's thresholds unless the router
    config sets its own."""
    n_int8 = window.requests["int8"]
    err = window.errors["int8"] / n_int8 if n_int8 else 0.0
    lat_i, lat_f = p99(window.latencies["int8"]), p99(window.latencies["fp16"])
    ratio = lat_i / lat_f if lat_i and lat_f else None
    shadow = window.shadow_same / window.shadow_pairs if window.shadow_pairs else None
    metrics = {"int8_requests": n_int8, "fp16_requests": window.requests["fp16"], "int8_error_rate": err,
               "int8_p99_s": lat_i, "fp16_p99_s": lat_f, "p99_latency_ratio": ratio,
               "shadow_pairs": window.shadow_pairs, "shadow_agreement": shadow, "golden": window.golden}
    t = cfg.thresholds or bundle_thresholds
    fails = []
    if n_int8 and err > cfg.max_error_rate:
        fails.append(f"int8 error rate {err:.3f} > max {cfg.max_error_rate}")
    enough_both = n_int8 >= cfg.min_samples and window.requests["fp16"] >= cfg.min_samples
    if ratio is not None and enough_both and ratio > cfg.max_p99_latency_ratio:
        fails.append(f"p99 latency ratio {ratio:.2f} > max {cfg.max_p99_latency_ratio}")
    if shadow is not None and window.shadow_pairs >= max(3, cfg.min_samples // 4) and shadow < t.min_greedy_agreement:
        fails.append(f"shadow greedy agreement {shadow:.3f} < min {t.min_greedy_agreement}")
    g = window.golden
    if g:
        nan = float("nan")  # teacher-forced metrics are the build's; live runs judge generations
        report = FidelityReport(g["items"], 0, nan, nan, nan, greedy_agreement=g.get("greedy_agreement"),
                                reward_delta=g.get("reward_delta"))
        fails += [f"golden {f}" for f in evaluate_gate(report, t).failures]
    if fails:
        return "fail", fails, metrics
    evidence = n_int8 + (g or {}).get("items", 0)
    if evidence < cfg.min_samples:
        return "inconclusive", [f"{evidence} samples < min_samples {cfg.min_samples}"], metrics
    return "pass", [], metrics


class RolloutController:
    """Applies analysis verdicts and operator commands to the persisted state. Every transition is saved
    (state and event in one transaction) before the in-memory state changes: a failed save changes nothing."""

    ANALYSED = ("progressing", "waiting", "held")

    def __init__(self, store: RolloutStore, cfg: RolloutConfig):
        self.store, self.cfg = store, cfg
        self.lock = threading.Lock()
        loaded = store.load()
        self.state = loaded or RolloutState()
        self.resumed = loaded is not None
        if not loaded and cfg.auto_start:
            self._move(0, "start", "rollout started at the first step", {}, status="progressing")

    def analysing(self) -> bool:
        return self.state.status in self.ANALYSED

    # -- transitions ---------------------------------------------------------------------------
    def _set(self, weight: float, event: str, reason: str, metrics: dict, **changes) -> None:
        now = time.time()
        new = replace(self.state, weight=weight, updated_at=now, **changes)
        self.store.save(new, Event(now, event, self.state.weight, weight, reason, metrics))
        self.state = new

    def _move(self, index: int, event: str, reason: str, metrics: dict, **changes) -> None:
        index = max(0, min(index, len(self.cfg.steps) - 1))
        self._set(self.cfg.steps[index], event, reason, metrics, step_index=index, **changes)

    def apply(self, verdict: str, reasons: List[str], metrics: dict) -> None:
        with self.lock:
            s = self.state
            if s.status not in self.ANALYSED:  # operator pause, rollback, promoted: hands off
                return
            if verdict == "fail":
                failures = s.consecutive_failures + 1
                if failures >= self.cfg.failure_limit:
                    self._set(0.0, "rollback", f"{self.cfg.failure_limit} failed analyses: " + "; ".join(reasons),
                              metrics, status="rolled-back", step_index=-1, consecutive_failures=0)
                else:
                    self._set(s.weight, "analysis-failed", "; ".join(reasons), metrics, consecutive_failures=failures)
            elif verdict == "inconclusive":  # hold the current step until there is enough data
                if s.status == "progressing":
                    self._set(s.weight, "waiting", "inconclusive: " + "; ".join(reasons), metrics, status="waiting")
            elif s.status == "held":  # an operator's weight: passing analyses keep it, failing ones roll back
                if s.consecutive_failures:
                    self._set(s.weight, "analysis-passed", "analysis passed at the operator's weight", metrics,
                              consecutive_failures=0)
            elif s.step_index + 1 >= len(self.cfg.steps):
                self._set(s.weight, "promoted", "all steps passed", metrics, status="promoted", consecutive_failures=0)
            else:
                self._move(s.step_index + 1, "promote", "analysis passed", metrics, status="progressing",
                           consecutive_failures=0)

    def note(self, event: str, reason: str, metrics: dict) -> None:
        """Record something that happened without a transition (e.g. variant failures), in any status."""
        with self.lock:
            self._set(self.state.weight, event, reason, metrics)

    # -- operator commands ---------------------------------------------------------------------
    def command(self, action: str, weight: Optional[float] = None, reason: str = "operator") -> RolloutState:
        with self.lock:
            s = self.state
            if action == "promote":
                if s.step_index + 1 >= len(self.cfg.steps):
                    self._set(100.0, "promote", reason, {}, status="promoted")
                else:
                    self._move(s.step_index + 1, "promote", reason, {}, status="progressing")
            elif action == "pause":
                self._set(s.weight, "pause", reason, {}, status="paused")
            elif action == "resume":
                self._set(s.weight, "resume", reason, {}, status="progressing")
            elif action == "rollback":
                self._set(0.0, "rollback", reason, {}, status="rolled-back", step_index=-1)
            elif action == "set-weight":
                idx = max([i for i, w in enumerate(self.cfg.steps) if w <= weight] or [-1])
                self._set(float(weight), "set-weight", reason, {}, status="held", step_index=idx,
                          consecutive_failures=0)
            elif action == "restart":
                self._move(0, "start", reason, {}, status="progressing", consecutive_failures=0)
            else:
                raise ValueError(f"action: {action!r} is not one of promote, pause, resume, rollback, set-weight, restart")
            return self.state
