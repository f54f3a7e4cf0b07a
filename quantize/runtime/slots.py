"""Sequences decoding together, each on a KV cache of its own that grows by blocks: the build's batched greedy
rollouts (``decode.greedy_generate_batch``) and the serving engine's continuous batching.

A prompt is prefilled (whole, or in chunks) into a cache of its own, ``join`` makes it a row, ``step`` advances every
row by one token, each at its own position, and ``release`` drops a row's cache: its memory goes back at once. No
sequence is priced at another's length: with ``block`` > 0 (the server) a sequence's cache holds whole blocks of
``block`` positions, one more each time it runs past the last, so a 6000-token request beside eight short ones costs
its own 6144 positions and theirs 256 each, not nine times 6144. Without (the build's rollouts) each sequence holds
``max_len`` positions from its prefill.

A cache is one contiguous tensor per sequence, grown by copying it into one a block longer: attention reads it as it
lies. A paged cache whose blocks lie anywhere in a shared pool would have to be gathered into such a tensor before
every step's attention (PyTorch has no CPU attention over a block table; the gather copies the whole attended cache
at every step, where growing copies it once per ``block`` steps: SmolLM2-135M at 7000 positions, 160 MB a step
against 160 MB per 256 steps).

Every sequence attends over its own cache (``Policy.step_seqs``; each row as it is alone, at its own
``attention_len``), so a row's tokens do not depend on the batch, nor on how long the other rows are.
"""

from __future__ import annotations

from typing import Callable, Generic, List, Sequence, Tuple, TypeVar

import torch
from torch import Tensor

from policy_bundle.quantize.model.blocks import attention_len, cache_len_for

R = TypeVar("R")
KV_BLOCK = 256  # positions a served sequence's cache grows by (``block``; a multiple of attention's 32)
# An idle server prefills a prompt whole up to this many tokens, a longer one in chunks of it: attention over a chunk
# makes a [chunk x heads, context] mask and scores, not [prompt, prompt] (a 6000-token prompt: 12 MB a head, not 144)
LONG_PROMPT_CHUNK = 512


class _Cache:
    """One sequence's keys and values [layers, 1, kv_heads, positions, head_dim], and how many positions it has
    written."""

    __slots__ = ("k", "v", "filled")

    def __init__(self, k: Tensor, v: Tensor):
        self.k, self.v, self.filled = k, v, 0

    @property
    def positions(self) -> int:
        return int(self.k.shape[3])


