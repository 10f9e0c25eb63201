"""Triton kernels for attention over a static KV cache (imported lazily by ``cache_attention``).

Flash-decoding: one program per (batch, KV head, block of rows, split of the keys). The rows of a
program are the ``rep * queries`` (query head, query) pairs of the query heads sharing one KV head,
so each key/value tile is loaded once for all of them (no repeat of the cache). Before any key is
read, the program scans its rows of the boolean mask for the first and last attended column; its
split of that range is all it walks, and inside it a key block that none of its rows attends is
skipped without loading K or V. Key/value loads are masked to attended columns, so nothing past the
valid prefix (or in left padding) is ever read: a masked column contributes exactly 0 even if the
cache holds NaN there. All bounds live on the device: no host read, so the launch can be captured
in a CUDA graph. Scores and the online softmax (running max, running sum, rescaled accumulator)
are fp32 whatever the input dtype. With several splits, ``combine`` merges the partial results by
their maxima and sums (log-sum-exp).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr):
    # fp32 inputs: IEEE products (no TF32); fp16/bf16: tensor cores, fp32 accumulation.
    # The interpreter multiplies bf16 tiles wrongly: DOT_FP32 upcasts first (CPU tests only).
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def cache_attention_kernel(
    Q,
    K,
    V,
    Mask,
    Out,
    Part,
    Stats,
    sqb,
    sqh,
    sqq,
    sqd,
    skb,
    skh,
    sks,
    skd,
    svb,
    svh,
    svs,
    svd,
    smb,
    smh,
    smq,
    sms,
    sob,
    soh,
    soq,
    sod,
    KV_HEADS,
    QUERIES,
    ROWS,
    SLOTS,
    DIM,
    DIM_V,
    REP,
    scale,
    SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    pid_bg = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = (pid_bg // KV_HEADS).to(tl.int64)  # offsets past 2**31 elements in big caches
    g = pid_bg % KV_HEADS
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < ROWS
    head = g * REP + rows // QUERIES
    query = rows % QUERIES
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_rows = Mask + b * smb + head[:, None] * smh + query[:, None] * smq

    # the attended column range of these rows, read from the mask on the device
    lo = tl.full([], SLOTS, tl.int32)
    hi = tl.zeros([], tl.int32)
    for n0 in range(0, SLOTS, BLOCK_N):
        cols = n0 + offs_n
        allowed = tl.load(mask_rows + cols[None, :] * sms, mask=row_ok[:, None] & (cols[None, :] < SLOTS), other=0) != 0
        hi = tl.maximum(hi, tl.max(tl.max(tl.where(allowed, cols[None, :] + 1, 0), axis=1), axis=0))
        lo = tl.minimum(lo, tl.min(tl.min(tl.where(allowed, cols[None, :], SLOTS), axis=1), axis=0))
    lo = (lo // BLOCK_N) * BLOCK_N
    span = tl.maximum(hi - lo, 0)
    chunk = ((span + SPLITS * BLOCK_N - 1) // (SPLITS * BLOCK_N)) * BLOCK_N
    start = lo + pid_s * chunk
    end = tl.minimum(start + chunk, hi)

    q = tl.load(Q + b * sqb + head[:, None] * sqh + query[:, None] * sqq + offs_d[None, :] * sqd, mask=row_ok[:, None] & (offs_d[None, :] < DIM), other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + offs_n
        allowed = tl.load(mask_rows + cols[None, :] * sms, mask=row_ok[:, None] & (cols[None, :] < end), other=0) != 0
        col_any = tl.max(allowed.to(tl.int32), axis=0) > 0
        if tl.max(col_any.to(tl.int32), axis=0) > 0:  # a key block no row attends is not read at all
            k = tl.load(K + b * skb + g * skh + cols[:, None] * sks + offs_d[None, :] * skd, mask=col_any[:, None] & (offs_d[None, :] < DIM), other=0.0)
            s = _dot(q, tl.trans(k), DOT_FP32) * scale
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing attended yet
            alpha = tl.exp(m_i - m_safe)
            p = tl.where(allowed, tl.exp(s - m_safe[:, None]), 0.0)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(V + b * svb + g * svh + cols[:, None] * svs + offs_dv[None, :] * svd, mask=col_any[:, None] & (offs_dv[None, :] < DIM_V), other=0.0)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_FP32)
            m_i = m_new

    dv_ok = row_ok[:, None] & (offs_dv[None, :] < DIM_V)
    if SPLITS == 1:
        out = tl.where(l_i[:, None] == 0, 0.0, acc / tl.where(l_i == 0, 1.0, l_i)[:, None])  # a row attending nothing: 0, as SDPA (NaN stays NaN)
        tl.store(Out + b * sob + head[:, None] * soh + query[:, None] * soq + offs_dv[None, :] * sod, out.to(Out.dtype.element_ty), mask=dv_ok)
    else:
        slot = (pid_bg * ROWS + rows) * SPLITS + pid_s
        tl.store(Part + slot[:, None] * DIM_V + offs_dv[None, :], acc, mask=dv_ok)
        tl.store(Stats + slot * 2, m_i, mask=row_ok)
        tl.store(Stats + slot * 2 + 1, l_i, mask=row_ok)


@triton.jit
def combine_kernel(
    Part,
    Stats,
    Out,
    sob,
    soh,
    soq,
    sod,
    KV_HEADS,
    QUERIES,
    ROWS,
    DIM_V,
    REP,
    SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """One row: the splits' partial sums rescaled to their common maximum, added, normalised."""
    pid_bg = tl.program_id(0)
    row = tl.program_id(1)
    b = (pid_bg // KV_HEADS).to(tl.int64)  # offsets past 2**31 elements in big caches
    g = pid_bg % KV_HEADS
    head = g * REP + row // QUERIES
    query = row % QUERIES
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    s_ok = offs_s < SPLITS
    slot = (pid_bg * ROWS + row) * SPLITS + offs_s
    m = tl.load(Stats + slot * 2, mask=s_ok, other=float("-inf"))
    l_s = tl.load(Stats + slot * 2 + 1, mask=s_ok, other=0.0)
    m_max = tl.max(m, axis=0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(s_ok, tl.exp(m - m_safe), 0.0)
    total = tl.sum(w * l_s, axis=0)
    part = tl.load(Part + slot[:, None] * DIM_V + offs_dv[None, :], mask=s_ok[:, None] & (offs_dv[None, :] < DIM_V), other=0.0)
    acc = tl.sum(w[:, None] * part, axis=0)
    out = tl.where(total == 0, 0.0, acc / tl.where(total == 0, 1.0, total))
    tl.store(Out + b * sob + head * soh + query * soq + offs_dv * sod, out.to(Out.dtype.element_ty), mask=offs_dv < DIM_V)
