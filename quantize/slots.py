"""A KV cache of sequence slots for batched decoding: the active rows are always slots ``0..n-1``.

The one slot bookkeeping of the build's batched greedy rollouts (``decode.greedy_generate_batch``) and
the serving engine's continuous batching. A prompt is prefilled (whole, or in chunks) into the next
free slot, ``len(rows)``, and ``join`` makes that slot a row; ``step`` advances every row by one token,
each at its own position, on a view of the cache; ``release`` moves the last row into a freed slot.
Rows do not see each other, so a row's tokens do not depend on the batch (for modules whose rows are
independent: float policies, per-token or static int8).

With ``block`` > 0 (the server) the cache's positions grow in blocks as its rows need them and ``trim`` gives memory
back when long rows leave, so a context of thousands of tokens costs what the rows use, not slots x the context; the
caller bounds the worst case with ``footprint``. Without (the build's batched rollouts) it holds ``max_len`` positions
from the start. Either way attention runs over the same ``attention_len`` positions, so a row's tokens do not depend
on how long the cache is.
"""

from __future__ import annotations

from typing import Callable, Generic, List, Optional, Sequence, Tuple, TypeVar

import torch
from torch import Tensor

from policy_bundle.quantize.blocks import attention_len, cache_len_for

R = TypeVar("R")
KV_BLOCK = 256  # positions a served cache grows by (``block``; a multiple of attention's 32)
# An idle server prefills a prompt whole up to this many tokens, a longer one in chunks of it: attention over a chunk
# makes a [chunk x heads, context] mask and scores, not [prompt, prompt] (a 6000-token prompt: 12 MB a head, not 144)
LONG_PROMPT_CHUNK = 512


