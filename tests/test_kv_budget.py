"""The served KV cache in blocks within a budget: it grows by blocks as sequences do and gives memory back as they
leave; a request is admitted when its worst case (prompt + max_tokens) fits beside the others', waits otherwise,
and gets a 429 after ``kv_wait_s``; one that could never fit is a 400 naming max_tokens. A sequence's tokens are the
same alone, batched, and across cache growth (the HTTP side: tests/test_long_context.py)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from policy_bundle.quantize.runtime.decode import decode_steps, greedy_pick
from policy_bundle.quantize.model.hf_weights import init_random_policy
from policy_bundle.quantize.model.policy import KV_CACHES, set_kv_cache
from policy_bundle.quantize.model.policy_config import PolicyConfig
from policy_bundle.quantize.runtime.slots import SlotBatch
from policy_bundle.serve.variants.batching import KV_BLOCK, BatchedEngine, KvBudget, policy_engine
from policy_bundle.serve.variants.engines import CapacityError, SamplingParams

CFG = PolicyConfig(family="llama", vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                   intermediate_size=128, max_seq_len=1024)


@pytest.fixture(scope="module")
def policy():
    return torch.jit.script(init_random_policy(CFG, seed=3).eval())


def sleeps(seconds: float):
    """An engine step hook that makes each decode step last ``seconds`` longer."""
    return lambda _step: time.sleep(seconds)


def prompt(n: int, seed: int):
    return torch.randint(1, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


async def tokens(engine, ids, max_tokens: int):
    return [s.token_id async for s in engine.generate(ids, SamplingParams(max_tokens=max_tokens))]


def settled(engine) -> dict:
    """The engine's stats once its rows have left (a last token reaches its caller before its row leaves)."""
    for _ in range(300):
        stats = engine.stats()
        if not stats["active"] and not stats["kv_held_bytes"]:
            return stats
        time.sleep(0.01)
    return stats


def footprint(policy, n: int, positions: int) -> int:
    return SlotBatch(policy, CFG.max_seq_len, 32, KV_BLOCK).footprint(n, positions)


def watched(engine, keys, make):
    """``asyncio.run(make())`` while the engine's stats ``keys`` are sampled every 2 ms: (its result, the samples)."""
    seen, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            s = engine.stats()
            seen.append(tuple(s[k] for k in keys))
            time.sleep(0.002)
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        return asyncio.run(make()), seen
    finally:
        stop.set()
        watcher.join()


@pytest.mark.parametrize("kv_cache", KV_CACHES)
def test_tokens_past_several_blocks_are_the_same_alone_batched_and_as_the_cache_grows(kv_cache):
    """Three requests crossing 256-position blocks at different steps (the cache grows under them, and shrinks when
    the long one leaves) get the tokens each gets alone in one whole-context cache; in a float32 cache and in each
    16-bit one (float16, the build's default, and bfloat16)."""
    policy = torch.jit.script(set_kv_cache(init_random_policy(CFG, seed=3).eval(), kv_cache))
    assert policy.new_cache(1, 32)[0].dtype == getattr(torch, kv_cache)
    cases = [(prompt(300, 0), 300), (prompt(40, 1), 200), (prompt(10, 2), 600)]
    alone = [[s.token_id for s in decode_steps(policy, p, n, greedy_pick, max_seq_len=CFG.max_seq_len)]
             for p, n in cases]
    engine = BatchedEngine(policy, CFG.max_seq_len, "kv", max_batch=4, kv=KvBudget(2**30))

    async def run():
        short = await tokens(engine, prompt(5, 9), 4)  # alone: one block, not the whole context
        positions = engine.stats()["kv_positions"]
        return short, positions, await asyncio.gather(*[tokens(engine, p, n) for p, n in cases])
    _, positions, batched = asyncio.run(run())
    assert positions in (0, KV_BLOCK)  # a block while it ran (0 once it left), never the context's 1024
    assert batched == alone and [len(t) for t in batched] == [n for _, n in cases]
    stats = settled(engine)
    assert stats["kv_held_bytes"] == 0 and stats["kv_allocated_bytes"] == 0  # memory given back at the end


