"""Launchers for the Triton block-sparse attention kernels, and the look-up tables they walk.

Triton is imported on first launch (``kernels/_block_sparse_triton.py``), never at import
time, so CPU runs can set ``TRITON_INTERPRET=1`` first. Same contract as
``block_sparse_reference``: ``q, k, v`` ``[B, H, S, D]``, ``S`` a multiple of ``block``,
layout ``[H, S // block, S // block]``, optional additive ``bias`` broadcastable to
``[B, H, S, S]``, keys ``>= kv_len`` masked.
"""

from __future__ import annotations

from typing import Any

import torch

from dscompile.kernels import layout_cache


def build_lut(layout: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row and column look-up tables of a layout.

    Returns ``(cols, col_count, rows, row_count)``: ``cols[h, i, :col_count[h, i]]`` are the key
    blocks query block ``i`` visits (ascending), ``rows[h, j, :row_count[h, j]]`` the query
    blocks that visit key block ``j`` (for dk/dv). Above-diagonal blocks are dropped when causal.
    """
    lay = layout.bool()
    nb = lay.shape[-1]
    if causal:
        lay = lay & torch.ones(nb, nb, dtype=torch.bool, device=lay.device).tril()

    def table(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = m.sum(-1, dtype=torch.int32)
        width = max(int(counts.max().item()), 1)
        order = torch.argsort((~m).to(torch.int8), dim=-1, stable=True)[..., :width]
        return order.to(torch.int32).contiguous(), counts.contiguous()

    cols, col_count = table(lay)
    rows, row_count = table(lay.transpose(-1, -2))
    return cols, col_count, rows, row_count


def cached_lut(layout: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``build_lut`` once per layout (and ``causal``): every later call with that layout reuses the tables."""
    return layout_cache.cached("lut", layout, (causal,), lambda: build_lut(layout, causal))


def _kernels() -> Any:
    from dscompile.kernels import _block_sparse_triton

    return _block_sparse_triton


def _check(q: torch.Tensor, block: int) -> None:
    if block < 16 or block & (block - 1):
        raise ValueError(
            f"the Triton block-sparse kernel needs a power-of-two block >= 16, got {block}; "
            "use sparse_attention.block=16 (or more), or kernel='reference'"
        )
    if q.device.type != "cuda":
        import os

        if os.environ.get("TRITON_INTERPRET", "") != "1":
            raise RuntimeError(
                "the Triton block-sparse kernel got CPU tensors without TRITON_INTERPRET=1; set it before "
                "importing triton, or use sparse_attention.kernel='reference' (or 'flex') on CPU"
            )


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


def _dot_fp32(q: torch.Tensor) -> bool:
    return q.device.type != "cuda" and q.dtype == torch.bfloat16


def _bias_args(bias: torch.Tensor | None, like: torch.Tensor, shape: tuple[int, int, int, int]) -> tuple[torch.Tensor, list[int]]:
    if bias is None:
        return like, [0, 0, 0, 0]
    expanded = bias.expand(shape)
    return expanded, list(expanded.stride())


def _common(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> tuple[Any, ...]:
    b, h, s, d = q.shape
    bias_t, bias_strides = _bias_args(bias, q, (b, h, s, s))
    return bias_t, [*q.stride(), *k.stride(), *v.stride(), *bias_strides]


def _seed_value(seed: torch.Tensor | None, dropout_p: float) -> int:
    if dropout_p <= 0.0:
        return 0
    if seed is None:
        raise ValueError("dropout_p > 0 needs a seed tensor")
    return int(seed.item()) & 0x7FFFFFFF


def _as_kernel_dtype(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype == torch.float64 else x


def block_sparse_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: torch.Tensor,
    block: int,
    scale: float,
    *,
    bias: torch.Tensor | None = None,
    causal: bool = False,
    kv_len: int | None = None,
    dropout_p: float = 0.0,
    seed: torch.Tensor | None = None,
    lut: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton forward: output ``[B, H, S, D]`` in q's dtype and fp32 row log-sum-exp ``[B, H, S]``."""
    _check(q, block)
    kern = _kernels()
    in_dtype = q.dtype
    q, k, v = (_as_kernel_dtype(x) for x in (q, k, v))
    b, h, s, d = q.shape
    cols, col_count, _, _ = lut if lut is not None else cached_lut(layout_cache.on_device(layout, q.device), causal)
    out = torch.empty((b, h, s, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, s), dtype=torch.float32, device=q.device)
    bias_t, strides = _common(q, k, v, bias)
    grid = (s // block, b * h)
    kern.block_sparse_fwd_kernel[grid](
        q, k, v, bias_t, out, lse, cols, col_count,
        *strides, *out.stride(),
        cols.stride(0), cols.stride(1), col_count.stride(0),
        h, s, d, s if kv_len is None else kv_len, float(scale), float(dropout_p), _seed_value(seed, dropout_p),
        BLOCK=block, BLOCK_D=max(16, triton_next_pow2(d)),
        HAS_BIAS=bias is not None, CAUSAL=causal, DROPOUT=dropout_p > 0.0, PRECISION=_precision(q.dtype), DOT_FP32=_dot_fp32(q),
    )  # fmt: skip
    return out.to(in_dtype), lse


def block_sparse_attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    layout: torch.Tensor,
    block: int,
    scale: float,
    *,
    bias: torch.Tensor | None = None,
    causal: bool = False,
    kv_len: int | None = None,
    dropout_p: float = 0.0,
    seed: torch.Tensor | None = None,
    lut: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton backward: the rows' ``delta`` (one preprocess launch), dq from the row table, dk/dv from the column
    table; both block-sparse. Per call: three launches and no host read once the layout's tables are cached."""
    _check(q, block)
    kern = _kernels()
    dtypes = (q.dtype, k.dtype, v.dtype)
    q, k, v, grad_out = (_as_kernel_dtype(x) for x in (q, k, v, grad_out))
    b, h, s, d = q.shape
    cols, col_count, rows, row_count = lut if lut is not None else cached_lut(layout_cache.on_device(layout, q.device), causal)
    lse = lse.contiguous()
    grid = (s // block, b * h)
    block_d = max(16, triton_next_pow2(d))
    delta = torch.empty((b, h, s), dtype=torch.float32, device=q.device)
    kern.block_sparse_bwd_preprocess_kernel[grid](
        out, grad_out, delta, *out.stride(), *grad_out.stride(), h, s, d, BLOCK=block, BLOCK_D=block_d,
    )  # fmt: skip
    dq = torch.empty((b, h, s, d), dtype=q.dtype, device=q.device)
    dk = torch.empty_like(dq)
    dv = torch.empty_like(dq)
    bias_t, strides = _common(q, k, v, bias)
    common = dict(
        BLOCK=block, BLOCK_D=block_d,
        HAS_BIAS=bias is not None, CAUSAL=causal, DROPOUT=dropout_p > 0.0, PRECISION=_precision(q.dtype), DOT_FP32=_dot_fp32(q),
    )  # fmt: skip
    scalars = (h, s, d, s if kv_len is None else kv_len, float(scale), float(dropout_p), _seed_value(seed, dropout_p))
    kern.block_sparse_bwd_dkdv_kernel[grid](
        q, k, v, bias_t, grad_out, lse, delta, dk, dv, rows, row_count,
        *strides, *grad_out.stride(), rows.stride(0), rows.stride(1), row_count.stride(0), *scalars, **common,
    )  # fmt: skip
    kern.block_sparse_bwd_dq_kernel[grid](
        q, k, v, bias_t, grad_out, lse, delta, dq, cols, col_count,
        *strides, *grad_out.stride(), cols.stride(0), cols.stride(1), col_count.stride(0), *scalars, **common,
    )  # fmt: skip
    return dq.to(dtypes[0]), dk.to(dtypes[1]), dv.to(dtypes[2])


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
