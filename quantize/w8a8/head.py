"""The INT8 policy's vocabulary ends: the LM head in int8 with its top-k logits rescored, and the int8 embedding.

On a small LM the vocabulary is much of the model: SmolLM2-135M's tied 49152 x 576 embedding is 28M of its 134M
parameters, 113 MB of its 538 MB in fp32. With the head in int8 and the embedding left in float, that fp32 matrix
stayed (the embedding gathers its rows, the head's rescoring reads them): 45 % of the INT8 file.

``Int8Embedding`` gathers int8 rows and their per-row scales instead. Tied to an int8 head, it reads the head's own
int8 weight (``FbgemmWeight.shared``: one tensor in the file and in memory beside the packed copy), whose rows are of
the Hadamard-rotated weight ``W @ R``: a gathered row is turned back with ``R^T`` (exact in real arithmetic; the
quantization error is the head's). The head's rescoring then reads those same rows (``Int8RescoredHead`` without
float rows): float activations against int8 weights, so the top-k logits carry the weight's rounding only.

The default rows (``recipe.vocab_rows: int12``) are those int8 rows plus a 4-bit residual per element
(``quantize_rows_int12``): 15 times finer than int8, 1.5 bytes an element in all. The FP32 policy with only its
vocabulary in int12 agreed with FP32 on 0.9992 of next tokens on SmolLM2-135M's 80 held-out items; with int8 rows,
0.9892.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from policy_bundle.quantize.w8a8.rotation import mm_rows
from policy_bundle.quantize.w8a8.linear import Int8TokenLinear, quantize_weight


def quantize_rows_int16(weight: Tensor) -> Tuple[Tensor, Tensor]:
    """Symmetric int16 per row of a float [rows, dim] matrix: (int16 [rows, dim], float scales [rows]). Each element
    is within about amax / 65534 of its row's float value: on SmolLM2-135M's embedding the FP32 policy with only its
    embedding in int16 matched FP32 on 1279 of 1280 greedy tokens (docs/recipes.md)."""
    return quantize_weight(weight.detach().float(), 32767, torch.int16, 1e-12)


def quantize_rows_int12(weight: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """int8 rows with a scale per row (nearest rounding, as ``quantize_weight``) and each element's rounding residual
    in 4 bits, packed two to a byte: (int8 [rows, dim], float scales [rows], uint8 [rows, ceil(dim / 2)]). The residual
    ``weight / scale - q``, in [-1/2, 1/2], is rounded to fifteenths (codes 0-14 for -7/15 ... 7/15: zero exact, so
    an exact code stays exact), so ``q + (code - 7) / 15`` is within 1/30 of a code of ``weight / scale`` (amax /
    3810 of the row): 15 times finer than int8, at 12 bits an element. The int8 part alone is the int8 head's own
    weight."""
    w = weight.detach().float()
    q, scales = quantize_weight(w)
    codes = ((w / scales.unsqueeze(1) - q.float()) * 15.0).round_().clamp_(-7.0, 7.0).to(torch.int32) + 7
    if codes.shape[1] % 2:  # an odd width: one padding code, cut off again where the rows are read
        codes = torch.cat([codes, torch.full_like(codes[:, :1], 7)], dim=1)
    return q, scales, (codes[:, 0::2] * 16 + codes[:, 1::2]).to(torch.uint8)


def int12_rows(rows_int8: Tensor, residual: Tensor, ids: Tensor) -> Tensor:
    """The rows ``ids`` [n] of a ``quantize_rows_int12`` matrix in units of their scale, [n, dim] float; without a
    residual (empty) the int8 rows alone. Elementwise: a row's values do not depend on the others."""
    rows = rows_int8.index_select(0, ids).float()
    if residual.numel() == 0:
        return rows
    # each byte's two residuals looked up, not unpacked: a [256, 2] table of (code - 7) / 15 for its high and low
    # nibble, formed by the same float operations as unpacking did, so the same floats (SmolLM2-135M's head rescoring
    # 16 rows' top 64: 0.4 ms against 1.3)
    codes = torch.arange(256, dtype=torch.int32)
    table = (torch.stack([torch.bitwise_right_shift(codes, 4), torch.bitwise_and(codes, 15)], dim=-1).float() - 7.0) / 15.0
    packed = residual.index_select(0, ids).reshape(-1).long()
    res = table.index_select(0, packed).view(ids.shape[0], 2 * residual.shape[1])
    return rows + res[:, :rows.shape[1]]  # no -1: zero ids is fine too


