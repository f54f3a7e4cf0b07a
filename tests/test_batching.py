"""Continuous batching in the INT8 engine: a decode step advances every active request at once.

Greedy requests get exactly the tokens they get alone, whether they run alone, join while others
are mid-stream, or leave (finish, or are cancelled) while others go on. The engine runs the
exported INT8 TorchScript artifact of a real reference bundle.
"""

from __future__ import annotations

import asyncio
import math
import time

import pytest
import torch

from policy_bundle.quantize.runtime.decode import decode_steps, greedy_pick
from policy_bundle.serve.variants.batching import BatchedEngine, policy_engine
from policy_bundle.serve.variants.lanes import Lanes
from policy_bundle.serve.variants.engines import CachedPolicyEngine, SamplingParams

PROMPTS = [[1, 6, 8, 13, 7, 14], [1, 9, 9, 12, 4, 14], [1, 5, 13, 5, 14], [1, 7, 3, 2, 13, 8, 8, 14],
           [1, 4, 13, 4, 14], [1, 3, 3, 3, 12, 2, 14], [1, 8, 13, 6, 6, 14], [1, 2, 12, 9, 14]]
MAX_TOKENS = [6, 3, 8, 5, 7, 2, 6, 4]  # different lengths: requests leave at different steps


@pytest.fixture(scope="module")
def artifact(small_bundle):
    return torch.jit.load(str(small_bundle / "int8" / "policy.ts"))


def collect(engine, prompt, max_tokens, **kw):
    async def run():
        return [s async for s in engine.generate(prompt, SamplingParams(max_tokens=max_tokens, **kw))]
    return run()


def solo(engine, **kw):
    """Each request alone, one after the other."""
    async def run():
        return [await collect(engine, p, n, **kw) for p, n in zip(PROMPTS, MAX_TOKENS)]
    return asyncio.run(run())


def wait_idle(engine) -> bool:
    """The last token reaches its caller before its row leaves the batch: wait (briefly) for that."""
    for _ in range(200):
        if engine.stats()["active"] == 0:
            return True
        time.sleep(0.01)
    return False


def test_artifact_has_batched_decode_and_the_engine_picks_it(artifact):
    assert isinstance(policy_engine(artifact, 32, "int8"), BatchedEngine)

    class SingleSequence:  # an artifact exported before decode_batch existed
        def new_cache(self, b, n): return artifact.new_cache(b, n)
        def prefill(self, ids, k, v): return artifact.prefill(ids, k, v)
        def decode(self, t, pos, k, v): return artifact.decode(t, pos, k, v)

    old = policy_engine(SingleSequence(), 32, "int8")
    assert isinstance(old, CachedPolicyEngine) and old.name.endswith("-sequential")
    assert [s.token_id for s in asyncio.run(collect(old, PROMPTS[0], 6))] == \
        [s.token_id for s in decode_steps(artifact, PROMPTS[0], 6, greedy_pick, max_seq_len=32)]


class WithoutFusedStep:
    """The artifact as exported before ``step_seqs`` existed: a prefill call per newcomer, then the step (a ``decode``
    per row)."""

    def __init__(self, artifact):
        self.artifact = artifact

    def __getattr__(self, name):
        if name == "step_seqs":
            raise AttributeError(name)
        return getattr(self.artifact, name)


@pytest.mark.parametrize("fused", [True, False], ids=["chunks-in-the-step", "prefill-calls"])
@pytest.mark.parametrize("chunk", [64, 2], ids=["whole-prompts", "prompts-in-chunks-of-2"])
def test_batched_greedy_equals_unbatched_with_requests_joining_and_leaving(artifact, chunk, fused):
    """Newcomers' prompts are prefilled while others decode: whole, or 2 tokens per step across steps; in the step's
    own forward (``step_seqs``), or by a prefill call each (an artifact without it)."""
    engine = BatchedEngine(artifact if fused else WithoutFusedStep(artifact), 32, "int8", prefill_chunk=chunk)
    assert engine.fused is fused
    alone = solo(engine)
    # the one decode loop of the build, no engine at all
    loop = [[s.token_id for s in decode_steps(artifact, p, n, greedy_pick, max_seq_len=32)]
            for p, n in zip(PROMPTS, MAX_TOKENS)]
    assert [[s.token_id for s in steps] for steps in alone] == loop
    # 20 ms a step (a step hook on the decode thread) so the newcomers join while the first half still decodes,
    # however slowly the event loop runs beside a busy CI worker (in a CI run they arrived after all 4 had left)
    engine.step_hook = lambda _step: time.sleep(0.02)

    async def together():
        started = asyncio.Event()
        first_half = []

        async def first(i):
            out = []
            async for s in engine.generate(PROMPTS[i], SamplingParams(max_tokens=MAX_TOKENS[i])):
                out.append(s)
                if len(out) == 2:
                    started.set()  # the second half joins while these are mid-stream
            return out

        async def later(i):
            await started.wait()
            return await collect(engine, PROMPTS[i], MAX_TOKENS[i])

        for i in range(4):
            first_half.append(asyncio.create_task(first(i)))
        return await asyncio.gather(*first_half, *[later(i) for i in range(4, 8)])

    batched = asyncio.run(together())
    for a, b in zip(alone, batched):
        assert [s.token_id for s in a] == [s.token_id for s in b]
        assert all(math.isclose(x.logprob, y.logprob, abs_tol=1e-4) for x, y in zip(a, b))
    stats = engine.stats()
    # whole prompts join at once; in chunks of 2, newcomers join over several steps while the first ones leave
    assert stats["peak_batch"] >= (5 if chunk > 8 else 2) and wait_idle(engine), stats
    assert (stats["fused_chunks"] > 0) is fused, stats


