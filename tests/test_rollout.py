"""Rollout state machine and its database, in process (one window's verdict is in test_analysis, the HTTP
behaviour in test_serve*, the shared-database replicas in test_rollout_replicas)."""

import time

import pytest

from policy_bundle.quantize.fidelity.scores import GateThresholds
from policy_bundle.serve.rollout.machine import RolloutController
from policy_bundle.serve.rollout.types import RolloutConfig, RolloutStep
from policy_bundle.serve.rollout.state import BundlePair, RolloutDatabase, StateConflict, StoreUnavailable, default_url

PAIR = BundlePair("a" * 64, "a" * 64, "ref-aaaa")


def controller(tmp_path, pair=PAIR, **cfg) -> RolloutController:
    return RolloutController(RolloutDatabase(default_url(tmp_path)), pair, RolloutConfig(**cfg), "test")


class FailingDatabase(RolloutDatabase):
    """An injected fault: the database refuses writes (server down, disk full)."""

    fail = False

    def transition(self, *args):
        if self.fail:
            raise StoreUnavailable("injected: database is down")
        return super().transition(*args)

    def append(self, *args):
        if self.fail:
            raise StoreUnavailable("injected: database is down")
        return super().append(*args)


def test_a_failed_save_changes_nothing_in_memory_but_a_stop_applies_at_once(tmp_path):
    """With the database down, promote and pause change nothing (503); a rollback was refused too, which left no kill
    switch: it now applies on this replica at once and is written when the database is back."""
    db = FailingDatabase(default_url(tmp_path))
    ctl = RolloutController(db, PAIR, RolloutConfig(), "test")
    before = (ctl.state.weight, ctl.state.status, ctl.state.step_index, ctl.version)
    db.fail = True
    for action in ("promote", "pause"):
        with pytest.raises(StoreUnavailable):
            ctl.command(action)
        assert (ctl.state.weight, ctl.state.status, ctl.state.step_index, ctl.version) == before
    assert ctl.command("rollback", reason="incident").status == "rolled-back" and ctl.state.weight == 0.0
    assert ctl.local_stop is not None and db.load(PAIR)[0]["status"] == "progressing"  # not written yet
    assert not ctl.refresh() and ctl.state.weight == 0.0  # still down: the stop holds here
    db.fail = False
    assert ctl.refresh() and ctl.local_stop is None
    body, version = db.load(PAIR)
    assert body["status"] == "rolled-back" and body["weight"] == 0.0 and version == ctl.version == before[3] + 1
    assert "applied at once while the rollout database was unreachable" in db.history(PAIR)[-1].reason


def test_failed_analyses_the_database_cannot_record_still_roll_back(tmp_path):
    db = FailingDatabase(default_url(tmp_path))
    ctl = RolloutController(db, PAIR, RolloutConfig(failure_limit=2), "test")
    db.fail = True
    assert ctl.apply("fail", ["int8 error rate"], {}) and ctl.state.weight == 1.0 and ctl.offline_failures == 1
    assert ctl.apply("fail", ["int8 error rate"], {}) and ctl.state.status == "rolled-back"
    assert not ctl.apply("pass", [], {})  # stopped here: no later verdict moves it back
    db.fail = False
    ctl.refresh()
    assert db.load(PAIR)[0]["status"] == "rolled-back"
    assert db.history(PAIR)[-1].reason.startswith("2 failed analyses: int8 error rate")


def test_a_router_that_starts_without_its_database_serves_fp16_until_it_answers(tmp_path):
    class Unreachable(RolloutDatabase):
        down = True

        def load(self, pair):
            if self.down:
                raise StoreUnavailable("injected: connection refused")
            return super().load(pair)

    db = Unreachable(default_url(tmp_path))
    ctl = RolloutController(db, PAIR, RolloutConfig(), "test")
    assert (ctl.state.status, ctl.state.weight, ctl.stopped()) == ("database-unreachable", 0.0, True)
    assert not ctl.refresh()
    db.down = False
    assert ctl.refresh() and (ctl.state.status, ctl.state.weight, ctl.version) == ("progressing", 1.0, 1)


