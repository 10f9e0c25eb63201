"""The plain reference for 1-bit compression: one row at a time, one bit position at a time.

A row of ``n`` values (``n`` a multiple of 8) is sent as its signs, 8 to a byte, and one scale,
``||row|| / sqrt(n)``: the scale that keeps the row's norm when every value becomes ``±scale``.
Bit ``7 - j`` of byte ``b`` holds value ``8 * b + j`` (the first value is the most significant
bit, as ``numpy.packbits``); a set bit means ``+scale`` (the value was ``>= 0``), a clear bit
``-scale``. With error feedback the row first absorbs the error left by the previous
compression, and the new error is what this compression loses.

This file is the oracle the fast paths (``kernels/onebit.py``: vectorized torch and Triton) are
tested against; it favours obviousness over speed.
"""

from __future__ import annotations

import math

import torch


def compress_reference(x: torch.Tensor, error: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` ``[rows, n]`` -> ``(packed uint8 [rows, n // 8], scales fp32 [rows], new_error [rows, n])``."""
    rows, n = x.shape
    packed = torch.zeros(rows, n // 8, dtype=torch.uint8)
    scales = torch.zeros(rows, dtype=torch.float32)
    new_error = torch.zeros(rows, n, dtype=torch.float32)
    for r in range(rows):
        y = x[r].float() if error is None else x[r].float() + error[r].float()
        scale = torch.linalg.vector_norm(y) / math.sqrt(n)
        positive = ~(y < 0)  # NaN counts as positive, like ``sign(y) + 1 != 0``
        for j in range(8):
            packed[r] |= positive[j::8].to(torch.uint8) << (7 - j)
        scales[r] = scale
        new_error[r] = torch.where(positive, y - scale, y + scale)
    return packed, scales, new_error


def decompress_reference(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``packed`` ``[rows, n // 8]`` and ``scales`` ``[rows]`` -> ``±scale`` values ``[rows, n]``."""
    rows, nbytes = packed.shape
    out = torch.zeros(rows, nbytes * 8, dtype=torch.float32)
    for r in range(rows):
        for j in range(8):
            bit = (packed[r] >> (7 - j)) & 1
            out[r, j::8] = torch.where(bit == 1, scales[r], -scales[r])
    return out


def decompress_mean_reference(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The mean over ``k`` compressed copies: ``packed`` ``[k, rows, n // 8]``, ``scales`` ``[k, rows]`` -> ``[rows, n]``."""
    total = decompress_reference(packed[0], scales[0])
    for i in range(1, packed.shape[0]):
        total = total + decompress_reference(packed[i], scales[i])
    return total / packed.shape[0]
