"""Two router replicas on one real PostgreSQL rollout database, over HTTP: a transition made by either is
obeyed by both within one sync tick, and a database restart mid-rollout loses no event and no transition."""

import time

import httpx
import pytest

from serve_helpers import Server, bundle_version
from test_serve import ADMIN, FORCE_INT8, admin, complete, env_for



def users_on(variant: str, weight: float, n: int) -> list:
    """``n`` sticky users the router sends to ``variant`` at INT8 ``weight`` (default salt): routed traffic, which is
    rollout evidence (a forced variant is not)."""
    from policy_bundle.serve.router.routing import sticky_bucket

    out, i = [], 0
    while len(out) < n:
        user, i = f"user-{i}", i + 1
        if (sticky_bucket("policy-bundle", user) < weight) == (variant == "int8"):
            out.append(user)
    return out


@pytest.fixture(scope="module")
def replicas(small_bundle, postgres, tmp_path_factory):
    state = tmp_path_factory.mktemp("replicas")
    version = bundle_version(small_bundle)
    servers = []
    try:
        # replica a judges latency with an impossible bound (an injected bad verdict): its windows fail
        steps = [1, {"weight": 5, "pause": "indefinite"}, {"weight": 50, "pause_s": 3}, 100]
        for name, strict in (("a", {"max_p99_latency_ratio": 0.0, "min_latency_samples": 1}), ("b", {})):
            # two whole routers (four variant workers) on a 2-core machine beside other test workers: a probe or a
            # decode step slowed by that contention must not mark a variant down here (these tests are about the
            # rollout's transitions; the down/up detection has its own tests in test_serve_faults.py)
            env = env_for(state, name, version, vllm=False, health_timeout_s=15.0,
                          rollout={"sync_interval_s": 0.5, "steps": steps, "inconclusive_limit": 2, **strict})
            env["POLICY_BUNDLE_STATE_URL"] = postgres.url
            servers.append(Server(env, state / f"{name}.log"))
        yield [s.wait_ready() for s in servers]
    finally:
        for s in servers:
            s.stop()


def test_racing_replicas_on_postgres_never_write_the_same_version_twice(postgres):
    """8 threads on 4 replicas (each its own engine) set weights as fast as they can: every transition
    lands at a distinct version, and the history holds exactly the transitions that succeeded."""
    from concurrent.futures import ThreadPoolExecutor

    from policy_bundle.serve.rollout.machine import RolloutController
    from policy_bundle.serve.rollout.types import RolloutConfig
    from policy_bundle.serve.rollout.state import BundlePair, RolloutDatabase

    pair = BundlePair("c" * 64, "c" * 64, "race")
    replicas = [RolloutController(RolloutDatabase(postgres.url, f"r{i}"), pair, RolloutConfig(), f"r{i}")
                for i in range(4)]

    def hammer(i: int) -> int:
        ctl = replicas[i % 4]
        done = 0
        for k in range(10):
            ctl.command("set-weight", float(10 * i + k), reason=f"r{i}-{k}")
            done += 1
        return done

    with ThreadPoolExecutor(8) as pool:
        total = sum(pool.map(hammer, range(8)))
    events = replicas[0].db.history(pair, 10000)
    versions = [e.state_version for e in events]
    assert versions == list(range(1, total + 2))  # the start, then one version per command: none lost, none twice
    replicas[0].refresh()
    assert replicas[0].version == total + 1


def rollout_of(server) -> dict:
    return httpx.get(f"{server.url}/admin/rollout", headers=ADMIN, timeout=30).json()


def wait_for(server, status: str, version: int = 0, seconds: float = 5.0) -> dict:
    """The replica's rollout once it shows ``status`` at ``version`` or newer (or after ``seconds``)."""
    deadline = time.monotonic() + seconds
    while True:
        got = rollout_of(server)
        if (got["state"]["status"] == status and got["state_version"] >= version) or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def test_both_replicas_serve_the_same_pair_from_one_state_row(replicas):
    a, b = replicas
    admin(a, "restart")
    ra = rollout_of(a)
    rb = wait_for(b, "progressing", ra["state_version"])
    assert ra["pair"] == rb["pair"] and ra["pair"]["int8_manifest"] == ra["pair"]["fp16_manifest"]
    assert ra["state_version"] == rb["state_version"]


def test_a_pause_sent_to_one_replica_holds_both(replicas):
    a, b = replicas
    admin(a, "restart")
    assert admin(a, "pause")["state"]["status"] == "paused"
    # obeyed through the database (sync ticks every 0.5 s); 5 s of slack for a busy 2-core machine, not a timing test
    assert wait_for(b, "paused", seconds=5.0)["state"]["status"] == "paused"
    for _ in range(3):
        complete(b, max_tokens=4)
        assert admin(b, "analyse")["verdict"] in ("pass", "inconclusive", "stale", "idle")
    assert rollout_of(b)["state"]["status"] == "paused" and rollout_of(a)["state"]["status"] == "paused"
    admin(b, "resume")
    assert wait_for(a, "progressing")["state"]["status"] == "progressing"


