"""Hadamard rotations of an int8 linear's input: the block size, the seeded orthogonal matrix and its Kronecker
factors (``quantize.w8a8.linear.Int8TokenLinear`` applies them; ``quantize.w8a8.plan`` folds them into the weights)."""

from __future__ import annotations

import math
from typing import Tuple

import torch
from torch import Tensor


def rotation_block(n: int, max_block: int) -> int:
    """The Hadamard block for an ``n``-wide input: the largest power of two <= ``max_block`` dividing ``n``
    (SmolLM2-135M: 64 for its 576-wide inputs, 512 for down_proj's 1536); 0 (no rotation) under 2."""
    b = 1
    while b * 2 <= max_block and n % (b * 2) == 0:
        b *= 2
    return b if b >= 2 else 0


_HADAMARD: dict = {}  # size -> the normalized Sylvester matrix (``hadamard``)
KRON_INNER = 64  # a block above this is applied as H_outer (x) H_64: two small matmuls instead of one dense one


def hadamard(n: int) -> Tensor:
    """The normalized Sylvester Hadamard matrix of a power-of-two size ``n``, one shared tensor per size (every
    rotated linear's buffer is this same tensor: a TorchScript file stores it once)."""
    if n not in _HADAMARD:
        h = torch.ones(1, 1)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        _HADAMARD[n] = h / math.sqrt(n)
    return _HADAMARD[n]



def rotated_weight(weight: Tensor, block: int) -> Tensor:
    """A linear's float weight [out, in] as its rotated input meets it, ``W @ R`` (``block`` 0: ``W`` itself)."""
    w = weight.detach().float()
    return rotate(w, block) if block else w


def mm_rows(x: Tensor, m: Tensor) -> Tensor:
    """``x @ m`` with a row's result the same whatever other rows ``x`` holds: one row goes in as two (the same row
    twice, the first result kept). For one row the BLAS takes its matrix-vector kernel, whose sums are in another
    order than its matrix kernel's (an AVX-512 CPU: 1-ulp differences between a row alone and in a batch; seen only
    where an input is one block wide, 64 or less, as in tiny test models: SmolLM2's 576-wide rows are 9 blocks)."""
    if x.shape[0] == 1:
        return torch.mm(torch.cat([x, x]), m)[:1]
    return torch.mm(x, m)


def rotation_signs(n: int) -> Tensor:
    """The seeded +-1 signs [n] of ``R = diag(signs) @ blockdiag(H, ..., H)``, the orthogonal rotation of an
    ``n``-wide input: ``x @ R`` spreads a few loud channels over their block, so a per-token scale no longer
    rounds the quiet ones away; ``W @ R`` is the weight that meets it."""
    return torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(n)).float() * 2 - 1


def kron_factors(block: int) -> Tuple[Tensor, Tensor]:
    """(H_a, H_b) with ``H_block = H_a (x) H_b`` (Sylvester's construction is a Kronecker power), b = min(block,
    64): a row block viewed as X [a, b] rotates as ``H_a @ X @ H_b``, (a + b) * block multiply-adds instead of
    block**2 (SmolLM2's 512-wide down_proj input: 36 K instead of 262 K per block, 16 KB of matrices, not 1 MB)."""
    b = min(block, KRON_INNER)
    return hadamard(block // b), hadamard(b)


def rotate(x: Tensor, block: int) -> Tensor:
    """``x @ R`` (``rotation_matrix``) without the dense matrix, in ``x``'s dtype: the signs, then each ``block`` of
    columns times H_block, ``n * block`` multiply-adds a row instead of ``n**2`` (a 3072-wide input in 512-blocks: 6x
    fewer). The same product as the dense one up to float rounding."""
    n = x.shape[-1]
    rows = (x * rotation_signs(n).to(x.dtype)).reshape(-1, block)  # one matrix product, not a batch of them
    return (rows @ hadamard(block).to(x.dtype)).reshape(x.shape)


def rotate_both_sides(m: Tensor, block: int) -> Tensor:
    """``R^T @ m @ R`` (an input Hessian as the rotated input meets it): ``rotate`` of ``m``, transposed, rotated
    and transposed back."""
    return rotate(rotate(m, block).t(), block).t()


def rotation_matrix(n: int, block: int) -> Tensor:
    """``R`` (``rotation_signs``) as a dense [n, n] matrix (for weights and statistics; the kernel applies it
    block by block)."""
    return rotation_signs(n).unsqueeze(1) * torch.block_diag(*([hadamard(block)] * (n // block)))