def test_a_restored_older_row_is_adopted_instead_of_failing_every_command(tmp_path):
    import shutil

    ctl = controller(tmp_path)
    path = tmp_path / "rollout.sqlite"
    ctl.db.engine.dispose()
    shutil.copy(path, tmp_path / "backup.sqlite")  # version 1
    ctl.command("promote")
    ctl.command("promote")
    assert ctl.version == 3
    ctl.db.engine.dispose()
    for suffix in ("-wal", "-shm"):
        (tmp_path / f"rollout.sqlite{suffix}").unlink(missing_ok=True)
    shutil.copy(tmp_path / "backup.sqlite", path)  # the database restored from its backup
    assert ctl.command("promote").weight == 5.0 and ctl.version == 2  # from the restored row's step, not refused


def test_notes_written_while_the_database_is_down_are_kept_and_written_later(tmp_path):
    db = FailingDatabase(default_url(tmp_path))
    ctl = RolloutController(db, PAIR, RolloutConfig(), "test")
    db.fail = True
    ctl.note("variant-errors", "while down", {})
    ctl.flush()
    assert len(ctl.pending) == 1 and db.count(PAIR) == 1
    db.fail = False
    ctl.refresh()
    assert not ctl.pending and [e.reason for e in db.history(PAIR)][-1] == "while down"


def test_history_pages_from_the_newest(tmp_path):
    ctl = controller(tmp_path)
    for i in range(30):
        ctl.note("n", f"event {i}", {})
    ctl.flush()
    assert [e.reason for e in ctl.db.history(PAIR, 3)] == ["event 27", "event 28", "event 29"]
    assert ctl.db.count(PAIR) == 31


def test_a_new_bundle_pair_starts_its_own_rollout_and_the_old_history_stays(tmp_path):
    old = controller(tmp_path)
    old.command("promote")
    old.command("set-weight", 100.0)
    assert old.state.weight == 100.0
    new_pair = BundlePair("b" * 64, "b" * 64, "ref-bbbb")
    new = controller(tmp_path, pair=new_pair)
    assert (new.state.weight, new.state.status, new.state.step_index) == (1.0, "progressing", 0)
    assert [e.event for e in new.db.history(new_pair)] == ["start"]
    assert [e.event for e in new.db.history(PAIR)] == ["start", "promote", "set-weight"]
    assert [p["label"] for p in new.db.pairs()] == ["ref-bbbb", "ref-aaaa"]


def test_a_verdict_observed_under_an_older_version_is_dropped(tmp_path):
    a = controller(tmp_path)
    b = controller(tmp_path)  # a second replica on the same database
    seen = b.epoch()
    assert a.apply("pass", [], {}, observed=a.epoch()) and a.state.weight == 5.0
    assert not b.apply("pass", [], {}, observed=seen)  # stale: a moved first
    assert b.state.weight == 5.0 and b.version == a.version  # b re-read instead of promoting twice
    assert [e.event for e in a.db.history(PAIR)] == ["start", "promote"]


def test_compare_and_set_refuses_a_write_from_an_old_version(tmp_path):
    a, b = controller(tmp_path), controller(tmp_path)
    a.command("pause")
    with pytest.raises(StateConflict):
        b.db.transition(PAIR, 1, {"weight": 100.0}, a.db.history(PAIR)[-1])
    b.command("resume")  # commands re-read the newest state first
    assert b.version == 3 and b.state.status == "progressing"


def test_an_operator_weight_keeps_automatic_rollback(tmp_path):
    ctl = controller(tmp_path, failure_limit=2)
    assert ctl.command("set-weight", 40.0).status == "held"
    ctl.apply("pass", [], {})
    assert (ctl.state.weight, ctl.state.status) == (40.0, "held")  # passing never promotes a held weight
    ctl.apply("fail", ["bad"], {})
    ctl.apply("fail", ["bad"], {})
    assert (ctl.state.weight, ctl.state.status) == (0.0, "rolled-back")