class ChunksSeen:
    """The artifact, recording each prompt chunk that goes into a step's forward: (start, length)."""

    def __init__(self, artifact):
        self.artifact, self.chunks = artifact, []

    def step_seqs(self, tokens, pos, prompts, starts, ks, vs):
        self.chunks += [(start, p.shape[1]) for p, start in zip(prompts, starts)]
        return self.artifact.step_seqs(tokens, pos, prompts, starts, ks, vs)

    def __getattr__(self, name):
        return getattr(self.artifact, name)


@pytest.mark.parametrize("chunk", [8, 4])
def test_a_prompt_is_cut_only_where_it_is_longer_than_the_prefill_budget(artifact, chunk):
    """A float layer's sums over a prompt's rows depend on how many there are: a prompt cut where other newcomers
    left the budget got another continuation than whole (the gate's). One that fits ``prefill_chunk`` waits a step
    instead; a longer one is cut at multiples of it (every prompt here fits 8 tokens; at 4 most are longer)."""
    module = ChunksSeen(artifact)
    engine = BatchedEngine(module, 32, "int8", prefill_chunk=chunk)

    async def together():
        return await asyncio.gather(*[collect(engine, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)])

    asyncio.run(together())
    assert len(module.chunks) >= len(PROMPTS)
    if chunk == 8:
        assert all(start == 0 for start, _ in module.chunks) and \
            sorted(n for _, n in module.chunks) == sorted(len(p) for p in PROMPTS)
    else:
        first, rest = module.chunks[0], module.chunks[1:]  # an idle engine takes its first prompt whole
        assert first[0] == 0 and first[1] in {len(p) for p in PROMPTS}
        assert {start for start, _ in rest} == {0, 4} and all(n <= 4 for _, n in rest)


def test_lanes_split_concurrent_requests_and_each_gets_the_tokens_it_gets_alone(artifact):
    """Two decode threads on one module: a request goes to the lane with the fewest, and a greedy request gets the
    tokens it gets alone on one engine (each lane decodes with one intra-op thread, as the gate did)."""
    alone = solo(BatchedEngine(artifact, 32, "int8"))
    engine = policy_engine(artifact, 32, "int8", lanes=2)
    assert isinstance(engine, Lanes) and [lane.name for lane in engine.lanes] == ["int8-lane0", "int8-lane1"]
    assert [lane.max_batch for lane in engine.lanes] == [16, 16]  # the lanes share max_batch: no more KV slots
    assert [lane.max_batch for lane in policy_engine(artifact, 32, "int8", max_batch=5, lanes=2).lanes] == [3, 2]
    assert isinstance(policy_engine(artifact, 32, "int8", max_batch=1, lanes=2), BatchedEngine)
    one_by_one = solo(engine)  # negative control: a lone client never needs the second lane
    assert engine.stats()["per_lane"][1]["steps"] == 0

    async def together():
        return await asyncio.gather(*[collect(engine, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)])

    laned = asyncio.run(together())
    for a, b, c in zip(alone, one_by_one, laned):
        assert [s.token_id for s in a] == [s.token_id for s in b] == [s.token_id for s in c]
        assert all(math.isclose(x.logprob, y.logprob, abs_tol=1e-4) for x, y in zip(a, c))
    stats = engine.stats()
    assert stats["lanes"] == 2 and all(s["steps"] > 0 and s["peak_batch"] >= 2 for s in stats["per_lane"]), stats
    assert wait_idle(engine) and engine._load == [0, 0]

    async def hang_up():  # a caller that stops early hands its lane back too
        gen = engine.generate(PROMPTS[0], SamplingParams(max_tokens=6))
        await gen.__anext__()
        assert engine._load == [1, 0]
        await gen.aclose()

    asyncio.run(hang_up())
    assert engine._load == [0, 0] and wait_idle(engine)
    with pytest.raises(ValueError, match="prompt_ids: empty"):  # refused before it joins a step it would fail
        asyncio.run(collect(engine, [], 3))
    assert engine._load == [0, 0] and [s.token_id for s in asyncio.run(collect(engine, PROMPTS[0], 6))] == \
        [s.token_id for s in alone[0]]


