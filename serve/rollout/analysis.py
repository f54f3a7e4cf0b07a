"""One analysis window (what this replica saw since the last verdict) and its verdict: error rate, latency
ratio, the shadow flip rate with a confidence bound, and the golden canary judged by the build's gate thresholds with
a confidence bound too (a run's items pooled with the window's earlier runs)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import List, Optional, Tuple

from policy_bundle.quantize.fidelity.scores import GateThresholds
from policy_bundle.quantize.percentile import percentile
from policy_bundle.serve.rollout.types import RolloutConfig


LATENCY_SAMPLES = 5000  # per variant, the newest kept in a window (its p99 is over these)


@dataclass
class Window:
    """Per variant requests, errors, latencies, plus shadow and golden comparisons, observed while the rollout
    was at ``epoch`` (``RolloutController.epoch``: step, weight, since when)."""

    epoch: tuple = ()
    requests: dict = field(default_factory=lambda: {"int8": 0, "fp16": 0})
    errors: dict = field(default_factory=lambda: {"int8": 0, "fp16": 0})
    latencies: dict = field(default_factory=lambda: {"int8": [], "fp16": []})
    shadow_pairs: int = 0
    shadow_same: int = 0
    golden: Optional[dict] = None  # the golden tally's summary after a run in this window (``GoldenTally``)

    def extended(self, later: "Window") -> "Window":
        """This window's evidence plus what ``later`` (recorded since this one was closed) saw: an
        inconclusive window goes on collecting at the same split instead of starting from nothing again."""
        return Window(self.epoch, {v: n + later.requests[v] for v, n in self.requests.items()},
                      {v: n + later.errors[v] for v, n in self.errors.items()},
                      {v: (lat + later.latencies[v])[-LATENCY_SAMPLES:] for v, lat in self.latencies.items()},
                      self.shadow_pairs + later.shadow_pairs, self.shadow_same + later.shadow_same,
                      later.golden or self.golden)


@dataclass
class GoldenTally:
    """The live golden canary's evidence: each golden item's latest result (did the served INT8's greedy continuation
    match the build's FP32 one; its task reward minus FP16's) over every run so far, kept across analysis windows (a
    golden answer does not depend on the traffic split). Runs go round the set, and a deterministic answer asked
    again is no new evidence, so each item counts once. The set is the gate's held-out items: the whole set judged is
    the gate's own measurement again (``_golden_verdict``)."""

    set_items: int
    results: dict = field(default_factory=dict)  # item index -> (greedy matched FP32's, reward delta or None)
    runs: int = 0

    def add(self, per_item: List[list]) -> dict:
        """One run's ``[index, matched, reward delta]`` per item; the summary a window is judged on."""
        for index, same, delta in per_item:
            self.results[int(index)] = (bool(same), delta)
        self.runs += 1
        return self.summary()

    def summary(self) -> dict:
        n = len(self.results)
        same = sum(s for s, _ in self.results.values())
        out = {"items": n, "set_items": self.set_items, "runs": self.runs, "greedy_same": same,
               "greedy_agreement": same / n if n else None}
        deltas = [d for _, d in self.results.values() if d is not None]
        if deltas:
            out.update(reward_pairs=len(deltas), reward_delta_sum=sum(deltas),
                       reward_delta_sq_sum=sum(d * d for d in deltas), reward_delta=sum(deltas) / len(deltas))
        return out


