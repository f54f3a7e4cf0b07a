"""The gate's teacher-forced comparison in memory bounded by a batch: the reference's logits in a file, the
candidate's compared as they come, with the numbers the whole-set comparison gives."""

import torch

from policy_bundle.quantize.fidelity.scores import GoldenItem, compare_logits, teacher_forced_logits
from policy_bundle.quantize.fidelity.reference_logits import ReferenceLogits, compare_streamed, length_batches

VOCAB = 97


def _items(n=23, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = int(torch.randint(2, 12, (1,), generator=g))
        c = int(torch.randint(1, 9, (1,), generator=g))
        ids = torch.randint(0, VOCAB, (p + c,), generator=g).tolist()
        out.append(GoldenItem(prompt=f"p{i}", prompt_ids=ids[:p], completion_ids=ids[p:]))
    return out


def _logits_fn(seed, seen=None):
    """Deterministic logits per (position, token) that do not depend on what a row is batched with."""
    table = torch.randn(64, VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed))

    def fn(batch):
        if seen is not None:
            seen.append(tuple(batch.shape))
        t = batch.shape[1]
        return torch.stack([table[torch.arange(t), row] for row in batch])

    return fn


def test_streamed_comparison_equals_the_whole_set_comparison():
    items = _items()
    ref_fn, cand_fn = _logits_fn(1), _logits_fn(2)
    top1, kl = compare_logits(teacher_forced_logits(ref_fn, items), teacher_forced_logits(cand_fn, items))
    ref = ReferenceLogits.compute(ref_fn, items, max_tokens=40)
    s_top1, s_kl = compare_streamed(ref, cand_fn, items, max_tokens=40)
    assert s_top1 == top1 and torch.equal(s_kl, kl)  # the same tokens in the same (item) order
    assert kl.numel() == ref.tokens == sum(len(it.completion_ids) for it in items)
    assert 0 < top1 < 1  # a negative control: different logits are compared, not the reference with itself
    same_top1, same_kl = compare_streamed(ref, ref_fn, items)
    assert same_top1 == 1.0 and same_kl.abs().max() < 1e-12


def test_the_reference_is_read_back_from_its_file_and_its_head_is_the_first_items():
    items = _items()
    ref = ReferenceLogits.compute(_logits_fn(1), items)
    whole = teacher_forced_logits(_logits_fn(1), items)
    assert all(torch.equal(a, b) for a, b in zip(ref.all(), whole))
    head = ref.head(5)
    assert head.items == 5 and all(torch.equal(a, b) for a, b in zip(head.all(), whole[:5]))
    top1, kl = compare_streamed(head, _logits_fn(2), items[:5])
    assert kl.numel() == sum(len(it.completion_ids) for it in items[:5])


def test_a_teacher_forced_batch_stays_within_its_token_budget():
    items = _items(60)
    seen = []
    compare_streamed(ReferenceLogits.compute(_logits_fn(1), items), _logits_fn(2, seen), items, max_tokens=32)
    assert seen and all(b * t <= 32 or b == 1 for b, t in seen)
    assert any(b > 1 for b, _ in seen)  # items of one length still share a batch
    lengths = [len(it.prompt_ids) + len(it.completion_ids) for it in items]
    batches = list(length_batches(lengths, 32))
    assert sorted(i for b in batches for i in b) == list(range(len(items)))
    assert all(len({lengths[i] for i in b}) == 1 for b in batches)  # no padding


def test_a_comparison_on_other_items_than_the_reference_is_refused():
    items = _items()
    ref = ReferenceLogits.compute(_logits_fn(1), items)
    try:
        compare_streamed(ref, _logits_fn(2), items[:-1])
    except ValueError as exc:
        assert "23 items" in str(exc)
    else:
        raise AssertionError("a reference of other items was accepted")
