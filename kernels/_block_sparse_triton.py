"""Triton kernels for block-sparse attention (imported lazily by ``block_sparse_attention``).

Each program owns one ``BLOCK``-row tile of one (batch, head) and walks only the key blocks
(forward, dq) or query blocks (dk/dv) that the look-up table lists for it, with the online
softmax of FlashAttention: running max, running sum, rescaled accumulator. Scores and the
softmax are fp32 whatever the input dtype. Dropout draws Philox numbers from (seed, position),
so the backward regenerates exactly the forward's mask.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    # The interpreter multiplies bf16 tiles wrongly; DOT_FP32 upcasts them first (CPU tests only).
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _tile(Ptr, b, h, idx, offs_d, dmask, sb, sh, ss, sd):
    return tl.load(Ptr + b * sb + h * sh + idx[:, None] * ss + offs_d[None, :] * sd, mask=dmask, other=0.0)


@triton.jit
def _scores(
    q,
    k,
    rows,
    cols,
    b,
    h,
    Bias,
    stride_bb,
    stride_bh,
    stride_bm,
    stride_bn,
    kv_len,
    scale,
    HAS_BIAS: tl.constexpr,
    CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    s = _dot(q, tl.trans(k), PRECISION, DOT_FP32) * scale
    if HAS_BIAS:
        bias_ptrs = Bias + b * stride_bb + h * stride_bh + rows[:, None] * stride_bm + cols[None, :] * stride_bn
        s += tl.load(bias_ptrs).to(tl.float32)
    valid = cols[None, :] < kv_len
    if CAUSAL:
        valid = valid & (cols[None, :] <= rows[:, None])
    return tl.where(valid, s, float("-inf"))


@triton.jit
def _keep(seed, bh, rows, cols, S, dropout_p):
    offsets = (bh * S + rows[:, None]) * S + cols[None, :]
    return tl.rand(seed, offsets) >= dropout_p


@triton.jit
def block_sparse_fwd_kernel(
    Q, K, V, Bias, Out, Lse, LutCols, LutCount,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_ob, stride_oh, stride_os, stride_od,
    lut_stride_h, lut_stride_r, cnt_stride_h,
    H, S, D, kv_len, scale, dropout_p, seed,
    BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = i * BLOCK + tl.arange(0, BLOCK)
    offs_n = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d[None, :] < D
    q = _tile(Q, b, h, rows, offs_d, dmask, stride_qb, stride_qh, stride_qs, stride_qd)
    m_i = tl.full([BLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, BLOCK_D], tl.float32)
    count = tl.load(LutCount + h * cnt_stride_h + i)
    for t in range(0, count):
        j = tl.load(LutCols + h * lut_stride_h + i * lut_stride_r + t)
        cols = j * BLOCK + offs_n
        k = _tile(K, b, h, cols, offs_d, dmask, stride_kb, stride_kh, stride_ks, stride_kd)
        v = _tile(V, b, h, cols, offs_d, dmask, stride_vb, stride_vh, stride_vs, stride_vd)
        s = _scores(q, k, rows, cols, b, h, Bias, stride_bb, stride_bh, stride_bm, stride_bn, kv_len, scale,
                    HAS_BIAS, CAUSAL, PRECISION, DOT_FP32)  # fmt: skip
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            p = tl.where(_keep(seed, bh, rows, cols, S, dropout_p), p / (1.0 - dropout_p), 0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, DOT_FP32)
        m_i = m_new
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("inf"), tl.where(m_i == float("-inf"), 0.0, m_i) + tl.log(l_i))
    tl.store(Out + b * stride_ob + h * stride_oh + rows[:, None] * stride_os + offs_d[None, :] * stride_od,
             out.to(Out.dtype.element_ty), mask=dmask)  # fmt: skip
    tl.store(Lse + bh * S + rows, lse)


@triton.jit
def block_sparse_bwd_preprocess_kernel(
    Out, DO, Delta,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_dob, stride_doh, stride_dos, stride_dod,
    H, S, D,
    BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Delta = rowsum(dO * O) in fp32, read in the inputs' own dtype: one launch where casts, a product and a sum took four."""
    i = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = i * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d[None, :] < D
    o = _tile(Out, b, h, rows, offs_d, dmask, stride_ob, stride_oh, stride_os, stride_od).to(tl.float32)
    do = _tile(DO, b, h, rows, offs_d, dmask, stride_dob, stride_doh, stride_dos, stride_dod).to(tl.float32)
    tl.store(Delta + bh * S + rows, tl.sum(o * do, 1))