def test_a_step_with_a_pause_waits_out_its_duration_before_the_next(tmp_path):
    ctl = controller(tmp_path, steps=(RolloutStep(1.0, pause_s=0.5), RolloutStep(100.0)))
    assert not ctl.apply("pass", [], {}) and ctl.state.weight == 1.0
    time.sleep(0.6)
    assert ctl.apply("pass", [], {}) and (ctl.state.weight, ctl.state.status) == (100.0, "progressing")


def test_an_indefinite_step_waits_for_a_manual_promote_but_still_rolls_back(tmp_path):
    steps = (RolloutStep(10.0), RolloutStep(50.0, indefinite=True), RolloutStep(100.0))
    ctl = controller(tmp_path, steps=steps, failure_limit=1)
    ctl.apply("pass", [], {})
    assert (ctl.state.weight, ctl.state.status) == (50.0, "awaiting-promote")
    for _ in range(3):
        ctl.apply("pass", [], {})
    assert (ctl.state.weight, ctl.state.status) == (50.0, "awaiting-promote")
    assert ctl.command("promote").weight == 100.0
    ctl2 = controller(tmp_path / "other", steps=steps, failure_limit=1)
    ctl2.apply("pass", [], {})
    ctl2.apply("fail", ["bad"], {})
    assert (ctl2.state.weight, ctl2.state.status) == (0.0, "rolled-back")


def test_inconclusive_analyses_pause_the_rollout_instead_of_promoting(tmp_path):
    ctl = controller(tmp_path, inconclusive_limit=3)
    for _ in range(2):
        ctl.apply("inconclusive", ["2 samples < min_samples 20"], {})
    assert (ctl.state.status, ctl.state.weight) == ("waiting", 1.0)
    ctl.apply("inconclusive", ["2 samples < min_samples 20"], {})
    assert (ctl.state.status, ctl.state.weight) == ("paused", 1.0)
    assert not ctl.apply("pass", [], {})  # paused: hands off until an operator resumes
    ctl.command("resume")
    assert ctl.apply("pass", [], {}) and ctl.state.weight == 5.0


def test_a_broken_metric_source_aborts_after_its_consecutive_error_limit(tmp_path):
    ctl = controller(tmp_path, consecutive_error_limit=3)
    ctl.command("promote")
    ctl.error("golden canary run failed")
    ctl.error("golden canary run failed")
    ctl.apply("inconclusive", ["few"], {})  # other analyses do not reset it: only a golden run that measured
    assert ctl.state.consecutive_errors == 2
    ctl.measured()
    assert ctl.state.consecutive_errors == 0
    for _ in range(3):
        ctl.error("golden canary run failed")
    assert (ctl.state.weight, ctl.state.status) == (0.0, "aborted")
    assert ctl.db.history(PAIR)[-1].event == "abort"


def test_abort_sets_int8_weight_to_zero_at_once(tmp_path):
    ctl = controller(tmp_path)
    ctl.command("set-weight", 60.0)
    assert (ctl.command("abort").weight, ctl.state.status) == (0.0, "aborted")
    assert not ctl.apply("pass", [], {})


def test_rollout_config_refuses_bad_steps_and_limits():
    for bad in ({"steps": (5.0, 1.0)}, {"steps": (0.0, 100.0)}, {"steps": (50.0, 120.0)}, {"steps": ()},
                {"failure_limit": 0}, {"confidence": 1.5}):
        with pytest.raises(ValueError, match="rollout"):
            RolloutConfig(**bad)


def test_resume_returns_to_the_status_the_pause_interrupted(tmp_path):
    steps = (RolloutStep(10.0), RolloutStep(50.0, indefinite=True), RolloutStep(100.0))
    ctl = controller(tmp_path, steps=steps)
    ctl.apply("pass", [], {})
    assert ctl.state.status == "awaiting-promote"
    ctl.command("pause")
    assert ctl.command("resume").status == "awaiting-promote"  # the manual gate still holds
    assert not ctl.apply("pass", [], {}) and ctl.state.weight == 50.0
    ctl.command("set-weight", 30.0)
    ctl.command("pause")
    assert ctl.command("resume").status == "held"


