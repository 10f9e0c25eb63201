"""Weight-only quantized matmul: ``x @ dequantize(W).T + bias`` with W stored as a ``PackedWeight``.

Three spellings of the same product:

- ``quantized_matmul_reference``: dequantize the whole weight (``kernels.quantize.dequantize``),
  then ``F.linear``; the numerics contract.
- ``quantized_matmul_torch``: the CPU path. Plain torch ops (unpack with shifts and masks, scale per
  group by broadcasting, matmul), so Inductor fuses the unpacking and dequantization into one
  kernel feeding the matmul when a model holding quantized layers is compiled.
- ``quantized_matmul_triton``: a Triton kernel that dequantizes tiles of W inside the K loop
  (int8 codes, or 4-/2-bit codes unpacked from bytes), so the float weight never exists in
  memory; the GPU path (and, with ``TRITON_INTERPRET=1``, testable on CPU).

``quantized_matmul`` picks the Triton kernel for CUDA tensors and the torch path otherwise. The
inference engine and ``dscompile.compression.redundancy_clean``'s quantized layers both call it.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import torch.nn.functional as F

from dscompile.kernels.quantize import PackedWeight, code_offset, codes_per_byte, dequantize


def quantized_matmul_reference(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize all of W, then an ordinary linear."""
    w = dequantize(packed).reshape(packed.rows, packed.columns).to(x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def dequantize_torch(packed: PackedWeight, dtype: torch.dtype) -> torch.Tensor:
    """``[N, K]`` float weight from packed codes, written for Inductor (no gathers, no Python loops)."""
    rows, columns, bits = packed.rows, packed.columns, packed.bits
    if bits == 8:
        codes = packed.data.to(torch.float32)
    else:
        per = codes_per_byte(bits)
        shifts = torch.arange(per, dtype=torch.int32, device=packed.data.device) * bits
        unpacked = (packed.data.to(torch.int32).unsqueeze(-1) >> shifts) & (2**bits - 1)
        codes = unpacked.reshape(rows, -1)[:, :columns].to(torch.float32) - code_offset(bits, packed.symmetric)
    groups = columns // packed.group_size
    grouped = codes.reshape(rows, groups, packed.group_size) * packed.scale.unsqueeze(-1)
    if packed.zero is not None:
        grouped = grouped + packed.zero.unsqueeze(-1)
    return grouped.reshape(rows, columns).to(dtype)


def quantized_matmul_torch(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU path: dequantize with plain torch ops, then ``F.linear``."""
    return F.linear(x, dequantize_torch(packed, x.dtype), None if bias is None else bias.to(x.dtype))


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def quantized_matmul_kernel(
        x_ptr,
        w_ptr,
        scale_ptr,
        zero_ptr,
        bias_ptr,
        out_ptr,
        M,
        N,
        K,
        sxm,
        sxk,
        swn,
        swk,
        ssn,
        ssg,
        som,
        son,
        BITS: tl.constexpr,
        PER_BYTE: tl.constexpr,
        OFFSET: tl.constexpr,
        GROUP: tl.constexpr,
        HAS_ZERO: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + rk
            x = tl.load(x_ptr + rm[:, None] * sxm + ks[None, :] * sxk, mask=(rm[:, None] < M) & (ks[None, :] < K), other=0.0)
            w_mask = (ks[:, None] < K) & (rn[None, :] < N)
            raw = tl.load(w_ptr + rn[None, :] * swn + (ks[:, None] // PER_BYTE) * swk, mask=w_mask, other=0)
            if PER_BYTE == 1:
                codes = raw.to(tl.float32)
            else:
                shift = ((ks[:, None] % PER_BYTE) * BITS).to(tl.int32)
                codes = ((raw.to(tl.int32) >> shift) & ((1 << BITS) - 1)).to(tl.float32) - OFFSET
            group = ks[:, None] // GROUP
            scale = tl.load(scale_ptr + rn[None, :] * ssn + group * ssg, mask=w_mask, other=0.0)
            w = codes * scale
            if HAS_ZERO:
                w += tl.load(zero_ptr + rn[None, :] * ssn + group * ssg, mask=w_mask, other=0.0)
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee", out_dtype=tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rm[:, None] * som + rn[None, :] * son, acc.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))

    return quantized_matmul_kernel


def triton_available(x: torch.Tensor) -> bool:
    """The Triton kernel runs on CUDA tensors, or anywhere under Triton's interpreter."""
    return x.is_cuda or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def quantized_matmul_triton(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize tiles of W inside the matmul's K loop (one Triton kernel)."""
    if not triton_available(x):
        raise RuntimeError("the Triton quantized matmul needs a CUDA tensor or TRITON_INTERPRET=1 set before triton is imported")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    m, k = x2.shape
    n = packed.rows
    if k != packed.columns:
        raise ValueError(f"input has {k} features, the quantized weight {packed.columns}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    interpreting = not x.is_cuda
    bm, bn, bk = (16, 16, 32) if interpreting else (64, 64, 64)
    per = 1 if packed.bits == 8 else codes_per_byte(packed.bits)
    grid = ((m + bm - 1) // bm, (n + bn - 1) // bn)
    zero = packed.zero if packed.zero is not None else packed.scale
    _kernel()[grid](
        x2,
        packed.data,
        packed.scale,
        zero,
        bias if bias is not None else out,
        out,
        m,
        n,
        k,
        x2.stride(0),
        x2.stride(1),
        packed.data.stride(0),
        packed.data.stride(1),
        packed.scale.stride(0),
        packed.scale.stride(1),
        out.stride(0),
        out.stride(1),
        BITS=packed.bits,
        PER_BYTE=per,
        OFFSET=code_offset(packed.bits, packed.symmetric),
        GROUP=packed.group_size,
        HAS_ZERO=packed.zero is not None,
        HAS_BIAS=bias is not None,
        BM=bm,
        BN=bn,
        BK=bk,
    )
    return out.reshape(*lead, n)


def quantized_matmul(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None, impl: str = "auto") -> torch.Tensor:
    """``x @ W.T + bias`` for a packed W: ``impl`` is ``auto`` (Triton on CUDA, torch elsewhere),
    ``triton``, ``torch`` or ``reference``."""
    if impl == "auto":
        impl = "triton" if x.is_cuda else "torch"
    if impl == "triton":
        return quantized_matmul_triton(x, packed, bias)
    if impl == "torch":
        return quantized_matmul_torch(x, packed, bias)
    if impl == "reference":
        return quantized_matmul_reference(x, packed, bias)
    raise ValueError(f"quantized_matmul: impl {impl!r} is not one of auto, triton, torch, reference")
