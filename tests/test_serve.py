"""Serving over real `bentoml serve` processes: OpenAI API, routing, shadow, rollout, admin, bad input."""

import asyncio
import json
import re
import time

import httpx
import pytest

from cli_helpers import needs_vllm
from policy_bundle.quantize.runtime.vllm_launch import vllm_available
from serve_helpers import ADMIN, FORCE_INT8, Server, admin, bundle_version, burst, complete, env_for, sse_events


@pytest.fixture(scope="module")
def good(small_bundle, state):
    """The main server: good bundle, vLLM for FP16 where installed, admin token, shadow on a quarter of requests."""
    cohorts = [{"header": "x-cohort", "value": "int8-beta", "variant": "int8"},
               {"cookie": "cohort", "value": "control", "variant": "fp16"}]
    server = Server(env_for(state, "good", bundle_version(small_bundle), rollout={"match": cohorts}),
                    state / "good.log").wait_ready()
    yield server
    server.stop()


def test_openai_client_completion_chat_and_streaming(good):
    from openai import OpenAI

    client = OpenAI(base_url=f"{good.url}/v1", api_key="unused")
    models = client.models.list().data
    assert [m.id for m in models] == ["policy"] and models[0].model_extra["max_model_len"] == 32  # the bundle's
    done = client.completions.create(model="policy", prompt="358+64=", max_tokens=6, temperature=0, logprobs=1)
    assert done.choices[0].text == "998" and done.model_extra["policy_variant"] in ("int8", "fp16")
    assert len(done.choices[0].logprobs.token_logprobs) == done.usage.completion_tokens
    chat = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "12+34="}],
                                          max_tokens=6, temperature=0)
    assert chat.choices[0].message.content == "46"
    streamed = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "12+34="}],
                                              max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == "46"
    streamed = client.completions.create(model="policy", prompt="358+64=", max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == "998"


def test_locust_scenario_runs_headless_without_failures(good, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    locust = Path(sys.executable).parent / "locust"
    root = Path(__file__).resolve().parents[1]
    # bounded by a request budget long before the time limit (at 4 users for 60 s it would send hundreds)
    res = subprocess.run([str(locust), "-f", "loadtest/locustfile.py", "--headless", "-u", "4", "-r", "4", "-t", "60s",
                          "--max-requests", "40", "--host", good.url, "--csv", str(tmp_path / "run"), "--only-summary"],
                         capture_output=True, text=True, timeout=120, cwd=root)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = (tmp_path / "run_stats.csv").read_text().splitlines()
    total = next(r for r in rows if ",Aggregated," in r).split(",")
    # the budget ends the run well before its 60 s limit, never past the budget + the 4 users' requests in
    # flight (Locust's stats can count a few less than the 40 requests its events saw); no failures
    assert 0 < int(total[2]) <= 44 and int(total[3]) == 0
    remote = subprocess.run([str(locust), "-f", "loadtest/locustfile.py", "--headless", "-u", "1", "-t", "5s",
                             "--host", "http://192.0.2.1:3000"], capture_output=True, text=True, timeout=60, cwd=root)
    assert remote.returncode == 2 and "not loopback" in remote.stderr


def test_every_response_names_its_variant(good):
    r = complete(good)
    assert r.headers["x-policy-variant"] == r.json()["policy_variant"] in ("int8", "fp16")


def test_forced_requests_are_counted_apart_from_rollout_evidence(good):
    """Benchmarks force a variant with the admin token: those requests must neither promote nor roll back INT8."""
    before = httpx.get(f"{good.url}/status", timeout=30).json()["evidence_excluded"]["forced_requests"]
    for _ in range(3):
        assert complete(good, headers=FORCE_INT8).status_code == 200
    assert complete(good).status_code == 200  # routed, not forced: evidence
    after = httpx.get(f"{good.url}/status", timeout=30).json()["evidence_excluded"]
    assert after["forced_requests"]["int8"] == before["int8"] + 3 and after["forced_requests"]["fp16"] == before["fp16"]
    assert "not rollout evidence" in after["why"]


def test_forced_variant_needs_the_admin_token(good):
    assert complete(good, headers=FORCE_INT8).headers["x-policy-variant"] == "int8"
    forced_fp16 = {"x-policy-variant": "fp16", "x-admin-token": "test-admin-token"}
    assert complete(good, headers=forced_fp16).headers["x-policy-variant"] == "fp16"
    assert complete(good, headers={"x-policy-variant": "int8"}).status_code == 403
    assert complete(good, headers={"x-policy-variant": "int8", "x-admin-token": "wrong"}).status_code == 403


def test_fp16_variant_runs_on_vllm_when_installed(good):
    status = httpx.get(f"{good.url}/status", timeout=30).json()
    expected = "vllm" if vllm_available(honour_switch=False) else "policy-module-fp32"
    assert status["variants"]["fp16"]["engine"] == expected and status["ready"]


def test_weighted_split_and_sticky_users(good):
    admin(good, "set-weight", weight=30)
    try:
        bodies = [{"model": "policy", "prompt": "12+34=", "temperature": 0, "max_tokens": 4} for _ in range(300)]
        responses = asyncio.run(burst(good.url, bodies))
        assert all(r.status_code == 200 for r in responses)
        share = sum(r.headers["x-policy-variant"] == "int8" for r in responses) / len(responses)
        assert 0.22 <= share <= 0.38
        for user in ("alice", "bob", "carol"):
            seen = {complete(good, user=user, max_tokens=2).headers["x-policy-variant"] for _ in range(15)}
            assert len(seen) == 1
        by_header = {complete(good, headers={"x-policy-user": "dave"}, max_tokens=2).headers["x-policy-variant"]
                     for _ in range(10)}
        assert len(by_header) == 1
        users = {complete(good, user=f"user-{i}", max_tokens=2).headers["x-policy-variant"] for i in range(40)}
        assert users == {"int8", "fp16"}
    finally:
        admin(good, "restart")


def test_shadow_comparisons_appear_in_metrics(good):
    for _ in range(24):
        assert complete(good, max_tokens=4).status_code == 200
    for _ in range(60):
        metrics = httpx.get(f"{good.url}/metrics", timeout=10).text
        m = re.findall(r'^policy_shadow_comparisons_total\{[^}]*outcome="same"[^}]*\} (\S+)', metrics, re.M)
        if m and float(m[0]) >= 1:
            break
        asyncio.run(asyncio.sleep(0.5))
    assert m and float(m[0]) >= 1
    assert re.search(r'^policy_requests_total\{[^}]*variant="(int8|fp16)"', metrics, re.M)
    assert "policy_int8_traffic_ratio" in metrics


def test_rollout_promotes_through_every_step_with_a_good_bundle(good):
    admin(good, "restart")
    weights = []
    for _ in range(6):
        admin(good, "golden-canary")
        result = admin(good, "analyse")
        assert result["verdict"] == "pass", result
        weights.append(httpx.get(f"{good.url}/admin/rollout", headers=ADMIN).json()["state"])
    assert [w["weight"] for w in weights] == [5.0, 25.0, 50.0, 100.0, 100.0, 100.0]
    assert weights[-1]["status"] == "promoted"
    events = [e["event"] for e in httpx.get(f"{good.url}/admin/rollout/history", headers=ADMIN).json()["history"]
              if e["state_version"] is not None]  # transitions only (notes carry no state version)
    assert events[-6:] == ["start", "promote", "promote", "promote", "promote", "promoted"]


def test_a_cohort_header_or_cookie_pins_its_variant_until_a_rollback(good):
    admin(good, "restart")  # 1 % on INT8: without the rule nearly every request would be FP16
    beta = [complete(good, headers={"x-cohort": "int8-beta"}, user=f"c{i}", max_tokens=3) for i in range(8)]
    assert [r.headers["x-policy-variant"] for r in beta] == ["int8"] * 8
    admin(good, "set-weight", weight=100)
    control = [httpx.post(f"{good.url}/v1/completions", cookies={"cohort": "control"}, timeout=60, json={
        "model": "policy", "prompt": "1+2=", "max_tokens": 3, "temperature": 0}) for _ in range(4)]
    assert [r.headers["x-policy-variant"] for r in control] == ["fp16"] * 4
    other = complete(good, headers={"x-cohort": "someone-else"}, max_tokens=3)
    assert other.headers["x-policy-variant"] == "int8"  # no rule matched: the weight decides
    admin(good, "abort")  # a stopped rollout sends INT8 cohorts to FP16 too
    assert complete(good, headers={"x-cohort": "int8-beta"}, max_tokens=3).headers["x-policy-variant"] == "fp16"
    admin(good, "restart")


def test_admin_api_needs_the_bearer_token(good):
    assert httpx.get(f"{good.url}/admin/rollout").status_code == 401
    assert httpx.get(f"{good.url}/admin/rollout", headers={"Authorization": "Bearer nope"}).status_code == 403
    assert httpx.get(f"{good.url}/admin/rollout", headers=ADMIN).status_code == 200
    bad = httpx.post(f"{good.url}/admin/rollout", json={"action": "set-weight", "weight": 101}, headers=ADMIN)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "weight"


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"model": "policy", "prompt": "1+1=", "max_tokens": "many"}, 400, "max_tokens"),
        ({"model": "policy", "prompt": "1+1=", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "policy", "prompt": "1+1=", "max_tokens": 100000}, 400, "max_tokens"),
        ({"model": "policy", "prompt": "   "}, 400, "prompt"),
        ({"model": "policy", "prompt": "1" * 40 + "+1="}, 400, "prompt"),
        ({"model": "policy", "prompt": "1+1=", "temperature": 9}, 400, "temperature"),
        ({"model": "gpt-4", "prompt": "1+1="}, 404, "model"),
        ({"prompt": "1+1="}, 400, "model"),
        # strict types: a string or a bool is not a number
        ({"model": "policy", "prompt": "1+1=", "temperature": "0.5"}, 400, "temperature"),
        ({"model": "policy", "prompt": "1+1=", "temperature": True}, 400, "temperature"),
        # what the server does not implement is refused by name, never ignored
        ({"model": "policy", "prompt": "1+1=", "logit_bias": {"5": 101}}, 400, "logit_bias.5"),
        ({"model": "policy", "prompt": "1+1=", "logit_bias": {"five": 1}}, 400, "logit_bias"),
        ({"model": "policy", "prompt": "1+1=", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
        ({"model": "policy", "prompt": "1+1=", "presence_penalty": 2.5}, 400, "presence_penalty"),
        ({"model": "policy", "prompt": "1+1=", "frequency_penalty": -3}, 400, "frequency_penalty"),
        ({"model": "policy", "prompt": "1+1=", "logprobs": 6}, 400, "logprobs"),
        ({"model": "policy", "prompt": "1+1=", "best_of": 3}, 400, "best_of"),
        ({"model": "policy", "prompt": "1+1=", "n": 0}, 400, "n"),
        ({"model": "policy", "prompt": "1+1=", "n": 17}, 400, "n"),  # MAX_CHOICES
        ({"model": "policy", "prompt": "1+1=", "n": "2"}, 400, "n"),
        ({"model": "policy", "prompt": "1+1=", "suffix": "!"}, 400, "suffix"),
        ({"model": "policy", "prompt": "1+1=", "top_k": 5}, 400, "top_k"),
        ({"model": "policy", "prompt": "1+1=", "no_such_field": 1}, 400, "no_such_field"),
    ],
)
def test_bad_input_gets_a_clear_4xx(good, body, status, param):
    r = httpx.post(f"{good.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param)


CHAT = {"model": "policy", "messages": [{"role": "user", "content": "12+34="}], "max_tokens": 6, "temperature": 0}


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, "response_format"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]},
                   {"role": "user", "content": "12+34="}]}, "messages.0.tool_calls"),
])
def test_chat_fields_the_server_does_not_implement_are_refused_by_name(good, extra, param):
    r = httpx.post(f"{good.url}/v1/chat/completions", json={**CHAT, **extra}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(f"{param}: not implemented by this server")


def token_id(small_bundle, text: str) -> int:
    from policy_bundle.bundle.info import load_tokenizer

    ids = load_tokenizer(small_bundle / "int8")(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == 1, ids
    return ids[0]


@pytest.mark.parametrize("variant", ["int8", "fp16"])
def test_logit_bias_steers_greedy_decoding_in_both_variants(good, small_bundle, variant):
    seven = token_id(small_bundle, "7")
    forced = {"x-policy-variant": variant, "x-admin-token": "test-admin-token"}
    plain = complete(good, headers=forced, max_tokens=4).json()["choices"][0]["text"]
    biased = complete(good, headers=forced, max_tokens=4, logit_bias={str(seven): 100}).json()
    assert plain != "7777" and biased["choices"][0]["text"] == "7777", (plain, biased)
    banned = complete(good, headers=forced, max_tokens=4, logit_bias={str(token_id(small_bundle, "9")): -100}).json()
    assert "9" not in banned["choices"][0]["text"] and "9" in plain  # the control: 998 without the ban


@pytest.mark.parametrize("variant", ["int8", "fp16"])
def test_top_logprobs_are_the_likeliest_tokens_and_hold_the_greedy_one(good, variant):
    forced = {"x-policy-variant": variant, "x-admin-token": "test-admin-token"}
    r = httpx.post(f"{good.url}/v1/chat/completions", headers=forced, timeout=60,
                   json={**CHAT, "logprobs": True, "top_logprobs": 3})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert content and all(len(c["top_logprobs"]) == 3 for c in content)
    for c in content:  # greedy: the chosen token is the likeliest, with its logprob, and the rest are below it
        alts = c["top_logprobs"]
        assert alts[0]["token"] == c["token"] and abs(alts[0]["logprob"] - c["logprob"]) < 1e-3
        assert [a["logprob"] for a in alts] == sorted((a["logprob"] for a in alts), reverse=True)
    done = complete(good, headers=forced, max_tokens=3, logprobs=2).json()["choices"][0]["logprobs"]
    assert len(done["top_logprobs"]) == len(done["tokens"]) and all(len(t) == 2 for t in done["top_logprobs"])


@pytest.mark.parametrize("variant", ["int8", "fp16"])
def test_n_choices_are_sampled_side_by_side_and_reproducible_with_a_seed(good, variant):
    forced = {"x-policy-variant": variant, "x-admin-token": "test-admin-token"}
    body = dict(prompt="9", n=4, temperature=2.0, seed=7, max_tokens=8, ignore_eos=True)
    first = complete(good, headers=forced, **body)
    assert first.status_code == 200, first.text
    done = first.json()
    assert [c["index"] for c in done["choices"]] == [0, 1, 2, 3]
    assert all(c["finish_reason"] == "length" for c in done["choices"])
    assert done["usage"]["completion_tokens"] == 4 * 8 and done["usage"]["prompt_tokens"] > 0
    texts = [c["text"] for c in done["choices"]]
    assert len(set(texts)) > 1, texts  # choice i samples with seed + i: the choices differ...
    again = complete(good, headers=forced, **body).json()
    assert [c["text"] for c in again["choices"]] == texts  # ...and the request is reproducible
    alone = [complete(good, headers=forced, **{**body, "n": 1, "seed": 7 + i}).json()["choices"][0]["text"]
             for i in range(4)]
    assert alone == texts  # choice i is the request with n: 1 and seed + i, decoded alone
    greedy = complete(good, headers=forced, n=3, max_tokens=6).json()
    assert [c["text"] for c in greedy["choices"]] == ["998"] * 3


def test_n_streamed_choices_interleave_by_index_and_count_every_token(good):
    events = sse_events(httpx.post(f"{good.url}/v1/chat/completions", timeout=60, json={
        **CHAT, "n": 3, "stream": True, "stream_options": {"include_usage": True}}))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts, finishes = {}, {}
    for c in chunks[:-1]:
        for choice in c["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + (choice["delta"].get("content") or "")
            if choice["finish_reason"]:
                finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {0: "46", 1: "46", 2: "46"} and finishes == {0: "stop", 1: "stop", 2: "stop"}
    single = httpx.post(f"{good.url}/v1/chat/completions", json=CHAT, timeout=60).json()["usage"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3 * single["completion_tokens"]
    from openai import OpenAI

    client = OpenAI(base_url=f"{good.url}/v1", api_key="unused")
    done = client.completions.create(model="policy", prompt="358+64=", max_tokens=6, temperature=0, n=2)
    assert [c.text for c in done.choices] == ["998", "998"] and [c.index for c in done.choices] == [0, 1]


@pytest.mark.parametrize("variant", ["int8", "fp16"])
def test_streamed_logprobs_add_up_to_the_plain_answers(good, variant):
    """Streamed chunks carry the logprobs of the tokens their text came from (a token that adds no text, such as
    the EOS, in the last chunk): concatenated, the plain answer's tokens, logprobs and top alternatives."""
    forced = {"x-policy-variant": variant, "x-admin-token": "test-admin-token"}
    for path, body, read in (
            ("chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2},
             lambda lp: [(c["token"], c["logprob"], [a["token"] for a in c["top_logprobs"]]) for c in lp["content"]]),
            ("completions", {"model": "policy", "prompt": "358+64=", "max_tokens": 6, "temperature": 0, "logprobs": 2},
             lambda lp: [(t, x, sorted(top)) for t, x, top in zip(lp["tokens"], lp["token_logprobs"],
                                                                   lp["top_logprobs"])])):
        plain = httpx.post(f"{good.url}/v1/{path}", json=body, headers=forced, timeout=60).json()
        want = read(plain["choices"][0]["logprobs"])
        events = sse_events(httpx.post(f"{good.url}/v1/{path}", json={**body, "stream": True}, headers=forced,
                                       timeout=60))
        got = []
        for e in events[:-1]:
            lp = json.loads(e)["choices"][0]["logprobs"]
            got += read(lp) if lp else []
        assert [(t, top) for t, _, top in got] == [(t, top) for t, _, top in want] and len(want) >= 2, (got, want)
        assert all(abs(a[1] - b[1]) < 1e-4 for a, b in zip(got, want))


@pytest.mark.parametrize("variant", ["int8", "fp16"])
def test_penalties_steer_a_repetitive_greedy_answer_in_both_variants(good, variant):
    """A greedy answer that repeats its tokens changes under frequency and presence penalties (the control: both at
    0 answer exactly the plain text)."""
    forced = {"x-policy-variant": variant, "x-admin-token": "test-admin-token"}
    body = dict(prompt="99+99=", max_tokens=16, ignore_eos=True)
    plain = complete(good, headers=forced, **body).json()["choices"][0]["text"]
    off = complete(good, headers=forced, **body, presence_penalty=0, frequency_penalty=0).json()
    assert off["choices"][0]["text"] == plain
    steered = complete(good, headers=forced, **body, presence_penalty=2, frequency_penalty=2).json()
    assert steered["choices"][0]["text"] != plain, plain


def test_fields_at_their_off_value_are_accepted(good):
    """A client that sends a field at the value that means off (vLLM's benchmark sends repetition_penalty 1.0) is
    answered: nothing it asked for is ignored."""
    off = {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "tools": [], "tool_choice": None,
           "response_format": {"type": "text"}, "repetition_penalty": 1.0, "top_logprobs": None, "best_of": 1}
    r = httpx.post(f"{good.url}/v1/chat/completions", json={**CHAT, **off}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "46"


def test_max_tokens_is_bounded_by_the_context_less_the_prompt_not_a_fixed_cap(good):
    """max_tokens was capped at 256 whatever the context; it is bounded by the context less the prompt, with the
    numbers named."""
    err = complete(good, prompt="1+1=", max_tokens=300).json()["error"]
    assert err["param"] == "max_tokens" and err["value"] == 300 and err["limit"] < 32
    assert "tokens the context (32) leaves after the" in err["message"]
    room = err["limit"]
    ok = complete(good, prompt="1+1=", max_tokens=room, ignore_eos=True)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == room  # the whole room, answered
    chat = httpx.post(f"{good.url}/v1/chat/completions", timeout=30,
                      json={**CHAT, "max_tokens": None, "max_completion_tokens": 999})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "max_completion_tokens"


def test_prompt_too_long_names_the_limit(good):
    err = complete(good, prompt="1" * 40 + "+1=").json()["error"]
    assert err["limit"] == 32 and err["value"] > 32


def test_oversized_and_malformed_bodies(good):
    big = httpx.post(f"{good.url}/v1/completions", content=b"{" + b" " * 70000 + b"}",
                     headers={"content-type": "application/json"})
    assert big.status_code == 413 and big.json()["error"]["limit"] == 65536
    broken = httpx.post(f"{good.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert broken.status_code == 400 and broken.json()["error"]["param"] == "body"


MALFORMED = [
    b'{"model": "policy", "prompt": "1+1=", "temperature": NaN}',
    b'{"model": "policy", "prompt": "1+1=", "temperature": Infinity}',
    b'{"model": "policy", "prompt": "1+1=", "top_p": -Infinity}',
    b'{"model": "policy", "prompt": "1+1=", "seed": 1e999}',
    b'{"model": "policy", "prompt": "1+1=", "max_tokens": 1' + b"0" * 5000 + b"}",
    b'{"model": "policy", "prompt": "\\ud800"}',
    b'{"model": "policy", "prompt": ["\\udc00x"]}',
    b'{"model": "policy", "prompt": "1+1=", "user": "\\ud83d"}',
    b'{"model": "policy", "\\ud800": 1, "prompt": "1+1="}',
    b"[" * 100000 + b"]" * 100000,
    b'{"a":' * 5000 + b"1" + b"}" * 5000,
    b'{"model": "policy", "prompt": "\xff\xfe"}',
    b"\xef\xbb\xbf{}",
    b'{"model": "policy", "prompt": {"nested": [1, 2, {"x": null}]}}',
    b'{"model": "policy", "prompt": "1+1=", "stop": ["", "x"]}',
    b'{"model": "policy", "prompt": "1+1=", "stop": ["a", "b", "c", "d", "e"]}',
    b'{"model": ["policy"], "prompt": "1+1="}',
    b'{"model": "policy", "prompt": "1+1=", "stream": "yes"}',
    b"null", b"[]", b'"text"', b"1e999", b"", b" ", b"{", b"\x00\x01",
]


def test_any_byte_sequence_gets_a_4xx_json_body_on_one_keep_alive_connection(good):
    with httpx.Client(base_url=good.url, timeout=60, headers={"content-type": "application/json"}) as client:
        for body in MALFORMED:
            for path in ("/v1/completions", "/v1/chat/completions"):
                r = client.post(path, content=body)
                assert 400 <= r.status_code < 500, (body[:80], r.status_code, r.text[:300])
                assert r.json()["error"]["message"], body[:80]
        ok = client.post("/v1/completions", json={"model": "policy", "prompt": "358+64=", "temperature": 0})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "998"


def test_stop_strings_and_echo(good):
    stopped = complete(good, stop=["8"]).json()["choices"][0]
    assert stopped["text"] == "99" and stopped["finish_reason"] == "stop"
    assert complete(good, stop="9").json()["choices"][0]["text"] == ""
    assert complete(good, echo=True).json()["choices"][0]["text"] == "358+64=998"
    streamed = httpx.post(f"{good.url}/v1/completions", timeout=60, json={
        "model": "policy", "prompt": "358+64=", "temperature": 0, "stop": ["8"], "stream": True, "echo": True}).text
    chunks = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "358+64=99"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    refused = complete(good, echo=True, logprobs=1)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "echo"



def sse_chunks(server, path, body, headers):
    """Every JSON event of a streamed answer, and whether it ended with [DONE]."""
    text = httpx.post(f"{server.url}{path}", timeout=60, headers=headers, json={**body, "stream": True}).text
    lines = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    return [json.loads(x) for x in lines if x != "[DONE]"], lines[-1] == "[DONE]"


@pytest.mark.parametrize("variant", ["int8", "fp16"])
def test_ignore_eos_generates_max_tokens(good, variant):
    """vLLM's ``ignore_eos`` (its benchmark client sends it): past EOS up to max_tokens, plain and streamed,
    on both variants (FP16 on vLLM where installed, whose engine stops at EOS unless told not to)."""
    hdr = {"x-policy-variant": variant, "x-admin-token": "test-admin-token"}
    natural = complete(good, headers=hdr, max_tokens=12).json()
    assert natural["usage"]["completion_tokens"] < 12 and natural["choices"][0]["finish_reason"] == "stop"
    forced = complete(good, headers=hdr, max_tokens=12, ignore_eos=True).json()
    assert forced["policy_variant"] == variant and forced["usage"]["completion_tokens"] == 12
    assert forced["choices"][0]["finish_reason"] == "length"
    assert forced["choices"][0]["text"].startswith(natural["choices"][0]["text"])
    chunks, done = sse_chunks(good, "/v1/completions", {"model": "policy", "prompt": "358+64=", "temperature": 0,
                                                         "max_tokens": 12, "ignore_eos": True,
                                                         "stream_options": {"include_usage": True}}, hdr)
    assert done and chunks[-1]["usage"]["completion_tokens"] == 12
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == forced["choices"][0]["text"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_options_include_usage_adds_the_usage_chunk(good, path):
    """OpenAI's ``stream_options.include_usage``: every chunk has ``usage: null``; one more chunk before
    [DONE] has empty ``choices`` and the request's usage (the same numbers as the plain answer's)."""
    body = {"model": "policy", "temperature": 0, "max_tokens": 6,
            **({"prompt": "358+64="} if "chat" not in path else {"messages": [{"role": "user", "content": "12+34="}]})}
    plain = httpx.post(f"{good.url}{path}", json=body, headers=FORCE_INT8, timeout=60).json()
    chunks, done = sse_chunks(good, path, {**body, "stream_options": {"include_usage": True}}, FORCE_INT8)
    assert done and chunks[-1]["choices"] == [] and chunks[-1]["usage"] == plain["usage"]
    assert chunks[-1]["id"] == chunks[0]["id"] and chunks[-1]["object"] == chunks[0]["object"]
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
    assert chunks[-2]["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
    without, _ = sse_chunks(good, path, body, FORCE_INT8)
    assert all("usage" not in c for c in without) and without[-1]["choices"]
    refused = httpx.post(f"{good.url}{path}", json={**body, "stream_options": {"include_usage": True}}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream_options"


@pytest.mark.parametrize("variant", ["int8", "fp16"])
def test_vllm_benchmark_request_function_reads_the_router(good, variant):
    """vLLM's own benchmark request function (what ``vllm bench serve --backend openai`` sends and parses):
    every request succeeds, and the token count it takes from the usage chunk is max_tokens."""
    aiohttp = pytest.importorskip("aiohttp")
    lib = pytest.importorskip("vllm.benchmarks.lib.endpoint_request_func")

    async def run():
        inp = lib.RequestFuncInput(prompt="0123456", api_url=f"{good.url}/v1/completions", prompt_len=8,
                                   output_len=10, model="policy", ignore_eos=True, extra_body={"temperature": 0},
                                   extra_headers={"x-policy-variant": variant, "x-admin-token": "test-admin-token"})
        async with aiohttp.ClientSession() as session:
            return await lib.async_request_openai_completions(inp, session)

    out = asyncio.run(run())
    assert out.success, out.error
    assert out.output_tokens == 10 and out.prompt_len == 8 and len(out.itl) >= 1 and out.ttft > 0

def test_the_rollout_cli_operates_the_served_rollout(good):
    """`policy-bundle rollout` over the admin API: what an operator typed as curl with a bearer token."""
    from cli_helpers import run_cli

    env = {"POLICY_BUNDLE_URL": good.url, "POLICY_BUNDLE_ADMIN_TOKEN": "test-admin-token"}
    res = run_cli("rollout", "restart", "--reason", "cli test", env=env)
    assert res.returncode == 0 and "restart: done" in res.stdout and "weight:  1 % of traffic on INT8" in res.stdout, \
        res.stderr
    res = run_cli("rollout", "set-weight", "30", env=env)
    assert res.returncode == 0 and "status:  held" in res.stdout and "weight:  30 %" in res.stdout, res.stderr
    assert httpx.get(f"{good.url}/admin/rollout", headers=ADMIN, timeout=30).json()["state"]["weight"] == 30.0
    res = run_cli("rollout", "pause", env=env)
    assert res.returncode == 0 and "status:  paused (paused from held)" in res.stdout, res.stderr
    res = run_cli("rollout", "resume", env=env)
    assert res.returncode == 0 and "status:  held" in res.stdout, res.stderr
    res = run_cli("rollout", "resume", env=env)  # not paused: refused by the router, one line
    assert res.returncode == 3 and res.stderr.strip().splitlines() == [
        "error: 400: action: resume needs a paused rollout (it is held)"], res.stderr
    res = run_cli("rollout", "history", "--limit", "3", env=env)
    assert res.returncode == 0 and "set-weight" in res.stdout and "(3 of" in res.stdout, res.stderr
    res = run_cli("rollout", "promote", env=env)  # held at 30 % (past the 25 % step): on to the 50 % step
    assert res.returncode == 0 and "promote: done" in res.stdout and "weight:  50 %" in res.stdout, res.stdout
    res = run_cli("rollout", "rollback", "--reason", "cli rollback", env=env)
    assert res.returncode == 0 and "status:  rolled-back" in res.stdout and "weight:  0 %" in res.stdout, res.stdout
    res = run_cli("rollout", "promote", env=env)  # nothing in progress: refused by the router, one line
    assert res.returncode == 3 and "promote needs a rollout in progress" in res.stderr, res.stderr
    run_cli("rollout", "restart", env=env)
    res = run_cli("rollout", "abort", env=env)
    assert res.returncode == 0 and "status:  aborted" in res.stdout and "weight:  0 %" in res.stdout, res.stdout
    status = run_cli("rollout", "status", env=env)
    assert status.returncode == 0 and "state version:" in status.stdout
    refused = run_cli("rollout", "status", env={**env, "POLICY_BUNDLE_ADMIN_TOKEN": "wrong"})
    assert refused.returncode == 3 and refused.stderr.strip().splitlines() == [
        "error: 403: admin token is not valid"], refused.stderr
    gone = run_cli("rollout", "status", "--url", "http://127.0.0.1:9", env=env)
    assert gone.returncode == 1 and "no answer" in gone.stderr and "Traceback" not in gone.stderr
    admin(good, "restart")


def test_history_returns_the_newest_events(good):
    admin(good, "restart", reason="h0")  # pause needs a rollout in progress, whatever earlier tests left
    admin(good, "pause", reason="h1")
    admin(good, "resume", reason="h2")
    admin(good, "pause", reason="h3")
    admin(good, "restart", reason="h4")
    page = httpx.get(f"{good.url}/admin/rollout/history?limit=3", headers=ADMIN).json()
    assert [e["reason"] for e in page["history"]] == ["h2", "h3", "h4"] and page["total"] >= 5
    full = httpx.get(f"{good.url}/admin/rollout/history", headers=ADMIN).json()["history"]
    assert full[-1]["reason"] == "h4"
    assert httpx.get(f"{good.url}/admin/rollout/history?limit=0", headers=ADMIN).status_code == 400


def test_golden_canary_calls_count_against_the_cap(good):
    def golden_calls():
        m = re.search(r'^policy_background_calls_total\{[^}]*kind="golden"[^}]*\} (\S+)$',
                      httpx.get(f"{good.url}/metrics").text, re.M)
        return float(m.group(1)) if m else 0.0

    before = golden_calls()
    run = admin(good, "golden-canary")["golden"]  # 16 golden items through each variant, gathered at once
    assert golden_calls() == before + 32  # each admitted through the in-flight count as a background call
    # the run's own high-water mark (a poll from here can fall between the calls): up to background_slots, not past
    assert run["max_in_flight"] == 2, run
    assert httpx.get(f"{good.url}/status", timeout=10).json()["background_inflight_peak"] == 2


def test_a_request_id_is_returned_and_logged_as_json_by_the_router_and_the_variant(good):
    r = complete(good, headers={**FORCE_INT8, "x-request-id": "req-abc.123"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "req-abc.123"
    made = complete(good).headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", made)  # none given: one is made
    odd = complete(good, headers={"x-request-id": "<script>"}).headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", odd)  # not a plain token: replaced, never echoed
    refused = httpx.post(f"{good.url}/v1/completions", json={"model": "policy"}, timeout=30,
                         headers={"x-request-id": "req-refused"})
    assert refused.status_code == 400 and refused.headers["x-request-id"] == "req-refused"
    with httpx.stream("POST", f"{good.url}/v1/completions", headers={"x-request-id": "req-stream"}, timeout=60,
                      json={"model": "policy", "prompt": "12+34=", "max_tokens": 4, "temperature": 0,
                            "stream": True}) as s:
        sse_events(s)
    assert s.headers["x-request-id"] == "req-stream"
    time.sleep(0.5)
    lines = [json.loads(line) for line in good.log.read_text().splitlines() if line.startswith('{"ts"')]
    mine = {(x["logger"], x["msg"]) for x in lines if x.get("request_id") == "req-abc.123"}
    assert ("policy_bundle.router", "request") in mine and ("policy_bundle.serve", "generated") in mine, mine
    stream = [x for x in lines if x.get("request_id") == "req-stream"]
    assert {x["msg"] for x in stream} >= {"request", "streamed"} and all(x["level"] == "info" for x in stream)


def test_every_metric_the_dashboard_and_alert_rules_name_is_exported(good):
    """deploy/'s dashboard and alert rules read only what the router exports (after streamed traffic: the
    time-to-first-token and inter-token histograms have series)."""
    from test_observability import metric_names_in_deploy

    for headers in ({}, FORCE_INT8):  # INT8's torch engine too: its queue and KV gauges
        httpx.post(f"{good.url}/v1/completions", timeout=60, headers=headers, json={
            "model": "policy", "prompt": "12+34=", "max_tokens": 4, "temperature": 0, "stream": True})
    time.sleep(2.5)  # a health probe after them: the engines' gauges
    text = httpx.get(f"{good.url}/metrics", timeout=30).text
    exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line.startswith("policy_")}
    exported |= {n[: -len(s)] for n in exported for s in ("_bucket", "_count", "_sum") if n.endswith(s)}
    assert metric_names_in_deploy() <= exported, sorted(metric_names_in_deploy() - exported)


@needs_vllm
def test_the_vllm_variant_exports_its_batch_queue_and_kv_cache(good):
    """vLLM's scheduler, read through a stat logger of vLLM's own interface: the FP16 variant's batch, queue and KV
    gauges have series as the torch engine's do (before: none), its KV budget the engine's cache (1 GiB here), the
    INT8 engine's default budget no more than that."""
    force_fp16 = {**FORCE_INT8, "x-policy-variant": "fp16"}
    r = httpx.post(f"{good.url}/v1/completions", timeout=60, headers=force_fp16, json={
        "model": "policy", "prompt": "12+34=", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.headers.get("x-policy-variant") in (None, "fp16"), r.text
    # the gauges are the variant's figures at the router's last health poll, which may have come mid-request (or
    # beside a shadow call): read them until the poll after the request has shown the engine idle
    idle = 'policy_engine_batch_size{variant="fp16"}'
    deadline, found = time.monotonic() + 20, {}
    while time.monotonic() < deadline and (len(found) < 3 or found[idle] != 0.0):
        text = httpx.get(f"{good.url}/metrics", timeout=30).text
        found = {m[0]: float(m[1]) for m in re.findall(
            r'^(policy_engine_batch_size\{variant="fp16"\}|policy_engine_pending_requests\{variant="fp16"\}|'
            r'policy_kv_cache_bytes\{kind="budget",variant="fp16"\}) (\S+)$', text, re.M)}
        time.sleep(1)
    assert found.get('policy_kv_cache_bytes{kind="budget",variant="fp16"}') == 2**30, found
    # the INT8 engine's default budget is the FP16 variant's KV space (less where a tenth of memory is less): an A/B
    # split compares the engines, not what each may hold
    int8_budget = float(re.search(r'^policy_kv_cache_bytes\{kind="budget",variant="int8"\} (\S+)$', text, re.M)[1])
    assert 256 * 2**20 <= int8_budget <= 2**30, int8_budget
    assert found.get(idle) == 0.0, found  # idle again after the request
    health = httpx.get(f"{good.url}/status", headers=ADMIN, timeout=30).json()["variants"]["fp16"]
    assert health["engine"].startswith("vllm") and health["batch"]["steps"] > 0 and 0.0 <= health["batch"]["kv_usage"] < 1


def test_restart_resumes_the_rollout_with_its_history(good, small_bundle, state):
    admin(good, "restart")
    admin(good, "promote")
    before = httpx.get(f"{good.url}/admin/rollout", headers=ADMIN).json()["state"]
    history = httpx.get(f"{good.url}/admin/rollout/history", headers=ADMIN).json()["history"]
    good.stop()
    # the rollout state is the router's: the restarted one serves FP16 with the fallback (no second vLLM start)
    again = Server(env_for(state, "good", bundle_version(small_bundle), vllm=False), state / "good2.log").wait_ready()
    try:
        after = httpx.get(f"{again.url}/admin/rollout", headers=ADMIN).json()["state"]
        assert {k: after[k] for k in ("weight", "step_index", "status")} == {k: before[k] for k in ("weight", "step_index", "status")}
        assert httpx.get(f"{again.url}/admin/rollout/history", headers=ADMIN).json()["history"] == history
    finally:
        again.stop()


@needs_vllm
def test_int8_served_by_vllm_on_the_w8a8_dir_reports_its_engine(small_bundle, state):
    server = Server(env_for(state, "int8vllm", bundle_version(small_bundle), int8_engine="vllm"),
                    state / "int8vllm.log").wait_ready(600)
    try:
        status = httpx.get(f"{server.url}/status", timeout=30).json()
        assert status["variants"]["int8"]["engine"] == "vllm-w8a8" and status["variants"]["fp16"]["engine"] == "vllm"
        r = complete(server, headers=FORCE_INT8, max_tokens=6)
        assert r.status_code == 200 and r.json()["policy_variant"] == "int8" and r.json()["choices"][0]["text"] == "998"
        assert re.search(r'^policy_variant_engine_info\{(?=[^}]*engine="vllm-w8a8")(?=[^}]*variant="int8")[^}]*\} 1\.0',
                         httpx.get(f"{server.url}/metrics", timeout=30).text, re.M)
    finally:
        server.stop()

