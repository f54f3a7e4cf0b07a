"""A deliberately broken INT8 bundle (the drills' one) behind real router servers: its own rollout, rolled back
while every request succeeds; entries from different builds and a tampered entry refused."""

import asyncio
import json
import os

import httpx
import pytest

from cli_helpers import shared_tmp
from serve_helpers import ADMIN, Server, admin, bundle_version, burst, complete, env_for


@pytest.fixture(scope="module")
def broken_version(tmp_path_factory, small_bundle, bentoml_home):
    """The drills' broken bundle (gate off, one scale x400), shared with them: built once per run."""
    from policy_bundle.loadtest.drill_kit import build_bundle

    out = tmp_path_factory.mktemp("broken") / "bundle"
    os.environ["POLICY_BUNDLE_DRILL_BUNDLES"] = str(shared_tmp(tmp_path_factory) / "drill-bundles")
    try:
        version = build_bundle(bentoml_home, out, broken=True)
    finally:
        del os.environ["POLICY_BUNDLE_DRILL_BUNDLES"]
    assert json.loads((out / "bundle.json").read_text())["test_fault"] == "scale:layer=layers.0.mlp.down_proj:factor=400"
    return version


def test_a_new_bundle_starts_its_own_rollout_at_the_first_step(small_bundle, broken_version, state):
    """A promoted pair's state never carries over to the next build; the earlier pair stays readable."""
    old = Server(env_for(state, "pairs", bundle_version(small_bundle), vllm=False), state / "pairs-old.log")
    try:
        old.wait_ready()
        for _ in range(5):
            admin(old, "promote")
        assert httpx.get(f"{old.url}/admin/rollout", headers=ADMIN).json()["state"]["status"] == "promoted"
    finally:
        old.stop()
    new = Server(env_for(state, "pairs", broken_version, vllm=False), state / "pairs-new.log")
    try:
        new.wait_ready()
        got = httpx.get(f"{new.url}/admin/rollout", headers=ADMIN).json()
        assert (got["state"]["weight"], got["state"]["status"], got["pair"]["label"]) == (1.0, "progressing",
                                                                                         broken_version)
        pairs = httpx.get(f"{new.url}/admin/rollout/pairs", headers=ADMIN).json()["pairs"]
        assert [(p["label"], p["state"]["status"]) for p in pairs] == [
            (broken_version, "progressing"), (bundle_version(small_bundle), "promoted")]
        history = httpx.get(f"{new.url}/admin/rollout/history", headers=ADMIN).json()["history"]
        assert [e["event"] for e in history] == ["start"]
    finally:
        new.stop()


def test_an_int8_and_fp16_entry_from_different_builds_are_refused(small_bundle, broken_version):
    import bentoml

    from policy_bundle.serve.model_entries import bundle_pair

    with pytest.raises(SystemExit, match="come from different builds"):
        bundle_pair(bentoml.models.BentoModel(f"policy-int8:{bundle_version(small_bundle)}"),
                    bentoml.models.BentoModel(f"policy-fp16:{broken_version}"))


def test_broken_bundle_is_rolled_back_while_every_request_succeeds(broken_version, state):
    """Also: the build that had a test fault set records it in its manifest."""
    server = Server(env_for(state, "broken", broken_version, vllm=False, rollout={"golden_items": 32}),
                    state / "broken.log").wait_ready()
    try:
        # an operator's weight holds the rollout without switching off automatic rollback
        assert admin(server, "set-weight", weight=50)["state"]["status"] == "held"
        verdicts = []
        for _ in range(2):
            bodies = [{"model": "policy", "prompt": p, "temperature": 0, "max_tokens": 6, "user": f"u{i}"}
                      for i, p in enumerate(["358+64=", "12+34=", "999+1=", "5+5="] * 5)]
            responses = asyncio.run(burst(server.url, bodies))
            assert all(r.status_code == 200 for r in responses)
            admin(server, "golden-canary")
            verdicts.append(admin(server, "analyse")["verdict"])
        state_now = httpx.get(f"{server.url}/admin/rollout", headers=ADMIN).json()["state"]
        assert verdicts == ["fail", "fail"] and state_now["weight"] == 0.0 and state_now["status"] == "rolled-back"
        history = httpx.get(f"{server.url}/admin/rollout/history", headers=ADMIN).json()["history"]
        assert history[-1]["event"] == "rollback" and "failed analyses" in history[-1]["reason"]
        assert all(complete(server, user=f"u{i}").headers["x-policy-variant"] == "fp16" for i in range(10))
        # a restart on the same state keeps it rolled back (auto_start starts only a pair that has no rollout)
        server.stop()
        server = Server(env_for(state, "broken", broken_version, vllm=False, rollout={"golden_items": 32}),
                        state / "broken-restarted.log").wait_ready()
        again = httpx.get(f"{server.url}/admin/rollout", headers=ADMIN).json()["state"]
        assert again["status"] == "rolled-back" and again["weight"] == 0.0
        assert all(complete(server, user=f"u{i}").headers["x-policy-variant"] == "fp16" for i in range(10))
    finally:
        server.stop()


def test_golden_runs_judge_the_items_pooled_over_a_window_not_one_small_run(broken_version, state):
    """Two golden items that disagree with FP32 (or lose their task reward) are no evidence of a bad policy (a good one
    misses that often: the served SmolLM2-135M default bundle scored 6 of 16 against its gate's 0.5); the window keeps
    them, and the same misses over more items fail it. Judged per run, the first analysis failed."""
    server = Server(env_for(state, "golden-pooled", broken_version, vllm=False,
                            rollout={"golden_items": 2, "shadow_fraction": 0.0,
                                     "thresholds": {"min_greedy_agreement": 0.5}}),
                    state / "golden-pooled.log").wait_ready()
    try:
        run = admin(server, "golden-canary")
        assert (run["golden"]["items"], run["window_golden"]["items"]) == (2, 2)
        first = admin(server, "analyse")
        assert first["verdict"] == "inconclusive", first
        lo, hi = first["metrics"]["golden_greedy_agreement_bounds"]
        assert hi > 0.5 and first["metrics"]["golden"]["items"] == 2
        verdicts = []
        for _ in range(6):  # 2 items a run, pooled: at 0 of 4 matching the upper bound is 0.49
            pooled = admin(server, "golden-canary")["window_golden"]
            verdicts.append(admin(server, "analyse"))
            if verdicts[-1]["verdict"] != "inconclusive":
                break
        last = verdicts[-1]
        assert last["verdict"] == "fail", verdicts
        assert last["metrics"]["golden"]["items"] == pooled["items"] > 2
        assert all(r.startswith("golden ") and f"{pooled['items']} items" in r for r in last["reasons"]), last
        m = last["metrics"]  # whichever failed (greedy agreement or task reward: the broken policy loses both), by its bound
        assert m["golden_greedy_agreement_bounds"][1] < 0.5 or m["golden_reward_delta_bounds"][1] < -0.02
    finally:
        server.stop()


def test_tampered_store_entry_stops_the_variant_from_starting(small_bundle):
    import bentoml

    from policy_bundle.serve.model_entries import verified_artifact

    model = bentoml.models.get(f"policy-int8:{bundle_version(small_bundle)}")
    target = model.path_of("int8/config.json")
    original = open(target).read()
    try:
        open(target, "w").write(original + " ")
        with pytest.raises(SystemExit, match="failed verification"):
            verified_artifact(bentoml.models.BentoModel(str(model.tag)), "int8")
    finally:
        open(target, "w").write(original)
    json.loads(original)
