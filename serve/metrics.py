"""The router's Prometheus metrics (served on BentoML's /metrics), labelled by variant."""

from __future__ import annotations

import bentoml


class Metrics:
    def __init__(self) -> None:
        m = bentoml.metrics
        self.requests = m.Counter(name="policy_requests_total", documentation="Requests served", labelnames=["variant"])
        self.errors = m.Counter(name="policy_errors_total", documentation="Variant failures", labelnames=["variant"])
        self.rejected = m.Counter(name="policy_rejected_total", documentation="Requests refused with a 4xx",
                                  labelnames=["endpoint", "status"])
        self.latency = m.Histogram(name="policy_latency_seconds", documentation="End-to-end latency",
                                   labelnames=["variant"],
                                   buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.rerouted = m.Counter(name="policy_rerouted_total", documentation="Requests sent to the other variant "
                                  "because the chosen one failed its health probe", labelnames=["variant"])
        self.tokens = m.Counter(name="policy_tokens_total", documentation="Completion tokens", labelnames=["variant"])
        self.shadow = m.Counter(name="policy_shadow_comparisons_total", documentation="Shadow pairs compared",
                                labelnames=["outcome"])
        self.shadow_agreement = m.Gauge(name="policy_shadow_agreement", documentation="Greedy agreement, last window",
                                          multiprocess_mode="livemostrecent")
        self.verdicts = m.Counter(name="policy_canary_verdicts_total", documentation="Rollout analyses",
                                  labelnames=["verdict"])
        self.weight = m.Gauge(name="policy_int8_weight_percent", documentation="Traffic share of INT8",
                               multiprocess_mode="livemostrecent")
        self.inflight = m.Gauge(name="policy_inflight_requests", documentation="Requests in flight",
                                 multiprocess_mode="livemostrecent")
        self.inflight_peak = m.Gauge(name="policy_inflight_peak", documentation="Most calls in flight at once since "
                                     "start (client, shadow and golden-canary calls)", multiprocess_mode="livemax")
        self.background = m.Counter(name="policy_background_calls_total", documentation="Shadow and golden-canary "
                                    "calls admitted (counted against max_inflight)", labelnames=["kind"])
        self.loop_errors = m.Counter(name="policy_loop_errors_total", documentation="Exceptions in the router's "
                                     "background loops (each loop logs them and goes on)", labelnames=["loop"])
        self.engine = m.Gauge(name="policy_variant_engine", documentation="1 for the engine each variant runs "
                              "(its health's engine)", labelnames=["variant", "engine"], multiprocess_mode="livemostrecent")
        self.fp16_fallback = m.Gauge(name="policy_fp16_fallback", documentation="1 when FP16 runs without vLLM",
                                      multiprocess_mode="livemostrecent")

    def set_inflight(self, now: int, peak: int) -> None:
        self.inflight.set(now)
        self.inflight_peak.set(peak)
