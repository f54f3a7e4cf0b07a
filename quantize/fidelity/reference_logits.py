"""Teacher-forced comparison of a candidate with a reference in memory linear in the batch, not in the golden set.

The reference's logits at the scored positions of every golden item (``ReferenceLogits``) are written to an unnamed
file and read back one item at a time: 100 golden items of 32 scored tokens at a vocabulary of 49152 are 630 MB of
float32 that no process has to hold. A candidate's logits are made in batches of at most ``TEACHER_FORCED_TOKENS``
positions and compared item by item as they come (``compare_streamed``): the double-precision log-softmax copies of
the KL are one item's rows, not the whole set's. The numbers are the ones ``kl_per_token`` gives on the whole set.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

# Positions per teacher-forced batch: a [B, T, V] float32 logits batch of 1024 positions is 200 MB at V=49152
# (the Qwen3 vocabulary of 151936 makes it 620 MB). Before, a batch was 32 items of any length: 32 x 64 x 49152.
TEACHER_FORCED_TOKENS = 1024

LogitsFn = Callable[[Tensor], Tensor]


def scored_positions(ids_prompt: Sequence[int], ids_completion: Sequence[int]) -> Tuple[List[int], int, int]:
    """An item's full token ids, and the slice of logit rows that predict its completion tokens."""
    ids = list(ids_prompt) + list(ids_completion)
    return ids, len(ids_prompt) - 1, len(ids) - 1


def length_batches(lengths: Sequence[int], max_tokens: int = TEACHER_FORCED_TOKENS) -> Iterator[List[int]]:
    """Indices grouped by equal length (no batch needs padding: the numbers do not depend on what an item is batched
    with), each batch at most ``max_tokens`` positions (at least one item)."""
    groups: Dict[int, List[int]] = {}
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        groups.setdefault(lengths[i], []).append(i)
    for length, idxs in groups.items():
        size = max(1, max_tokens // max(1, length))
        for s in range(0, len(idxs), size):
            yield idxs[s: s + size]


@torch.no_grad()
def scored_logits(logits_fn: LogitsFn, items: Sequence, max_tokens: int = TEACHER_FORCED_TOKENS
                  ) -> Iterator[Tuple[int, Tensor]]:
    """(item index, float32 logits [n_completion, V] at the positions that predict its completion), a batch at a
    time; items are GoldenItems (``prompt_ids``, ``completion_ids``)."""
    spans = [scored_positions(it.prompt_ids, it.completion_ids) for it in items]
    for chunk in length_batches([len(ids) for ids, _, _ in spans], max_tokens):
        logits = logits_fn(torch.tensor([spans[i][0] for i in chunk])).float()
        for row, i in enumerate(chunk):
            _, a, b = spans[i]
            yield i, logits[row, a:b]
        del logits


@dataclass
class ReferenceLogits:
    """A reference's teacher-forced logits on golden items, in an unnamed file (``dir``: where it lives; the
    system's temporary directory by default), read back one item at a time."""

    items: int
    vocab: int
    tokens: int
    _file: Optional[object] = field(default=None, repr=False)
    _spans: List[Tuple[int, int]] = field(default_factory=list, repr=False)  # per item: byte offset, rows

    @classmethod
    def compute(cls, logits_fn: LogitsFn, items: Sequence, dir: Optional[Path] = None,
                max_tokens: int = TEACHER_FORCED_TOKENS) -> "ReferenceLogits":
        f = tempfile.TemporaryFile(dir=dir)
        spans: List[Optional[Tuple[int, int]]] = [None] * len(items)
        vocab, offset = 0, 0
        for i, rows in scored_logits(logits_fn, items, max_tokens):
            data = rows.contiguous().numpy().tobytes()
            os.pwrite(f.fileno(), data, offset)
            spans[i], vocab, offset = (offset, rows.shape[0]), rows.shape[1], offset + len(data)
        return cls(len(items), vocab, sum(n for _, n in spans), f, spans)

    def rows(self, i: int) -> Tensor:
        """Item ``i``'s logits [n_completion, V], float32."""
        offset, n = self._spans[i]
        data = bytearray(os.pread(self._file.fileno(), n * self.vocab * 4, offset))
        return torch.frombuffer(data, dtype=torch.float32).view(n, self.vocab)

    def head(self, n: int) -> "ReferenceLogits":
        """The first ``n`` items' logits (the same file)."""
        spans = self._spans[:n]
        return ReferenceLogits(len(spans), self.vocab, sum(r for _, r in spans), self._file, spans)

    def all(self) -> List[Tensor]:
        """Every item's logits in memory (small golden sets and tests)."""
        return [self.rows(i) for i in range(self.items)]


def item_kl(ref_logits: Tensor, cand_logits: Tensor) -> Tensor:
    """KL(ref || cand) per row in nats (``scores.kl_per_token``'s arithmetic, on one item's rows)."""
    ref_lp = torch.log_softmax(ref_logits.double(), dim=-1)
    cand_lp = torch.log_softmax(cand_logits.double(), dim=-1)
    return (ref_lp.exp() * (ref_lp - cand_lp)).sum(-1).clamp_min(0.0)


def compare_streamed(reference: ReferenceLogits, logits_fn: LogitsFn, items: Sequence,
                     max_tokens: int = TEACHER_FORCED_TOKENS) -> Tuple[float, Tensor]:
    """Top-1 agreement and KL per token (in item order) of ``logits_fn``'s logits against ``reference``."""
    if reference.items != len(items):
        raise ValueError(f"the reference has {reference.items} items, the comparison {len(items)}")
    kl: List[Optional[Tensor]] = [None] * len(items)
    agree = 0
    for i, cand in scored_logits(logits_fn, items, max_tokens):
        ref = reference.rows(i)
        if ref.shape != cand.shape:
            raise ValueError(f"item {i}: reference logits {tuple(ref.shape)}, candidate {tuple(cand.shape)}")
        agree += int((ref.argmax(-1) == cand.argmax(-1)).sum())
        kl[i] = item_kl(ref, cand)
    per_token = torch.cat([k for k in kl if k is not None]) if items else torch.zeros(0, dtype=torch.float64)
    return agree / max(1, per_token.numel()), per_token