def analysed(server) -> dict:
    admin(server, "golden-canary")  # 16 golden items: enough evidence for a verdict
    return admin(server, "analyse")


def test_an_indefinite_step_waits_for_promote_and_a_timed_step_for_its_pause(replicas):
    _, b = replicas
    admin(b, "restart")
    assert analysed(b)["verdict"] == "pass"
    assert (rollout_of(b)["state"]["weight"], rollout_of(b)["state"]["status"]) == (5.0, "awaiting-promote")
    assert analysed(b)["verdict"] == "pass" and rollout_of(b)["state"]["weight"] == 5.0  # passing never moves it
    assert admin(b, "promote")["state"]["weight"] == 50.0
    assert analysed(b)["verdict"] == "pass" and rollout_of(b)["state"]["weight"] == 50.0  # pause_s 3 not over
    time.sleep(3)
    assert analysed(b)["verdict"] == "pass" and rollout_of(b)["state"]["weight"] == 100.0


def test_inconclusive_analyses_pause_the_rollout_for_an_operator(replicas):
    _, b = replicas
    admin(b, "restart")
    assert admin(b, "analyse")["verdict"] == "idle"  # no traffic at all: not counted
    verdicts = []
    assert complete(b, headers=FORCE_INT8, max_tokens=3).status_code == 200
    assert admin(b, "analyse")["verdict"] == "idle"  # a forced variant is no evidence either
    for user in users_on("int8", 1.0, 2):  # some evidence, less than min_samples (10)
        r = complete(b, max_tokens=3, user=user)
        assert r.status_code == 200 and r.headers["x-policy-variant"] == "int8"
        verdicts.append(admin(b, "analyse")["verdict"])
    assert verdicts == ["inconclusive", "inconclusive"]
    got = rollout_of(b)["state"]
    assert (got["status"], got["weight"]) == ("paused", 1.0)
    assert "inconclusive analyses in a row" in history(b)[-1]["reason"]


def history(server) -> list:
    return httpx.get(f"{server.url}/admin/rollout/history", headers=ADMIN, timeout=30).json()["history"]


def test_a_rollback_decided_by_one_replica_is_obeyed_by_the_other(replicas):
    a, b = replicas
    admin(a, "restart")
    admin(a, "set-weight", weight=50)
    assert wait_for(b, "held")["state"]["weight"] == 50.0
    verdicts = []
    for _ in range(2):
        for user in users_on("int8", 50.0, 10) + users_on("fp16", 50.0, 10):
            assert complete(a, max_tokens=3, user=user).status_code == 200
        verdicts.append(admin(a, "analyse")["verdict"])
    assert verdicts == ["fail", "fail"]
    got = wait_for(b, "rolled-back")
    assert (got["state"]["status"], got["state"]["weight"]) == ("rolled-back", 0.0)
    assert all(complete(b, user=f"u{i}", max_tokens=3).headers["x-policy-variant"] == "fp16" for i in range(8))
    assert admin(b, "analyse")["verdict"] in ("pass", "inconclusive", "stale", "idle")  # b's verdict cannot undo it
    assert rollout_of(a)["state"]["status"] == "rolled-back"
    events = history(b)
    since = max(i for i, e in enumerate(events) if e["event"] == "set-weight")  # made on a
    rollbacks = [e for e in events[since:] if e["event"] == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0]["reason"].startswith("2 failed analyses")
    assert rollbacks[0]["replica"] == events[since]["replica"]  # decided once, by replica a


def test_a_database_restart_mid_rollout_loses_no_event_and_no_transition(replicas, postgres):
    a, b = replicas
    admin(a, "restart")
    wait_for(b, "progressing", rollout_of(a)["state_version"])
    before = history(a)
    postgres.stop()
    try:
        for server in (a, b):  # serving goes on at the last weight read
            assert complete(server, max_tokens=3).status_code == 200
        refused = httpx.post(f"{a.url}/admin/rollout", headers=ADMIN, json={"action": "promote"}, timeout=60)
        assert refused.status_code == 503 and "database" in refused.json()["error"]["message"]
        assert rollout_of(a)["state"]["weight"] == 1.0  # nothing changed in memory either
    finally:
        postgres.start()
    assert admin(b, "promote")["state"]["weight"] == 5.0
    deadline = time.monotonic() + 10
    while rollout_of(a)["state"]["weight"] != 5.0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert rollout_of(a)["state"]["weight"] == 5.0
    after = history(a)
    assert after[: len(before)] == before  # every earlier event is still there
    versions = [e["state_version"] for e in after if e["state_version"] is not None]
    assert versions == list(range(versions[0], versions[0] + len(versions)))  # no gap, no duplicate
    assert rollout_of(a)["state_version"] == rollout_of(b)["state_version"] == versions[-1]