def wilson_interval(failures: int, n: int, confidence: float) -> Tuple[float, float]:
    """Wilson score interval of a binomial rate ``failures / n`` (how often INT8's greedy answer differs from FP16's,
    how often an INT8 request fails, how often a golden item's greedy answer matches FP32's)."""
    if n == 0:
        return 0.0, 1.0
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    p = failures / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _shadow_verdict(window: Window, cfg: RolloutConfig, t: GateThresholds, metrics: dict) -> Tuple[List[str], bool]:
    """(failures, conclusive): the flip rate's bound against the allowed rate 1 - min_greedy_agreement. Fails only
    when even the lower bound is over (INT8 differs from FP16 too often, with ``confidence``); conclusive only when
    the upper bound is within."""
    n = window.shadow_pairs
    if n < max(3, cfg.min_samples // 4):
        return [], True
    allowed = 1.0 - t.min_greedy_agreement
    lo, hi = wilson_interval(n - window.shadow_same, n, cfg.confidence)
    metrics["shadow_flip_rate_bounds"] = [lo, hi]
    if lo > allowed:
        return [f"shadow flip rate >= {lo:.3f} (at {cfg.confidence:.0%} confidence) > allowed {allowed:.3f}"], True
    return [], hi <= allowed


def delta_interval(total: float, sq_total: float, n: int, confidence: float) -> Tuple[float, float]:
    """Interval of the mean of ``n`` per-item reward deltas in [-1, 1] (INT8's task reward minus FP16's) from their sum
    and sum of squares: the normal interval after adding z^2 pseudo-items, half at +1 and half at -1 (Agresti-Coull's
    adjustment for a binomial, here for a difference). Without it 2 items that both dropped have no spread and bound
    the drop at exactly 1 (all 16 dropping still bound it at >= 0.55; one of 16 is within the noise)."""
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    m = n + z * z
    mean = total / m
    half = z * math.sqrt(max(0.0, (sq_total + z * z) / m - mean * mean) / m)
    return max(-1.0, mean - half), min(1.0, mean + half)


def _golden_verdict(g: dict, cfg: RolloutConfig, t: GateThresholds, metrics: dict) -> List[str]:
    """The golden items seen so far (``GoldenTally``) against the gate's greedy and reward limits. Over the whole set,
    the greedy agreement is judged as the build's gate judged it, on the point: the same items, decoded as served.
    Over part of it, and for the reward (INT8 against FP16 served, not the build's measurement), a window fails only
    when even the bound at ``confidence`` most favourable to INT8 misses the limit, as the shadow flips and INT8
    errors do. Judged on each 16-item run's point, the served SmolLM2-135M default bundle (gate greedy 0.55 against
    0.5 over 20 items) scored 0.375-0.5625 and failed 2 of 6 windows, and 2 failed windows in a row roll back. A broken
    INT8 (0 of 16, or 1: 0.05 was what saturating int8 sums gave) still fails in one run."""
    fails = []
    n, same = g["items"], g["greedy_same"]
    if n:
        lo, hi = wilson_interval(same, n, cfg.confidence)
        metrics["golden_greedy_agreement_bounds"] = [lo, hi]
        if g.get("set_items") and n >= g["set_items"]:
            if same / n < t.min_greedy_agreement:
                fails.append(f"golden greedy_agreement {same / n:.4f} < min {t.min_greedy_agreement} (all {n} golden "
                             "items, the gate's rule)")
        elif hi < t.min_greedy_agreement:
            fails.append(f"golden greedy_agreement {same / n:.4f} (<= {hi:.3f} at {cfg.confidence:.0%} confidence, "
                         f"{n} items) < min {t.min_greedy_agreement}")
    pairs = g.get("reward_pairs", 0)
    if pairs:
        lo, hi = delta_interval(g["reward_delta_sum"], g["reward_delta_sq_sum"], pairs, cfg.confidence)
        metrics["golden_reward_delta_bounds"] = [lo, hi]
        if -hi > t.max_reward_drop:  # even the delta's upper bound is a drop beyond the limit
            fails.append(f"golden reward_drop {-g['reward_delta_sum'] / pairs:.4f} (>= {-hi:.3f} at "
                         f"{cfg.confidence:.0%} confidence, {pairs} items) > max {t.max_reward_drop}")
    return fails


def _error_verdict(window: Window, cfg: RolloutConfig, metrics: dict) -> List[str]:
    """INT8's error rate, judged from ``min_samples`` requests (one timed-out request of one is no error rate) and
    against FP16's in the same window: it fails when even its lower bound at ``confidence`` exceeds FP16's upper bound
    by more than ``max_error_rate``, so overload that fails both variants alike rolls nothing back. FP16's rate counts
    from ``min_samples`` requests too (before that it is taken as 0: INT8 is judged on its own)."""
    n_int8, n_fp16 = window.requests["int8"], window.requests["fp16"]
    if n_int8 < cfg.min_samples:
        return []
    err_lo, err_hi = wilson_interval(window.errors["int8"], n_int8, cfg.confidence)
    fp16_hi = wilson_interval(window.errors["fp16"], n_fp16, cfg.confidence)[1] if n_fp16 >= cfg.min_samples else 0.0
    metrics["int8_error_rate_bounds"], metrics["fp16_error_rate_upper_bound"] = [err_lo, err_hi], fp16_hi
    if err_lo - fp16_hi <= cfg.max_error_rate:
        return []
    return [f"int8 error rate {window.errors['int8'] / n_int8:.3f} (>= {err_lo:.3f} at {cfg.confidence:.0%} "
            f"confidence) exceeds fp16's ({window.errors['fp16'] / max(1, n_fp16):.3f}, <= {fp16_hi:.3f}) by more "
            f"than max {cfg.max_error_rate}"]


def analyse(window: Window, cfg: RolloutConfig, bundle_thresholds: GateThresholds) -> Tuple[str, List[str], dict]:
    """('pass' | 'fail' | 'inconclusive', reasons, metrics) for one window. Golden runs are judged against the build
    gate's greedy and reward limits (the bundle's thresholds unless the router config sets its own), with a
    confidence bound (``_golden_verdict``)."""
    n_int8 = window.requests["int8"]
    err = window.errors["int8"] / n_int8 if n_int8 else 0.0
    lat_i, lat_f = (percentile(window.latencies[v], 0.99, empty=None) for v in ("int8", "fp16"))
    ratio = lat_i / lat_f if lat_i and lat_f else None
    shadow = window.shadow_same / window.shadow_pairs if window.shadow_pairs else None
    metrics = {"int8_requests": n_int8, "fp16_requests": window.requests["fp16"], "int8_error_rate": err,
               "fp16_error_rate": window.errors["fp16"] / window.requests["fp16"] if window.requests["fp16"] else 0.0,
               "int8_p99_s": lat_i, "fp16_p99_s": lat_f, "p99_latency_ratio": ratio,
               "shadow_pairs": window.shadow_pairs, "shadow_agreement": shadow, "golden": window.golden}
    t = cfg.thresholds or bundle_thresholds
    fails = []
    fails += _error_verdict(window, cfg, metrics)
    need = max(cfg.min_samples, cfg.min_latency_samples)
    enough_both = all(len(window.latencies[v]) >= need for v in ("int8", "fp16"))
    if ratio is not None and enough_both and ratio > cfg.max_p99_latency_ratio:
        fails.append(f"p99 latency ratio {ratio:.2f} > max {cfg.max_p99_latency_ratio}")
    shadow_fails, shadow_conclusive = _shadow_verdict(window, cfg, t, metrics)
    fails += shadow_fails
    g = window.golden
    if g:
        fails += _golden_verdict(g, cfg, t, metrics)
    if fails:
        return "fail", fails, metrics
    evidence = n_int8 + (g or {}).get("items", 0)
    if evidence == 0 and not window.shadow_pairs:  # nothing reached INT8 (no traffic yet): not an analysis at all
        return "idle", ["no INT8 request, shadow pair or golden run in this window"], metrics
    if evidence < cfg.min_samples:
        return "inconclusive", [f"{evidence} samples < min_samples {cfg.min_samples}"], metrics
    if not shadow_conclusive:
        lo, hi = metrics["shadow_flip_rate_bounds"]
        return "inconclusive", [f"shadow flip rate in [{lo:.3f}, {hi:.3f}] straddles the allowed "
                                f"{1 - t.min_greedy_agreement:.3f}: more pairs needed"], metrics
    return "pass", [], metrics
