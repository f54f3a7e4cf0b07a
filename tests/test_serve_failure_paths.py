"""The failure paths a review of serve/ found (issue 21), over a real `bentoml serve`: streams whose variant
stalls past ``request_timeout_s`` (before or after their first token), clients that hang up before the first
streamed byte, sampling values that overflow, chunked and slow uploads, a chat template that raises, a
history ``limit`` that is a digit but not a number, a KV-cache allocation that fails."""

import asyncio
import json
import socket
import time

import httpx
import pytest
import torch
import yaml

from serve_helpers import Server, bundle_version, metric, sse_events

TOKEN = "t"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
FORCE_INT8 = {"x-policy-variant": "int8", "x-admin-token": TOKEN}
FORCE_FP16 = {"x-policy-variant": "fp16", "x-admin-token": TOKEN}
TIMEOUT_S = 2.0  # the stalled server's request_timeout_s
MAX_INFLIGHT = 3  # its admission cap: a leaked slot per request shows as a 429 by the 4th
# INT8 stalls past the timeout before its first token; FP16 holds its first token back 1 s (within the
# timeout: the window a hang-up test needs), then stalls past the timeout at its third token
STALLS = (f"stall:after=0:factor={3 * TIMEOUT_S}:name=int8;stall:after=0:factor=1:name=fp16;"
          f"stall:after=2:factor={3 * TIMEOUT_S}:name=fp16")
STREAM = {"model": "policy", "prompt": "12+34=", "max_tokens": 8, "temperature": 0, "stream": True,
          "ignore_eos": True}
QUIET = {"analysis_interval_s": 3600, "golden_interval_s": 3600, "shadow_fraction": 0.0}


def start(tmp_path, small_bundle, name, fault, config):
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump(config))
    env = {"POLICY_BUNDLE_VERSION": bundle_version(small_bundle), "POLICY_BUNDLE_STATE_DIR": str(tmp_path / name),
           "POLICY_BUNDLE_ADMIN_TOKEN": TOKEN, "POLICY_BUNDLE_ROUTER_CONFIG": str(cfg), "POLICY_BUNDLE_DISABLE_VLLM": "1",
           "POLICY_BUNDLE_TEST_FAULT": fault}
    return Server(env, tmp_path / f"{name}.log").wait_ready()


@pytest.fixture(scope="module")
def stalled(tmp_path_factory, small_bundle):
    server = start(tmp_path_factory.mktemp("stalled"), small_bundle, "stalled", STALLS,
                   {"request_timeout_s": TIMEOUT_S, "max_inflight": MAX_INFLIGHT, "background_slots": 1,
                    "rollout": QUIET})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def plain(tmp_path_factory, small_bundle):
    server = start(tmp_path_factory.mktemp("plain"), small_bundle, "plain", "template",
                   {"max_inflight": 2, "background_slots": 1, "rollout": QUIET})
    yield server
    server.stop()


def inflight_drains(server, seconds: float = 15.0) -> int:
    """The in-flight count once it reaches 0 (or what it is after ``seconds``)."""
    deadline = time.monotonic() + seconds
    while True:
        inflight = httpx.get(f"{server.url}/status", timeout=10).json()["inflight"]
        if inflight == 0 or time.monotonic() > deadline:
            return inflight
        time.sleep(0.2)


