"""Failure paths over a real `bentoml serve` with injected faults (POLICY_BUNDLE_TEST_FAULT): streams that fail
before or after their first token, loops that raise, vLLM that does not load, bad router settings, an INT8
engine the bundle cannot run."""

import json
import os
import time

import httpx
import pytest
import yaml

from cli_helpers import needs_vllm
from serve_helpers import Server, bundle_version, metric, sse_events

ADMIN = {"Authorization": "Bearer t"}
# INT8 fails before its first token, FP16 after two; the analysis and health loops raise on their first 2 ticks
FAULTS = "fail:after=0:name=int8;fail:after=2:name=fp16;loop:name=analysis,health:count=2"


def start(tmp_path, small_bundle, name, fault=None, config=None, wait=True, **env):
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump(config if config is not None else {
        "rollout": {"analysis_interval_s": 0.5, "golden_interval_s": 3600, "min_samples": 10}}))
    env = {"POLICY_BUNDLE_VERSION": bundle_version(small_bundle), "POLICY_BUNDLE_STATE_DIR": str(tmp_path / name),
           "POLICY_BUNDLE_ADMIN_TOKEN": "t", "POLICY_BUNDLE_ROUTER_CONFIG": str(cfg), "POLICY_BUNDLE_DISABLE_VLLM": "1",
           **({"POLICY_BUNDLE_TEST_FAULT": fault} if fault else {}), **env}
    server = Server(env, tmp_path / f"{name}.log")
    return server.wait_ready() if wait else server


@pytest.fixture(scope="module")
def faulty(tmp_path_factory, small_bundle):
    server = start(tmp_path_factory.mktemp("faulty"), small_bundle, "faulty", FAULTS)
    yield server
    server.stop()


def test_stream_that_fails_before_its_first_token_everywhere_is_a_503(faulty):
    served_before = metric(faulty, "policy_requests_total")
    body = {"model": "policy", "prompt": "12+34=", "max_tokens": 6, "temperature": 0, "stream": True}
    forced = {"x-policy-variant": "int8", "x-admin-token": "t"}  # only INT8, which fails before its first token
    with httpx.stream("POST", f"{faulty.url}/v1/completions", json=body, headers=forced, timeout=60) as r:
        r.read()
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "service_unavailable"
    assert metric(faulty, "policy_requests_total") == served_before  # not recorded as a success
    assert metric(faulty, "policy_errors_total", variant="int8") >= 1


def test_stream_fails_over_before_its_first_token_and_reports_a_mid_stream_failure(faulty):
    httpx.post(f"{faulty.url}/admin/rollout", json={"action": "set-weight", "weight": 100}, headers=ADMIN)
    errors_before = metric(faulty, "policy_errors_total", variant="fp16")
    body = {"model": "policy", "prompt": "12+34=", "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{faulty.url}/v1/completions", json=body, timeout=60) as r:
        events = sse_events(r)
        # INT8 was chosen and failed before a token: the header names the variant that answered
        assert r.status_code == 200 and r.headers["x-policy-variant"] == "fp16"
    assert "[DONE]" not in events  # FP16 failed after 2 tokens: an error event, never a normal "stop"
    chunks = [json.loads(e) for e in events]
    assert "error" in chunks[-1] and chunks[-1]["error"]["code"] == "variant_failed"
    assert not any(c.get("choices", [{}])[0].get("finish_reason") for c in chunks[:-1])
    assert metric(faulty, "policy_errors_total", variant="fp16") == errors_before + 1


def test_plain_request_is_a_503_when_no_variant_answers(faulty):
    r = httpx.post(f"{faulty.url}/v1/completions", json={"model": "policy", "prompt": "1+1=", "temperature": 0},
                   timeout=60)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"


