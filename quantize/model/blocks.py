"""The policy's layers: RMSNorm, rotary embedding, attention over a caller's KV cache, the gated MLP, and the
decoder block (``quantize/model/policy.py`` puts them together)."""

from __future__ import annotations

import copy
import threading
from contextlib import contextmanager
from typing import Iterator, List, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from policy_bundle.quantize.model.policy_config import PolicyConfig


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


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding, HF's ``x * cos + rotate_half(x) * sin`` in two fewer ops: ``sin`` comes with its first half
    negated (``Policy.rope_sin``), so ``rotate_half(x) * sin`` is ``roll(x, half) * sin``, bitwise (a sign moves from
    one factor to the other; every product and sum is the same)."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * sin


def additive_mask(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """A boolean attention mask as the float one (0 / -inf) ``scaled_dot_product_attention`` makes of it, made once
    per forward instead of once per layer."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(allowed.logical_not(), float("-inf"))


def cache_len_for(total: int) -> int:
    """The KV-cache length a decoding caller allocates for ``total`` positions: whole blocks of ``attention_len``, so
    every step, the last ones too, attends over a multiple of 32 (``decode_steps``, the slot batch)."""
    return (total + 31) // 32 * 32


def attention_len(needed: int, cache_len: int) -> int:
    """How many cache positions attention runs over: ``needed`` rounded up to a multiple of 32, within the cache.
    The CPU attention kernel's sums depend on the key length, valid or masked: over exactly ``pos + 1`` keys a
    decode step's output moved by ~1e-5 against a longer cache, and an int8 policy turns that into other logits
    (SmolLM2-135M: 0.52 in one step). So a row attending alone over ``pos + 1`` keys, in a batch over the longest
    row's, or in the build's greedy over its whole cache, gave three answers. Over any multiple of 32 it gives one
    (measured from 32 to 1280 keys, across the kernel's 512-key blocks). Decoding callers allocate whole blocks
    (``cache_len_for``); a teacher-forced forward over a cache of exactly its T tokens attends over T, as before."""
    return min(cache_len_for(needed), cache_len)


def attended_cache(k_cache: Tensor, v_cache: Tensor, needed: int) -> Tuple[Tensor, Tensor]:
    """Views of the caches [..., S, head_dim] (positions on dim 3) over the ``attention_len`` positions a step
    needing ``needed`` of them attends over."""
    n = attention_len(needed, k_cache.shape[3])
    if n < k_cache.shape[3]:
        return k_cache.narrow(3, 0, n), v_cache.narrow(3, 0, n)
    return k_cache, v_cache


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
        # quantization, one matmul: ``quantize.w8a8.linear.fuse_projections``); q_proj/k_proj/v_proj then become
        # Identity.
        self.fused_qkv = False
        self.qkv_proj: nn.Module = nn.Identity()
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        # True where a projection's rows do not depend on each other (per-token int8:
        # ``quantize.w8a8.linear.mark_batchable``):
        # a step that decodes some sequences and prefills others runs it once over all their rows (``forward_parts``)
        self.batchable_qkv = False
        self.batchable_o = False

    def _qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """Rotated queries and keys, and values, as [B, heads, T, head_dim]."""
        b, t, _ = x.shape
        if self.fused_qkv:
            return self._heads(self.qkv_proj(x), cos, sin)
        else:
            q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim)
            k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim)
            v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim)
        if self.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return rope(q.transpose(1, 2), cos, sin), rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)

    def _heads(self, qkv: Tensor, cos: Tensor, sin: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """``_qkv`` from the fused projection's output [B, T, (heads + 2 kv heads) * head_dim]."""
        b, t = qkv.shape[0], qkv.shape[1]
        if not self.use_qk_norm:
            # queries and keys side by side, as the fused projection returns them: one rotary pass for both
            nqk = (self.n_heads + self.n_kv_heads) * self.head_dim
            qk = rope(qkv.narrow(2, 0, nqk).reshape(b, t, self.n_heads + self.n_kv_heads, self.head_dim).transpose(1, 2),
                      cos, sin)
            v = qkv.narrow(2, nqk, qkv.shape[2] - nqk).reshape(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
            return qk.narrow(1, 0, self.n_heads), qk.narrow(1, self.n_heads, self.n_kv_heads), v
        nq, nkv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q = self.q_norm(qkv[:, :, :nq].reshape(b, t, self.n_heads, self.head_dim))
        k = self.k_norm(qkv[:, :, nq : nq + nkv].reshape(b, t, self.n_kv_heads, self.head_dim))
        v = qkv[:, :, nq + nkv :].reshape(b, t, self.n_kv_heads, self.head_dim)
        return rope(q.transpose(1, 2), cos, sin), rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)

    def _attend(self, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
        return self.o_proj(self._sdpa(q, keys, values, mask))

    def _sdpa(self, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
        """Attention before the output projection, [B, T, heads * head_dim]."""
        b, t = q.shape[0], q.shape[2]
        if self.n_kv_heads != self.n_heads:
            # Grouped-query attention without copying the cache per query head: the ``rep`` query heads
            # of one kv head attend as ``rep * t`` rows of that head (head h reads kv head h // rep).
            # ``mask`` is [rep * t, S] here (``Policy.forward`` repeats it once per forward, not once per layer).
            rep = self.n_heads // self.n_kv_heads
            q = q.reshape(b, self.n_kv_heads, rep * t, self.head_dim)
            out = attend(q, keys, values, mask, t == 1).reshape(b, self.n_heads, t, self.head_dim)
        else:
            out = attend(q, keys, values, mask, t == 1)
        return out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, start_pos: int, k_cache: Tensor, v_cache: Tensor
    ) -> Tensor:
        q, k, v = self._qkv(x, cos, sin)
        t = x.shape[1]
        # Write this step's keys/values into the caller's preallocated cache, then attend over it.
        k_cache.narrow(2, start_pos, t).copy_(k)  # narrow: one op where [:, :, a:b] is a slice per dimension
        v_cache.narrow(2, start_pos, t).copy_(v)
        return self._attend(q, k_cache, v_cache, mask)

    def forward_rows(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, pos: Tensor, k_cache: Tensor, v_cache: Tensor
    ) -> Tensor:
        """One token per row, each row at its own position ``pos[b]`` (batched decode)."""
        q, k, v = self._qkv(x, cos, sin)
        _write_rows(k, v, pos, k_cache, v_cache)
        return self._attend(q, k_cache, v_cache, mask)

    def forward_parts(self, x: Tensor, sizes: List[int], rows: int, cos: List[Tensor], sin: List[Tensor],
                      masks: List[Tensor], pos: List[int], starts: List[int], ks: List[Tensor], vs: List[Tensor]) -> Tensor:
        """``x`` [N, dim] holds parts (``part_views``): a decode step's ``rows`` rows first where there are any, then
        prompt chunks, each part with its own rotary tables (``cos``, ``sin``). Every sequence has its own cache
        [1, kv_heads, S, head_dim] and mask (``ks``, ``vs``, ``masks``: the rows' first, one each, then one per
        chunk): row b writes its key and value at ``pos[b]`` and attends as ``forward_rows`` gives its row, a chunk
        writes from ``starts[j]`` as ``forward``. Each part's rows come out as its own call gives them; a projection
        whose rows are independent (``batchable_*``) runs once over all of them. [N, dim]."""
        if self.batchable_qkv:
            heads = [self._heads(p, cos[j], sin[j]) for j, p in enumerate(part_views(self.qkv_proj(x), sizes, rows))]
        else:
            heads = [self._qkv(p, cos[j], sin[j]) for j, p in enumerate(part_views(x, sizes, rows))]
        outs: List[Tensor] = []
        seq = 0
        for j, (q, k, v) in enumerate(heads):
            if j == 0 and rows > 0:
                each: List[Tensor] = []
                for b in range(rows):
                    ks[b].narrow(2, pos[b], 1).copy_(k.narrow(0, b, 1))
                    vs[b].narrow(2, pos[b], 1).copy_(v.narrow(0, b, 1))
                    each.append(self._sdpa(q.narrow(0, b, 1), ks[b], vs[b], masks[b]))
                outs.append(torch.cat(each))
                seq = rows
            else:
                ks[seq].narrow(2, starts[j], q.shape[2]).copy_(k)
                vs[seq].narrow(2, starts[j], q.shape[2]).copy_(v)
                outs.append(self._sdpa(q, ks[seq], vs[seq], masks[seq]))
                seq += 1
        if self.batchable_o:
            return self.o_proj(torch.cat([o.reshape(-1, o.shape[2]) for o in outs]))
        return torch.cat([self.o_proj(o).reshape(-1, x.shape[1]) for o in outs])


def attend(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, decode: bool) -> Tensor:
    """Scaled dot-product attention of ``q`` over the cache, in ``q``'s dtype (``attend_narrow`` for a cache narrower
    than the queries; ``decode``: one query position per sequence)."""
    if keys.dtype == q.dtype:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    return attend_narrow(q, keys, values, mask, decode and keys.dtype == torch.bfloat16 and bf16_products_pay())


def bf16_products_pay() -> bool:
    """Whether ``attend_narrow``'s own bfloat16 products beat PyTorch's fused attention for a decode step on this CPU:
    where oneDNN multiplies bfloat16 on AVX-512 without AMX. With AMX they are slow (an Intel Xeon with AMX, SmolLM2's
    attention of one decode row, one thread: 114 us at 128 positions and 1255 us at 7008, where the fused kernel takes
    30 and 665), and a server attends per sequence, one such call per row and layer. A prompt chunk's many queries
    always take the fused kernel: the products' scores come out transposed, and the softmax over them was 22x slower
    (the same Xeon, a 512-token chunk at position 4096: 725 ms a layer against 33). AMX is read as oneDNN's float16
    support (AVX512-FP16 or AMX-FP16): every x86 CPU with AMX has it, and the AVX-512 BF16 CPUs without AMX (AMD Zen 4
    and 5, Cooper Lake) do not; TorchScript sees oneDNN's checks, not the CPU's flags. The choice depends on the CPU
    and the call's own shape, never on a batch: a row's tokens are the same alone or batched on any one CPU."""
    return torch.ops.mkldnn._is_mkldnn_bf16_supported() and not torch.ops.mkldnn._is_mkldnn_fp16_supported()


def attend_narrow(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, native: bool) -> Tensor:
    """Attention over a 16-bit cache under float32 queries (``Policy.kv_cache``): a float16 cache always takes the fused
    kernel (``native`` False); a bfloat16 one two kernels, as the CPU allows
    (``bf16_products_pay``; measured on SmolLM2's shape, one thread, AMD EPYC with AVX-512 + VNNI + BF16 and no AMX, a
    float32 policy's decode step against a float32 cache: 89.0 ms at position 7000, 61.9 at 2048, 52.3 at 128):

    - ``native`` (oneDNN multiplies bfloat16: AVX-512 without AMX): the two products in bfloat16 (float32 accumulation
      inside, the scores and the output rounded to bfloat16), the softmax in float32; the cache is read as it is
      stored: 82.4 / 63.7 / 55.0 ms. The scores are keys @ q^T,
      transposed: the cache view attention runs over is narrowed from a longer allocation, and oneDNN copies such a
      view when it is the transposed right operand (1.5 ms a layer at 7000 positions instead of 0.33). Each product
      costs about 30 us however small, hence the short contexts' few ms;
    - otherwise (AVX2; AMX), PyTorch's fused attention in bfloat16 (queries and mask rounded to it, float32
      accumulation inside): 97.7 / 66.0 / 53.6 ms on that CPU (a bfloat16 product without oneDNN took 4.6 ms a layer at 7000 positions; the cache
      widened to float32 and attended as such, 110.7 / 66.4 / 57.6).

    Either way a row's result does not depend on the other rows of its batch (tests/test_kv_cache.py)."""
    if not native:
        return F.scaled_dot_product_attention(q.to(keys.dtype), keys, values, attn_mask=mask.to(keys.dtype)).to(q.dtype)
    scores = torch.matmul(keys, q.to(keys.dtype).transpose(-1, -2)).transpose(-1, -2).to(q.dtype) * (q.shape[-1] ** -0.5)
    scores = scores + mask
    return torch.matmul(torch.softmax(scores, -1).to(values.dtype), values).to(q.dtype)


def _write_rows(k: Tensor, v: Tensor, pos: Tensor, k_cache: Tensor, v_cache: Tensor) -> None:
    """Row b's key and value (one token each) into its cache slot b at ``pos[b]``."""
    rows = torch.arange(k.shape[0])
    # [B, S, kv_heads, head_dim] views of the cache: (row, pos) picks the slot this row writes.
    k_cache.transpose(1, 2).index_put_([rows, pos], k.select(2, 0).to(k_cache.dtype))
    v_cache.transpose(1, 2).index_put_([rows, pos], v.select(2, 0).to(v_cache.dtype))


def part_views(x: Tensor, sizes: List[int], rows: int) -> List[Tensor]:
    """``x`` [N, width] cut into its parts as each part's own call holds them: a decode step's ``rows`` rows (the
    first part, where ``rows`` > 0) as [rows, 1, width], a prompt chunk of T tokens as [1, T, width]."""
    out: List[Tensor] = []
    start = 0
    for j, n in enumerate(sizes):
        part = x.narrow(0, start, n)
        out.append(part.view(n, 1, x.shape[1]) if j == 0 and rows > 0 else part.view(1, n, x.shape[1]))
        start += n
    return out


class MLP(nn.Module):
    def __init__(self, cfg: PolicyConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.dim, bias=False)
        self.intermediate_size = cfg.intermediate_size
        self.fused_gate_up = False  # as Attention.fused_qkv: gate/up as one projection in an int8 export
        self.gate_up_proj: nn.Module = nn.Identity()
        self.batchable = False  # as Attention.batchable_qkv, for gate/up and down together
        self.batchable_gate_up = False  # gate/up alone (a float down_proj): it runs once over every part

    def forward(self, x: Tensor) -> Tensor:
        if self.fused_gate_up:
            gu = self.gate_up_proj(x)
            n = self.intermediate_size
            return self.down_proj(F.silu(gu.narrow(-1, 0, n)) * gu.narrow(-1, n, n))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def forward_parts(self, x: Tensor, sizes: List[int], rows: int) -> Tensor:
        """``forward`` of each part of ``x`` [N, dim] (``part_views``) as its own call gives it: once over all rows
        where the projections' rows are independent (``batchable``); gate/up and the elementwise product once where
        only theirs are (``batchable_gate_up``), then the down projection per part."""
        if self.batchable:
            return self.forward(x)
        if self.batchable_gate_up:
            gu = self.gate_up_proj(x)
            n = self.intermediate_size
            h = F.silu(gu.narrow(-1, 0, n)) * gu.narrow(-1, n, n)
            return torch.cat([self.down_proj(p).reshape(-1, x.shape[1]) for p in part_views(h, sizes, rows)])
        return torch.cat([self.forward(p).reshape(-1, x.shape[1]) for p in part_views(x, sizes, rows)])


NARROW = (torch.bfloat16, torch.float16)  # weight dtypes a block may keep as its source stored them


class Block(nn.Module):
    """One decoder layer. ``narrow``: its weights are kept as a 16-bit source stored them (``hf_weights.load_policy``:
    bfloat16 or float16, mapped from the file, half float32's bytes) and widened to float32 for each call, one layer
    at a time (``widened``): widening is exact, so every output is bitwise a float32 copy's. Eager only: a module to
    be converted or scripted is widened first (``widen_narrow``)."""

    def __init__(self, cfg: PolicyConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)
        self.narrow = False

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, start_pos: int, k_cache: Tensor, v_cache: Tensor
    ) -> Tensor:
        if self.narrow and not torch.jit.is_scripting():
            return self._widened_forward(x, cos, sin, mask, start_pos, k_cache, v_cache)
        return self._forward(x, cos, sin, mask, start_pos, k_cache, v_cache)

    def _forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, start_pos: int, k_cache: Tensor, v_cache: Tensor
    ) -> Tensor:
        return self._mlp_residual(x + self.self_attn(self.input_layernorm(x), cos, sin, mask, start_pos, k_cache,
                                                     v_cache))

    def forward_rows(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, pos: Tensor, k_cache: Tensor, v_cache: Tensor
    ) -> Tensor:
        if self.narrow and not torch.jit.is_scripting():
            return self._widened_rows(x, cos, sin, mask, pos, k_cache, v_cache)
        return self._forward_rows(x, cos, sin, mask, pos, k_cache, v_cache)

    def _forward_rows(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, pos: Tensor, k_cache: Tensor, v_cache: Tensor
    ) -> Tensor:
        return self._mlp_residual(x + self.self_attn.forward_rows(self.input_layernorm(x), cos, sin, mask, pos, k_cache,
                                                                  v_cache))

    def _mlp_residual(self, x: Tensor) -> Tensor:
        """The block's second half, after the attention's residual: the same for one sequence and for rows."""
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_parts(self, x: Tensor, sizes: List[int], rows: int, cos: List[Tensor], sin: List[Tensor],
                      masks: List[Tensor], pos: List[int], starts: List[int], ks: List[Tensor], vs: List[Tensor]) -> Tensor:
        if self.narrow and not torch.jit.is_scripting():
            return self._widened_parts(x, sizes, rows, cos, sin, masks, pos, starts, ks, vs)
        return self._forward_parts(x, sizes, rows, cos, sin, masks, pos, starts, ks, vs)

    def _forward_parts(self, x: Tensor, sizes: List[int], rows: int, cos: List[Tensor], sin: List[Tensor],
                       masks: List[Tensor], pos: List[int], starts: List[int], ks: List[Tensor], vs: List[Tensor]) -> Tensor:
        x = x + self.self_attn.forward_parts(self.input_layernorm(x), sizes, rows, cos, sin, masks, pos, starts, ks, vs)
        return x + self.mlp.forward_parts(self.post_attention_layernorm(x), sizes, rows)

    @torch.jit.unused
    def _widened_forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, start_pos: int, k_cache: Tensor,
                         v_cache: Tensor) -> Tensor:
        with widened(self):
            return self._forward(x, cos, sin, mask, start_pos, k_cache, v_cache)

    @torch.jit.unused
    def _widened_rows(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, pos: Tensor, k_cache: Tensor,
                      v_cache: Tensor) -> Tensor:
        with widened(self):
            return self._forward_rows(x, cos, sin, mask, pos, k_cache, v_cache)

    @torch.jit.unused
    def _widened_parts(self, x: Tensor, sizes: List[int], rows: int, cos: List[Tensor], sin: List[Tensor],
                       masks: List[Tensor], pos: List[int], starts: List[int], ks: List[Tensor], vs: List[Tensor]) -> Tensor:
        with widened(self):
            return self._forward_parts(x, sizes, rows, cos, sin, masks, pos, starts, ks, vs)