def raw_request(server, path: str, headers: dict, body: bytes = b"") -> socket.socket:
    """An HTTP/1.1 request written on a raw socket (headers and ``body``, nothing more): the caller decides
    what else to send, when to read and when to hang up."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    head = "".join(f"{k}: {v}\r\n" for k, v in {"Host": "127.0.0.1", **headers}.items())
    sock.sendall(f"POST {path} HTTP/1.1\r\n{head}\r\n".encode() + body)
    return sock


def status_line(sock: socket.socket) -> str:
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.split(b"\r\n", 1)[0].decode()


# ---- streams past request_timeout_s (issue 21 item 3) ---------------------------------------------


def test_forced_stream_whose_variant_stalls_before_its_first_token_is_a_503_not_a_500(stalled):
    with httpx.stream("POST", f"{stalled.url}/v1/completions", json=STREAM, headers=FORCE_INT8, timeout=30) as r:
        r.read()
    assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
    assert inflight_drains(stalled) == 0


def test_stream_fails_over_when_its_variant_stalls_before_the_first_token(stalled):
    httpx.post(f"{stalled.url}/admin/rollout", json={"action": "set-weight", "weight": 100}, headers=ADMIN,
               timeout=10).raise_for_status()
    with httpx.stream("POST", f"{stalled.url}/v1/completions", json=STREAM, timeout=30) as r:
        events = sse_events(r)
    assert r.status_code == 200 and r.headers["x-policy-variant"] == "fp16"  # INT8 was chosen, FP16 answered
    last = json.loads(events[-1])  # FP16 stalled at its third token: an error event, not a normal end
    assert last["error"]["code"] == "variant_failed" and "[DONE]" not in events
    assert inflight_drains(stalled) == 0


def test_streams_that_stall_mid_stream_release_their_slots(stalled):
    """More stalled streams than the admission cap, one after the other: every one is a 200 with an error
    event, none is a 429 (a leaked slot each would refuse the 4th)."""
    for _ in range(MAX_INFLIGHT + 1):
        with httpx.stream("POST", f"{stalled.url}/v1/completions", json=STREAM, headers=FORCE_FP16, timeout=30) as r:
            events = sse_events(r)
        assert r.status_code == 200 and json.loads(events[-1])["error"]["code"] == "variant_failed"
    assert inflight_drains(stalled) == 0


def test_n_choices_hold_a_slot_each_and_release_them_all_when_their_streams_stall(stalled):
    """A request with n choices holds n admission slots (n above the cap is a 400 naming n), and a stream whose
    variant stalls mid-stream frees every one of them: twice 2 choices against a cap of 3 would 429 on a leak."""
    err = httpx.post(f"{stalled.url}/v1/completions", json={**STREAM, "n": MAX_INFLIGHT + 1}, timeout=30)
    assert err.status_code == 400 and err.json()["error"]["param"] == "n"
    assert err.json()["error"]["limit"] == MAX_INFLIGHT
    for _ in range(2):
        with httpx.stream("POST", f"{stalled.url}/v1/completions", json={**STREAM, "n": 2}, headers=FORCE_FP16,
                          timeout=30) as r:
            events = sse_events(r)
        assert r.status_code == 200 and json.loads(events[-1])["error"]["code"] == "variant_failed"
        assert inflight_drains(stalled) == 0
    plain = httpx.post(f"{stalled.url}/v1/completions", headers=FORCE_FP16, timeout=30, json={
        "model": "policy", "prompt": "12+34=", "max_tokens": 2, "temperature": 0, "n": MAX_INFLIGHT})
    assert plain.status_code == 200 and len(plain.json()["choices"]) == MAX_INFLIGHT  # within FP16's first 2 tokens
    assert inflight_drains(stalled) == 0


# ---- hang-ups before the first streamed byte (item 4) ---------------------------------------------


def test_clients_that_hang_up_before_the_first_streamed_byte_release_their_slots(stalled):
    body = json.dumps(STREAM).encode()
    for _ in range(MAX_INFLIGHT + 1):  # FP16 holds its first token back 1 s; each client leaves after 0.3 s
        sock = raw_request(stalled, "/v1/completions", {**FORCE_FP16, "Content-Type": "application/json",
                                                        "Content-Length": str(len(body))}, body)
        time.sleep(0.3)
        sock.close()
    assert inflight_drains(stalled) == 0
    r = httpx.post(f"{stalled.url}/v1/completions", headers=FORCE_FP16, timeout=30,
                   json={"model": "policy", "prompt": "12+34=", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200


# ---- sampling values that overflow (item 5) -------------------------------------------------------


@pytest.mark.parametrize("temperature", [1e-320, 5e-324, 1e-300, 1e-6])
def test_a_tiny_temperature_is_greedy_and_never_a_variant_failure(plain, temperature):
    errors = metric(plain, "policy_errors_total", variant="int8")
    body = {"model": "policy", "prompt": "12+34=", "max_tokens": 6}
    greedy = httpx.post(f"{plain.url}/v1/completions", json={**body, "temperature": 0}, headers=FORCE_INT8, timeout=30)
    tiny = httpx.post(f"{plain.url}/v1/completions", json={**body, "temperature": temperature, "top_p": 1e-300},
                      headers=FORCE_INT8, timeout=30)
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    assert metric(plain, "policy_errors_total", variant="int8") == errors


# ---- request bodies (item 7) ----------------------------------------------------------------------


def test_a_chunked_body_is_refused_as_it_streams_past_the_limit(plain):
    sock = raw_request(plain, "/v1/completions", {"Content-Type": "application/json",
                                                  "Transfer-Encoding": "chunked"})
    try:
        chunk = b"x" * 16384
        for _ in range(5):  # 80 KiB > max_body_bytes (64 KiB), and no terminating chunk: the body never ends
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        assert status_line(sock).startswith("HTTP/1.1 413")  # answered without waiting for the rest
    finally:
        sock.close()


def test_slow_uploads_do_not_hold_admission_slots(plain):
    """More half-sent bodies than the admission cap (2): a whole request still gets in."""
    socks = [raw_request(plain, "/v1/completions", {"Content-Type": "application/json", "Content-Length": "100"},
                         b'{"model": "policy", ') for _ in range(3)]
    try:
        time.sleep(0.5)
        r = httpx.post(f"{plain.url}/v1/completions", timeout=30,
                       json={"model": "policy", "prompt": "12+34=", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
    finally:
        for s in socks:
            s.close()
    assert inflight_drains(plain) == 0


# ---- history limit, chat template (item 12) -------------------------------------------------------


@pytest.mark.parametrize("limit", ["\u00b2", "\u0661\u0660", "1.5", "-1", "0"])
def test_history_limit_that_is_not_an_ascii_integer_is_a_400(plain, limit):
    r = httpx.get(f"{plain.url}/admin/rollout/history", params={"limit": limit}, headers=ADMIN, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit"


def test_a_chat_template_that_raises_is_a_400_naming_messages(plain):
    messages = [{"role": "user", "content": "12+34="}, {"role": "system", "content": "be brief"}]
    r = httpx.post(f"{plain.url}/v1/chat/completions", timeout=30,
                   json={"model": "policy", "messages": messages, "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages" and "System role must be the first message" in err["message"]
    ok = httpx.post(f"{plain.url}/v1/chat/completions", timeout=30,
                    json={"model": "policy", "messages": messages[:1], "max_tokens": 2})
    assert ok.status_code == 200


# ---- the batched engine (item 12) -----------------------------------------------------------------


class FailingAllocation:
    """The INT8 artifact, except that its first ``new_cache`` (the KV-cache allocation) raises."""

    def __init__(self, module):
        self.module, self.failures = module, 1

    def new_cache(self, batch: int, seq: int):
        if self.failures:
            self.failures -= 1
            raise RuntimeError("injected fault: cannot allocate the KV cache")
        return self.module.new_cache(batch, seq)

    def __call__(self, *args):
        return self.module(*args)

    def __getattr__(self, name):
        return getattr(self.module, name)


def test_a_failed_kv_cache_allocation_answers_its_request_with_an_error(small_bundle):
    from policy_bundle.serve.variants.batching import BatchedEngine
    from policy_bundle.serve.variants.engines import SamplingParams

    engine = BatchedEngine(FailingAllocation(torch.jit.load(str(small_bundle / "int8" / "policy.ts"))), 32, "int8")

    async def generate():
        return [s async for s in engine.generate([1, 6, 8, 13, 7, 14], SamplingParams(max_tokens=4))]

    with pytest.raises(RuntimeError, match="KV cache"):
        asyncio.run(asyncio.wait_for(generate(), 10))  # answered at once, not left to a timeout
    assert len(asyncio.run(asyncio.wait_for(generate(), 10))) == 4  # the next allocation works