def test_loops_survive_their_exceptions(faulty):
    """The analysis and health loops raised twice each at start; both still run (and are reported alive)."""
    deadline = time.monotonic() + 30
    while metric(faulty, "policy_loop_errors_total") < 4 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert metric(faulty, "policy_loop_errors_total", loop="analysis") == 2
    assert metric(faulty, "policy_loop_errors_total", loop="health") == 2
    # The analysis loop still judges new evidence: a fresh rollout (1 % on INT8), then a request of a user routed to
    # INT8 (which fails here: FP16 answers it) at a time; each must get a verdict from the loop, not from an admin
    # call. Routed, not forced: a forced variant is no rollout evidence.
    from policy_bundle.serve.router.routing import sticky_bucket

    httpx.post(f"{faulty.url}/admin/rollout", json={"action": "restart"}, headers=ADMIN, timeout=30)
    users = [u for u in (f"user-{i}" for i in range(5000)) if sticky_bucket("policy-bundle", u) < 1.0][:2]
    for user in users:
        before = metric(faulty, "policy_canary_verdicts_total")
        r = httpx.post(f"{faulty.url}/v1/completions", timeout=60, json={
            "model": "policy", "prompt": "1+1=", "max_tokens": 1, "temperature": 0, "user": user})
        assert r.status_code == 200 and r.headers["x-policy-variant"] == "fp16"  # INT8 failed: failed over
        deadline = time.monotonic() + 30
        while metric(faulty, "policy_canary_verdicts_total") <= before and time.monotonic() < deadline:
            time.sleep(0.2)
        assert metric(faulty, "policy_canary_verdicts_total") > before  # judged by the loop after its failures
    status = httpx.get(f"{faulty.url}/status", timeout=10).json()
    assert all(status["loops"].values()) and status["test_fault"] is True
    first = status["variants"]["int8"]["probed_at"]
    time.sleep(2.5)
    assert httpx.get(f"{faulty.url}/status", timeout=10).json()["variants"]["int8"]["probed_at"] > first


def test_the_fault_switch_is_announced(faulty):
    assert "TEST FAULT ACTIVE" in faulty.log.read_text()


def test_status_serves_the_cached_health_without_probing(faulty):
    a = httpx.get(f"{faulty.url}/status", timeout=10).json()
    b = httpx.get(f"{faulty.url}/status", timeout=10).json()
    assert a["variants"]["int8"]["probed_at"] == b["variants"]["int8"]["probed_at"] or \
        b["variants"]["int8"]["probed_at"] - a["variants"]["int8"]["probed_at"] >= 0.5  # only the loop probes
    events = httpx.get(f"{faulty.url}/admin/rollout/history", headers=ADMIN).json()["total"]
    for _ in range(20):
        httpx.get(f"{faulty.url}/status", timeout=10)
    assert httpx.get(f"{faulty.url}/admin/rollout/history", headers=ADMIN).json()["total"] <= events + 2


@needs_vllm
def test_vllm_expected_but_the_fallback_loaded_is_not_ready(tmp_path, small_bundle):
    server = start(tmp_path, small_bundle, "novllm", "novllm", wait=False, POLICY_BUNDLE_DISABLE_VLLM="0")
    try:
        deadline, status, relaunches = time.monotonic() + 240, {}, [2]
        while time.monotonic() < deadline:
            server.relaunch_if_port_lost(relaunches)  # its port taken before its bind: a new one
            assert server.proc.poll() is None, f"server exited:\n{server.log.read_text()[-3000:]}"
            try:
                status = httpx.get(f"{server.url}/status", timeout=10).json()
                if status["variants"]["fp16"].get("ready"):
                    break
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(1)
        assert status, f"no /status answer in 240 s:\n{server.log.read_text()[-3000:]}"
        fp16 = status["variants"]["fp16"]
        assert fp16["ready"] and fp16["engine"] == "policy-module-fp32" and fp16["expected_engine"] is False
        assert "injected fault" in fp16["fallback"]
        assert httpx.get(f"{server.url}/readyz", timeout=10).status_code != 200 and status["ready"] is False
    finally:
        server.stop()


def wait_exit(server, seconds=120) -> str:
    server.proc.wait(timeout=seconds)
    return server.log.read_text()


def refused_start(tmp_path, small_bundle, name, **kw) -> str:
    """The log of a server that must exit on its own (non-zero, no traceback)."""
    server = start(tmp_path, small_bundle, name, wait=False, **kw)
    try:
        log = wait_exit(server)
    finally:
        server.stop()
    assert server.proc.returncode != 0 and "Traceback" not in log
    return log


def test_require_vllm_refuses_to_start_on_the_fallback(tmp_path, small_bundle):
    server = start(tmp_path, small_bundle, "require", config={"require_vllm": True}, wait=False)
    try:
        log = wait_exit(server)
    finally:
        server.stop()
    assert server.proc.returncode != 0 and "require_vllm: vLLM is switched off" in log and "Traceback" not in log


def test_bad_router_config_key_is_one_line_not_a_traceback(tmp_path, small_bundle):
    server = start(tmp_path, small_bundle, "badcfg", config={"rollout": {"analysis_intervall_s": 3}}, wait=False)
    try:
        log = wait_exit(server)
    finally:
        server.stop()
    assert server.proc.returncode != 0
    assert "rollout.analysis_intervall_s: unknown field" in log and "Traceback" not in log