def test_admission_counts_kv_over_every_lane_and_gives_it_back(policy):
    """A budget for two worst cases: six requests over two lanes never hold more than two sequences' memory at
    once, all are answered, and the budget and the cache are back to 0 afterwards."""
    budget = footprint(policy, 2, 512)
    engine = policy_engine(policy, CFG.max_seq_len, "kv", max_batch=8, lanes=2, kv_cache_bytes=budget)
    for lane in engine.lanes:
        lane.step_hook = sleeps(0.002)  # steps long enough for the requests to overlap

    async def run():
        return await asyncio.wait_for(asyncio.gather(*[tokens(engine, prompt(10, i), 300) for i in range(6)]), 120)
    out, seen = watched(engine, ("active", "kv_held_bytes", "kv_allocated_bytes"), run)
    assert [len(t) for t in out] == [300] * 6
    assert max(a for a, _, _ in seen) == 2  # two at once (the budget's worth), never three
    assert max(h for _, h, _ in seen) <= budget and max(b for _, _, b in seen) <= budget
    stats = settled(engine)
    assert stats["kv_held_bytes"] == 0 and stats["kv_allocated_bytes"] == 0 and stats["active"] == 0


def test_a_worst_case_over_the_whole_budget_is_refused_naming_max_tokens(policy):
    engine = BatchedEngine(policy, CFG.max_seq_len, "kv", kv=KvBudget(footprint(policy, 1, 256)))
    with pytest.raises(CapacityError) as err:
        asyncio.run(tokens(engine, prompt(10, 0), 500))
    assert err.value.status == 400 and str(err.value).startswith("max_tokens: 10 prompt tokens + max_tokens 500")
    assert asyncio.run(tokens(engine, prompt(10, 0), 200)) and settled(engine)["kv_held_bytes"] == 0  # answered


def test_a_request_that_waits_past_kv_wait_s_gets_a_429_and_the_one_holding_the_memory_finishes(policy):
    engine = BatchedEngine(policy, CFG.max_seq_len, "kv", kv=KvBudget(footprint(policy, 1, 512)), kv_wait_s=0.3)
    engine.step_hook = sleeps(0.004)  # the first request decodes 400 tokens for about 1.6 s

    async def run():
        first = asyncio.ensure_future(tokens(engine, prompt(10, 0), 400))
        await asyncio.sleep(0.1)
        t0 = time.monotonic()
        with pytest.raises(CapacityError) as err:
            await tokens(engine, prompt(10, 1), 400)
        waited = time.monotonic() - t0
        return await first, waited, err.value
    done, waited, err = asyncio.run(run())
    assert err.status == 429 and str(err).startswith("kv_cache: no KV memory came free") and 0.25 < waited < 1.5
    assert len(done) == 400 and settled(engine)["kv_refused"] == 1 and engine.kv.held() == 0


def test_a_long_sequence_costs_its_own_blocks_and_short_ones_theirs(policy):
    """Each sequence holds whole blocks of its own (a block table of one contiguous run per sequence): a 600-position
    row beside three short ones costs its three blocks and theirs one each, not four times three; the engine holds the
    worst cases in blocks the same way, and a row that leaves gives its blocks back at once."""
    batch = SlotBatch(policy, CFG.max_seq_len, 8, KV_BLOCK)
    for seed, n in enumerate((600, 10, 20, 30)):
        batch.prefill(prompt(n, seed))
        batch.join(seed)
    per = KV_BLOCK * batch.bytes_per_position()
    assert batch.blocks == 3 + 1 + 1 + 1 and batch.allocated_bytes() == 6 * per  # a dense cache: 4 x 3 blocks
    batch.step([1, 2, 3, 4])
    batch.release([0])
    assert batch.blocks == 3 and batch.allocated_bytes() == 3 * per

    engine = BatchedEngine(policy, CFG.max_seq_len, "kv", max_batch=4, kv=KvBudget(2**30))
    engine.step_hook = sleeps(0.004)
    async def run():  # one 700-position worst case, three of 40: held 3 + 1 + 1 + 1 blocks
        return await asyncio.gather(tokens(engine, prompt(500, 0), 200),
                                    *[tokens(engine, prompt(10, i), 30) for i in (1, 2, 3)])
    out, seen = watched(engine, ("active", "kv_held_bytes", "kv_blocks"), run)
    assert [len(o) for o in out] == [200, 30, 30, 30]
    assert max((h for a, h, _ in seen if a == 4), default=None) == 6 * per  # dense slots: 4 x 3 blocks
    assert max(b for _, _, b in seen) <= 6 and min(h for a, h, _ in seen if a == 1 and h) == 3 * per
    stats = settled(engine)
    assert stats["kv_blocks"] == 0 and stats["kv_held_bytes"] == 0


