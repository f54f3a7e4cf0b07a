"""The policy model: a compact Llama-family decoder (Llama, Qwen2, Qwen3) that loads HF weights.

In the spirit of gpt-fast's model.py: a dataclass config plus plain modules. Every projection is a
plain ``nn.Linear`` so eager ``torch.ao.quantization`` can swap it, and the forward pass is written
so ``torch.jit.script`` and ``torch.onnx.export`` both accept it. The KV cache is preallocated and
passed in by the caller (one pair of tensors ``[layers, batch, kv_heads, max_seq, head_dim]``), so
a scripted module can serve many independent sequences.
"""

from __future__ import annotations

from typing import List, Tuple

import torch
from torch import Tensor, nn

from policy_bundle.quantize.model.blocks import Block, RMSNorm, additive_mask, attended_cache
from policy_bundle.quantize.model.policy_config import (  # noqa: F401 (re-exported: the model's public names)
    SUPPORTED_ARCHITECTURES, PolicyConfig, UnsupportedModelError, rope_inv_freq)


def rope_tables(cfg: PolicyConfig) -> Tuple[Tensor, Tensor]:
    """cos and sin of every position's rotary angles [max_seq_len, head_dim] on the CPU; sin with its first half
    negated: what ``rope`` multiplies the rolled halves by."""
    with torch.device("cpu"):
        freqs = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float32), rope_inv_freq(cfg))
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), torch.cat((-freqs.sin(), freqs.sin()), dim=-1)


