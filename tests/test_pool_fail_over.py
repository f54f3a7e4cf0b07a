"""The pool's one fail-over loop, for plain calls and streams alike: a dropped connection is retried once on the
same variant, any other failure goes to the other variant (reported once), a variant's 4xx goes to the client."""

import asyncio
import json
from types import SimpleNamespace

import aiohttp
import pytest

from policy_bundle.serve.router.pool import VariantPool
from policy_bundle.serve.schemas import ApiError


def stream_service(outcomes: list, calls: list, name: str):
    """A variant whose n-th stream does ``outcomes[n]``: "drop" (the connection), "refuse" (an in-band 400),
    "fail" (an in-band 500) or "ok" (one step, then the end marker)."""

    async def stream(**_):
        outcome = outcomes[len(calls) if len(calls) < len(outcomes) else -1]
        calls.append(name)
        if outcome == "drop":
            raise aiohttp.ServerDisconnectedError()
        if outcome in ("refuse", "fail"):
            yield json.dumps({"error": outcome, "status": 400 if outcome == "refuse" else 500}) + "\n"
        yield json.dumps({"token_id": 7, "variant": name}) + "\n" + json.dumps({"done": True}) + "\n"

    async def generate(**_):
        calls.append(name)
        outcome = outcomes[0]
        if outcome == "drop":
            raise aiohttp.ServerDisconnectedError()
        if outcome == "fail":
            raise RuntimeError("engine died")
        return {"variant": name}

    return SimpleNamespace(to_async=SimpleNamespace(stream=stream, generate=generate))


def pool_of(int8: list, fp16: list):
    calls, errors = [], []
    services = {"int8": stream_service(int8, calls, "int8"), "fp16": stream_service(fp16, calls, "fp16")}
    pool = VariantPool(services, SimpleNamespace(request_timeout_s=10.0, health_timeout_s=3.0), note=lambda *a: None,
                       on_error=lambda name, exc, evidence: errors.append(name), metrics=None)
    return pool, calls, errors


def open_stream(pool):
    async def run():
        name, [(first, steps)] = await pool.open_stream("int8", False, [{}])
        await steps.aclose()
        return name, first

    return asyncio.run(run())


def test_a_stream_dropped_once_is_retried_on_the_same_variant():
    pool, calls, errors = pool_of(["drop", "ok"], ["ok"])
    assert open_stream(pool) == ("int8", {"token_id": 7, "variant": "int8"})
    assert calls == ["int8", "int8"] and errors == []


def test_a_stream_dropped_twice_or_failing_goes_to_the_other_variant_reported_once():
    for int8 in (["drop", "drop"], ["fail"]):
        pool, calls, errors = pool_of(int8, ["ok"])
        assert open_stream(pool)[0] == "fp16"
        assert calls == ["int8"] * len(int8) + ["fp16"] and errors == ["int8"]


def test_a_variants_4xx_is_the_clients_error_and_the_other_variant_is_not_asked():
    pool, calls, errors = pool_of(["refuse"], ["ok"])
    with pytest.raises(ApiError) as info:
        open_stream(pool)
    assert info.value.status == 400 and calls == ["int8"] and errors == []


def test_a_plain_call_fails_over_too_and_with_no_variant_left_it_is_a_503():
    pool, calls, errors = pool_of(["fail"], ["ok"])
    assert asyncio.run(pool.generate("int8", False, [{}])) == ("fp16", [{"variant": "fp16"}])
    assert errors == ["int8"]
    pool, calls, errors = pool_of(["fail"], ["drop"])
    with pytest.raises(ApiError) as info:
        asyncio.run(pool.generate("int8", False, [{}]))
    assert info.value.status == 503 and calls == ["int8", "fp16", "fp16"] and errors == ["int8", "fp16"]


def test_a_request_with_several_choices_fails_over_whole_and_closes_the_streams_it_opened():
    """n choices are answered by one variant: when one choice's stream fails on INT8, the choices INT8 opened are
    closed and every choice goes to FP16."""
    closed = []
    pool, calls, errors = pool_of(["ok", "fail"], ["ok"])
    stream = pool.services["int8"].to_async.stream

    async def tracked(**kw):
        try:
            async for line in stream(**kw):
                yield line
        finally:
            closed.append("int8")
    pool.services["int8"].to_async.stream = tracked

    async def run():
        name, opened = await pool.open_stream("int8", False, [{}, {}])
        for _, steps in opened:
            await steps.aclose()
        return name, [first for first, _ in opened]
    name, firsts = asyncio.run(run())
    assert name == "fp16" and firsts == [{"token_id": 7, "variant": "fp16"}] * 2
    assert calls == ["int8", "int8", "fp16", "fp16"] and errors == ["int8"] and closed == ["int8", "int8"]
