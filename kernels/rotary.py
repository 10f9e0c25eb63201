"""Rotary position embedding (rotate-half form) as one function: what the rotary pass puts in graphs.

Hugging Face's Llama/Mistral/Qwen/GPT-NeoX write ``x * cos + rotate_half(x) * sin`` with
``rotate_half(x) = cat(-x2, x1)`` over the two halves of the last dimension: a slice pair, a
negation, a concatenation, two products and a sum per application, each a separate tensor in
eager. Written per half, the same numbers are two fused multiply-adds per element with no rotated
copy: ``[x1 * c1 - x2 * s1, x2 * c2 + x1 * s2]``. Bit for bit the same as the rotate-half form
(``(-a) * b == -(a * b)`` and ``p + (-q) == p - q`` in IEEE arithmetic), so the pass changes no
result. ``rotary_dim`` (GPT-NeoX's ``rotary_pct``, Phi's partial rotary): only the first
``rotary_dim`` channels rotate, the rest pass through unchanged.

This is the PyTorch reference and, on CPU, what the lowering compiles: Inductor turns the
expression (slices, products, the concatenation) into one loop. No hand-written Triton kernel
yet (no GPU has been lent to this work to check one).
"""

from __future__ import annotations

import torch
from torch import Tensor


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
