"""The slot batch: rows decode together, each on a KV cache of its own, and each gets the tokens it gets alone,
however rows join or leave or their caches grow. On the shipped reference policy."""

from __future__ import annotations

import pytest
import torch

from policy_bundle.quantize.runtime.decode import greedy_generate, greedy_generate_batch
from policy_bundle.quantize.model.hf_weights import load_policy
from policy_bundle.quantize.runtime.slots import SlotBatch
from policy_bundle.quantize.reference.task import EOS, VOCAB, rollout_prompts

EOS_ID = VOCAB.index(EOS)


@pytest.fixture(scope="module")
def policy(reference_dir):
    return load_policy(reference_dir)


@pytest.fixture(scope="module")
def prompts():
    """Task prompts (their answers end with EOS) and a few of random tokens (which may run to the limit)."""
    task = [[VOCAB.index("<s>")] + [VOCAB.index(c) for c in p] for p in rollout_prompts(20)]
    g = torch.Generator().manual_seed(0)
    noise = [torch.randint(3, len(VOCAB), (int(n),), generator=g).tolist() for n in (1, 3, 10, 12, 6)]
    return task + noise


def solo(policy, prompts, n=12):
    return [greedy_generate(policy, p, n) for p in prompts]


def admit(batch, prompt, row, outs):
    """Prefill ``prompt`` into the next free slot, take its first token, join it as ``row``."""
    outs[row] = [int(batch.prefill(prompt).argmax())]
    batch.join(row)


def advance(batch, outs, steps):
    for _ in range(steps):
        logits = batch.step([outs[r][-1] for r in batch.rows])
        for r, token in zip(batch.rows, logits.argmax(-1).tolist()):
            outs[r].append(token)


def test_batched_greedy_with_slots_refilled_equals_one_sequence_at_a_time(policy, prompts):
    alone = [greedy_generate(policy, p, 8, eos_token_id=EOS_ID) for p in prompts]
    assert any(len(a) < 8 for a in alone) and any(len(a) == 8 for a in alone)  # some rows stop at EOS
    finished = []
    for batch_size in (1, 3, 8):
        assert greedy_generate_batch(policy, prompts, 8, EOS_ID, batch_size, done=finished.append) == alone
    assert sorted(finished) == sorted(list(range(len(prompts))) * 3)


def test_released_rows_leave_with_their_caches_and_the_others_continuations_are_unchanged(policy, prompts):
    picked = [prompts[0], prompts[21], prompts[5], prompts[23]]  # different lengths
    expected = solo(policy, picked)
    batch, outs = SlotBatch(policy, 32, 8), {}
    for r, p in enumerate(picked):
        admit(batch, p, r, outs)
    advance(batch, outs, 3)
    held = batch.allocated_bytes()
    batch.release([0, 2])
    assert batch.rows == [1, 3] and batch.pos == [len(picked[1]) + 3, len(picked[3]) + 3]
    assert batch.allocated_bytes() == held // 2  # two of four equal caches: their memory went with them
    advance(batch, outs, 8)
    assert [outs[r] for r in (1, 3)] == [expected[r] for r in (1, 3)]


def test_a_part_prefilled_prompt_follows_the_rows_when_a_slot_is_released(policy, prompts):
    picked = [prompts[0], prompts[1], prompts[23]]
    expected = solo(policy, picked)
    batch, outs = SlotBatch(policy, 32, 8), {}
    admit(batch, picked[0], 0, outs)
    admit(batch, picked[1], 1, outs)
    advance(batch, outs, 2)
    head = batch.prefill(picked[2][:5])  # the first chunk of the newcomer's prompt, in a cache of its own
    batch.release([0])  # a row leaves: the newcomer's chunk stays staged
    logits = batch.prefill(picked[2][5:], start=5)
    assert head.shape == logits.shape == (policy.lm_head.out_features,) and batch.rows == [1]
    outs[2] = [int(logits.argmax())]
    batch.join(2)
    advance(batch, outs, 6)
    assert [outs[1], outs[2]] == [expected[1][:9], expected[2][:7]]


