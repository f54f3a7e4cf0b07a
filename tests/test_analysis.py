"""One analysis window's verdict (``serve/analysis.py``): golden runs judged by the bundle's gate, shadow flips and
INT8 errors failing only with confidence, the p99 ratio judged only over enough samples."""

from policy_bundle.quantize.fidelity import GateThresholds
from policy_bundle.serve.analysis import Window, analyse, wilson_interval
from policy_bundle.serve.rollout_types import RolloutConfig


def test_golden_runs_are_judged_with_the_bundle_thresholds():
    w = Window(golden={"items": 16, "greedy_agreement": 0.6, "reward_delta": 0.0})
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