class SlotBatch(Generic[R]):
    """Up to ``max_capacity`` sequences of up to ``max_len`` positions decoding on ``module``; ``rows[i]`` (the
    caller's object for the sequence) writes its next token at ``pos[i]`` into its own cache."""

    def __init__(self, module, max_len: int, max_capacity: int, block: int = 0):
        self.module, self.max_len, self.max_capacity = module, max_len, max(1, max_capacity)
        if block and block % 32:
            raise ValueError(f"block: {block} positions is not a multiple of 32 (attention runs over whole 32s)")
        self.block = block
        self._bytes_per_position = 0
        self.rows: List[R] = []
        self.pos: List[int] = []
        self.caches: List[_Cache] = []  # the rows'
        # prompts prefilled (whole, or the first in part) that have not joined yet, in the order they join
        self._staged: List[_Cache] = []

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def filling(self) -> int:
        """The prompt positions already in the next sequence to join (0: none staged)."""
        return self._staged[0].filled if self._staged else 0

    @property
    def length(self) -> int:
        """The positions the longest sequence's cache holds now (0 when there is none)."""
        return max((c.positions for c in self.caches + self._staged), default=0)

    @property
    def blocks(self) -> int:
        """The blocks the caches hold now (``positions_for``'s units: ``block`` positions, or a whole ``max_len``)."""
        unit = self.block or cache_len_for(self.max_len)
        return sum(-(-c.positions // unit) for c in self.caches + self._staged)

    def positions_for(self, needed: int) -> int:
        """The positions a sequence needing ``needed`` of them holds: whole blocks (without ``block``: the whole
        ``max_len``, in whole attention blocks), never past ``max_len``'s."""
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
        """The bytes ``n`` sequences of up to ``positions`` positions each come to, at most (``positions_for``)."""
        return n * self.positions_for(positions) * self.bytes_per_position()

    def allocated_bytes(self) -> int:
        return sum(c.positions for c in self.caches + self._staged) * self.bytes_per_position()

    def _reach(self, cache: _Cache, needed: int) -> None:
        """Make ``cache`` hold at least ``needed`` positions (``positions_for``), keeping what it has written. A failed
        allocation leaves it as it was."""
        if needed <= cache.positions:
            return
        k, v = self.module.new_cache(1, self.positions_for(needed))
        n = cache.filled
        k[:, :, :, :n] = cache.k[:, :, :, :n]
        v[:, :, :, :n] = cache.v[:, :, :, :n]
        cache.k, cache.v = k, v

    def _new(self, needed: int, replacing: bool = False) -> _Cache:
        if len(self.rows) + len(self._staged) - replacing >= self.max_capacity:
            raise ValueError(f"no free slot: {len(self.rows)} rows and {len(self._staged)} staged prompts fill the "
                             f"batch's {self.max_capacity} sequences")
        return _Cache(*self.module.new_cache(1, self.positions_for(needed)))

    def _target(self, start: int, needed: int, j: int = 0) -> _Cache:
        """The cache a prompt chunk from ``start`` goes into, holding ``needed`` positions: the ``j``-th staged prompt
        when the chunk continues it (``start`` > 0) or it is staged and empty, else a new one (a chunk from 0 starts a
        prompt over)."""
        staged = self._staged[j] if j < len(self._staged) else None
        if start and (staged is None or staged.filled != start):
            raise ValueError(f"a prompt chunk from position {start} continues no staged prompt "
                             f"(it holds {staged.filled if staged else 0})")
        if staged is not None and staged.filled == start:
            self._reach(staged, needed)
            return staged
        cache = self._new(needed, staged is not None)
        if staged is not None:
            self._staged[j] = cache
        else:
            self._staged.append(cache)
        return cache

    def grow_rows(self) -> List[Tuple[int, BaseException]]:
        """Give every row the position its next step writes (``_reach``); returns ``(row index, error)`` for each row
        whose cache could not grow (out of memory): the caller fails and releases those rows, and the others step."""
        failed: List[Tuple[int, BaseException]] = []
        for i, (cache, p) in enumerate(zip(self.caches, self.pos)):
            try:
                self._reach(cache, p + 1)
            except Exception as exc:  # noqa: BLE001 - that row's failure, not the batch's
                failed.append((i, exc))
        return failed

    def _grow_all(self) -> None:
        """``grow_rows``, raising the first failure (a caller that fails rows one by one calls ``grow_rows`` first)."""
        failed = self.grow_rows()
        if failed:
            raise failed[0][1]

    def stage(self, chunks: Sequence[Tuple[Sequence[int], int]]) -> List[_Cache]:
        """Allocate what ``step_and_prefill(..., chunks)`` writes: each chunk's sequence (the ``j``-th to join) holding
        its end, and every row one more position. A failed allocation (out of memory) raises before any forward, and
        the caller may ``unstage`` the newcomers and step the rows alone. Staging twice allocates once."""
        self._grow_all()
        return [self._target(start, start + len(ids), j) for j, (ids, start) in enumerate(chunks)]

    def unstage(self) -> None:
        """Drop the prompts prefilled (whole or in part) that have not joined, and their caches."""
        self._staged = []

    def prefill(self, ids: Sequence[int], start: int = 0) -> Tensor:
        """Write the prompt tokens ``ids`` at positions ``start..`` of the next sequence to join (its positions
        ``0..start-1`` hold the prompt's earlier tokens, from the prefill before); returns the logits after its last
        token [V]: the module's ``next_logits`` (the LM head on that row alone), or the last row of its ``forward`` where
        it has none (a policy exported without ``next_logits``)."""
        end = start + len(ids)
        cache = self._target(start, end)
        run = getattr(self.module, "next_logits", self.module)
        n = attention_len(end, cache.positions)
        logits = run(torch.tensor([list(ids)]), start, cache.k[:, :, :, :n], cache.v[:, :, :, :n])
        cache.filled = end
        return logits[0, -1]

    def join(self, row: R) -> None:
        """The next staged prompt becomes ``row``: its next token goes after the prompt."""
        cache = self._staged.pop(0)
        self.rows.append(row)
        self.pos.append(cache.filled)
        self.caches.append(cache)

    def can_fuse(self) -> bool:
        """Whether the module runs a step and prompt chunks in one forward over caches of their own (``step_seqs``;
        older artifacts lack it)."""
        return hasattr(self.module, "step_seqs")

    def step_and_prefill(self, tokens: Sequence[int], chunks: Sequence[Tuple[Sequence[int], int]]) -> Tuple[Tensor, Tensor]:
        """``step(tokens)`` for the rows and, in the same forward (the module's ``step_seqs``), each chunk
        ``(ids, start)`` written at ``start..`` of the ``j``-th sequence to join as ``prefill`` writes it (the first
        chunk may continue a part-prefilled prompt; only the last may stop short of its prompt's end). Returns the rows'
        next logits [n, V] and each chunk's last logits [chunks, V]; then ``join`` each whole prompt, in order."""
        n = len(self.rows)
        targets = self.stage(chunks)
        seqs = self.caches + targets
        logits = self.module.step_seqs(torch.tensor(list(tokens), dtype=torch.long).view(n, 1),
                                       torch.tensor(self.pos, dtype=torch.long),
                                       [torch.tensor([list(ids)]) for ids, _ in chunks], [start for _, start in chunks],
                                       [c.k for c in seqs], [c.v for c in seqs])[:, 0]
        self._stepped()
        for cache, (ids, start) in zip(targets, chunks):
            cache.filled = start + len(ids)
        return logits[:n], logits[n:]

    def step(self, tokens: Sequence[int]) -> Tensor:
        """Feed ``tokens[i]`` to row ``i`` at ``pos[i]``; returns the next logits [n, V]. One row runs the
        single-sequence ``decode`` (the same arithmetic, minus the step's per-sequence bookkeeping); several run
        ``step_seqs`` (one ``decode`` per row on a module without it)."""
        self._grow_all()
        n = len(self.rows)
        if n == 1 or not self.can_fuse():
            logits = torch.cat([self._decode_one(t, c, p) for t, c, p in zip(tokens, self.caches, self.pos)])
        else:
            logits = self.module.step_seqs(torch.tensor(list(tokens), dtype=torch.long).view(n, 1),
                                           torch.tensor(self.pos, dtype=torch.long), [], [],
                                           [c.k for c in self.caches], [c.v for c in self.caches])
        self._stepped()
        return logits[:, 0]

    def _decode_one(self, token: int, cache: _Cache, pos: int) -> Tensor:
        s = attention_len(pos + 1, cache.positions)
        return self.module.decode(torch.tensor([[token]]), pos, cache.k[:, :, :, :s], cache.v[:, :, :, :s])

    def _stepped(self) -> None:
        for cache, p in zip(self.caches, self.pos):
            cache.filled = p + 1
        self.pos = [p + 1 for p in self.pos]

    def release(self, slots: Sequence[int]) -> None:
        """Drop the rows at ``slots`` and their caches (their memory goes back at once); the others keep their order."""
        gone = set(slots)
        keep = [i for i in range(len(self.rows)) if i not in gone]
        self.rows = [self.rows[i] for i in keep]
        self.pos = [self.pos[i] for i in keep]
        self.caches = [self.caches[i] for i in keep]

    def drop(self, leaves: Callable[[R], bool]) -> None:
        """Release the rows for which ``leaves(row)`` is true."""
        self.release([i for i, row in enumerate(self.rows) if leaves(row)])

    def clear(self) -> None:
        """Forget every row and staged prompt, and their caches."""
        self.rows, self.pos, self.caches, self._staged = [], [], [], []
