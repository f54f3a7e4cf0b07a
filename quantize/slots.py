"""A KV cache of sequence slots for batched decoding: the active rows are always slots ``0..n-1``.

The one slot bookkeeping of the build's batched greedy rollouts (``decode.greedy_generate_batch``) and
the serving engine's continuous batching. A prompt is prefilled (whole, or in chunks) into the next
free slot, ``len(rows)``, and ``join`` makes that slot a row; ``step`` advances every row by one token,
each at its own position, on a view of the cache; ``release`` moves the last row into a freed slot.
Rows do not see each other, so a row's tokens do not depend on the batch (for modules whose rows are
independent: float policies, per-token or static int8).
"""

from __future__ import annotations

from typing import Callable, Generic, List, Optional, Sequence, Tuple, TypeVar

import torch
from torch import Tensor

from policy_bundle.quantize.blocks import attention_len, cache_len_for

R = TypeVar("R")


class SlotBatch(Generic[R]):
    """``module``'s KV cache of ``capacity`` slots of ``max_len`` positions; ``rows[i]`` (the caller's
    object for the sequence in slot ``i``) writes its next token at ``pos[i]``."""

    def __init__(self, module, max_len: int, max_capacity: int):
        self.module, self.max_len, self.max_capacity = module, max_len, max(1, max_capacity)
        self.k: Optional[Tensor] = None
        self.v: Optional[Tensor] = None
        self.capacity = 0
        self.rows: List[R] = []
        self.pos: List[int] = []
        self.filling = 0  # prompt positions already in the next free slot (a part-prefilled prompt)
        self._queued: List[int] = []  # the prompt positions of the free slots after it (``step_and_prefill``'s chunks)

    def __len__(self) -> int:
        return len(self.rows)

    def grow(self, n: int) -> bool:
        """Make room for ``n`` slots (a power of two, at least 4, at most ``max_capacity``), keeping the
        cache's contents; True when it reallocated. A failed allocation leaves the batch as it was."""
        if n <= self.capacity:
            return False
        if n > self.max_capacity:
            raise ValueError(f"{n} slots asked of a batch of at most {self.max_capacity}")
        cap = min(self.max_capacity, max(4, 1 << (n - 1).bit_length()))
        k, v = self.module.new_cache(cap, cache_len_for(self.max_len))  # whole attention blocks
        if self.k is not None:
            k[:, : self.capacity] = self.k
            v[:, : self.capacity] = self.v
        self.k, self.v, self.capacity = k, v, cap
        return True

    def prefill(self, ids: Sequence[int], start: int = 0) -> Tensor:
        """Write the prompt tokens ``ids`` at positions ``start..`` of the next free slot (its positions
        ``0..start-1`` hold the prompt's earlier tokens); returns the logits after its last token [V]: the
        module's ``next_logits`` (the LM head on that row alone), or the last row of its ``forward`` where it has
        none (a policy exported before 2026-12-04)."""
        slot, end = len(self.rows), start + len(ids)
        if slot >= self.capacity:
            raise ValueError(f"no free slot: {slot} rows fill the cache's {self.capacity} slots (grow it first)")
        self.filling = 0
        run = getattr(self.module, "next_logits", self.module)
        n = self.attended(end)
        logits = run(torch.tensor([list(ids)]), start, self.k[:, slot : slot + 1, :, :n], self.v[:, slot : slot + 1, :, :n])
        self.filling = end
        return logits[0, -1]

    def attended(self, needed: int) -> int:
        """The cache positions a step attends over: ``needed`` rounded up to a multiple of 32 within the cache
        (``blocks.attention_len``, which an artifact exported since 2026-12-05 applies itself): a row's answer is then
        the same alone, beside rows at other positions, and in the build's greedy decode."""
        return attention_len(needed, self.k.shape[3])

    def join(self, row: R) -> None:
        """The next free slot, its prompt prefilled, becomes ``row``: its next token goes after the prompt."""
        self.rows.append(row)
        self.pos.append(self.filling)
        self.filling = self._queued.pop(0) if self._queued else 0

    def can_fuse(self) -> bool:
        """Whether the module runs a step and prompt chunks in one forward (``step_and_prefill``; artifacts exported
        since 2026-12-05)."""
        return hasattr(self.module, "step_and_prefill")

    def step_and_prefill(self, tokens: Sequence[int], chunks: Sequence[Tuple[Sequence[int], int]]) -> Tuple[Tensor, Tensor]:
        """``step(tokens)`` for the rows and, in the same forward (the module's ``step_and_prefill``), each chunk
        ``(ids, start)`` written at ``start..`` of free slot ``len(rows) + j`` as ``prefill`` writes it (the first chunk
        continues a part-prefilled prompt from ``filling``; only the last may stop short of its prompt's end). Returns
        the rows' next logits [n, V] and each chunk's last logits [chunks, V]; then ``join`` each whole prompt, in order."""
        n, m = len(self.rows), len(chunks)
        if n + m > self.capacity:
            raise ValueError(f"no free slot: {n} rows and {m} prompts overfill the cache's {self.capacity} slots")
        ends = [start + len(ids) for ids, start in chunks]
        s = self.attended(max([p + 1 for p in self.pos] + ends))
        logits = self.module.step_and_prefill(torch.tensor(list(tokens), dtype=torch.long).view(n, 1),
                                              torch.tensor(self.pos, dtype=torch.long),
                                              [torch.tensor([list(ids)]) for ids, _ in chunks],
                                              [start for _, start in chunks],
                                              self.k[:, : n + m, :, :s], self.v[:, : n + m, :, :s])[:, 0]
        self.pos = [p + 1 for p in self.pos]
        if ends:
            self.filling, self._queued = ends[0], ends[1:]
        return logits[:n], logits[n:]

    def step(self, tokens: Sequence[int]) -> Tensor:
        """Feed ``tokens[i]`` to row ``i`` at ``pos[i]``; returns the next logits [n, V]. One row runs the
        single-sequence ``decode`` (the same arithmetic, minus ``decode_batch``'s gathers)."""
        n, s = len(self.rows), self.attended(max(self.pos) + 1)
        k, v = self.k[:, :n, :, :s], self.v[:, :n, :, :s]
        ids = torch.tensor(list(tokens)).view(n, 1)
        if n == 1:
            logits = self.module.decode(ids, self.pos[0], k, v)
        else:
            logits = self.module.decode_batch(ids, torch.tensor(self.pos, dtype=torch.long), k, v)
        self.pos = [p + 1 for p in self.pos]
        return logits[:, 0]

    def release(self, slots: Sequence[int]) -> None:
        """Free ``slots``: the last row moves into each (its filled positions only), and a part-prefilled
        prompt follows the rows into the next free slot."""
        n = len(self.rows)
        for i in sorted(set(slots), reverse=True):  # the last row is then always one that stays
            last = len(self.rows) - 1
            if i != last:
                self._copy(last, i, self.pos[last])
                self.rows[i], self.pos[i] = self.rows[last], self.pos[last]
            self.rows.pop()
            self.pos.pop()
        if self.filling and len(self.rows) != n:
            self._copy(n, len(self.rows), self.filling)

    def drop(self, leaves: Callable[[R], bool]) -> None:
        """Release the slots of the rows for which ``leaves(row)`` is true."""
        self.release([i for i, row in enumerate(self.rows) if leaves(row)])

    def clear(self) -> None:
        """Forget every row and any part-prefilled prompt (the cache stays allocated)."""
        self.rows, self.pos, self.filling, self._queued = [], [], 0, []

    def _copy(self, src: int, dst: int, n: int) -> None:
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