def test_a_cancelled_part_prefilled_prompt_gives_its_cache_back(policy):
    """A long prompt prefilled in chunks beside a running row, its client gone half-way: its staged cache goes
    back, and the next newcomer is answered as alone."""
    engine = BatchedEngine(policy, CFG.max_seq_len, "kv", max_batch=4, prefill_chunk=64, kv=KvBudget(2**30))
    engine.step_hook = sleeps(0.02)  # the row's 240 tokens (one block all along) take 5 s or more
    alone = [s.token_id for s in decode_steps(policy, prompt(12, 5), 6, greedy_pick, max_seq_len=CFG.max_seq_len)]

    async def run():
        row = asyncio.ensure_future(tokens(engine, prompt(10, 1), 240))
        await asyncio.sleep(0.05)
        long = asyncio.ensure_future(tokens(engine, prompt(900, 2), 4))  # 64 tokens a step: 15 steps of prefill
        for _ in range(200):  # until the prompt is part-way in: the row's block and at least one of its own
            await asyncio.sleep(0.01)
            if engine.stats()["kv_blocks"] >= 2:
                break
        assert engine.stats()["kv_blocks"] >= 2
        long.cancel()
        for _ in range(300):  # the forward its chunk is in ends, then the engine finds it cancelled
            await asyncio.sleep(0.01)
            if engine.stats()["kv_blocks"] == 1:
                break
        between = engine.stats()["kv_blocks"], engine.stats()["active"]
        newcomer = await tokens(engine, prompt(12, 5), 6)
        return await row, newcomer, between
    done, newcomer, between = asyncio.run(run())
    assert between == (1, 1)  # the running row's block only: the cancelled prompt's went back before a newcomer came
    assert len(done) == 240 and newcomer == alone
    stats = settled(engine)
    assert stats["kv_blocks"] == 0 and stats["kv_allocated_bytes"] == 0


def test_a_row_whose_cache_cannot_grow_fails_alone_and_the_budget_lets_go_of_it(policy):
    """Out of memory as a row crosses into its second block: that request gets an error naming the KV cache, the row
    beside it decodes on to the tokens it gets alone, and the budget held for the failed one goes back."""
    class GrowthFails:  # the first allocation past one block raises
        def __init__(self, module):
            self.module, self.failures = module, 1

        def new_cache(self, batch: int, seq: int):
            if seq > KV_BLOCK and self.failures:
                self.failures -= 1
                raise RuntimeError("injected fault: cannot allocate")
            return self.module.new_cache(batch, seq)

        def __getattr__(self, name):
            return getattr(self.module, name)

    engine = BatchedEngine(GrowthFails(policy), CFG.max_seq_len, "kv", max_batch=4, kv=KvBudget(2**30))
    engine.step_hook = sleeps(0.002)
    alone = [s.token_id for s in decode_steps(policy, prompt(10, 1), 200, greedy_pick, max_seq_len=CFG.max_seq_len)]

    async def run():
        grows = asyncio.ensure_future(tokens(engine, prompt(10, 0), 400))  # needs a second block at position 256
        await asyncio.sleep(0.02)
        beside = await tokens(engine, prompt(10, 1), 200)
        with pytest.raises(RuntimeError, match="KV cache growth failed at position 256"):
            await grows
        return beside
    assert asyncio.run(asyncio.wait_for(run(), 60)) == alone
    stats = settled(engine)
    assert stats["kv_held_bytes"] == 0 and stats["kv_blocks"] == 0 and engine.loop_errors == 0