def test_a_rollback_during_a_database_outage_applies_at_once_and_is_written_when_it_is_back(replicas, postgres):
    """The kill switch worked only with the database up: rollback and abort answered 503."""
    a, b = replicas
    admin(a, "restart")
    admin(a, "set-weight", weight=50)
    wait_for(b, "held")
    postgres.stop()
    try:
        r = httpx.post(f"{a.url}/admin/rollout", headers=ADMIN, json={"action": "rollback", "reason": "incident"},
                       timeout=60)
        assert r.status_code == 200 and r.json()["written"] is False, r.text
        assert r.json()["state"]["status"] == "rolled-back" and r.json()["state"]["weight"] == 0.0
        status = httpx.get(f"{a.url}/status", timeout=30).json()
        assert status["rollout_database"]["unwritten_stop"] == "rollback"
        assert all(complete(a, user=u, max_tokens=3).headers["x-policy-variant"] == "fp16"
                   for u in users_on("int8", 50.0, 6))  # INT8's users too: the stop holds on a at once
    finally:
        postgres.start()
    got = wait_for(b, "rolled-back", seconds=20)  # written by a once the database answers, then obeyed by b
    assert (got["state"]["status"], got["state"]["weight"]) == ("rolled-back", 0.0)
    assert httpx.get(f"{a.url}/status", timeout=30).json()["rollout_database"]["unwritten_stop"] is None
    assert "applied at once while the rollout database was unreachable" in history(b)[-1]["reason"]


def test_a_router_that_starts_while_its_database_is_down_serves_fp16_until_it_answers(small_bundle, postgres,
                                                                                     tmp_path):
    """It refused to start: a database outage took every restarting replica down with it."""
    env = env_for(tmp_path, "late", bundle_version(small_bundle), vllm=False, rollout={"sync_interval_s": 0.5})
    env["POLICY_BUNDLE_STATE_URL"] = postgres.url
    postgres.stop()
    server = Server(env, tmp_path / "late.log")
    try:
        server.wait_ready()
        got = rollout_of(server)
        assert (got["state"]["status"], got["state"]["weight"]) == ("database-unreachable", 0.0)
        assert httpx.get(f"{server.url}/status", timeout=30).json()["rollout_database"]["unreachable_since"]
        assert all(complete(server, user=u, max_tokens=3).headers["x-policy-variant"] == "fp16"
                   for u in users_on("int8", 50.0, 4))
        postgres.start()
        deadline = time.monotonic() + 20
        while rollout_of(server)["state"]["status"] == "database-unreachable" and time.monotonic() < deadline:
            time.sleep(0.5)
        assert rollout_of(server)["state"]["status"] != "database-unreachable"
        assert httpx.get(f"{server.url}/status", timeout=30).json()["rollout_database"]["unreachable_since"] is None
    finally:
        if not postgres.running():
            postgres.start()
        server.stop()


def test_two_routers_on_one_sqlite_file_obey_each_other(small_bundle, tmp_path):
    """The zero-set-up default shared by two processes (BentoML workers > 1, or replicas on one volume): both
    keep their state in one SQLite file; a command made on either holds on the other, and their writes never
    undo each other (compare-and-set on the state version)."""
    version = bundle_version(small_bundle)
    servers = []
    try:
        for name in ("a", "b"):
            env = env_for(tmp_path, name, version, vllm=False, rollout={"sync_interval_s": 0.5})
            env["POLICY_BUNDLE_STATE_DIR"] = str(tmp_path / "shared-state")  # one rollout.sqlite for both
            servers.append(Server(env, tmp_path / f"{name}.log"))
        a, b = [s.wait_ready() for s in servers]
        assert rollout_of(a)["pair"] == rollout_of(b)["pair"]
        assert admin(a, "pause")["state"]["status"] == "paused"
        assert wait_for(b, "paused", seconds=5.0)["state"]["status"] == "paused"
        admin(b, "resume")
        admin(b, "set-weight", weight=25)
        got = wait_for(a, "held", seconds=5.0)
        assert (got["state"]["status"], got["state"]["weight"]) == ("held", 25.0)
        assert rollout_of(a)["state_version"] == rollout_of(b)["state_version"]
        events = history(a)
        assert [e["event"] for e in events][-3:] == ["pause", "resume", "set-weight"]
        assert events[-3]["replica"] != events[-1]["replica"] == events[-2]["replica"]  # pause on a, the rest on b
        versions = [e["state_version"] for e in events if e["state_version"] is not None]
        assert versions == list(range(1, len(versions) + 1))  # one file, one sequence: no gap, none twice
    finally:
        for s in servers:
            s.stop()
