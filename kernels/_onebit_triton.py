"""Triton kernels for 1-bit compression (imported lazily by ``kernels/onebit.py``).

``compress``: one program per row. The first loop sums the squares of ``x + error`` for the
scale; the second loads ``BYTES x 8`` tiles, folds each tile row of signs into a byte and
writes the new error (``x + error - ±scale``) in the same pass. ``decompress_mean``: one program
per (row, tile of bytes) unpacks the ``k`` sources' bits and averages ``±scale`` in registers.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BYTES = 128
"""Bytes (x 8 values) one tile of a program handles."""


@triton.jit
def _compress_kernel(X, Err, Packed, Scales, n, sqrt_n, HAS_ERROR: tl.constexpr, BYTES: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * n
    nbytes = n // 8
    j = tl.arange(0, 8)
    acc = tl.zeros([BYTES, 8], dtype=tl.float32)
    for start in range(0, nbytes, BYTES):
        b = start + tl.arange(0, BYTES)
        offs = base + b[:, None] * 8 + j[None, :]
        mask = (b < nbytes)[:, None] & (j < 8)[None, :]
        y = tl.load(X + offs, mask=mask, other=0.0)
        if HAS_ERROR:
            y += tl.load(Err + offs, mask=mask, other=0.0)
        acc += y * y
    scale = tl.sqrt(tl.sum(tl.sum(acc, axis=1), axis=0)) / sqrt_n
    tl.store(Scales + row, scale)
    weights = (1 << (7 - j)).to(tl.int32)
    for start in range(0, nbytes, BYTES):
        b = start + tl.arange(0, BYTES)
        offs = base + b[:, None] * 8 + j[None, :]
        mask = (b < nbytes)[:, None] & (j < 8)[None, :]
        y = tl.load(X + offs, mask=mask, other=0.0)
        if HAS_ERROR:
            y += tl.load(Err + offs, mask=mask, other=0.0)
        negative = y < 0
        bits = tl.where(negative, 0, weights[None, :])
        byte = tl.sum(bits, axis=1)
        tl.store(Packed + row * nbytes + b, byte.to(tl.uint8), mask=b < nbytes)
        if HAS_ERROR:
            tl.store(Err + offs, tl.where(negative, y + scale, y - scale), mask=mask)


@triton.jit
def _decompress_mean_kernel(Packed, Scales, Out, rows, nbytes, k, BYTES: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1) * BYTES + tl.arange(0, BYTES)
    j = tl.arange(0, 8)
    bmask = b < nbytes
    acc = tl.zeros([BYTES, 8], dtype=tl.float32)
    for src in range(0, k):
        byte = tl.load(Packed + (src * rows + row) * nbytes + b, mask=bmask, other=0).to(tl.int32)
        s = tl.load(Scales + src * rows + row)
        bit = (byte[:, None] >> (7 - j)[None, :]) & 1
        acc += tl.where(bit == 1, s, -s)
    acc = acc / k
    offs = row * nbytes * 8 + b[:, None] * 8 + j[None, :]
    tl.store(Out + offs, acc, mask=bmask[:, None] & (j < 8)[None, :])


def compress(x: torch.Tensor, error: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    rows, n = x.shape
    packed = torch.empty(rows, n // 8, dtype=torch.uint8, device=x.device)
    scales = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        _compress_kernel[(rows,)](x, x if error is None else error, packed, scales, n, math.sqrt(n), HAS_ERROR=error is not None, BYTES=BYTES)
    return packed, scales


def decompress_mean(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    k, rows, nbytes = packed.shape
    out = torch.empty(rows, nbytes * 8, dtype=torch.float32, device=packed.device)
    if rows and nbytes:
        _decompress_mean_kernel[(rows, triton.cdiv(nbytes, BYTES))](packed, scales, out, rows, nbytes, k, BYTES=BYTES)
    return out
