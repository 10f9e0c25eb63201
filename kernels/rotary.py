"""Rotary position embedding (rotate-half form) as one function: what the rotary pass puts in graphs.

Hugging Face's Llama/Mistral/Qwen/GPT-NeoX write ``x * cos + rotate_half(x) * sin`` with
``rotate_half(x) = cat(-x2, x1)`` over the two halves of the last dimension: a slice pair, a
negation, a concatenation, two products and a sum per application, each a separate tensor in
eager. Written per half, the same numbers are two fused multiply-adds per element with no rotated
copy: ``[x1 * c1 - x2 * s1, x2 * c2 + x1 * s2]``. Bit for bit the same as the rotate-half form
(``(-a) * b == -(a * b)`` and ``p + (-q) == p - q`` in IEEE arithmetic), so the pass changes no
result. ``rotary_dim`` (GPT-NeoX's ``rotary_pct``, Phi's partial rotary): only the first
``rotary_dim`` channels rotate, the rest pass through unchanged.

``rotary_embedding`` is the PyTorch reference and, on CPU, what the lowering compiles: Inductor
turns the expression (slices, products, the concatenation) into one loop. ``rotary_embedding_triton``
(``kernels/_rotary_triton.py``) is the GPU path: one kernel, ``cos``/``sin`` read through their
broadcast strides, no FMA contraction, so the same bits as this reference in fp32, fp16 and bf16
(equal under Triton's interpreter on CPU; not yet run on a GPU). The rotary pass puts the
``dscompile::rotary_embedding`` op (``dscompile.runtime.inference.ops``, which calls the Triton
kernel) in graphs whose tensors are on CUDA, this function elsewhere.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from dscompile.kernels.triton_dispatch import resolve_impl, triton_available

log = logging.getLogger("dscompile.kernels.rotary")


def rotary_embedding(x: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int | None = None) -> Tensor:
    """``x * cos + rotate_half(x) * sin`` on the first ``rotary_dim`` channels (default all), the rest of ``x`` after them.

    ``cos``/``sin`` broadcast against ``x[..., :rotary_dim]`` and have ``rotary_dim`` channels.
    """
    d = x.shape[-1] if rotary_dim is None else rotary_dim
    h = d // 2
    x1, x2 = x[..., :h], x[..., h:d]
    c1, c2 = cos[..., :h], cos[..., h:]
    s1, s2 = sin[..., :h], sin[..., h:]
    parts = [x1 * c1 - x2 * s1, x2 * c2 + x1 * s2]
    if d < x.shape[-1]:
        parts.append(x[..., d:])
    return torch.cat(parts, dim=-1)


def rotary_embedding_unfused(x: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int | None = None) -> Tensor:
    """The rotate-half form as models write it (the tests' reference)."""
    d = x.shape[-1] if rotary_dim is None else rotary_dim
    rot, rest = x[..., :d], x[..., d:]
    half = d // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


def rotary_dtype(x: Tensor, cos: Tensor, sin: Tensor) -> torch.dtype:
    """The result's dtype: torch's promotion of the three (Hugging Face casts ``cos``/``sin`` to ``x``'s)."""
    return torch.promote_types(x.dtype, torch.promote_types(cos.dtype, sin.dtype))


def rotary_embedding_triton(x: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int | None = None) -> Tensor:
    """``rotary_embedding`` as one Triton kernel (up to 4 leading dims of ``x``; a new contiguous tensor)."""
    if not triton_available(x):
        raise RuntimeError("the Triton rotary kernel needs a CUDA tensor or TRITON_INTERPRET=1 set before triton is imported")
    from dscompile.kernels import _rotary_triton

    width = x.shape[-1]
    d = width if rotary_dim is None else rotary_dim
    if d % 2 or not 0 < d <= width or x.dim() > 5 or cos.shape[-1] != d or sin.shape[-1] != d:
        raise ValueError(f"rotary_embedding_triton: x {tuple(x.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}, rotary_dim {rotary_dim}")
    dtype = rotary_dtype(x, cos, sin)
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    lead = tuple(x.shape[:-1])
    sizes = (1,) * (4 - len(lead)) + lead
    views = [t.reshape(*sizes, width) for t in (x, out)]  # leading 1s added: views, no copy
    tables = [t.expand(*lead, d).reshape(*sizes, d) for t in (cos, sin)]
    rows = x.numel() // max(width, 1)
    block_r = 16
    rest = width - d
    _rotary_triton.rotary_kernel[(-(-rows // block_r),)](
        views[0],
        tables[0],
        tables[1],
        out,
        rows,
        sizes[1],
        sizes[2],
        sizes[3],
        *views[0].stride(),
        *tables[0].stride(),
        *tables[1].stride(),
        *views[1].stride(),
        d // 2,
        rest,
        BLOCK_R=block_r,
        BLOCK_H=max(1, 1 << (d // 2 - 1).bit_length()),
        BLOCK_REST=0 if rest == 0 else 1 << (rest - 1).bit_length(),
        enable_fp_fusion=False,
    )
    return out


def rotary(x: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int | None = None, impl: str = "auto") -> Tensor:
    """``rotary_embedding`` by ``impl``: ``auto`` (Triton on CUDA when triton imports, torch elsewhere), ``triton`` or ``torch``."""
    chosen = resolve_impl(impl, x.device)
    if chosen == "triton" and impl == "auto" and x.dim() > 5:
        log.debug("rotary: %d-dim input (the kernel indexes up to 4 leading dims): torch path", x.dim())
        chosen = "torch"
    if chosen == "triton":
        return rotary_embedding_triton(x, cos, sin, rotary_dim)
    return rotary_embedding(x, cos, sin, rotary_dim)