def test_cancelling_one_stream_does_not_disturb_the_others(artifact):
    engine = BatchedEngine(artifact, 32, "int8")
    alone = solo(engine)

    async def scenario():
        async def quitter():
            gen = engine.generate(PROMPTS[2], SamplingParams(max_tokens=MAX_TOKENS[2]))
            got = [await gen.__anext__(), await gen.__anext__()]
            await gen.aclose()  # what the server does when the client goes away
            return got

        others = [asyncio.create_task(collect(engine, p, n)) for i, (p, n) in enumerate(zip(PROMPTS, MAX_TOKENS))
                  if i != 2]
        cut = await quitter()
        return cut, await asyncio.gather(*others)

    cut, others = asyncio.run(scenario())
    assert [s.token_id for s in cut] == [s.token_id for s in alone[2][:2]]
    assert [[s.token_id for s in o] for o in others] == [[s.token_id for s in a] for i, a in enumerate(alone) if i != 2]
    assert wait_idle(engine)  # the cancelled row leaves at the engine's next step


def test_sampling_stays_per_request_seeds_and_stop_tokens(artifact):
    engine = BatchedEngine(artifact, 32, "int8")
    kw = dict(temperature=1.0, top_p=0.9)
    alone = [asyncio.run(collect(engine, p, 6, seed=i, **kw)) for i, p in enumerate(PROMPTS)]

    async def together():
        return await asyncio.gather(*[collect(engine, p, 6, seed=i, **kw) for i, p in enumerate(PROMPTS)])

    assert [[s.token_id for s in a] for a in alone] == [[s.token_id for s in b] for b in asyncio.run(together())]
    greedy = asyncio.run(collect(engine, PROMPTS[0], 6))
    stop = greedy[1].token_id
    stopped = asyncio.run(collect(engine, PROMPTS[0], 6, stop_token_id=stop))
    assert [s.token_id for s in stopped] == [s.token_id for s in greedy[: [g.token_id for g in greedy].index(stop) + 1]]


def test_served_int8_batches_concurrent_streams_and_frees_a_disconnected_ones_slot(small_bundle, tmp_path):
    """Over HTTP: the INT8 variant's own /stream API, four clients at once on two decode lanes, one client hangs up."""
    import httpx

    from serve_helpers import Server, bundle_version

    (tmp_path / "router.yaml").write_text("engine_lanes: 2\n")
    env = {"POLICY_BUNDLE_STATE_DIR": str(tmp_path / "state"), "POLICY_BUNDLE_VERSION": bundle_version(small_bundle),
           "POLICY_BUNDLE_DISABLE_VLLM": "1", "POLICY_BUNDLE_TEST_FAULT": "slow:factor=0.1",
           "POLICY_BUNDLE_ROUTER_CONFIG": str(tmp_path / "router.yaml")}
    server = Server(env, tmp_path / "int8.log", target="policy_bundle.serve.variants.services:Int8Policy").wait_ready()
    prompts, n = PROMPTS[:4], 14

    async def scenario():
        async with httpx.AsyncClient(timeout=60) as client:
            alone = [(await client.post(f"{server.url}/generate", json={"prompt_ids": p, "max_tokens": n})).json()
                     for p in prompts]

            async def stream(p, hang_up_after=None):
                got = []
                async with client.stream("POST", f"{server.url}/stream", json={"prompt_ids": p, "max_tokens": n}) as r:
                    async for line in r.aiter_lines():
                        if line:
                            got.append(line)
                        if hang_up_after is not None and len(got) == hang_up_after:
                            return got  # leaving the block closes the connection mid-stream
                return got

            tasks = [asyncio.create_task(stream(p, 2 if i == 1 else None)) for i, p in enumerate(prompts)]
            await tasks[1]
            seen = []
            while not all(t.done() for t in tasks):  # the others are still streaming
                seen.append((await client.post(f"{server.url}/health", json={})).json()["batch"])
                await asyncio.sleep(0.05)
            return alone, await asyncio.gather(*tasks), seen, (await client.post(f"{server.url}/health", json={})).json()

    try:
        alone, streams, seen, health = asyncio.run(scenario())
    finally:
        server.stop()
    import json

    for i, (a, lines) in enumerate(zip(alone, streams)):
        tokens = [json.loads(x)["token_id"] for x in lines if "token_id" in json.loads(x)]
        if i == 1:
            assert tokens == a["token_ids"][:2]
        else:
            assert tokens == a["token_ids"] and json.loads(lines[-1]) == {"done": True}
    # two streams on each lane, each lane batching its two
    assert health["batch"]["lanes"] == 2 and all(lane["peak_batch"] == 2 for lane in health["batch"]["per_lane"])
    # every stream makes 14 tokens: 3 active well before the end means the hung-up stream's slot was
    # freed while the others were still decoding
    # (at least 5 decode steps of each lane before its end: not a row that merely joined one step late and ends early)
    assert any(s["active"] == 3 and all(lane["steps"] <= end["steps"] - 5 for lane, end in
                                        zip(s["per_lane"], health["batch"]["per_lane"])) for s in seen), (seen, health)
    assert health["batch"]["active"] == 0


