"""Triton kernel for the rotary embedding (imported lazily by ``rotary_embedding_triton``).

One program per block of rows (the leading dims of ``x``, up to four, indexed through their strides
so that ``cos``/``sin`` broadcast with stride 0 and are never expanded in memory). Each row
computes ``[x1 * c1 - x2 * s1, x2 * c2 + x1 * s2]`` over its first ``rotary_dim`` channels and copies
the rest. Each product and each sum is computed in fp32 and rounded to the output dtype, as eager
PyTorch does for fp16/bf16 (a product of two half-precision numbers is exact in fp32, and fp32 is
wide enough that rounding twice equals rounding once), and the launch passes
``enable_fp_fusion=False`` so the compiler does not contract a product and a sum into one FMA: the
same bits as ``kernels.rotary.rotary_embedding`` in fp32, fp16 and bf16. (Rounding through fp32
also keeps bf16 away from the interpreter's bf16 arithmetic, which is wrong.)
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _offset(r, N1, N2, N3, s0, s1, s2, s3):
    """Offset of flat row ``r`` in a tensor of leading sizes ``(N0, N1, N2, N3)`` with the given strides."""
    i3 = r % N3
    r = r // N3
    i2 = r % N2
    r = r // N2
    i1 = r % N1
    i0 = r // N1
    return i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3


@triton.jit
def _mul(a, b, dtype: tl.constexpr):
    return (a * b).to(dtype).to(tl.float32)


@triton.jit
def _add(a, b, dtype: tl.constexpr):
    return (a + b).to(dtype)


@triton.jit
def _sub(a, b, dtype: tl.constexpr):
    return (a - b).to(dtype)


@triton.jit
def rotary_kernel(
    X,
    Cos,
    Sin,
    Out,
    ROWS,
    N1,
    N2,
    N3,
    sx0,
    sx1,
    sx2,
    sx3,
    sxd,
    sc0,
    sc1,
    sc2,
    sc3,
    scd,
    ss0,
    ss1,
    ss2,
    ss3,
    ssd,
    so0,
    so1,
    so2,
    so3,
    sod,
    HALF,
    REST,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_REST: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # int64 offsets: big prefills
    row_ok = rows < ROWS
    x_row = X + _offset(rows, N1, N2, N3, sx0, sx1, sx2, sx3)[:, None]
    c_row = Cos + _offset(rows, N1, N2, N3, sc0, sc1, sc2, sc3)[:, None]
    s_row = Sin + _offset(rows, N1, N2, N3, ss0, ss1, ss2, ss3)[:, None]
    o_row = Out + _offset(rows, N1, N2, N3, so0, so1, so2, so3)[:, None]
    j = tl.arange(0, BLOCK_H)[None, :]
    ok = row_ok[:, None] & (j < HALF)
    dtype = Out.dtype.element_ty
    x1 = tl.load(x_row + j * sxd, mask=ok, other=0.0).to(dtype).to(tl.float32)
    x2 = tl.load(x_row + (j + HALF) * sxd, mask=ok, other=0.0).to(dtype).to(tl.float32)
    c1 = tl.load(c_row + j * scd, mask=ok, other=0.0).to(dtype).to(tl.float32)
    c2 = tl.load(c_row + (j + HALF) * scd, mask=ok, other=0.0).to(dtype).to(tl.float32)
    s1 = tl.load(s_row + j * ssd, mask=ok, other=0.0).to(dtype).to(tl.float32)
    s2 = tl.load(s_row + (j + HALF) * ssd, mask=ok, other=0.0).to(dtype).to(tl.float32)
    tl.store(o_row + j * sod, _sub(_mul(x1, c1, dtype), _mul(x2, s1, dtype), dtype), mask=ok)
    tl.store(o_row + (j + HALF) * sod, _add(_mul(x2, c2, dtype), _mul(x1, s2, dtype), dtype), mask=ok)
    if BLOCK_REST > 0:  # partial rotary: the channels after rotary_dim pass through
        r = tl.arange(0, BLOCK_REST)[None, :]
        rest_ok = row_ok[:, None] & (r < REST)
        tail = tl.load(x_row + (2 * HALF + r) * sxd, mask=rest_ok, other=0.0)
        tl.store(o_row + (2 * HALF + r) * sod, tail.to(Out.dtype.element_ty), mask=rest_ok)