def top_indices(out: Tensor, k: int, block: int = 64) -> Tensor:
    """The indices of each row's ``k`` largest values of ``out`` [n, V], [n, k] (largest first): the ``k`` blocks of
    ``block`` with the largest maxima hold every one of them, so ``topk`` runs over their ``k x block`` values, not
    over ``V`` (SmolLM2-135M's head, 16 rows, k = 64: 0.3 ms against 1.5). The same set as ``out.topk(k)``; where
    values tie at the k-th, either may keep another of the tied indices. A row's result does not depend on the others."""
    n, vocab = out.shape[0], out.shape[1]
    if vocab % block != 0 or vocab < 4 * k * block:
        return out.topk(k, dim=-1).indices
    blocks = out.view(n, vocab // block, block).amax(dim=-1).topk(k, dim=-1).indices  # [n, k]
    cand = (blocks.unsqueeze(-1) * block + torch.arange(block)).view(n, k * block)
    return cand.gather(1, out.gather(1, cand).topk(k, dim=-1).indices)


def gather_int16(rows16: Tensor, scales16: Tensor, ids: Tensor) -> Tensor:
    """The float rows ``ids`` [n] of a ``quantize_rows_int16`` matrix, [n, dim]: a row's values do not depend on the
    others."""
    return rows16.index_select(0, ids).float() * scales16.index_select(0, ids).unsqueeze(1)


class Int16Embedding(nn.Module):
    """Token embedding from int16 rows, a scale per row (``quantize_rows_int16``): half a float32 embedding's bytes,
    1/65534 of a row's largest value off. Tied to a rescored int8 head it holds the head's own ``rows16`` and
    ``scales16`` (the same tensors: saved and held once), so the embedding and the rescoring read the same rows."""

    def __init__(self, rows16: Tensor, scales16: Tensor):
        super().__init__()
        self.register_buffer("rows16", rows16)
        self.register_buffer("scales16", scales16)
        self.num_embeddings, self.embedding_dim = int(rows16.shape[0]), int(rows16.shape[1])

    @classmethod
    def from_float(cls, embedding: nn.Embedding) -> "Int16Embedding":
        return cls(*quantize_rows_int16(embedding.weight))

    def forward(self, tokens: Tensor) -> Tensor:
        return gather_int16(self.rows16, self.scales16, tokens.reshape(-1)).view(tokens.shape + (self.embedding_dim,))


class Int8RescoredHead(nn.Module):
    """The LM head in int8, with each row's top-k logits recomputed more exactly.

    On a 49k vocabulary the head is the largest matmul of a small LM's decode step (SmolLM2-135M:
    28M of its 134M multiply-adds per token), so it is where int8 pays most; near-tied top logits
    are where int8 errors flip the greedy choice. The int8 logits pick the k candidates, which are then scored
    against the row's float input: with ``float_weight`` (float weight rows, shared with a float tied embedding, not
    copied) exactly, so greedy decoding is exact whenever the float top-1 is among the int8 top-k; without it
    (``float_weight`` empty: an int8 embedding shares the head's rows) against the int8 rows, with their 4-bit
    residuals where there are (``int12_rows``: the default), and their scales, in the weight's rotated basis (``x @ R``
    against ``W @ R``), so only the rows' rounding is left; or against int16 rows (``rows16``). The tail keeps int8
    logits.

    A row's logits are the same bitwise alone or in any batch (fbgemm's two entry points give the same integers; the rescoring is a per-row product and sum), so batched greedy decoding equals unbatched.
    Many rows (a decode batch, a teacher-forced batch) go ``row_chunk`` (32) at a time into the output: the float
    temporaries over the vocabulary stay 32 rows' (SmolLM2-135M: 6 MB each; 512 rows at once made 100 MB each). With
    16-row chunks a served step of 16 decoding rows and two newcomers' prompts read the 28 MB head twice (16 + 2 rows);
    at 64 rows the INT8 process's peak rose by about 25 MB for no measurable speed.
    """

    def __init__(self, int8: Int8TokenLinear, float_weight: Tensor, topk: int, rows16: Optional[Tensor] = None,
                 scales16: Optional[Tensor] = None, residual: Optional[Tensor] = None):
        super().__init__()
        self.int8 = int8
        self.register_buffer("float_weight", float_weight)
        # int16 rows and their scales (``quantize_rows_int16``) in place of float rows: the same rows a tied
        # ``Int16Embedding`` gathers (the same tensors), half the bytes; empty otherwise
        if (rows16 is None) != (scales16 is None) or (rows16 is not None and scales16.shape[0] != rows16.shape[0]):
            raise ValueError("int16 rescoring rows need their scales, one per row")
        self.register_buffer("rows16", rows16 if rows16 is not None else torch.zeros(0, 0, dtype=torch.int16))
        self.register_buffer("scales16", scales16 if scales16 is not None else torch.zeros(0))
        # the int8 rows (the packed weight's own tensor, ``FbgemmWeight.shared``) and scales, for rescoring without
        # float or int16 rows; empty when those are there
        self.register_buffer("rows_int8", int8.fbgemm.shared if float_weight.numel() == 0 and self.rows16.numel() == 0
                             else torch.zeros(0, 0, dtype=torch.int8))
        self.register_buffer("rows_scale", int8.scales)
        # with int8 rows: their 4-bit rounding residuals (``quantize_rows_int12``), shared with a tied int8 embedding;
        # empty: the int8 rows alone
        self.register_buffer("residual", residual if residual is not None else torch.zeros(0, 0, dtype=torch.uint8))
        if self.residual.numel() > 0 and (self.rows_int8.numel() == 0 or self.residual.shape[0] != int8.out_features
                                          or self.residual.shape[1] != (int8.in_features + 1) // 2):
            raise ValueError("a 4-bit residual goes with the head's own int8 rows: one row of ceil(in / 2) bytes per row")
        if float_weight.numel() == 0 and self.rows16.numel() == 0 and self.rows_int8.numel() == 0:
            raise ValueError("an int8 head rescored without float rows needs its int8 weight shared (share_weight)")
        self.topk = int(min(topk, int8.out_features))  # a vocabulary smaller than k: every row rescored
        self.row_chunk = 32
        self.in_features, self.out_features = int8.in_features, int8.out_features

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.in_features).float()
        rows = flat.shape[0]
        chunk = self.row_chunk
        if rows <= chunk:
            out = self.scored(flat)
        else:
            out = flat.new_empty([rows, self.out_features])
            for start in range(0, rows, chunk):
                out[start:start + chunk] = self.scored(flat[start:start + chunk])
        return out.reshape(x.shape[:-1] + (self.out_features,))

    def scored(self, flat: Tensor) -> Tensor:
        out = self.int8(flat)
        idx = top_indices(out, self.topk)
        pick = idx.reshape(-1)
        # a product and a sum per row, not bmm: bmm's kernel depends on the batch (1-ulp differences between a row
        # alone and in a batch); this is the same for a row in any batch, and cheaper at 32 rows (3.4 vs 13 ms)
        if self.float_weight.numel() > 0:
            rows = self.float_weight.index_select(0, pick).view(idx.shape[0], self.topk, self.in_features)
            exact = (rows * flat.unsqueeze(1)).sum(-1)
        elif self.rows16.numel() > 0:  # the rows as the int16 embedding gives them, then as float rows
            rows = gather_int16(self.rows16, self.scales16, pick).view(idx.shape[0], self.topk, self.in_features)
            exact = (rows * flat.unsqueeze(1)).sum(-1)
        else:
            xr = self.int8.rotate(flat) if self.int8.rot_block > 0 else flat
            rows = int12_rows(self.rows_int8, self.residual, pick).view(idx.shape[0], self.topk, self.in_features)
            exact = (rows * xr.unsqueeze(1)).sum(-1) * self.rows_scale.index_select(0, pick).view(idx.shape)
        return out.scatter_(1, idx, exact)  # ``out`` is the int8 linear's own new tensor: no copy over the vocabulary


class Int8Embedding(nn.Module):
    """Token embedding from int8 rows, one scale per row (symmetric, as the head's weight), with each element's 4-bit
    residual where ``residual`` is not empty (``quantize_rows_int12``). ``rot_block`` > 0: the rows are of ``E @ R`` (a
    tied int8 head's rotated weight) and each gathered row is turned back with ``R^T``."""

    def __init__(self, weight_int8: Tensor, scales: Tensor, rot_outer: Tensor, rot_inner: Tensor, rot_signs: Tensor,
                 residual: Optional[Tensor] = None):
        super().__init__()
        # R^T's factors are R's own: Sylvester Hadamard matrices are symmetric (and multiplied as they are stored, the
        # contiguous matrix, a row comes out the same alone or in a batch; through a transposed view it did not)
        if not (torch.equal(rot_outer, rot_outer.t()) and torch.equal(rot_inner, rot_inner.t())):
            raise ValueError("Int8Embedding undoes a rotation with symmetric (Hadamard) factors only")
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("scales", scales)
        self.register_buffer("rot_outer", rot_outer)
        self.register_buffer("rot_inner", rot_inner)
        self.register_buffer("rot_signs", rot_signs)
        # the rows' 4-bit rounding residuals (``quantize_rows_int12``): a tied head's own; empty: int8 rows alone
        self.register_buffer("residual", residual if residual is not None else torch.zeros(0, 0, dtype=torch.uint8))
        self.rot_a, self.rot_b = int(rot_outer.shape[0]), int(rot_inner.shape[0])
        self.num_embeddings, self.embedding_dim = int(weight_int8.shape[0]), int(weight_int8.shape[1])

    @classmethod
    def tied_to(cls, head: Int8TokenLinear, residual: Optional[Tensor] = None) -> "Int8Embedding":
        """The embedding of a tied model whose int8 head (or rescored head's int8 part) is ``head``: its int8 rows,
        scales and rotation, and a rescored head's 4-bit residuals (the same tensors: saved and held once)."""
        if head.fbgemm.shared.numel() == 0:
            raise ValueError("the int8 head does not share its weight (build it with share_weight=True)")
        return cls(head.fbgemm.shared, head.scales, head.rot_outer, head.rot_inner, head.rot_signs, residual)

    @classmethod
    def from_float(cls, embedding: nn.Embedding, int12: bool = False) -> "Int8Embedding":
        """An untied embedding in int8 (nearest rounding, no rotation); ``int12``: with its 4-bit residuals."""
        empty = torch.zeros(0, 0)
        if int12:
            q, s, residual = quantize_rows_int12(embedding.weight)
            return cls(q, s, empty, empty, torch.zeros(0), residual)
        q, s = quantize_weight(embedding.weight.detach().float())
        return cls(q, s, empty, empty, torch.zeros(0))

    def forward(self, tokens: Tensor) -> Tensor:
        ids = tokens.reshape(-1)
        rows = int12_rows(self.weight_int8, self.residual, ids) * self.scales.index_select(0, ids).unsqueeze(1)
        if self.rot_b > 0:  # rows @ R^T: each block Y [a, b] becomes H_a @ Y @ H_b (symmetric), then the signs
            rows = mm_rows(rows.view(-1, self.rot_b), self.rot_inner)
            if self.rot_a > 1:
                rows = torch.matmul(self.rot_outer, rows.view(-1, self.rot_a, self.rot_b))
            rows = rows.reshape(-1, self.embedding_dim) * self.rot_signs
        return rows.view(tokens.shape + (self.embedding_dim,))
