"""Matmul with a fused epilogue (bias, activation, residual add) as a Triton template.

``matmul_epilogue(a, b, bias=None, activation=None, residual=None)`` computes
``act(a @ b + bias) + residual``; ``matmul_epilogue_reference`` is the aten version beside it and
is what runs wherever the template does not apply (no CUDA and no interpreter, odd dtypes,
non-2-D operands). ``matmul_epilogue_call`` is what a folded graph node runs (the rewrite that folds
``mm``/``addmm`` chains into it is ``passes/matmul_epilogue_fold.py``).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import torch.fx

ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "silu")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def matmul_epilogue_reference(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """The aten reference: the same epilogue, op by op."""
    out = a @ b
    if bias is not None:
        out = out + bias
    act = activation or "none"
    if act == "relu":
        out = torch.relu(out)
    elif act == "gelu":
        out = torch.nn.functional.gelu(out)
    elif act == "gelu_tanh":
        out = torch.nn.functional.gelu(out, approximate="tanh")
    elif act == "silu":
        out = torch.nn.functional.silu(out)
    if residual is not None:
        out = out + residual
    return out


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def matmul_epilogue_kernel(
        a_ptr, b_ptr, bias_ptr, res_ptr, c_ptr, M, N, K,
        sam, sak, sbk, sbn, sbias, srm, srn, scm, scn,
        HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr, PRECISION: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            ka = k0 + rk
            a = tl.load(a_ptr + rm[:, None] * sam + ka[None, :] * sak, mask=(rm[:, None] < M) & (ka[None, :] < K), other=0.0)
            b = tl.load(b_ptr + ka[:, None] * sbk + rn[None, :] * sbn, mask=(ka[:, None] < K) & (rn[None, :] < N), other=0.0)
            acc += tl.dot(a, b, input_precision=PRECISION, out_dtype=tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn * sbias, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        if ACT == 1:
            acc = tl.maximum(acc, 0.0)
        elif ACT == 2:
            acc = 0.5 * acc * (1.0 + tl.erf(acc * 0.7071067811865476))
        elif ACT == 3:
            inner = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
            t = tl.exp(-2.0 * tl.abs(inner))
            th = (1.0 - t) / (1.0 + t)
            acc = 0.5 * acc * (1.0 + tl.where(inner < 0, -th, th))
        elif ACT == 4:
            acc = acc * tl.sigmoid(acc)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        if HAS_RES:
            acc += tl.load(res_ptr + rm[:, None] * srm + rn[None, :] * srn, mask=mask, other=0.0).to(tl.float32)
        tl.store(c_ptr + rm[:, None] * scm + rn[None, :] * scn, acc.to(c_ptr.dtype.element_ty), mask=mask)

    return matmul_epilogue_kernel


def template_applies(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None) -> str | None:
    """None when the Triton template handles these operands, else why it does not."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and not a.is_cuda:
        return "no CUDA device and the Triton interpreter is off"
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        return "operands are not a 2-D matmul"
    if a.dtype not in _DTYPES or b.dtype != a.dtype:
        return f"dtype {a.dtype}/{b.dtype} not templated"
    n = b.shape[1]
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        return "bias is not a vector over the output columns"
    if residual is not None and tuple(residual.shape) != (a.shape[0], n):
        return "residual does not match the output shape"
    return None


def matmul_epilogue(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``act(a @ b + bias) + residual`` in one Triton kernel, or aten where the template does not apply."""
    act = activation or "none"
    if act not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of {ACTIVATIONS}")
    if template_applies(a, b, bias, residual) is not None:
        return matmul_epilogue_reference(a, b, bias, activation, residual)
    m, k = a.shape
    n = b.shape[1]
    c = torch.empty((m, n), dtype=a.dtype, device=a.device)
    small = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    bm = 32 if small else 64
    bn = 32 if small else 64
    bk = 32
    grid = ((m + bm - 1) // bm, (n + bn - 1) // bn)
    dummy = c
    _kernel()[grid](
        a, b, bias if bias is not None else dummy, residual if residual is not None else dummy, c, m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        bias.stride(0) if bias is not None else 0,
        residual.stride(0) if residual is not None else 0, residual.stride(1) if residual is not None else 0,
        c.stride(0), c.stride(1),
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, ACT=ACTIVATIONS.index(act), PRECISION=_precision(a.dtype),
        BM=bm, BN=bn, BK=bk,
    )
    return c


def _precision(dtype: torch.dtype) -> str:
    """fp32 matmuls use TF32 only where torch itself is allowed to (eager numerics otherwise)."""
    return "tf32" if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 else "ieee"


aten = torch.ops.aten

def matmul_epilogue_call(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    activation: str,
    out_shape: tuple[int, ...],
) -> torch.Tensor:
    """What a folded node runs: the template on 2-D ``a @ b``, then the free view to ``out_shape``."""
    m, n = a.shape[0], b.shape[1]
    res = residual.reshape(m, n) if residual is not None else None
    return matmul_epilogue(a, b, bias=bias, activation=activation, residual=res).view(out_shape)


def template_by_default() -> bool:
    """The lowering folds epilogues into the template on a GPU; the CPU interpreter is for tests."""
    return torch.cuda.is_available()
