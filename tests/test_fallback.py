"""The layer-fallback search: an early answer when the budget cannot pass, else the smallest passing prefix."""

import io
import time
from contextlib import redirect_stderr

import torch

from policy_bundle.build.gate.fallback import FallbackSearch, search_fallback
from policy_bundle.build.progress import heartbeat, set_status
from policy_bundle.quantize.fidelity.scores import FidelityReport, GateThresholds

RANKING = [(f"layers.{i}.mlp.down_proj", 1.0 / (i + 1)) for i in range(10)]
GATE = GateThresholds(max_kl_mean=0.1, min_greedy_agreement=0.5)


def search_over(kl_with_k_float, greedy_with_k_float=lambda k: 1.0):
    """A search whose 'model' is the number of layers kept in float and whose metrics are given per k;
    it records which k each measurement saw."""
    seen = []

    def report(k, greedy):
        return FidelityReport(items=1, tokens=1, top1_agreement=1.0, kl_mean=kl_with_k_float(k), kl_p99=0.0,
                              greedy_agreement=greedy_with_k_float(k) if greedy else None)

    def logits_only(k):
        seen.append(("teacher-forced", k))
        return report(k, False)

    def whole(k):
        seen.append(("whole", k))
        return report(k, True)

    search = FallbackSearch("test", lambda kept: len(kept), GATE, whole, logits_only)
    return search, seen


def test_a_candidate_that_fails_with_its_whole_budget_in_float_is_rejected_after_one_more_measurement():
    search, seen = search_over(lambda k: 1.0 - 0.01 * k)  # never below 0.1
    out = search_fallback(search, lambda: RANKING, max_fp_layers=8)
    assert seen == [("teacher-forced", 0), ("teacher-forced", 8)]
    assert not out.verdict.passed and len(out.fp32_layers) == 8
    assert "even with its 8 most sensitive layers in float" in out.rejected


def test_the_smallest_passing_prefix_is_found_by_bisection():
    search, seen = search_over(lambda k: 0.5 if k < 5 else 0.05)
    out = search_fallback(search, lambda: RANKING, max_fp_layers=8)
    assert out.verdict.passed and out.fp32_layers == [n for n, _ in RANKING[:5]]
    assert len(seen) <= 6 and seen[-1] == ("whole", 5)
    assert all(r.startswith("sensitivity rank") for r in out.reasons.values())


def test_greedy_misses_move_the_search_up_with_the_whole_gate():
    search, seen = search_over(lambda k: 0.5 if k < 2 else 0.05, lambda k: 0.0 if k < 6 else 1.0)
    out = search_fallback(search, lambda: RANKING, max_fp_layers=8)
    assert out.verdict.passed and len(out.fp32_layers) == 6
    assert ("whole", 2) in seen and ("whole", 8) in seen


def test_a_passing_candidate_is_never_ranked():
    search, seen = search_over(lambda k: 0.0)
    out = search_fallback(search, lambda: (_ for _ in ()).throw(AssertionError("ranked")), max_fp_layers=8)
    assert out.verdict.passed and out.fp32_layers == [] and seen == [("teacher-forced", 0), ("whole", 0)]


def test_the_heartbeat_prints_the_status_while_nothing_else_does():
    err = io.StringIO()
    with redirect_stderr(err), heartbeat(every=0.1):
        set_status("candidate 1/2 smooth-w8a8: sensitivity 3/10 linears; best so far: none passed yet")
        deadline = time.monotonic() + 5
        while "[progress]" not in err.getvalue() and time.monotonic() < deadline:
            torch.mm(torch.ones(64, 64), torch.ones(64, 64))
    assert "[progress]" in err.getvalue() and "sensitivity 3/10 linears" in err.getvalue()


