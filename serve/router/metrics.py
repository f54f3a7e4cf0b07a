"""The router's Prometheus metrics (served on BentoML's /metrics), labelled by variant. Names follow Prometheus'
conventions (base units, ``_total`` counters, ``_ratio`` fractions, ``_info`` for labels-as-values); the dashboard
and alert rules in ``deploy/prometheus`` and ``deploy/grafana`` read them (``tests/test_observability.py`` checks
every name they use is exported)."""

from __future__ import annotations

import bentoml

TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30)
ROLLOUT_STATUSES = ("not-started", "progressing", "waiting", "paused", "held", "promoted", "rolled-back", "aborted",
                    "database-unreachable")


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
        self.shadow_agreement = m.Gauge(name="policy_shadow_agreement_ratio", documentation="Greedy agreement of "
                                        "INT8 with FP16 on shadowed requests, last analysis window",
                                        multiprocess_mode="livemostrecent")
        self.verdicts = m.Counter(name="policy_canary_verdicts_total", documentation="Rollout analyses",
                                  labelnames=["verdict"])
        self.weight = m.Gauge(name="policy_int8_traffic_ratio", documentation="Share of routed traffic sent to "
                              "INT8 (0 to 1)", multiprocess_mode="livemostrecent")
        self.rollout = m.Gauge(name="policy_rollout_status_info", documentation="1 for the rollout's status",
                               labelnames=["status"], multiprocess_mode="livemostrecent")
        self.ttft = m.Histogram(name="policy_time_to_first_token_seconds", documentation="Streamed requests: time "
                                "from the request to its first token", labelnames=["variant"], buckets=TOKEN_BUCKETS)
        self.itl = m.Histogram(name="policy_inter_token_latency_seconds", documentation="Streamed requests: time "
                               "between consecutive tokens", labelnames=["variant"], buckets=TOKEN_BUCKETS)
        self.up = m.Gauge(name="policy_variant_up", documentation="1 while the variant's last probe found it ready "
                          "and not marked down", labelnames=["variant"], multiprocess_mode="livemostrecent")
        self.batch = m.Gauge(name="policy_engine_batch_size", documentation="Sequences the variant's engine "
                             "decodes now (the torch engine's every lane; vLLM's running requests)", labelnames=["variant"], multiprocess_mode="livemostrecent")
        self.pending = m.Gauge(name="policy_engine_pending_requests", documentation="Requests waiting in the "
                               "variant's engine for a slot or KV memory (vLLM: its waiting queue)", labelnames=["variant"],
                               multiprocess_mode="livemostrecent")
        self.queue_wait = m.Gauge(name="policy_engine_queue_wait_seconds", documentation="How long requests waited "
                                  "in the variant's torch engine before they joined its batch (recent requests; "
                                  "quantile 0.5 and 0.99)", labelnames=["variant", "quantile"],
                                  multiprocess_mode="livemostrecent")
        self.kv = m.Gauge(name="policy_kv_cache_bytes", documentation="The variant's engine's KV cache: budget, "
                          "held (the torch engine: admitted sequences' worst case; vLLM: the blocks in use) and "
                          "allocated (the torch engine)", labelnames=["variant", "kind"],
                          multiprocess_mode="livemostrecent")
        self.inflight = m.Gauge(name="policy_inflight_requests", documentation="Requests in flight",
                                 multiprocess_mode="livemostrecent")
        self.inflight_peak = m.Gauge(name="policy_inflight_peak", documentation="Most calls in flight at once since "
                                     "start (client, shadow and golden-canary calls)", multiprocess_mode="livemax")
        self.background = m.Counter(name="policy_background_calls_total", documentation="Shadow and golden-canary "
                                    "calls admitted (counted against max_inflight)", labelnames=["kind"])
        self.loop_errors = m.Counter(name="policy_loop_errors_total", documentation="Exceptions in the router's "
                                     "background loops (each loop logs them and goes on)", labelnames=["loop"])
        self.engine = m.Gauge(name="policy_variant_engine_info", documentation="1 for the engine each variant runs "
                              "(its health's engine)", labelnames=["variant", "engine"], multiprocess_mode="livemostrecent")
        self.fp16_fallback = m.Gauge(name="policy_fp16_fallback", documentation="1 when FP16 runs without vLLM",
                                      multiprocess_mode="livemostrecent")

    def declare(self, variants) -> None:
        """Every per-variant series at 0 from the start (a counter with labels has none until it first counts, and
        an alert or a panel on a series that does not exist says nothing); the shadow agreement NaN until measured."""
        for v in variants:
            for metric in (self.requests, self.errors, self.tokens, self.rerouted):
                metric.labels(variant=v).inc(0)
        for outcome in ("same", "different"):
            self.shadow.labels(outcome=outcome).inc(0)
        for verdict in ("pass", "fail", "inconclusive", "idle"):
            self.verdicts.labels(verdict=verdict).inc(0)
        for endpoint in ("completions", "chat"):
            for status in ("400", "429"):
                self.rejected.labels(endpoint=endpoint, status=status).inc(0)
        self.shadow_agreement.set(float("nan"))

    def set_rollout(self, state) -> None:
        """The rollout's traffic share and status (``RolloutState``)."""
        self.weight.set(state.weight / 100.0)
        for status in ROLLOUT_STATUSES:
            self.rollout.labels(status=status).set(1.0 if state.status == status else 0.0)

    def set_variant(self, name: str, up: bool, batch: dict) -> None:
        """What a health probe found: up or not, and the engine's batch, queue and KV cache."""
        self.up.labels(variant=name).set(1.0 if up else 0.0)
        if not batch:
            return
        self.batch.labels(variant=name).set(batch.get("active", 0))
        self.pending.labels(variant=name).set(batch.get("pending", 0))
        for q in ("0.5", "0.99"):
            wait = (batch.get("queue_wait_s") or {}).get(q)
            if wait is not None:
                self.queue_wait.labels(variant=name, quantile=q).set(wait)
        for kind in ("budget", "held", "allocated"):
            value = batch.get(f"kv_{kind}_bytes")
            if value is not None:
                self.kv.labels(variant=name, kind=kind).set(value)

    def set_inflight(self, now: int, peak: int) -> None:
        self.inflight.set(now)
        self.inflight_peak.set(peak)