class Policy(nn.Module):
    """Decoder-only policy. ``forward(tokens, start_pos, k_cache, v_cache)`` returns logits [B, T, V]."""

    def __init__(self, cfg: PolicyConfig):
        super().__init__()
        self.n_layers, self.n_kv_heads, self.head_dim = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
        self.max_seq_len = cfg.max_seq_len
        self.gqa_rep = cfg.n_heads // cfg.n_kv_heads
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.kv_cache = "float32"  # the KV cache's dtype: float32, bfloat16 or float16 (``set_kv_cache``)
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @torch.jit.export
    def new_cache(self, batch_size: int, max_len: int = 0) -> Tuple[Tensor, Tensor]:
        """Allocate an empty KV cache for ``batch_size`` sequences of up to ``max_len`` tokens."""
        n = max_len if max_len > 0 else self.max_seq_len
        shape = [self.n_layers, batch_size, self.n_kv_heads, n, self.head_dim]
        dtype = torch.float32
        if self.kv_cache == "bfloat16":
            dtype = torch.bfloat16
        elif self.kv_cache == "float16":
            dtype = torch.float16
        return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)

    def forward(self, tokens: Tensor, start_pos: int, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        return self.lm_head(self.norm(self.hidden(tokens, start_pos, k_cache, v_cache)))

    @torch.jit.export
    def next_logits(self, tokens: Tensor, start_pos: int, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        """``forward``'s logits at the last position only, [B, 1, V]: a prompt's prefill as a server or a decode
        loop needs it. The LM head runs on one row per sequence, not on every position (SmolLM2-135M: 28M of the
        134M multiply-adds per token, and a [B, T, 49152] float output, 100 MB at 8 x 64)."""
        x = self.hidden(tokens, start_pos, k_cache, v_cache)
        return self.lm_head(self.norm(x.narrow(1, x.shape[1] - 1, 1)))

    def hidden(self, tokens: Tensor, start_pos: int, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        """The last layer's output [B, T, dim] (before the final norm), the cache written at ``start_pos..``."""
        t = tokens.shape[1]
        k_cache, v_cache = attended_cache(k_cache, v_cache, start_pos + t)
        cos, sin, mask = self._chunk_tables(t, start_pos, k_cache)
        x = self.embed_tokens(tokens)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, start_pos, k_cache[i], v_cache[i])
        return x

    def _chunk_tables(self, t: int, start_pos: int, k_cache: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """Rotary tables and additive mask of ``t`` tokens of one sequence from ``start_pos``, over ``k_cache``."""
        cache_len = k_cache.shape[3]
        cos = self.rope_cos[start_pos : start_pos + t]
        sin = self.rope_sin[start_pos : start_pos + t]
        # Query i (absolute position start_pos+i) sees cache slots 0..start_pos+i.
        q_pos = torch.arange(t).unsqueeze(1) + start_pos
        mask = torch.arange(cache_len).unsqueeze(0) <= q_pos
        if self.gqa_rep > 1:  # the same [t, S] mask for each of a kv head's query heads (``Attention._attend``)
            mask = mask.repeat(self.gqa_rep, 1)
        return cos, sin, additive_mask(mask, cos.dtype)

    def _row_tables(self, pos: Tensor, k_cache: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """Rotary tables and additive mask of decode rows, row b at ``pos[b]``, over ``k_cache``."""
        cache_len = k_cache.shape[3]
        cos = self.rope_cos.index_select(0, pos).view(pos.shape[0], 1, 1, -1)
        sin = self.rope_sin.index_select(0, pos).view(pos.shape[0], 1, 1, -1)
        mask = additive_mask((torch.arange(cache_len).unsqueeze(0) <= pos.unsqueeze(1)).view(pos.shape[0], 1, 1, cache_len),
                             cos.dtype)
        return cos, sin, mask

    @torch.jit.export
    def prefill(self, tokens: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        """The prompt into a fresh cache; the next token's logits [B, 1, V] (``next_logits``)."""
        return self.next_logits(tokens, 0, k_cache, v_cache)

    @torch.jit.export
    def decode(self, token: Tensor, pos: int, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        return self.forward(token, pos, k_cache, v_cache)

    @torch.jit.export
    def decode_batch(self, tokens: Tensor, pos: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        """One decode step for B sequences at once, row b at its own position ``pos[b]`` (continuous
        batching): ``tokens`` [B, 1], ``pos`` [B] int64, caches [layers, B, kv_heads, S, head_dim] with
        S > max(pos); row b attends to its slots 0..pos[b] (over ``attention_len`` slots: its answer does not depend on
        the other rows' positions). Returns logits [B, 1, V]."""
        k_cache, v_cache = attended_cache(k_cache, v_cache, int(pos.max()) + 1)
        cos, sin, mask = self._row_tables(pos, k_cache)
        x = self.embed_tokens(tokens)
        for i, layer in enumerate(self.layers):
            x = layer.forward_rows(x, cos, sin, mask, pos, k_cache[i], v_cache[i])
        return self.lm_head(self.norm(x))

    @torch.jit.export
    def step_and_prefill(self, tokens: Tensor, pos: Tensor, prompts: List[Tensor], starts: List[int], k_cache: Tensor,
                         v_cache: Tensor) -> Tensor:
        """``decode_batch`` of rows 0..B-1 (``tokens`` [B, 1] at ``pos`` [B]; B may be 0) and, in the same forward,
        ``next_logits`` of each prompt chunk ``prompts[j]`` [1, T_j] written at ``starts[j]..`` of cache slot B + j
        (caches [layers, B + chunks, kv_heads, S, head_dim]): ``step_seqs`` over the cache's slots. Returns
        [B + chunks, 1, V]."""
        n = tokens.shape[0] + len(prompts)
        return self.step_seqs(tokens, pos, prompts, starts, [k_cache.narrow(1, i, 1) for i in range(n)],
                              [v_cache.narrow(1, i, 1) for i in range(n)])

    @torch.jit.export
    def step_seqs(self, tokens: Tensor, pos: Tensor, prompts: List[Tensor], starts: List[int], ks: List[Tensor],
                  vs: List[Tensor]) -> Tensor:
        """One forward for a decode step of B sequences (``tokens`` [B, 1], row b at ``pos[b]``; B may be 0) and prompt
        chunks (``prompts[j]`` [1, T_j] from position ``starts[j]``), every sequence on a KV cache of its own:
        ``ks[i]``, ``vs[i]`` [layers, 1, kv_heads, S_i, head_dim], the B rows' first, then one per chunk, each at least
        as long as what its sequence writes (a server grows each by blocks as its sequence does: no sequence is priced
        at another's length). Returns [B + chunks, 1, V]: each row's logits as ``decode`` gives them alone, each chunk's
        as ``next_logits``, bitwise where the LM head's rows are independent (int8). Projections whose rows are
        independent (per-token int8) run once over every row of the step; float ones, attention and the cache writes
        run per sequence as alone (``Block.forward_parts``). A server's newcomers join a running batch without a
        pass over the weights of their own."""
        rows, n = tokens.shape[0], len(prompts)
        row_pos: List[int] = pos.tolist()
        sizes: List[int] = []
        starts_all: List[int] = []
        ids: List[Tensor] = []
        cos: List[Tensor] = []
        sin: List[Tensor] = []
        masks: List[Tensor] = []
        kk: List[Tensor] = []
        vv: List[Tensor] = []
        last: List[int] = []
        if rows > 0:
            sizes.append(rows)
            starts_all.append(0)
            ids.append(tokens.reshape(-1))
            cos.append(self.rope_cos.index_select(0, pos).view(rows, 1, 1, -1))
            sin.append(self.rope_sin.index_select(0, pos).view(rows, 1, 1, -1))
            for b in range(rows):
                k, v = attended_cache(ks[b], vs[b], row_pos[b] + 1)
                masks.append(additive_mask((torch.arange(k.shape[3]) <= row_pos[b]).view(1, 1, 1, -1), cos[0].dtype))
                kk.append(k)
                vv.append(v)
            last = [i for i in range(rows)]
        for j in range(n):
            t = prompts[j].shape[1]
            k, v = attended_cache(ks[rows + j], vs[rows + j], starts[j] + t)
            c, s, m = self._chunk_tables(t, starts[j], k)
            sizes.append(t)
            starts_all.append(starts[j])
            ids.append(prompts[j].reshape(-1))
            cos.append(c)
            sin.append(s)
            masks.append(m)
            kk.append(k)
            vv.append(v)
            last.append(sum(sizes) - 1)
        x = self.embed_tokens(torch.cat(ids))
        for i, layer in enumerate(self.layers):
            x = layer.forward_parts(x, sizes, rows, cos, sin, masks, row_pos, starts_all, [k[i] for k in kk],
                                    [v[i] for v in vv])
        return self.lm_head(self.norm(x.index_select(0, torch.tensor(last)).unsqueeze(1)))


class FullSequence(nn.Module):
    """Cache-free full-sequence forward (tokens -> logits), the shape ONNX export wants."""

    def __init__(self, policy: Policy):
        super().__init__()
        self.policy = policy

    def forward(self, tokens: Tensor) -> Tensor:
        p = self.policy
        shape = [p.n_layers, tokens.shape[0], p.n_kv_heads, tokens.shape[1], p.head_dim]
        k = torch.zeros(shape, dtype=torch.float32)
        v = torch.zeros(shape, dtype=torch.float32)
        return p(tokens, 0, k, v)


KV_CACHES = ("float32", "bfloat16", "float16")


def set_kv_cache(policy: nn.Module, dtype: str) -> nn.Module:
    """The KV cache ``policy.new_cache`` allocates from now on (in place): ``float32``, or ``bfloat16`` or ``float16``,
    half the bytes a token costs. Keys and values are rounded to it as they are written; attention reads it
    (``blocks.attend``)."""
    if dtype not in KV_CACHES:
        raise ValueError(f"kv_cache: {dtype!r} is not one of {list(KV_CACHES)}")
    if not isinstance(getattr(policy, "kv_cache", None), str):
        raise TypeError(f"{type(policy).__name__} allocates no KV cache of its own (no kv_cache attribute)")
    policy.kv_cache = dtype
    return policy


def kv_bytes_per_token(policy: Policy, dtype: str) -> int:
    """The bytes one token of one sequence costs in ``policy``'s KV cache of ``dtype``: keys and values, every layer."""
    return 2 * policy.n_layers * policy.n_kv_heads * policy.head_dim * (4 if dtype == "float32" else 2)


def full_logits(policy: nn.Module, tokens: Tensor) -> Tensor:
    """Teacher-forced logits for a [B, T] batch (fresh cache sized to T)."""
    k, v = policy.new_cache(tokens.shape[0], tokens.shape[1])
    return policy(tokens, 0, k, v)


@torch.no_grad()
def run_with_hooks(policy: nn.Module, batches, hooks: list, stop: Tuple[type, ...] = ()) -> None:
    """Teacher-forced forwards over ``batches`` for the hooks' sake; the hook handles are removed
    afterwards. An exception of a ``stop`` type ends that batch's forward early (a hook saw enough)."""
    try:
        for batch in batches:
            try:
                full_logits(policy, batch)
            except stop:
                continue
    finally:
        for h in hooks:
            h.remove()


def param_count(policy: nn.Module) -> int:
    return sum(p.numel() for p in policy.parameters())


def logit_scale(logits: Tensor) -> float:
    return float(logits.abs().max().clamp_min(1e-6))


__all__ = [
    "PolicyConfig",
    "Policy",
    "FullSequence",
    "UnsupportedModelError",
    "full_logits",
]