@triton.jit
def block_sparse_bwd_dkdv_kernel(
    Q, K, V, Bias, DO, Lse, Delta, DK, DV, LutRows, LutCount,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_dob, stride_doh, stride_dos, stride_dod,
    lut_stride_h, lut_stride_r, cnt_stride_h,
    H, S, D, kv_len, scale, dropout_p, seed,
    BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):  # fmt: skip
    j = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    cols = j * BLOCK + tl.arange(0, BLOCK)
    offs_m = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d[None, :] < D
    k = _tile(K, b, h, cols, offs_d, dmask, stride_kb, stride_kh, stride_ks, stride_kd)
    v = _tile(V, b, h, cols, offs_d, dmask, stride_vb, stride_vh, stride_vs, stride_vd)
    dk = tl.zeros([BLOCK, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK, BLOCK_D], tl.float32)
    count = tl.load(LutCount + h * cnt_stride_h + j)
    for t in range(0, count):
        i = tl.load(LutRows + h * lut_stride_h + j * lut_stride_r + t)
        rows = i * BLOCK + offs_m
        q = _tile(Q, b, h, rows, offs_d, dmask, stride_qb, stride_qh, stride_qs, stride_qd)
        do = _tile(DO, b, h, rows, offs_d, dmask, stride_dob, stride_doh, stride_dos, stride_dod)  # fmt: skip
        lse = tl.load(Lse + bh * S + rows)
        delta = tl.load(Delta + bh * S + rows)
        s = _scores(q, k, rows, cols, b, h, Bias, stride_bb, stride_bh, stride_bm, stride_bn, kv_len, scale,
                    HAS_BIAS, CAUSAL, PRECISION, DOT_FP32)  # fmt: skip
        p = tl.exp(s - lse[:, None])
        dp = _dot(do, tl.trans(v), PRECISION, DOT_FP32)
        if DROPOUT:
            keep = _keep(seed, bh, rows, cols, S, dropout_p)
            pd = tl.where(keep, p / (1.0 - dropout_p), 0.0)
            dp = tl.where(keep, dp / (1.0 - dropout_p), 0.0)
        else:
            pd = p
        dv += _dot(tl.trans(pd.to(do.dtype)), do, PRECISION, DOT_FP32)
        ds = p * (dp - delta[:, None]) * scale
        dk += _dot(tl.trans(ds.to(q.dtype)), q, PRECISION, DOT_FP32)
    base = bh * S * D + cols[:, None] * D + offs_d[None, :]
    tl.store(DK + base, dk.to(DK.dtype.element_ty), mask=dmask)
    tl.store(DV + base, dv.to(DV.dtype.element_ty), mask=dmask)


@triton.jit
def block_sparse_bwd_dq_kernel(
    Q, K, V, Bias, DO, Lse, Delta, DQ, LutCols, LutCount,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_dob, stride_doh, stride_dos, stride_dod,
    lut_stride_h, lut_stride_r, cnt_stride_h,
    H, S, D, kv_len, scale, dropout_p, seed,
    BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = i * BLOCK + tl.arange(0, BLOCK)
    offs_n = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d[None, :] < D
    q = _tile(Q, b, h, rows, offs_d, dmask, stride_qb, stride_qh, stride_qs, stride_qd)
    do = _tile(DO, b, h, rows, offs_d, dmask, stride_dob, stride_doh, stride_dos, stride_dod)  # fmt: skip
    lse = tl.load(Lse + bh * S + rows)
    delta = tl.load(Delta + bh * S + rows)
    dq = tl.zeros([BLOCK, BLOCK_D], tl.float32)
    count = tl.load(LutCount + h * cnt_stride_h + i)
    for t in range(0, count):
        j = tl.load(LutCols + h * lut_stride_h + i * lut_stride_r + t)
        cols = j * BLOCK + offs_n
        k = _tile(K, b, h, cols, offs_d, dmask, stride_kb, stride_kh, stride_ks, stride_kd)
        v = _tile(V, b, h, cols, offs_d, dmask, stride_vb, stride_vh, stride_vs, stride_vd)
        s = _scores(q, k, rows, cols, b, h, Bias, stride_bb, stride_bh, stride_bm, stride_bn, kv_len, scale,
                    HAS_BIAS, CAUSAL, PRECISION, DOT_FP32)  # fmt: skip
        p = tl.exp(s - lse[:, None])
        dp = _dot(do, tl.trans(v), PRECISION, DOT_FP32)
        if DROPOUT:
            dp = tl.where(_keep(seed, bh, rows, cols, S, dropout_p), dp / (1.0 - dropout_p), 0.0)
        ds = p * (dp - delta[:, None]) * scale
        dq += _dot(ds.to(k.dtype), k, PRECISION, DOT_FP32)
    tl.store(DQ + bh * S * D + rows[:, None] * D + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=dmask)


__all__ = ["block_sparse_fwd_kernel", "block_sparse_bwd_preprocess_kernel", "block_sparse_bwd_dkdv_kernel", "block_sparse_bwd_dq_kernel", "triton"]