def held_out(passes_from: int, judged: list):
    """A held-out judgement that passes with at least ``passes_from`` layers in float; records each k judged."""
    from dataclasses import replace

    from policy_bundle.quantize.fidelity.scores import GateVerdict

    def confirm(out):
        k = len(out.fp32_layers)
        judged.append(k)
        ok = k >= passes_from
        return replace(out, verdict=GateVerdict(ok, [] if ok else ["kl_mean held out"]),
                       rejected="" if ok else "passes on the search prompts but fails on the held-out gate prompts")
    return confirm


def test_a_prefix_the_held_out_prompts_fail_walks_up_to_more_float_layers_then_back_to_the_fewest():
    search, seen = search_over(lambda k: 0.5 if k < 2 else 0.05)
    judged = []
    search.confirm = held_out(5, judged)
    out = search_fallback(search, lambda: RANKING, max_fp_layers=8)
    # one more up to 3, then doubling: 2 -> 3 -> 6 passes at 6; the prefixes it stepped over are bisected: 4 fails, 5
    # passes
    assert judged == [2, 3, 6, 4, 5] and out.verdict.passed and out.fp32_layers == [n for n, _ in RANKING[:5]]
    # each larger prefix passed the search prompts (teacher-forced) before it was judged held out; the greedy
    # confirmation is the held-out judgement's, never run on the search prompts
    assert ("teacher-forced", 8) in seen and not [k for what, k in seen if what == "whole"]


def test_a_stepped_over_prefix_that_fails_held_out_keeps_the_larger_one():
    search, _ = search_over(lambda k: 0.5 if k < 2 else 0.05)
    judged = []
    search.confirm = held_out(6, judged)
    out = search_fallback(search, lambda: RANKING, max_fp_layers=8)
    assert judged == [2, 3, 6, 4, 5] and out.verdict.passed and len(out.fp32_layers) == 6


def test_a_held_out_gap_of_one_or_two_layers_is_walked_one_at_a_time():
    """The gap SmolLM2-135M's default builds showed: the held-out prompts asking for 1-2 more float layers than the
    search prompts. Doubling judged 2, 4 and 3 for 3 layers; stepping judges 2 and 3."""
    from policy_bundle.build.gate.fallback import held_out_step

    assert [held_out_step(k) for k in range(6)] == [1, 2, 3, 6, 8, 10]
    search, _ = search_over(lambda k: 0.5 if k < 1 else 0.05)
    judged = []
    search.confirm = held_out(3, judged)
    out = search_fallback(search, lambda: RANKING, max_fp_layers=8)
    assert judged == [1, 2, 3] and out.verdict.passed and len(out.fp32_layers) == 3


def test_the_held_out_walk_stops_at_the_budget_and_says_so():
    search, _ = search_over(lambda k: 0.5 if k < 2 else 0.05)
    judged = []
    search.confirm = held_out(100, judged)  # never passes held out
    out = search_fallback(search, lambda: RANKING, max_fp_layers=6)
    assert judged == [2, 3, 6] and not out.verdict.passed and len(out.fp32_layers) == 6
    assert "still fail with 6 layer(s) in float, walked up from 2; gate.max_fp_layers=6" in out.rejected


def test_a_candidate_passing_the_search_with_nothing_in_float_is_ranked_when_held_out_fails():
    search, _ = search_over(lambda k: 0.0)
    judged = []
    search.confirm = held_out(1, judged)
    out = search_fallback(search, lambda: RANKING, max_fp_layers=8)
    assert judged == [0, 1] and out.verdict.passed and out.fp32_layers == [RANKING[0][0]]


def test_the_torch_ao_walk_goes_on_one_layer_at_a_time_after_a_held_out_failure():
    from policy_bundle.build.gate.fallback import walk_fallback

    search, _ = search_over(lambda k: 0.5 if k < 2 else 0.05)
    judged = []
    search.confirm = held_out(3, judged)
    out = walk_fallback(search, lambda: RANKING, max_fp_layers=8)
    assert judged == [2, 3] and out.verdict.passed and len(out.fp32_layers) == 3
