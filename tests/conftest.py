"""Shared fixtures: the cached reference policy, an isolated BentoML store, one small real bundle (with
int8-vllm/ where vLLM is installed)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Three workers on 2 cores: each worker and every process it starts (a build, a server's workers, vLLM)
    # computes on one thread. With torch's default (one thread per core in every process) two builds side by
    # side took 149 s where one alone took 27 s (OpenMP threads spinning against each other); on one thread
    # each, the pair took 27 s (reference policy, SMALL build).
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")

from cli_helpers import SMALL, WITH_INT8_VLLM, run_cli, shared_tmp


@pytest.fixture(scope="session")
def bentoml_home(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("bentoml")
    os.environ["BENTOML_HOME"] = str(home)
    return home


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    from policy_bundle.quantize.reference.embedded import ensure_reference_policy

    return ensure_reference_policy()


@pytest.fixture(scope="session")
def small_bundle(tmp_path_factory, bentoml_home, reference_dir) -> Path:
    """Built once per run: the first worker to ask builds it (registered in its store); the other waits on the
    lock, checks the built bundle against its manifest and registers it in its own store."""
    from filelock import FileLock

    from serve_helpers import register_into

    shared = shared_tmp(tmp_path_factory)
    out = shared / "small-reference"
    with FileLock(str(shared / "small-reference.lock")):
        if not (out / "bundle.json").is_file():
            res = run_cli("build", "--config", "build/configs/main.yaml", "--out", str(out), *SMALL,
                          *WITH_INT8_VLLM)
            assert res.returncode == 0, res.stderr[-3000:]
            return out
    register_into(out, bentoml_home)  # checked against its manifest first
    return out


@pytest.fixture(scope="module")
def state(tmp_path_factory) -> Path:
    """A folder per test module for its router servers' configs, state and logs (tests/serve_helpers.env_for)."""
    return tmp_path_factory.mktemp("serve")


def missing(what: str) -> None:
    """Skip a test whose real dependency is absent, except under CI (``POLICY_BUNDLE_CI=1``, set by .ci/run),
    where a missing dependency is a failure: nothing is silently left untested there."""
    if os.environ.get("POLICY_BUNDLE_CI"):
        pytest.fail(f"{what} (CI requires it)")
    pytest.skip(what)


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL server on loopback for the whole session."""
    from policy_bundle.loadtest.postgres import PostgresServer, fresh_root

    try:
        server = PostgresServer(fresh_root()).start()
    except (FileNotFoundError, RuntimeError) as exc:
        missing(f"PostgreSQL: {exc}")
    yield server
    server.remove()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI (``POLICY_BUNDLE_CI=1``) every skip is a failure: a ``needs_vllm`` skip that would pass
    silently on a machine without vLLM fails there instead."""
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("POLICY_BUNDLE_CI") and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"skipped under CI, where nothing may be left untested: {report.longrepr}"


# ---- parallel runs (pytest-xdist: ``-n 3 --dist loadfile`` in pyproject's addopts) ------------------------
# One file's tests run in one worker (its module fixtures, a built bundle, a running server, an image, are made
# once). Files go to the workers in this order (``--no-loadscope-reorder``): the longest first, measured on 2 cores,
# so no worker starts a long file at the end while the others idle; the second and third files need no shared
# bundle (test_torchtitan trains and builds its own, test_w8a8_build builds its own), so those workers compute
# while the first builds the small bundle instead of waiting on its lock. Within a file the order stays as written.
LONGEST_FIRST = ("test_real_lm", "test_drills", "test_torchtitan", "test_w8a8_build", "test_drills_faults",
                 "test_serve", "test_serve_rollback", "test_mesh", "test_build_cli", "test_container", "test_rollout_replicas", "test_watch",
                 "test_serve_faults", "test_serve_failure_paths", "test_gate", "test_real_lm_quick",
                 "test_serve_lifecycle", "test_serve_access", "test_serve_formats", "test_artifact_gate", "test_outliers", "test_bento",
                 "test_batching", "test_vllm_launch", "test_gguf_peer", "test_build_output", "test_tokenizer")


def cpu_line() -> str:
    """The CPU the suite ran on: kernels and figures differ between AVX2, AVX-512 VNNI and AMX machines (fbgemm's int8
    sums saturate without VNNI), and CI's machine has not always been the one described. Never fails the run."""
    try:
        from policy_bundle.quantize.runtime.fbgemm_int8 import cpu_flags, fbgemm_saturates, use_fbgemm

        flags = cpu_flags()
        named = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8", "amx_bf16") if f in flags]
        use_fbgemm()
        return (f"cpu: {len(os.sched_getaffinity(0))} cores, {' '.join(named) or 'no AVX2/AVX-512/VNNI/AMX flags'}; "
                f"fbgemm int8 sums saturate: {fbgemm_saturates()}")
    except Exception as exc:  # noqa: BLE001 - a log line, not a test
        return f"cpu: not described ({type(exc).__name__}: {exc})"


def pytest_terminal_summary(terminalreporter) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # once, beside the result line (the header is hidden under -q)
        terminalreporter.write_line(cpu_line())


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("OMP_NUM_THREADS") == "1":
        import torch

        torch.set_num_threads(1)  # in case something imported torch before this file set the variable


def pytest_collection_modifyitems(config, items):
    rank = {m: i for i, m in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rpartition(".")[2], len(rank)))  # stable sort
