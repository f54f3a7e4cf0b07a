"""One analysis window's verdict (``serve/rollout/analysis.py``): golden runs judged by the bundle's gate, shadow
flips and INT8 errors failing only with confidence, the p99 ratio judged only over enough samples."""

from policy_bundle.quantize.fidelity.scores import GateThresholds
from policy_bundle.serve.rollout.analysis import Window, analyse, wilson_interval
from policy_bundle.serve.rollout.types import RolloutConfig


def test_golden_runs_are_judged_with_the_bundle_thresholds():
    w = Window(golden={"items": 16, "greedy_same": 10, "greedy_agreement": 0.625})
    strict, lenient = GateThresholds(min_greedy_agreement=0.9), GateThresholds(min_greedy_agreement=0.5)
    assert analyse(w, RolloutConfig(min_samples=1), strict)[0] == "fail"
    assert analyse(w, RolloutConfig(min_samples=1), lenient)[0] == "pass"
    assert analyse(w, RolloutConfig(min_samples=1, thresholds=strict), lenient)[0] == "fail"  # config overrides


def test_shadow_flips_fail_only_with_confidence_and_are_inconclusive_in_between():
    t = GateThresholds(min_greedy_agreement=0.8)  # allowed flip rate 0.2
    cfg = RolloutConfig(min_samples=8)

    def verdict(pairs, same):
        return analyse(Window(requests={"int8": 40, "fp16": 40}, shadow_pairs=pairs, shadow_same=same), cfg, t)

    assert verdict(60, 60)[0] == "pass"  # 0 of 60 flipped: upper bound 0.06 < 0.2
    assert verdict(60, 30)[0] == "fail"  # half flipped: lower bound 0.38 > 0.2
    v, reasons, metrics = verdict(10, 7)  # 3 of 10: the interval [0.11, 0.60] straddles 0.2
    assert v == "inconclusive" and "straddles" in reasons[0]
    lo, hi = wilson_interval(3, 10, 0.95)
    assert metrics["shadow_flip_rate_bounds"] == [lo, hi] and round(lo, 2) == 0.11 and round(hi, 2) == 0.60


def test_int8_errors_fail_only_with_confidence_and_p99_only_over_enough_samples():
    cfg, t = RolloutConfig(min_samples=8), GateThresholds(min_greedy_agreement=0.0)

    def verdict(errors, n=40, lat_int8=(), lat_fp16=()):
        return analyse(Window(requests={"int8": n, "fp16": n}, errors={"int8": errors, "fp16": 0},
                              latencies={"int8": list(lat_int8), "fp16": list(lat_fp16)}), cfg, t)

    assert verdict(1)[0] == "pass"  # 1 of 40 (one timed-out request): the rate's lower bound 0.004 < 0.05
    v, reasons, metrics = verdict(12)  # 12 of 40: lower bound 0.18 > 0.05
    assert v == "fail" and "int8 error rate" in reasons[0] and metrics["int8_error_rate_bounds"][0] > 0.05
    # one stalled INT8 request among 40: a "p99" of 40 samples is their maximum, not judged below 100
    assert verdict(0, lat_int8=[0.1] * 39 + [5.0], lat_fp16=[0.1] * 40)[0] == "pass"
    v, reasons, _ = verdict(0, n=200, lat_int8=[1.0] * 200, lat_fp16=[0.1] * 200)  # 10x slower at 200 samples each
    assert v == "fail" and reasons == ["p99 latency ratio 10.00 > max 3.0"]


def test_golden_items_fail_part_of_the_set_only_with_confidence_and_the_whole_set_by_the_gates_rule():
    """The served SmolLM2-135M default bundle of 8696d32 (gate greedy 0.55 against 0.5 on its 20 held-out items) matched
    FP32 on 6 of 16 in one live run: judged on that point it failed the window, and two such windows roll INT8 back.
    Part of the set is judged with a bound; the whole set (the gate's own items) by the gate's rule, each item once."""
    from policy_bundle.serve.rollout.analysis import GoldenTally

    t, cfg = GoldenTally, RolloutConfig(min_samples=1)
    gate = GateThresholds(min_greedy_agreement=0.5)

    def run(first, matched, n=16, size=20):  # items first.. (mod size), the first ``matched`` of them matching FP32
        return [[(first + i) % size, i < matched, None] for i in range(n)]

    v, reasons, metrics = analyse(Window(golden=t(20).add(run(0, 6))), cfg, gate)
    lo, hi = metrics["golden_greedy_agreement_bounds"]
    assert v == "pass" and lo < 0.375 < 0.5 < hi  # 6 of 16: [0.19, 0.61] holds the limit
    for matched in (0, 1):  # broken (saturating int8 sums gave 1 in 20): failed by one run
        v, reasons, _ = analyse(Window(golden=t(20).add(run(0, matched))), cfg, gate)
        assert v == "fail" and reasons[0].startswith("golden greedy_agreement") and "16 items" in reasons[0]
    tally = t(20)
    tally.add(run(0, 8))  # items 0-15, 8 matching
    whole = tally.add(run(16, 1))  # items 16-19 and 0-11 again, only 16 matching: each item counts once, its latest
    assert (whole["items"], whole["runs"], whole["greedy_same"]) == (20, 2, 1)
    v, reasons, _ = analyse(Window(golden=whole), cfg, gate)
    assert v == "fail" and "all 20 golden items, the gate's rule" in reasons[0]  # 0.05 over the gate's own items
    tally = t(20)
    tally.add([[i, i < 10, None] for i in range(20)])
    assert analyse(Window(golden=tally.summary()), cfg, gate)[0] == "pass"  # 10 of 20 = 0.5: the gate passed it
    tally.add([[i, i < 9, None] for i in range(20)])  # a later run: item 9 no longer matches
    v, reasons, _ = analyse(Window(golden=tally.summary()), cfg, gate)
    assert v == "fail" and reasons[0].startswith("golden greedy_agreement 0.4500 < min 0.5")
    # an inconclusive window keeps the latest summary when it is extended
    w = Window(golden=t(20).add(run(0, 6))).extended(Window())
    assert w.golden["items"] == 16