def test_lanes_share_the_budget_first_come_first_served():
    """A lane that waits for KV memory for a request keeps the others from growing for newer ones until it holds it:
    a long request is not starved by a stream of small newcomers on other lanes. An older request still goes (the
    order is by arrival), shrinking is always allowed, and a lane that stops waiting lets the others grow again."""
    b = KvBudget(100)
    assert b.hold("a", 60, since=1.0)
    assert not b.hold("b", 60, since=2.0) and b.waiting() == 1  # does not fit: lane b waits from now on
    assert not b.hold("a", 70, since=3.0)  # a newer request on lane a may not overtake lane b's
    assert b.hold("a", 70, since=1.5)  # an older one may (it fits): first come, first served
    assert b.hold("a", 30)  # giving back memory is never refused
    assert b.hold("b", 60, since=2.0) and b.waiting() == 0  # lane b's request now fits and holds
    assert b.hold("a", 40, since=4.0)  # nobody waits: lane a grows again
    assert not b.hold("c", 20, since=5.0) and b.waiting() == 1
    b.withdraw("c")  # its request was refused or cancelled
    assert b.hold("a", 40, since=6.0) and b.held() == 100


def test_a_lane_whose_waiting_request_gives_up_stops_blocking_the_others(policy):
    """The lane's request waits past kv_wait_s and gets its 429: the lane withdraws, and another lane's newcomer is
    admitted at once instead of waiting behind a request that is gone."""
    budget = KvBudget(footprint(policy, 1, 512))
    first = BatchedEngine(policy, CFG.max_seq_len, "kv-a", kv=budget, kv_wait_s=0.3)
    second = BatchedEngine(policy, CFG.max_seq_len, "kv-b", kv=budget, kv_wait_s=5.0)
    first.step_hook = second.step_hook = sleeps(0.004)

    async def run():
        long = asyncio.ensure_future(tokens(first, prompt(10, 0), 300))  # holds the whole budget for about 1.2 s
        await asyncio.sleep(0.1)
        with pytest.raises(CapacityError):  # lane a's second request waits 0.3 s, then gives up
            await tokens(first, prompt(10, 1), 300)
        assert budget.waiting() == 0
        out = await tokens(second, prompt(10, 2), 8)  # waits only for the memory the long one holds
        return await long, out
    done, out = asyncio.run(run())
    assert len(done) == 300 and len(out) == 8
    assert settled(first)["kv_held_bytes"] == 0 and settled(second)["kv_held_bytes"] == 0


def test_the_default_budget_is_the_fp16_variants_kv_space_within_a_tenth_of_memory(monkeypatch):
    """``kv_cache_bytes: 0``: the INT8 engine holds as much KV memory as the FP16 variant's vLLM was given
    (``VLLM_CPU_KVCACHE_SPACE``, GiB, 1 by default), so an A/B split compares the engines and not their budgets; at
    most a tenth of the memory limit, at least 256 MiB."""
    import policy_bundle.quantize.runtime.memory as memory
    from policy_bundle.serve.variants.batching import MiB, auto_kv_budget

    limit = {"bytes": 20 * 1024 * MiB}  # the memory this process may use: a tenth is 2 GiB, above the KV space
    monkeypatch.setattr(memory, "memory_limit", lambda: (limit["bytes"], "test"))
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert auto_kv_budget() == 1024 * MiB  # vLLM's KV space as this project starts it
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.5")
    assert auto_kv_budget() == 512 * MiB
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    assert auto_kv_budget() == 2 * 1024 * MiB  # a tenth of 20 GiB
    limit["bytes"] = 1024 * MiB
    assert auto_kv_budget() == 256 * MiB  # a tenth, at least 256 MiB
