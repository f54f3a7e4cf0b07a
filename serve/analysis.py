"""One analysis window (what this replica saw since the last verdict) and its verdict: error rate, latency
ratio, the shadow flip rate with a confidence bound, and the golden canary judged by the build's gate."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import List, Optional, Tuple

from policy_bundle.quantize.fidelity import FidelityReport, GateThresholds, evaluate_gate
from policy_bundle.quantize.percentile import percentile
from policy_bundle.serve.rollout_types import RolloutConfig


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
    golden: Optional[dict] = None  # latest golden-set canary metrics (fidelity summary)

    def extended(self, later: "Window") -> "Window":
        """This window's evidence plus what ``later`` (recorded since this one was closed) saw: an
        inconclusive window goes on collecting at the same split instead of starting from nothing again."""
        return Window(self.epoch, {v: n + later.requests[v] for v, n in self.requests.items()},
                      {v: n + later.errors[v] for v, n in self.errors.items()},
                      {v: (lat + later.latencies[v])[-LATENCY_SAMPLES:] for v, lat in self.latencies.items()},
                      self.shadow_pairs + later.shadow_pairs, self.shadow_same + later.shadow_same,
                      later.golden or self.golden)


def wilson_interval(failures: int, n: int, confidence: float) -> Tuple[float, float]:
    """Wilson score interval of a binomial rate (here: how often INT8's greedy answer differs from FP16's)."""
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


def analyse(window: Window, cfg: RolloutConfig, bundle_thresholds: GateThresholds) -> Tuple[str, List[str], dict]:
    """('pass' | 'fail' | 'inconclusive', reasons, metrics) for one window. Golden runs are judged by the
    build's gate (``quantize.fidelity.evaluate_gate``) with the bundle's thresholds unless the router
    config sets its own."""
    n_int8 = window.requests["int8"]
    err = window.errors["int8"] / n_int8 if n_int8 else 0.0
    lat_i, lat_f = (percentile(window.latencies[v], 0.99, empty=None) for v in ("int8", "fp16"))
    ratio = lat_i / lat_f if lat_i and lat_f else None
    shadow = window.shadow_same / window.shadow_pairs if window.shadow_pairs else None
    metrics = {"int8_requests": n_int8, "fp16_requests": window.requests["fp16"], "int8_error_rate": err,
               "int8_p99_s": lat_i, "fp16_p99_s": lat_f, "p99_latency_ratio": ratio,
               "shadow_pairs": window.shadow_pairs, "shadow_agreement": shadow, "golden": window.golden}
    t = cfg.thresholds or bundle_thresholds
    fails = []
    if n_int8:
        # like the shadow flips: one timed-out request among 8 is no evidence of a 5 % error rate
        err_lo, err_hi = wilson_interval(window.errors["int8"], n_int8, cfg.confidence)
        metrics["int8_error_rate_bounds"] = [err_lo, err_hi]
        if err_lo > cfg.max_error_rate:
            fails.append(f"int8 error rate {err:.3f} (>= {err_lo:.3f} at {cfg.confidence:.0%} confidence) > max "
                         f"{cfg.max_error_rate}")
    need = max(cfg.min_samples, cfg.min_latency_samples)
    enough_both = all(len(window.latencies[v]) >= need for v in ("int8", "fp16"))
    if ratio is not None and enough_both and ratio > cfg.max_p99_latency_ratio:
        fails.append(f"p99 latency ratio {ratio:.2f} > max {cfg.max_p99_latency_ratio}")
    shadow_fails, shadow_conclusive = _shadow_verdict(window, cfg, t, metrics)
    fails += shadow_fails
    g = window.golden
    if g:
        nan = float("nan")  # teacher-forced metrics are the build's; live runs judge generations
        report = FidelityReport(g["items"], 0, nan, nan, nan, greedy_agreement=g.get("greedy_agreement"),
                                reward_delta=g.get("reward_delta"))
        fails += [f"golden {f}" for f in evaluate_gate(report, t).failures]
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