_WIDENING = threading.RLock()  # one widened call at a time per process: the swap is the module's state
# The float32 buffers a block is widened into, by (nesting depth, the parameter's name in its block, shape): one block's
# worth, kept (a block widened inside another's call, by a hook, gets its own). Widening into fresh memory costs a page
# fault per 4 KB on every call (1.7B shape: the 1.4G layer weights of a decode step, 3.9x a float32 copy's decode
# time); into these buffers, a copy.
_SCRATCH: dict = {}
_DEPTH = [0]  # widened calls open (under _WIDENING)


@contextmanager
def widened(block: Block) -> Iterator[Block]:
    """``block`` with float32 copies of its 16-bit parameters for the duration (its own tensors put back after). Calls
    from several threads take turns (a server that runs requests on threads widens at load instead)."""
    with _WIDENING:
        saved = [(f"{path}.{name}", mod, name, p) for path, mod in block.named_modules()
                 for name, p in mod._parameters.items() if p is not None and p.dtype in NARROW]
        for key, mod, name, p in saved:
            buf = _SCRATCH.get((_DEPTH[0], key, p.shape))
            if buf is None:
                with torch.inference_mode(False):  # a normal tensor: copied into in and out of inference mode
                    buf = _SCRATCH[(_DEPTH[0], key, p.shape)] = torch.empty(p.shape, dtype=torch.float32)
            mod._parameters[name] = nn.Parameter(buf.copy_(p.detach()), requires_grad=False)
        _DEPTH[0] += 1
        try:
            yield block
        finally:
            _DEPTH[0] -= 1
            for _, mod, name, p in saved:
                mod._parameters[name] = p


