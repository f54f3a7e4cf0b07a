"""``policy-bundle watch`` under failures: a broken checkpoint is retried with backoff and given up, a build failure that
may pass is retried while one that would fail again is not, the state file stays bounded and only ``--keep`` built
bundles stay (the real checks and builds: tests/test_watch.py)."""

import json
from pathlib import Path

import pytest

from policy_bundle.build.errors import GateError, ConfigError, MeshError, RegistrationError
from policy_bundle.build.source.memory_plan import BuildMemoryError
from policy_bundle.build.watch import monitor
from policy_bundle.build.watch.watch_state import BUILD_FAILED, CHECK_FAILED, MAX_CHECKS, WatchState, prune


def state_in(tmp_path, **opts):
    bundle = tmp_path / "deployed"
    bundle.mkdir(exist_ok=True)
    state_file = tmp_path / "watch-state.json"
    if not state_file.exists():
        state_file.write_text(json.dumps({"origin": str(bundle.resolve()), "deployed": str(bundle.resolve()),
                                          "deployed_step": 0, "last_step": 0, "checks": []}))
    o = monitor.WatchOptions(bundle=bundle, checkpoints=tmp_path, out_root=tmp_path, **opts)
    return o, WatchState(o, monitor.step_of)


def failed(step, decision=CHECK_FAILED, **kw):
    return {"step": step, "checkpoint": f"step-{step}", "decision": decision, "new_bundle": None, **kw}


def test_a_failing_checkpoint_is_retried_until_max_retries_then_given_up(tmp_path):
    _, state = state_in(tmp_path)
    for n in range(1, 3):
        state.record(failed(1000), max_retries=3)
        assert state.data["last_step"] == 0 and state.failures(1000) == n  # not done: tried again
    state.record(failed(1000), max_retries=3)
    assert state.data["last_step"] == 1000 and state.failures(1000) == 0  # given up: a newer checkpoint is next
    assert state.data["checks"][-1]["decision"] == "check failed, given up"


@pytest.mark.parametrize("exc, transient", [(MeshError("actor died"), True), (RegistrationError("store"), True),
                                            (GateError("gate"), False), (ConfigError("x"), False),
                                            (BuildMemoryError("too big"), False)])
def test_a_build_failure_that_may_pass_is_retried_and_one_that_would_fail_again_is_not(tmp_path, exc, transient):
    """One transient build failure skipped a checkpoint for good; a failed gate was retried like a broken mesh."""
    assert isinstance(exc, monitor.PERMANENT) is not transient
    _, state = state_in(tmp_path)
    state.record(failed(2000, BUILD_FAILED, transient=not isinstance(exc, monitor.PERMANENT)), max_retries=5)
    assert state.data["last_step"] == (0 if transient else 2000)


def test_the_state_file_keeps_the_newest_checks(tmp_path):
    _, state = state_in(tmp_path)
    for step in range(MAX_CHECKS + 25):
        state.record({"step": step, "decision": "no drift", "new_bundle": None})
    data = json.loads((tmp_path / "watch-state.json").read_text())
    assert len(data["checks"]) == MAX_CHECKS and data["checks_dropped"] == 25 and data["checks"][-1]["step"] == \
        MAX_CHECKS + 24


def test_the_monitor_backs_off_between_failures_of_one_checkpoint(tmp_path, monkeypatch):
    opts, _ = state_in(tmp_path, poll_s=10.0, max_retries=4)
    monkeypatch.setattr(monitor, "verify_bundle", lambda p: None)
    monkeypatch.setattr(monitor, "read_manifest", lambda p: {"config": {"policy": {}}})
    monkeypatch.setattr(monitor, "complete_checkpoints", lambda root, titan: [(1000, tmp_path / "step-1000")])
    monkeypatch.setattr(monitor, "check", lambda o, s, step, ckpt: failed(step, error="truncated weights"))  # fault
    waits = []

    class Done(Exception):
        pass

    def sleep(s):
        waits.append(s)
        if len(waits) > 4:
            raise Done

    monkeypatch.setattr(monitor.time, "sleep", sleep)
    with pytest.raises(Done):
        monitor.watch(opts)
    assert waits[:3] == [10.0, 20.0, 40.0]  # then the 4th failure gives it up: back to polling every 10 s
    assert waits[3:] == [10.0, 10.0]
    checks = json.loads((tmp_path / "watch-state.json").read_text())["checks"]
    assert [c["decision"] for c in checks] == ["check failed"] * 3 + ["check failed, given up"]


def test_keep_removes_the_oldest_built_bundles_but_never_the_deployed_one(tmp_path):
    _, state = state_in(tmp_path)
    dirs = []
    for step in (1000, 2000, 3000):
        d = tmp_path / f"b-step-{step}"
        d.mkdir()
        dirs.append(d)
        state.record({"step": step, "decision": "drift, rebuilt", "new_bundle": str(d.resolve())})
    prune(state, keep=1)
    assert [d.exists() for d in dirs] == [False, False, True]
    assert [b["step"] for b in state.data["built"]] == [3000]
    assert Path(state.data["deployed"]) == dirs[-1].resolve()