def test_golden_reward_drops_fail_only_with_confidence():
    t, cfg = GateThresholds(min_greedy_agreement=0.0, max_reward_drop=0.02), RolloutConfig(min_samples=1)

    def verdict(deltas):
        g = {"items": len(deltas), "greedy_same": len(deltas), "reward_pairs": len(deltas),
             "reward_delta_sum": sum(deltas), "reward_delta_sq_sum": sum(d * d for d in deltas)}
        return analyse(Window(golden=g), cfg, t)

    assert verdict([0.0] * 16)[0] == "pass"
    assert verdict([-1.0] + [0.0] * 15)[0] == "pass"  # one item of 16 flipped to wrong: a drop of 0.0625, not sure
    v, reasons, metrics = verdict([-1.0] * 8 + [0.0] * 8)  # half of them: the drop is at least 0.25
    assert v == "fail" and reasons[0].startswith("golden reward_drop 0.5000") and metrics["golden_reward_delta_bounds"][1] < -0.02
    assert verdict([-1.0] * 16)[0] == "fail"
    assert verdict([-1.0] * 2)[0] == "pass"  # no spread in 2 items is not certainty (the bound adds pseudo-items)


def test_int8_errors_need_min_samples_and_are_judged_against_fp16s_in_the_same_window():
    cfg, t = RolloutConfig(min_samples=20), GateThresholds(min_greedy_agreement=0.0)

    def verdict(errors_int8, n_int8, errors_fp16=0, n_fp16=400):
        return analyse(Window(requests={"int8": n_int8, "fp16": n_fp16},
                              errors={"int8": errors_int8, "fp16": errors_fp16}), cfg, t)

    assert verdict(1, 1)[0] == "inconclusive"  # one error of one request failed the window before
    assert verdict(5, 5)[0] == "inconclusive"  # below min_samples: no error rate yet
    v, reasons, metrics = verdict(15, 40)  # FP16 clean: INT8 judged as before
    assert v == "fail" and "exceeds fp16's" in reasons[0] and metrics["fp16_error_rate_upper_bound"] < 0.01
    # overload that fails both alike (35 % of each): not INT8's doing, nothing rolls back
    assert verdict(14, 40, errors_fp16=140)[0] == "pass"
    v, _, metrics = verdict(30, 40, errors_fp16=140)  # 75 % against 35 %: INT8 is worse with confidence
    assert v == "fail" and metrics["int8_error_rate_bounds"][0] > metrics["fp16_error_rate_upper_bound"] + 0.05
    assert verdict(15, 40, errors_fp16=3, n_fp16=5)[0] == "fail"  # 5 FP16 requests are no baseline: INT8 alone


def test_every_shadow_outcome_counts_a_request_of_the_variant_it_went_to():
    """A failed shadow counted a request and an error, a successful one nothing: a variant's error rate was over its
    failed shadows only."""
    import asyncio
    from types import SimpleNamespace

    from policy_bundle.serve.router.canary import LiveCanary

    class Counter:
        def labels(self, **_):
            return self

        def inc(self, *_):
            pass

    answers = iter([{"token_ids": [1, 2]}, {"token_ids": [1, 3]}, RuntimeError("variant down")])

    async def call(name, **_):
        a = next(answers)
        if isinstance(a, Exception):
            raise a
        return a

    canary = LiveCanary.__new__(LiveCanary)
    canary.pool, canary.admission = SimpleNamespace(call=call), SimpleNamespace(release=lambda background: None)
    canary.metrics = SimpleNamespace(shadow=Counter(), errors=Counter())
    canary.window, canary.excluded = Window(), {"int8": 0, "fp16": 0}
    for _ in range(3):  # INT8 served; its shadow goes to FP16: same, different, failed
        asyncio.run(canary._shadow("int8", {}, [1, 2]))
    w = canary.window
    assert (w.requests["fp16"], w.errors["fp16"], w.shadow_pairs, w.shadow_same) == (3, 1, 2, 1)
    assert w.requests["int8"] == 0