def test_int8_engine_vllm_refuses_a_bundle_without_int8_vllm(tmp_path, small_bundle):
    import shutil

    import bentoml

    from policy_bundle.build.artifacts.register import register_bundle
    from policy_bundle.bundle.manifest import manifest_hash

    bundle = tmp_path / "reference"  # the same manifest, registered without its int8-vllm/ dir
    shutil.copytree(small_bundle, bundle)
    shutil.rmtree(bundle / "int8-vllm", ignore_errors=True)
    tags = register_bundle(bundle, "reference-no-int8-vllm", manifest_hash(bundle))
    try:
        log = refused_start(tmp_path, small_bundle, "novllmdir", POLICY_BUNDLE_INT8_ENGINE="vllm",
                            POLICY_BUNDLE_VERSION="reference-no-int8-vllm")
    finally:  # other tests find the small bundle's entries by its manifest hash
        bentoml.models.delete(tags.int8_tag)
        bentoml.models.delete(tags.fp16_tag)
    assert "int8_engine: vllm, but policy-int8:reference-no-int8-vllm has no int8-vllm/" in log


def test_router_gate_threshold_out_of_the_builds_range_is_one_line(tmp_path, small_bundle):
    log = refused_start(tmp_path, small_bundle, "badgate", config={"rollout": {"thresholds": {"min_top1_agreement": 5}}})
    assert "rollout.thresholds.min_top1_agreement: 5 is out of range [0.0, 1.0]" in log


def test_bad_int8_engine_is_one_line(tmp_path, small_bundle):
    log = refused_start(tmp_path, small_bundle, "badengine", config={"int8_engine": "onnx"})
    assert "int8_engine: 'onnx' is not one of ['torchscript', 'vllm']" in log


def test_api_keys_set_to_nothing_refuse_to_start_and_an_open_router_says_so(tmp_path, small_bundle):
    """POLICY_BUNDLE_API_KEYS="," used to replace the file's keys with none: an open server, silently."""
    log = refused_start(tmp_path, small_bundle, "nokeys", config={"api_keys": ["s3cr3t"]}, POLICY_BUNDLE_API_KEYS=",")
    assert "POLICY_BUNDLE_API_KEYS: is set but holds no key" in log
    server = start(tmp_path, small_bundle, "open")  # no keys anywhere: open, and one warning line per start
    try:
        assert httpx.get(f"{server.url}/status", timeout=30).status_code == 200
        assert server.log.read_text().count("serving without API keys: every route") == 1
    finally:
        server.stop()


HALF_REGISTER = """
import shutil, sys, time
from pathlib import Path
import bentoml
bundle, version = Path(sys.argv[1]), sys.argv[2]
time.sleep(1.1)  # a later creation time than the whole pair's
with bentoml.models.create(f"policy-int8:{version}", metadata={"manifest_sha256": "f" * 64, "artifact": "int8"}) as m:
    shutil.copytree(bundle / "int8", Path(m.path) / "int8")
"""


def test_a_registration_killed_half_way_is_passed_over_for_the_last_whole_pair(tmp_path, small_bundle):
    """A build killed between its two registrations left `latest` naming two builds, and every router start refused
    until someone deleted an entry by hand."""
    import subprocess
    import sys

    from serve_helpers import register_into

    home = tmp_path / "bentoml"
    register_into(small_bundle, home)
    half = subprocess.run([sys.executable, "-c", HALF_REGISTER, str(small_bundle), "killed-build-000000000000"],
                          env={**os.environ, "BENTOML_HOME": str(home)}, capture_output=True, text=True)
    assert half.returncode == 0, half.stderr[-2000:]
    server = start(tmp_path, small_bundle, "halfpair", BENTOML_HOME=str(home), POLICY_BUNDLE_VERSION="latest")
    try:
        status = httpx.get(f"{server.url}/status", timeout=30).json()
        assert status["pair"]["label"] == bundle_version(small_bundle)
        assert httpx.post(f"{server.url}/v1/completions", json={"model": "policy", "prompt": "12+34=", "max_tokens": 4,
                                                                "temperature": 0}, timeout=60).status_code == 200
        log = server.log.read_text()
        assert f"latest: serving {bundle_version(small_bundle)}, the newest whole INT8/FP16 pair; passed over " \
               "policy-int8:killed-build-000000000000" in log
    finally:
        server.stop()