class ThreadsSeen:
    """A module that records, on each call, the calling thread's intra-op threads and grad mode."""

    def __init__(self, artifact):
        self.artifact, self.seen = artifact, []

    def record(self, fn, *args):
        self.seen.append((torch.get_num_threads(), torch.is_grad_enabled()))
        return fn(*args)

    def __call__(self, *args):
        return self.record(self.artifact, *args)

    def __getattr__(self, name):
        attr = getattr(self.artifact, name)
        return lambda *args: self.record(attr, *args)


@pytest.mark.parametrize("engine_cls", [BatchedEngine, CachedPolicyEngine])
def test_decode_thread_runs_with_the_configured_intra_op_threads_and_no_grad(artifact, engine_cls):
    """One intra-op thread on the decode thread by default (a second OpenMP team over-subscribes the cores:
    serve/variants/engines.py), whatever the main thread uses; the setting raises it."""
    main_threads = torch.get_num_threads()
    for threads in (1, 2):
        module = ThreadsSeen(artifact)
        engine = engine_cls(module, 32, "int8", threads=threads)
        assert len(asyncio.run(collect(engine, PROMPTS[0], 3))) == 3
        assert module.seen and set(module.seen) == {(threads, False)}
    assert torch.get_num_threads() == main_threads  # the caller's thread is left as it was


@pytest.mark.parametrize("engine_cls", [BatchedEngine, CachedPolicyEngine])
def test_an_engine_with_no_decode_threads_is_refused_at_construction(artifact, engine_cls):
    with pytest.raises(ValueError, match=r"^threads: 0 must be >= 1$"):
        engine_cls(artifact, 32, "int8", threads=0)


def test_score_runs_the_head_on_the_last_position_as_a_prefill_does(artifact):
    """The engines' ``score`` (the INT8 service's batchable API): each sequence's next-token logits as a generation's
    prefill computes them (``next_logits`` over whole attention blocks), not a full forward's last row, whose
    [B, T, vocab] head output is what a long batch ran out of memory on; an artifact without ``next_logits`` keeps
    the full forward."""
    from policy_bundle.quantize.model.blocks import cache_len_for
    from policy_bundle.quantize.model.policy import full_logits
    from policy_bundle.quantize.runtime.slots import SlotBatch
    from policy_bundle.serve.variants.engines import last_position_logits

    seqs = [p[:5] for p in PROMPTS if len(p) >= 5][:3]
    got = torch.tensor(last_position_logits(artifact, [seqs[0]]))[0]
    batch = SlotBatch(artifact, 32, 1)
    assert torch.equal(got, batch.prefill(seqs[0]))  # bitwise what the served prefill gives
    full = full_logits(artifact, torch.tensor(seqs))[:, -1]
    # a full forward's last row over the same whole blocks: PyTorch's fused attention sums in an order that depends on
    # the key count (``attention_len``), and one int8 activation code flipped by an ulp moved a logit of the reference
    # policy by 0.06 between 5 keys and 32 under a float16 cache (bfloat16 happened to agree), so the blocks are matched
    blocks = artifact(torch.tensor(seqs), 0, *artifact.new_cache(len(seqs), cache_len_for(len(seqs[0]))))[:, -1]
    assert torch.allclose(torch.tensor(last_position_logits(artifact, seqs)), blocks, atol=1e-4)

    calls = []

    class Old:  # exported before next_logits
        def new_cache(self, b, n): return artifact.new_cache(b, n)
        def __call__(self, *a): calls.append("forward"); return artifact(*a)  # noqa: E702

    class New(Old):
        def next_logits(self, *a): calls.append("next_logits"); return artifact.next_logits(*a)  # noqa: E702

    assert torch.allclose(torch.tensor(last_position_logits(Old(), seqs)), full, atol=0) and calls == ["forward"]
    calls.clear()
    last_position_logits(New(), seqs)
    assert calls == ["next_logits"]  # no full forward: the head runs on one row per sequence