def shared_copy(policy: nn.Module) -> nn.Module:
    """A new module tree over the same parameters and buffers: modules may be swapped and tensors reassigned in it
    without touching ``policy``, and nothing is copied."""
    memo = {id(t): t for t in [*policy.parameters(), *policy.buffers()]}
    return copy.deepcopy(policy, memo)


def widened_copy(model: nn.Module) -> nn.Module:
    """A ``shared_copy`` of ``model`` with its 16-bit parameters widened (``widen_narrow``): for an exporter that traces
    the whole model; ``model`` keeps its own."""
    return widen_narrow(shared_copy(model))


def widen_narrow(model: nn.Module) -> nn.Module:
    """In place: every 16-bit parameter of ``model`` replaced by a float32 copy (a tensor shared by several modules
    stays shared) and no block ``narrow``. For a module about to be converted, scripted or exported, whose code reads
    weights outside the blocks' calls. With ``shared_copy`` first, the source model keeps its 16-bit tensors."""
    wide: dict = {}
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None and p.dtype in NARROW:
                if id(p) not in wide:
                    wide[id(p)] = nn.Parameter(p.detach().float(), requires_grad=False)
                mod._parameters[name] = wide[id(p)]
        if isinstance(mod, Block):
            mod.narrow = False
    return model