def test_a_plain_request_the_router_gives_up_on_stops_decoding_in_the_variant(tmp_path, small_bundle):
    """A non-streaming call the router timed out on must not keep decoding to max_tokens: under load the variant would
    carry more work than admission let in. (BentoML cancels the handler when the router's connection closes; the
    variant's own deadline, a second past the router's timeout, stops it where a connection is not closed:
    tests/test_variant_deadline.py.)"""
    server = start(tmp_path, small_bundle, "giveup", "slow:factor=1.0", config={
        "request_timeout_s": 2.0, "health_interval_s": 0.5,
        "rollout": {"analysis_interval_s": 0.5, "golden_interval_s": 3600, "min_samples": 10}})
    try:
        t0 = time.monotonic()
        r = httpx.post(f"{server.url}/v1/completions", headers={"x-policy-variant": "int8", "x-admin-token": "t"},
                       json={"model": "policy", "prompt": "1+1=", "max_tokens": 25, "temperature": 0}, timeout=60)
        assert r.status_code == 503 and time.monotonic() - t0 < 10  # 25 tokens at 1 s each: given up at 2 s
        deadline, active = time.monotonic() + 15, None
        while time.monotonic() < deadline:
            active = httpx.get(f"{server.url}/status", timeout=10).json()["variants"]["int8"]["batch"]["active"]
            if active == 0:
                break
            time.sleep(0.5)
        assert active == 0 and time.monotonic() - t0 < 12  # decoding stopped, not 25 s later
    finally:
        server.stop()


def test_a_busy_engine_answers_429_before_the_router_times_out_and_no_failure_is_counted(tmp_path, small_bundle):
    """A request queued behind others past 0.8 x request_timeout_s without its first token gets a 429 with
    Retry-After from the engine, which is busy, not broken: not a 503 after the router's timeout, and not a variant
    failure for the rollout to act on. The request holding the engine's only slot (slow, but streaming from its first
    step) is answered in full: the limit is on the first token, not on the whole answer."""
    server = start(tmp_path, small_bundle, "busy", "slow:factor=0.4", config={
        "request_timeout_s": 4.0, "max_batch": 1, "health_interval_s": 0.5,
        "rollout": {"analysis_interval_s": 0.5, "golden_interval_s": 3600, "min_samples": 10}})
    forced = {"x-policy-variant": "int8", "x-admin-token": "t"}
    try:
        errors_before = metric(server, "policy_errors_total", variant="int8")
        with httpx.stream("POST", f"{server.url}/v1/completions", headers=forced, timeout=60, json={
                "model": "policy", "prompt": "1+1=", "max_tokens": 20, "temperature": 0, "ignore_eos": True,
                "stream": True}) as holder:
            lines = holder.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))  # it holds the only slot now
            t0 = time.monotonic()
            queued = httpx.post(f"{server.url}/v1/completions", headers=forced, timeout=60, json={
                "model": "policy", "prompt": "2+2=", "max_tokens": 2, "temperature": 0})
            waited = time.monotonic() - t0
            rest = [line for line in lines if line.startswith("data: ")]
        assert queued.status_code == 429 and queued.headers.get("retry-after"), queued.text
        assert queued.json()["error"]["code"] == "rate_limited" and "busy: no first token" in queued.text
        assert 3.0 < waited < 4.0, waited  # 0.8 x 4 s, before the router's own timeout
        assert first and rest[-1] == "data: [DONE]" and not any('"error"' in line for line in rest)
        batch = httpx.get(f"{server.url}/status", timeout=10).json()["variants"]["int8"]["batch"]
        assert batch["busy_refused"] == 1
        assert metric(server, "policy_errors_total", variant="int8") == errors_before  # no failure counted
    finally:
        server.stop()