class SlotBatch(Generic[R]):
    """``module``'s KV cache of ``capacity`` slots of ``max_len`` positions; ``rows[i]`` (the caller's
    object for the sequence in slot ``i``) writes its next token at ``pos[i]``."""

    def __init__(self, module, max_len: int, max_capacity: int, block: int = 0):
        self.module, self.max_len, self.max_capacity = module, max_len, max(1, max_capacity)
        if block and block % 32:
            raise ValueError(f"block: {block} positions is not a multiple of 32 (attention runs over whole 32s)")
        self.block = block
        self.ceiling = 0  # with ``block``: the most positions the cache may grow to (the caller's reservation; 0: any)
        self._bytes_per_position = 0
        self.k: Optional[Tensor] = None
        self.v: Optional[Tensor] = None
        self.capacity = 0
        self.rows: List[R] = []
        self.pos: List[int] = []
        self.filling = 0  # prompt positions already in the next free slot (a part-prefilled prompt)
        self._queued: List[int] = []  # the prompt positions of the free slots after it (``step_and_prefill``'s chunks)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def length(self) -> int:
        """The positions the cache holds now (0 before the first allocation)."""
        return 0 if self.k is None else int(self.k.shape[3])

    def slots_for(self, n: int) -> int:
        """The slots an allocation for ``n`` sequences holds: a power of two (at least 4 without ``block``), at most
        ``max_capacity``."""
        return min(self.max_capacity, max(1 if self.block else 4, 1 << (max(1, n) - 1).bit_length()))

    def positions_for(self, needed: int) -> int:
        """The positions an allocation for ``needed`` of them holds: whole blocks (whole attention blocks without
        ``block``: the whole ``max_len``), never past ``max_len``'s."""
        whole = cache_len_for(self.max_len)
        if not self.block:
            return whole
        return min(whole, max(self.block, -(-needed // self.block) * self.block))

    def bytes_per_position(self) -> int:
        """KV-cache bytes one position of one sequence costs (keys and values, every layer)."""
        if not self._bytes_per_position:
            k, v = self.module.new_cache(1, 1)
            self._bytes_per_position = k.numel() * k.element_size() + v.numel() * v.element_size()
        return self._bytes_per_position

    def footprint(self, n: int, positions: int) -> int:
        """The bytes a cache for ``n`` sequences of up to ``positions`` positions each takes, as this batch
        allocates it (``slots_for`` x ``positions_for``)."""
        return self.slots_for(n) * self.positions_for(positions) * self.bytes_per_position()

    def allocated_bytes(self) -> int:
        return 0 if self.k is None else self.capacity * self.length * self.bytes_per_position()

    def grow(self, n: int) -> bool:
        """Make room for ``n`` slots (``slots_for``), keeping the cache's contents; True when it reallocated. A failed
        allocation leaves the batch as it was."""
        if n <= self.capacity:
            return False
        if n > self.max_capacity:
            raise ValueError(f"{n} slots asked of a batch of at most {self.max_capacity}")
        self._reshape(self.slots_for(n), self.length or self.positions_for(1))
        return True

    def reach(self, needed: int) -> None:
        """Make the cache hold at least ``needed`` positions (with ``block``: at least doubling, so a long answer
        copies its cache a few times, not once per block; never past ``ceiling``)."""
        if needed > self.length and self.k is not None:
            grown = self.positions_for(max(needed, 2 * self.length))
            if self.ceiling:
                grown = max(self.positions_for(needed), min(grown, self.ceiling))
            self._reshape(self.capacity, grown)

    def trim(self, n: int, needed: int, slack: int = 2) -> bool:
        """With ``block``: give memory back when the cache holds more positions than ``ceiling``, or more than ``slack``
        times the slots ``n`` sequences take (none left: free it); it keeps ``needed`` positions. The slack keeps a
        batch whose size goes back and forth across a power of two from copying its cache at every turn. True when it
        reallocated."""
        if not self.block or self.k is None:
            return False
        # never below what is in use: the rows, a part-prefilled prompt and prompts prefilled but not joined yet
        n = max(n, len(self.rows) + bool(self.filling) + len(self._queued))
        needed = max([needed, self.filling, *self._queued] + [p + 1 for p in self.pos])
        if n == 0:
            self.k = self.v = None
            self.capacity = 0
            return True
        slots = self.slots_for(n)
        over = self.ceiling and self.length > self.ceiling
        if self.capacity <= slack * slots and not over:
            return False
        length = max(self.positions_for(needed), min(self.length, self.ceiling)) if over else self.length
        self._reshape(min(self.capacity, slots) if self.capacity > slack * slots else self.capacity, length)
        return True

    def held_footprint(self, n: int, positions: int) -> int:
        """What a cache for ``n`` sequences of up to ``positions`` positions may come to from this one: the slots it
        holds (``trim``'s slack) or ``n`` need, whichever is more, each of ``positions_for(positions)`` positions."""
        return max(self.capacity, self.slots_for(n)) * self.positions_for(positions) * self.bytes_per_position()

    def _reshape(self, cap: int, length: int) -> None:
        """Reallocate to ``cap`` slots of ``length`` positions, keeping what fits of the cache's contents."""
        k, v = self.module.new_cache(cap, length)
        if self.k is not None:
            c, n = min(cap, self.capacity), min(length, self.length)
            k[:, :c, :, :n] = self.k[:, :c, :, :n]
            v[:, :c, :, :n] = self.v[:, :c, :, :n]
        self.k, self.v, self.capacity = k, v, cap

    def prefill(self, ids: Sequence[int], start: int = 0) -> Tensor:
        """Write the prompt tokens ``ids`` at positions ``start..`` of the next free slot (its positions
        ``0..start-1`` hold the prompt's earlier tokens); returns the logits after its last token [V]: the
        module's ``next_logits`` (the LM head on that row alone), or the last row of its ``forward`` where it has
        none (a policy exported without ``next_logits``)."""
        slot, end = len(self.rows), start + len(ids)
        if slot >= self.capacity:
            raise ValueError(f"no free slot: {slot} rows fill the cache's {self.capacity} slots (grow it first)")
        self.filling = 0
        run = getattr(self.module, "next_logits", self.module)
        self.reach(end)
        n = self.attended(end)
        logits = run(torch.tensor([list(ids)]), start, self.k[:, slot : slot + 1, :, :n], self.v[:, slot : slot + 1, :, :n])
        self.filling = end
        return logits[0, -1]

    def attended(self, needed: int) -> int:
        """The cache positions a step attends over: ``needed`` rounded up to a multiple of 32 within the cache
        (``blocks.attention_len``, which a current artifact applies itself too): a row's answer is then
        the same alone, beside rows at other positions, and in the build's greedy decode."""
        return attention_len(needed, self.k.shape[3])

    def join(self, row: R) -> None:
        """The next free slot, its prompt prefilled, becomes ``row``: its next token goes after the prompt."""
        self.rows.append(row)
        self.pos.append(self.filling)
        self.filling = self._queued.pop(0) if self._queued else 0

    def can_fuse(self) -> bool:
        """Whether the module runs a step and prompt chunks in one forward (``step_and_prefill``; older artifacts lack
        it)."""
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
        needed = max([p + 1 for p in self.pos] + ends)
        self.reach(needed)
        s = self.attended(needed)
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
        needed = max(self.pos) + 1
        self.reach(needed)
        n, s = len(self.rows), self.attended(needed)
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
