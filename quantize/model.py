"""The policy model: a compact Llama-family decoder (Llama, Qwen2, Qwen3) that loads HF weights.

In the spirit of gpt-fast's model.py: a dataclass config plus plain modules. Every projection is a
plain ``nn.Linear`` so eager ``torch.ao.quantization`` can swap it, and the forward pass is written
so ``torch.jit.script`` and ``torch.onnx.export`` both accept it. The KV cache is preallocated and
passed in by the caller (one pair of tensors ``[layers, batch, kv_heads, max_seq, head_dim]``), so
a scripted module can serve many independent sequences.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from policy_bundle.quantize.decode import greedy_generate  # re-exported (see __all__)
from policy_bundle.quantize.policy_config import (  # noqa: F401 (re-exported: the model's public names)
    SUPPORTED_ARCHITECTURES, PolicyConfig, UnsupportedModelError, rope_inv_freq)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: PolicyConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, q, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.dim, kv, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.dim, kv, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q, cfg.dim, bias=False)
        self.use_qk_norm = cfg.qk_norm
        # An int8 export may replace q/k/v by one projection over the concatenated weights (one activation
        # quantization, one matmul: ``quantize.w8a8.fuse_projections``); q_proj/k_proj/v_proj then become Identity.
        self.fused_qkv = False
        self.qkv_proj: nn.Module = nn.Identity()
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else nn.Identity()

    def _qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """Rotated queries and keys, and values, as [B, heads, T, head_dim]."""
        b, t, _ = x.shape
        if self.fused_qkv:
            qkv = self.qkv_proj(x)
            nq, nkv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
            q = qkv[:, :, :nq].reshape(b, t, self.n_heads, self.head_dim)
            k = qkv[:, :, nq : nq + nkv].reshape(b, t, self.n_kv_heads, self.head_dim)
            v = qkv[:, :, nq + nkv :].reshape(b, t, self.n_kv_heads, self.head_dim)
        else:
            q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim)
            k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim)
            v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim)
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(k).transpose(1, 2)
        v = v.transpose(1, 2)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def _attend(self, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
        b, t = q.shape[0], q.shape[2]
        if self.n_kv_heads != self.n_heads:
            # Grouped-query attention without copying the cache per query head: the ``rep`` query heads
            # of one kv head attend as ``rep * t`` rows of that head (head h reads kv head h // rep).
            # ``mask`` is [rep * t, S] here (``Policy.forward`` repeats it once per forward, not once per layer).
            rep = self.n_heads // self.n_kv_heads
            q = q.reshape(b, self.n_kv_heads, rep * t, self.head_dim)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
            out = out.reshape(b, self.n_heads, t, self.head_dim)
        else:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, start_pos: int, k_cache: Tensor, v_cache: Tensor
    ) -> Tensor:
        q, k, v = self._qkv(x, cos, sin)
        t = x.shape[1]
        # Write this step's keys/values into the caller's preallocated cache, then attend over it.
        k_cache[:, :, start_pos : start_pos + t] = k
        v_cache[:, :, start_pos : start_pos + t] = v
        return self._attend(q, k_cache, v_cache, mask)

    def forward_rows(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, pos: Tensor, k_cache: Tensor, v_cache: Tensor
    ) -> Tensor:
        """One token per row, each row at its own position ``pos[b]`` (batched decode)."""
        q, k, v = self._qkv(x, cos, sin)
        rows = torch.arange(x.shape[0])
        # [B, S, kv_heads, head_dim] views of the cache: (row, pos) picks the slot this row writes.
        k_cache.transpose(1, 2).index_put_([rows, pos], k[:, :, 0])
        v_cache.transpose(1, 2).index_put_([rows, pos], v[:, :, 0])
        return self._attend(q, k_cache, v_cache, mask)


class MLP(nn.Module):
    def __init__(self, cfg: PolicyConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.dim, bias=False)
        self.intermediate_size = cfg.intermediate_size
        self.fused_gate_up = False  # as Attention.fused_qkv: gate/up as one projection in an int8 export
        self.gate_up_proj: nn.Module = nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        if self.fused_gate_up:
            gu = self.gate_up_proj(x)
            n = self.intermediate_size
            return self.down_proj(F.silu(gu[..., :n]) * gu[..., n:])
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: PolicyConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, start_pos: int, k_cache: Tensor, v_cache: Tensor
    ) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, start_pos, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_rows(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, pos: Tensor, k_cache: Tensor, v_cache: Tensor
    ) -> Tensor:
        x = x + self.self_attn.forward_rows(self.input_layernorm(x), cos, sin, mask, pos, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


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
        inv_freq = rope_inv_freq(cfg)
        freqs = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("rope_cos", emb.cos(), persistent=False)
        self.register_buffer("rope_sin", emb.sin(), persistent=False)

    @torch.jit.export
    def new_cache(self, batch_size: int, max_len: int = 0) -> Tuple[Tensor, Tensor]:
        """Allocate an empty KV cache for ``batch_size`` sequences of up to ``max_len`` tokens."""
        n = max_len if max_len > 0 else self.max_seq_len
        shape = [self.n_layers, batch_size, self.n_kv_heads, n, self.head_dim]
        return torch.zeros(shape), torch.zeros(shape)

    def forward(self, tokens: Tensor, start_pos: int, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        t = tokens.shape[1]
        cache_len = k_cache.shape[3]
        cos = self.rope_cos[start_pos : start_pos + t].to(k_cache.dtype)
        sin = self.rope_sin[start_pos : start_pos + t].to(k_cache.dtype)
        # Query i (absolute position start_pos+i) sees cache slots 0..start_pos+i.
        q_pos = torch.arange(t).unsqueeze(1) + start_pos
        mask = torch.arange(cache_len).unsqueeze(0) <= q_pos
        if self.gqa_rep > 1:  # the same [t, S] mask for each of a kv head's query heads (``Attention._attend``)
            mask = mask.repeat(self.gqa_rep, 1)
        x = self.embed_tokens(tokens)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, start_pos, k_cache[i], v_cache[i])
        return self.lm_head(self.norm(x))

    @torch.jit.export
    def prefill(self, tokens: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        return self.forward(tokens, 0, k_cache, v_cache)

    @torch.jit.export
    def decode(self, token: Tensor, pos: int, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        return self.forward(token, pos, k_cache, v_cache)

    @torch.jit.export
    def decode_batch(self, tokens: Tensor, pos: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        """One decode step for B sequences at once, row b at its own position ``pos[b]`` (continuous
        batching): ``tokens`` [B, 1], ``pos`` [B] int64, caches [layers, B, kv_heads, S, head_dim] with
        S > max(pos); row b attends to its slots 0..pos[b]. Returns logits [B, 1, V]."""
        cache_len = k_cache.shape[3]
        cos = self.rope_cos.index_select(0, pos).to(k_cache.dtype).view(pos.shape[0], 1, 1, -1)
        sin = self.rope_sin.index_select(0, pos).to(k_cache.dtype).view(pos.shape[0], 1, 1, -1)
        mask = (torch.arange(cache_len).unsqueeze(0) <= pos.unsqueeze(1)).view(pos.shape[0], 1, 1, cache_len)
        x = self.embed_tokens(tokens)
        for i, layer in enumerate(self.layers):
            x = layer.forward_rows(x, cos, sin, mask, pos, k_cache[i], v_cache[i])
        return self.lm_head(self.norm(x))


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


class CastPolicy(nn.Module):
    """A policy run in another float dtype (weights and KV cache alike), returning float32 logits:
    how the FP16 artifact computes, for comparing it with FP32 on the same golden set."""

    def __init__(self, policy: Policy, dtype: torch.dtype):
        super().__init__()
        self.policy, self.dtype = policy.to(dtype), dtype

    def new_cache(self, batch_size: int, max_len: int = 0) -> Tuple[Tensor, Tensor]:
        k, v = self.policy.new_cache(batch_size, max_len)
        return k.to(self.dtype), v.to(self.dtype)

    def forward(self, tokens: Tensor, start_pos: int, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        return self.policy(tokens, start_pos, k_cache, v_cache).float()

    def prefill(self, tokens: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        return self.forward(tokens, 0, k_cache, v_cache)

    def decode(self, token: Tensor, pos: int, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        return self.forward(token, pos, k_cache, v_cache)

    def decode_batch(self, tokens: Tensor, pos: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        return self.policy.decode_batch(tokens, pos, k_cache, v_cache).float()


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
    "greedy_generate",
    "full_logits",
]