def test_each_sequences_cache_grows_by_blocks_as_it_does_keeping_its_tokens():
    """Blocks of 32 positions: rows crossing them at different steps get a block more each, one at a time, and their
    tokens are the ones they get alone; no row is priced at another's length."""
    from policy_bundle.quantize.model.hf_weights import init_random_policy
    from policy_bundle.quantize.model.policy import PolicyConfig

    module = init_random_policy(PolicyConfig("llama", vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                             head_dim=8, intermediate_size=64, max_seq_len=128), seed=0)
    g = torch.Generator().manual_seed(1)
    picked = [torch.randint(3, 50, (int(n),), generator=g).tolist() for n in (3, 9, 20, 31, 5, 30)]
    expected = [greedy_generate(module, p, 40) for p in picked]
    batch, outs = SlotBatch(module, 128, 8, block=32), {}
    for r in range(4):
        admit(batch, picked[r], r, outs)
    assert [c.positions for c in batch.caches] == [32] * 4
    advance(batch, outs, 20)
    for r in (4, 5):
        admit(batch, picked[r], r, outs)
    assert [c.positions for c in batch.caches] == [32, 32, 64, 64, 32, 32]  # each its own blocks
    advance(batch, outs, 19)
    assert [outs[r] for r in range(6)] == [e[: len(outs[r])] for r, e in enumerate(expected)]
    assert batch.blocks == sum(-(-p // 32) for p in batch.pos)  # whole blocks: the p positions each row has written
    with pytest.raises(ValueError, match="not a multiple of 32"):
        SlotBatch(module, 64, 8, block=48)


def test_one_forward_continues_a_part_prefilled_prompt_starts_another_and_steps_the_rows(policy, prompts):
    """``step_and_prefill`` with a row decoding, the rest of a prompt whose head is staged, and a new prompt: each
    chunk goes into its own sequence's cache and every sequence continues as alone."""
    picked = [prompts[0], prompts[23], prompts[22]]  # the second's 12 tokens go in as 5, then 7
    expected = solo(policy, picked, 6)
    batch, outs = SlotBatch(policy, 32, 4), {}
    admit(batch, picked[0], 0, outs)
    batch.prefill(picked[1][:5])
    assert batch.filling == 5
    rows, chunks = batch.step_and_prefill([outs[0][-1]], [(picked[1][5:], 5), (picked[2], 0)])
    outs[0].append(int(rows[0].argmax()))
    for r, logits in zip((1, 2), chunks):
        outs[r] = [int(logits.argmax())]
        batch.join(r)
    advance(batch, outs, 4)
    assert [outs[r] for r in range(3)] == [expected[0][:6], expected[1][:5], expected[2][:5]]


def test_one_row_steps_with_decode_and_several_with_step_seqs(policy, prompts):
    calls = []

    class Counting:
        def new_cache(self, b, n): return policy.new_cache(b, n)
        def __call__(self, *a): return policy(*a)
        def decode(self, *a): calls.append("decode"); return policy.decode(*a)  # noqa: E702
        def step_seqs(self, *a): calls.append("seqs"); return policy.step_seqs(*a)  # noqa: E702

    batch, outs = SlotBatch(Counting(), 32, 4), {}
    admit(batch, prompts[0], 0, outs)
    advance(batch, outs, 1)
    admit(batch, prompts[1], 1, outs)
    advance(batch, outs, 1)
    assert calls == ["decode", "seqs"]


def test_a_module_without_step_seqs_decodes_row_by_row_with_the_same_tokens(policy, prompts):
    """An artifact exported before ``step_seqs``: each row runs ``decode`` on its own cache, as alone."""
    class Older:
        def new_cache(self, b, n): return policy.new_cache(b, n)
        def __call__(self, *a): return policy(*a)
        def decode(self, *a): return policy.decode(*a)

    picked = prompts[:3]
    batch, outs = SlotBatch(Older(), 32, 4), {}
    assert not batch.can_fuse()
    for r, p in enumerate(picked):
        admit(batch, p, r, outs)
    advance(batch, outs, 7)
    assert [outs[r] for r in range(3)] == [e[:8] for e in solo(policy, picked, 8)]


def test_a_batch_refuses_a_prefill_past_its_sequences_and_a_chunk_that_continues_nothing(policy, prompts):
    batch = SlotBatch(policy, 32, 3)
    for r in range(3):
        batch.prefill(prompts[r])
        batch.join(r)
    with pytest.raises(ValueError, match="no free slot"):
        batch.prefill(prompts[3])
    with pytest.raises(ValueError, match="continues no staged prompt"):
        SlotBatch(policy, 32, 3).prefill(prompts[3], start=4)


@pytest.mark.parametrize("which", ["fp32 policy", "int8 torchscript"])
def test_a_step_attends_over_whole_blocks_whatever_cache_it_is_handed(which, policy, small_bundle):
    """Attention's sums depend on how many keys it runs over, masked or not: over exactly ``pos + 1`` (what the slot
    batch once handed a step) a step's logits differ from those over a longer cache (``decode_steps``' own,
    the build's greedy; or the longest row's, in a batch). The model now attends over ``attention_len``: whole blocks
    of 32, the same for any cache at least that long, and the slot batch hands it such views. On SmolLM2-135M's INT8
    policy the old views moved logits by up to 0.52 in one step, and a row's greedy continuation beside others
    differed from its own in 9 of 20 golden prompts (0 of 20 now, at ``DECODE_THREADS``)."""
    from policy_bundle.quantize.runtime.decode import DECODE_THREADS, threads
    from policy_bundle.quantize.runtime.script_runner import load_torchscript

    module = policy if which == "fp32 policy" else load_torchscript(small_bundle / "int8" / "policy.ts")
    exact_differs = []
    with threads(DECODE_THREADS):
        for plen in (3, 7, 12, 20):
            ids = torch.randint(3, len(VOCAB), (1, plen), generator=torch.Generator().manual_seed(plen))
            k, v = module.new_cache(1, 128)
            module.prefill(ids, k, v)

            def step(n):
                return module.decode(torch.tensor([[5]]), plen, k[:, :, :, :n].clone(), v[:, :, :, :n].clone())

            block = step(32)
            assert all(torch.equal(step(n), block) for n in (64, 128))
            exact_differs.append(not torch.equal(step(plen + 1), block))  # the old view: the negative control
    if which == "fp32 policy":  # the static int8 layers round a 1e-6 attention difference away in this small policy
        assert any(exact_differs), "exact-length attention no longer differs: the control shows nothing here"



def test_the_slot_batch_hands_each_step_whole_blocks_of_its_cache():
    """``attention_len``: the positions needed rounded up to 32, within the cache; the slot batch allocates whole blocks
    (``cache_len_for``) and hands a step, a prefill and a part-prefilled chunk such views, never ``pos + 1``."""
    from policy_bundle.quantize.model.blocks import attention_len, cache_len_for
    from policy_bundle.quantize.model.hf_weights import init_random_policy
    from policy_bundle.quantize.model.policy import PolicyConfig

    assert [attention_len(n, 128) for n in (1, 31, 32, 33, 64, 65, 128)] == [32, 32, 32, 64, 64, 96, 128]
    assert (attention_len(33, 40), attention_len(100, 100), cache_len_for(100), cache_len_for(64)) == (40, 100, 128, 64)
    module = init_random_policy(PolicyConfig("llama", vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                             head_dim=8, intermediate_size=64, max_seq_len=128), seed=0)
    seen = []

    class Recording:  # the cache lengths the slot batch allocates and hands the module
        def new_cache(self, b, n): seen.append(("alloc", n)); return module.new_cache(b, n)  # noqa: E702
        def next_logits(self, ids, start, k, v): seen.append(k.shape[3]); return module.next_logits(ids, start, k, v)  # noqa: E702
        def decode(self, t, pos, k, v): seen.append(k.shape[3]); return module.decode(t, pos, k, v)  # noqa: E702

        def step_seqs(self, t, pos, prompts, starts, ks, vs):  # attends over ``attention_len`` of each itself
            seen.append(tuple(k.shape[3] for k in ks))
            return module.step_seqs(t, pos, prompts, starts, ks, vs)

    batch, outs = SlotBatch(Recording(), 100, 2), {}
    admit(batch, [1, 2, 3], 0, outs)  # positions 3..
    advance(batch, outs, 2)
    batch.prefill(list(range(3, 33)))  # a long prompt in two chunks: 30 then 12 more positions
    batch.prefill(list(range(5, 17)), 30)
    batch.join(1)
    outs[1] = [7]
    advance(batch, outs, 3)  # the short row at 5.., the long one at 42..: each sequence's own whole cache
    assert seen == [("alloc", 128), 32, 32, 32, ("alloc", 128), 32, 64] + [(128, 128)] * 3, seen
    served = SlotBatch(module, 100, 2, block=32)  # a served batch: blocks of 32, one more as a row passes the last
    admit(served, list(range(1, 31)), 0, outs)
    assert served.caches[0].positions == 32
    advance(served, {0: [5]}, 3)
    assert served.caches[0].positions == 64
