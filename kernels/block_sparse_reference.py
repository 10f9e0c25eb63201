"""Block-sparse attention in plain PyTorch: the reference beside the Triton kernel, and the CPU path.

It never forms the ``S x S`` score matrix: it gathers the query/key/value blocks of the
layout's nonzero blocks, scores each pair, and reduces rows with segment operations, so
memory grows with the number of nonzero blocks (linear in sequence length for the sparse
modes). Shapes: ``q, k, v`` are ``[B, H, S, D]`` with ``S`` a multiple of ``block``;
``layout`` is ``[H, S // block, S // block]``; ``bias`` (optional) is additive and
broadcastable to ``[B, H, S, S]``; keys at positions ``>= kv_len`` are masked (padding).
Rows with no visible key give zeros (and ``lse = +inf``, which makes their gradient zero).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dscompile.kernels import layout_cache


@dataclass
class _Blocks:
    """The nonzero blocks: head ``h``, query block ``i``, key block ``j``, and row/column segment ids."""

    h: torch.Tensor
    i: torch.Tensor
    j: torch.Tensor
    row: torch.Tensor  # h * nb + i: which query row-block a nonzero block contributes to
    col: torch.Tensor  # h * nb + j: which key block it reads


def nonzero_blocks(layout: torch.Tensor, causal: bool) -> _Blocks:
    """The layout's nonzero blocks (above-diagonal blocks dropped when causal), cached per layout."""
    return layout_cache.cached("nonzero", layout, (causal,), lambda: _nonzero_blocks(layout, causal))


def _nonzero_blocks(layout: torch.Tensor, causal: bool) -> _Blocks:
    lay = layout.bool()
    nb = lay.shape[-1]
    if causal:
        lay = lay & torch.ones(nb, nb, dtype=torch.bool, device=lay.device).tril()
    h, i, j = lay.nonzero(as_tuple=True)
    return _Blocks(h, i, j, h * nb + i, h * nb + j)


def _gather(x: torch.Tensor, heads: torch.Tensor, blocks: torch.Tensor, block: int) -> torch.Tensor:
    """``x[B, H, S, D]`` -> the selected blocks ``[B, nnz, block, D]`` in fp32."""
    b, h, s, d = x.shape
    return x.reshape(b, h, s // block, block, d)[:, heads, blocks].float()


def _scores(
    q: torch.Tensor,
    k: torch.Tensor,
    nz: _Blocks,
    block: int,
    scale: float,
    bias: torch.Tensor | None,
    causal: bool,
    kv_len: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Masked scores ``[B, nnz, block, block]`` and the gathered q and k blocks."""
    b, h, s, _ = q.shape
    nb = s // block
    q_sel = _gather(q, nz.h, nz.i, block)
    k_sel = _gather(k, nz.h, nz.j, block)
    scores = torch.matmul(q_sel, k_sel.transpose(-1, -2)) * scale
    if bias is not None:
        bias6 = bias.expand(b, h, s, s).reshape(b, h, nb, block, nb, block)
        scores = scores + bias6[:, nz.h, nz.i, :, nz.j, :].transpose(0, 1).float()
    offsets = torch.arange(block, device=q.device)
    cols = nz.j[:, None] * block + offsets  # [nnz, block]
    mask = (cols >= kv_len)[:, None, :]
    if causal:
        rows = nz.i[:, None] * block + offsets
        mask = mask | (cols[:, None, :] > rows[:, :, None])
    scores = scores.masked_fill(mask, float("-inf"))
    return scores, q_sel, k_sel


def _dropout_keep(shape: torch.Size, seed: torch.Tensor | None, p: float, device: torch.device) -> torch.Tensor | None:
    """The dropout keep-mask of every nonzero block, regenerated identically in backward from ``seed``."""
    if p <= 0.0:
        return None
    if seed is None:
        raise ValueError("dropout_p > 0 needs a seed tensor")
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed.item()))
    return torch.rand(shape, generator=gen, device=device) >= p


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output ``[B, H, S, D]`` (q's dtype) and the row log-sum-exp ``[B, H, S]`` (fp32)."""
    b, h, s, d = q.shape
    nb = s // block
    kv_len = s if kv_len is None else kv_len
    nz = nonzero_blocks(layout, causal)
    scores, _, _ = _scores(q, k, nz, block, scale, bias, causal, kv_len)
    block_max = scores.amax(-1)  # [B, nnz, block]
    row_max = torch.full((b, h * nb, block), float("-inf"), device=q.device)
    row_max = row_max.scatter_reduce(1, nz.row[None, :, None].expand_as(block_max), block_max, "amax")
    safe_max = torch.where(torch.isinf(row_max), 0.0, row_max)
    probs = torch.exp(scores - safe_max[:, nz.row, :, None])
    row_sum = torch.zeros(b, h * nb, block, device=q.device).index_add_(1, nz.row, probs.sum(-1))
    keep = _dropout_keep(probs.shape, seed, dropout_p, q.device)
    if keep is not None:
        probs = probs * keep / (1.0 - dropout_p)
    v_sel = _gather(v, nz.h, nz.j, block)
    acc = torch.zeros(b, h * nb, block, d, device=q.device).index_add_(1, nz.row, torch.matmul(probs, v_sel))
    empty = row_sum == 0
    out = acc / torch.where(empty, 1.0, row_sum)[..., None]
    lse = torch.where(empty, float("inf"), safe_max + torch.log(row_sum))
    return out.reshape(b, h, s, d).to(q.dtype), lse.reshape(b, h, s)


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of q, k, v, visiting the same nonzero blocks as the forward."""
    b, h, s, d = q.shape
    nb = s // block
    kv_len = s if kv_len is None else kv_len
    nz = nonzero_blocks(layout, causal)
    scores, q_sel, k_sel = _scores(q, k, nz, block, scale, bias, causal, kv_len)
    lse_rows = lse.reshape(b, h * nb, block)[:, nz.row, :, None]
    probs = torch.exp(scores - lse_rows)
    do_sel = _gather(grad_out, nz.h, nz.i, block)
    v_sel = _gather(v, nz.h, nz.j, block)
    keep = _dropout_keep(probs.shape, seed, dropout_p, q.device)
    dropped = probs if keep is None else probs * keep / (1.0 - dropout_p)
    grad_p = torch.matmul(do_sel, v_sel.transpose(-1, -2))
    if keep is not None:
        grad_p = grad_p * keep / (1.0 - dropout_p)
    delta = (grad_out.float() * out.float()).sum(-1).reshape(b, h * nb, block)[:, nz.row, :, None]
    grad_s = probs * (grad_p - delta) * scale
    zeros = lambda: torch.zeros(b, h * nb, block, d, device=q.device)
    dq = zeros().index_add_(1, nz.row, torch.matmul(grad_s, k_sel))
    dk = zeros().index_add_(1, nz.col, torch.matmul(grad_s.transpose(-1, -2), q_sel))
    dv = zeros().index_add_(1, nz.col, torch.matmul(dropped.transpose(-1, -2), do_sel))
    shape = (b, h, s, d)
    return dq.reshape(shape).to(q.dtype), dk.reshape(shape).to(k.dtype), dv.reshape(shape).to(v.dtype)