def test_steps_longer_than_the_health_timeout_are_not_taken_for_a_hang(tmp_path, small_bundle):
    """A long legitimate step (a long prompt's chunk on one thread took over 3 s on SmolLM2-135M, and the health loop
    then marked INT8 down under load) gets twice what its tokens and recent steps took beyond health_timeout_s: here
    every step takes 2.5 s against a 1 s health timeout, and INT8 serves its requests, never marked down. (The hung
    decode thread below is the control: it is marked down.)"""
    server = start(tmp_path, small_bundle, "longsteps", "slow:factor=2.5", config={
        "request_timeout_s": 60.0, "health_interval_s": 0.3, "health_timeout_s": 1.0,
        "rollout": {"analysis_interval_s": 0.5, "golden_interval_s": 3600, "min_samples": 10}})
    try:
        r = httpx.post(f"{server.url}/v1/completions", headers={"x-policy-variant": "int8", "x-admin-token": "t"},
                       json={"model": "policy", "prompt": "12+34=", "max_tokens": 4, "temperature": 0,
                             "ignore_eos": True}, timeout=90)
        assert r.status_code == 200 and r.headers["x-policy-variant"] == "int8", r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        status = httpx.get(f"{server.url}/status", timeout=10).json()
        assert status["degraded"] == [] and not status["variants"]["int8"].get("stalled")
        assert "variant-down" not in server.log.read_text()
    finally:
        server.stop()


def test_a_hung_decode_thread_is_marked_down_and_its_requests_fail_over(tmp_path, small_bundle):
    """Health was a flag set once at start: a decode thread that hung kept answering the probe, so every routed
    request waited request_timeout_s. The probe now reads the age of the last decode step while work waits."""
    server = start(tmp_path, small_bundle, "hang", "hang:after=2:name=int8", config={
        "request_timeout_s": 60.0, "health_interval_s": 0.5, "health_timeout_s": 2.0,
        "rollout": {"analysis_interval_s": 0.5, "golden_interval_s": 3600, "min_samples": 10}})
    try:
        httpx.post(f"{server.url}/admin/rollout", json={"action": "set-weight", "weight": 100}, headers=ADMIN,
                   timeout=30)
        t0 = time.monotonic()
        r = httpx.post(f"{server.url}/v1/completions", timeout=90,
                       json={"model": "policy", "prompt": "12+34=", "max_tokens": 6, "temperature": 0})
        took = time.monotonic() - t0
        assert r.status_code == 200 and r.headers["x-policy-variant"] == "fp16", r.text
        assert took < 15, took  # marked down within health_timeout_s of its last step, not after 60 s
        status = httpx.get(f"{server.url}/status", timeout=10).json()
        int8 = status["variants"]["int8"]
        assert int8["stalled"] and "no decode step" in int8["error"] and status["degraded"] == ["int8"]
        assert httpx.get(f"{server.url}/readyz", timeout=10).status_code == 200  # FP16 serves every request
        again = httpx.post(f"{server.url}/v1/completions", timeout=30,
                           json={"model": "policy", "prompt": "12+34=", "max_tokens": 6, "temperature": 0})
        assert again.status_code == 200 and again.headers["x-policy-variant"] == "fp16"
    finally:
        server.stop()


@needs_vllm
def test_vllm_steps_made_while_the_reader_waits_are_all_sent(tmp_path, small_bundle):
    """vLLM decodes on while a step waits on its reader (a slow client, a busy router loop: here a 1 s stall
    before the second token is handed on), and the cumulative output it hands over is its live token list, which
    grows in that wait: the tokens made during it were skipped ("998" came out "99", "46" as "4" in a loaded CI
    run). Each answer is checked against what FP16 answers without the stall (tests/test_serve.py's ``good``
    server: "998", "46")."""
    server = start(tmp_path, small_bundle, "slowreader", "stall:after=1:factor=1:name=fp16",
                   POLICY_BUNDLE_DISABLE_VLLM="0")
    forced = {"x-policy-variant": "fp16", "x-admin-token": "t"}
    try:
        assert httpx.get(f"{server.url}/status", timeout=10).json()["variants"]["fp16"]["engine"] == "vllm"
        plain = httpx.post(f"{server.url}/v1/completions", headers=forced, timeout=60,
                           json={"model": "policy", "prompt": "358+64=", "max_tokens": 6, "temperature": 0})
        assert plain.status_code == 200 and plain.json()["choices"][0]["text"] == "998", plain.text
        for path, body, field in (
                ("completions", {"prompt": "358+64="}, "text"),
                ("chat/completions", {"messages": [{"role": "user", "content": "12+34="}]}, "content")):
            with httpx.stream("POST", f"{server.url}/v1/{path}", headers=forced, timeout=60, json={
                    "model": "policy", "max_tokens": 6, "temperature": 0, "stream": True, **body}) as r:
                events = sse_events(r)
            assert r.headers["x-policy-variant"] == "fp16" and events[-1] == "[DONE]", events
            chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
            text = "".join((c.get("delta") or {}).get(field) or c.get(field) or "" for c in chunks)
            assert text == {"text": "998", "content": "46"}[field], events
    finally:
        server.stop()
