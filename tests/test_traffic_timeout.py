"""BentoML's per-request timeout ends a stream that many seconds after it began, whatever it is doing: the services'
own must not be what bounds a long answer (the router's per-token request_timeout_s and the client's disconnect do).
At 120 s it cut 16 streams of a 6000-token-prompt load at 121 s (loadtest/bench_long_requests.py)."""

from __future__ import annotations


def test_no_service_cuts_a_stream_that_a_full_context_answer_needs(bentoml_home):
    from policy_bundle.serve.http import TRAFFIC_TIMEOUT_S
    from policy_bundle.serve.router.service import PolicyRouter
    from policy_bundle.serve.variants.services import Fp16Policy, Int8Policy

    # an 8192-token answer at 1 token a second, the slowest a served stream is expected to be, with room to spare
    assert TRAFFIC_TIMEOUT_S >= 4 * 8192
    for service in (PolicyRouter, Int8Policy, Fp16Policy):
        assert service.config["traffic"]["timeout"] == TRAFFIC_TIMEOUT_S, service.name
