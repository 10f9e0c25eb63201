"""1-bit compression with error feedback: pack signs 8 to a byte with one scale per row, and back.

Same contract as ``kernels/onebit_reference.py`` (bit order, ``scale = ||row|| / sqrt(n)``, a
value ``>= 0`` (or NaN) is ``+scale``), in two fast implementations:

- ``"torch"``: vectorized torch ops, for CPU tensors (and anywhere Triton cannot run);
- ``"triton"``: one Triton kernel per direction (``kernels/_onebit_triton.py``): compression
  reads ``x`` and the error once for the norm and once to pack, writing the signs and the new
  error in the same pass; decompression unpacks and averages ``k`` sources in one pass.

``impl=None`` picks Triton for CUDA tensors and torch otherwise. Triton is imported on first
use only, so CPU runs can set ``TRITON_INTERPRET=1`` first.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

IMPLS = ("torch", "triton")
_BIT_WEIGHTS: dict[torch.device, torch.Tensor] = {}
_SHIFTS: dict[torch.device, torch.Tensor] = {}


def compress(x: torch.Tensor, error: torch.Tensor | None = None, impl: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Compress each row of ``x`` ``[rows, n]`` (fp32, ``n % 8 == 0``) to ``(packed uint8 [rows, n // 8], scales fp32 [rows])``.

    With ``error`` (fp32, shaped like ``x``) the row compressed is ``x + error``, and ``error`` is
    overwritten in place with what the compression lost (error feedback)."""
    _check_rows(x, "x")
    if error is not None and (error.shape != x.shape or error.dtype != torch.float32 or not error.is_contiguous()):
        raise ValueError(f"error must be a contiguous fp32 tensor shaped like x {tuple(x.shape)}, got {error.dtype} {tuple(error.shape)}")
    if _pick(impl, x) == "triton":
        return _triton().compress(x.contiguous(), error)
    y = x if error is None else x + error
    n = x.shape[1]
    scales = torch.linalg.vector_norm(y, dim=1) / math.sqrt(n)
    negative = y < 0
    packed = (~negative).view(x.shape[0], n // 8, 8).to(torch.uint8).mul_(_bit_weights(x.device)).sum(-1, dtype=torch.uint8)
    if error is not None:
        s = scales.unsqueeze(1)
        torch.where(negative, y + s, y - s, out=error)
    return packed, scales


def decompress(packed: torch.Tensor, scales: torch.Tensor, impl: str | None = None) -> torch.Tensor:
    """``packed`` uint8 ``[rows, n // 8]``, ``scales`` ``[rows]`` -> fp32 ``[rows, n]`` of ``±scale``."""
    return decompress_mean(packed.unsqueeze(0), scales.unsqueeze(0), impl)


def decompress_mean(packed: torch.Tensor, scales: torch.Tensor, impl: str | None = None) -> torch.Tensor:
    """The mean of ``k`` compressed tensors: ``packed`` ``[k, rows, n // 8]``, ``scales`` ``[k, rows]`` -> fp32 ``[rows, n]``."""
    if packed.dim() != 3 or packed.dtype != torch.uint8:
        raise ValueError(f"packed must be uint8 [k, rows, n // 8], got {packed.dtype} {tuple(packed.shape)}")
    if scales.shape != packed.shape[:2]:
        raise ValueError(f"scales must be shaped [k, rows] = {tuple(packed.shape[:2])}, got {tuple(scales.shape)}")
    if _pick(impl, packed) == "triton":
        return _triton().decompress_mean(packed.contiguous(), scales.float().contiguous())
    k, rows, nbytes = packed.shape
    positive = (packed.unsqueeze(-1) >> _shifts(packed.device)) & 1
    s = scales.float().view(k, rows, 1, 1)
    values = torch.where(positive.bool(), s, -s).view(k, rows, nbytes * 8)
    return values[0] if k == 1 else values.sum(0) / k


def _check_rows(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2 or x.dtype != torch.float32:
        raise ValueError(f"{name} must be a 2-D fp32 tensor [rows, n], got {x.dtype} {tuple(x.shape)}")
    if x.shape[1] % 8:
        raise ValueError(f"{name} rows must hold a multiple of 8 values (signs are packed 8 to a byte), got {x.shape[1]}; pad them")


def _pick(impl: str | None, like: torch.Tensor) -> str:
    if impl is None:
        return "triton" if like.device.type == "cuda" else "torch"
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS} or None, got {impl!r}")
    if impl == "triton" and like.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "") != "1":
        raise RuntimeError("the Triton 1-bit kernels got CPU tensors without TRITON_INTERPRET=1; set it before importing triton, or use impl='torch' on CPU")
    return impl


def _bit_weights(device: torch.device) -> torch.Tensor:
    if device not in _BIT_WEIGHTS:
        _BIT_WEIGHTS[device] = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=device)
    return _BIT_WEIGHTS[device]


def _shifts(device: torch.device) -> torch.Tensor:
    if device not in _SHIFTS:
        _SHIFTS[device] = torch.arange(7, -1, -1, dtype=torch.uint8, device=device)
    return _SHIFTS[device]


def _triton() -> Any:
    from dscompile.kernels import _onebit_triton

    return _onebit_triton
