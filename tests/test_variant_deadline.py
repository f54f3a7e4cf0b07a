"""A variant's plain generation stops at its caller's deadline and frees its decode slot (the HTTP side, with a real
router that times out: tests/test_serve_faults.py)."""

import asyncio

import pytest

from policy_bundle.serve.variants.engines import SamplingParams, Step


class SlowEngine:
    """A fault injected: one token every 0.2 s, and a record of whether the caller closed the generation."""

    def __init__(self):
        self.closed, self.produced = False, 0

    async def generate(self, prompt_ids, params):
        try:
            for i in range(params.max_tokens):
                await asyncio.sleep(0.2)
                self.produced += 1
                yield Step(i, 0.0)
        finally:
            self.closed = True  # the batched engine marks the request cancelled here: its slot is freed


def test_a_plain_generation_stops_at_its_deadline_and_closes_the_engines_stream(bentoml_home):
    # imported here, with the test store set: importing the variants module reads the model store, and BentoML
    # binds a process to the first store it reads
    from policy_bundle.serve.variants.services import _collect

    engine = SlowEngine()
    with pytest.raises(TimeoutError, match=r"deadline_s: generation stopped after 0.5s \(2 tokens\)"):
        asyncio.run(_collect(engine, [1, 2], SamplingParams(max_tokens=50), deadline_s=0.5))
    assert engine.closed and engine.produced < 4  # not 50 tokens (10 s) later
    done = SlowEngine()  # the control: within its deadline the whole answer comes back
    out = asyncio.run(_collect(done, [1, 2], SamplingParams(max_tokens=3), deadline_s=5.0))
    assert out["token_ids"] == [0, 1, 2] and done.closed