def test_a_stopped_rollout_cannot_be_paused_resumed_or_promoted_back_into_traffic(tmp_path):
    ctl = controller(tmp_path)
    ctl.command("rollback")
    for action in ("pause", "resume", "promote"):
        with pytest.raises(ValueError, match=f"action: {action} needs"):
            ctl.command(action)
    assert (ctl.state.weight, ctl.state.status, ctl.stopped()) == (0.0, "rolled-back", True)
    assert not ctl.apply("pass", [], {})
    assert ctl.command("restart").weight == 1.0


def test_an_operator_promote_into_an_indefinite_step_waits_there(tmp_path):
    steps = (RolloutStep(10.0), RolloutStep(50.0, indefinite=True), RolloutStep(100.0))
    ctl = controller(tmp_path, steps=steps)
    assert ctl.command("promote").status == "awaiting-promote"
    assert not ctl.apply("pass", [], {}) and ctl.state.weight == 50.0


def test_without_auto_start_an_operator_restart_creates_the_rollout(tmp_path):
    ctl = controller(tmp_path, auto_start=False)
    assert (ctl.state.status, ctl.version) == ("not-started", 0)
    assert ctl.command("restart").weight == 1.0 and ctl.version == 1


def test_a_refresh_never_goes_back_to_an_older_version(tmp_path):
    ctl = controller(tmp_path)
    old = ctl.db.load(PAIR)
    ctl.command("promote")
    real, reads = ctl.db.load, iter([old])
    ctl.db.load = lambda pair: next(reads, None) or real(pair)  # one read that raced with the commit above
    assert not ctl.refresh() and ctl.state.weight == 5.0


def test_notes_from_many_threads_are_each_written_once(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    ctl = controller(tmp_path)

    def work(i):
        for k in range(25):
            ctl.note("n", f"{i}-{k}", {})
            ctl.flush()

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(work, range(4)))
    ctl.flush()
    reasons = [e.reason for e in ctl.db.history(PAIR, 10000) if e.event == "n"]
    assert sorted(reasons) == sorted(f"{i}-{k}" for i in range(4) for k in range(25)) and not ctl.pending


class _Counter:
    def labels(self, **_):
        return self

    def inc(self, *_):
        pass

    def set(self, *_):
        pass


def test_an_inconclusive_window_keeps_collecting_until_its_pairs_bound_the_flip_rate(tmp_path):
    """Three windows of 15 unflipped shadow pairs: each alone straddles the allowed 0.1 (upper bound 0.20), so
    each analysis of a fresh window would say "more pairs needed" for ever; kept open, the third sees 45 pairs
    (upper bound 0.08) and promotes."""
    from types import SimpleNamespace

    from policy_bundle.serve.router.canary import LiveCanary

    cfg = RolloutConfig(min_samples=8, inconclusive_limit=5)
    ctl = controller(tmp_path, min_samples=8, inconclusive_limit=5)
    metrics = SimpleNamespace(verdicts=_Counter(), weight=_Counter(), shadow_agreement=_Counter(), set_rollout=lambda state: None)
    info = SimpleNamespace(golden=lambda: [], thresholds=GateThresholds(min_greedy_agreement=0.9))
    live = LiveCanary(None, None, ctl, info, None, SimpleNamespace(rollout=cfg), metrics)
    verdicts = []
    for _ in range(3):
        live.window.requests["int8"] += 4
        live.window.shadow_pairs += 15
        live.window.shadow_same += 15
        verdicts.append(live.analyse_now()["verdict"])
    assert verdicts == ["inconclusive", "inconclusive", "pass"] and ctl.state.weight == 5.0
    assert live.window.shadow_pairs == 0  # the promoted split starts from nothing
