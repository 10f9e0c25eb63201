"""Attention over a static KV cache that reads only the cache's valid prefix (PyTorch reference).

A static cache of ``S`` slots keeps every decode step's shapes fixed (one compiled decode graph),
but attention as models write it then reads all ``S`` slots each step, the future ones masked, and
under grouped-query attention first copies the whole cache once per query head group
(``repeat_kv``: an expand and a reshape). Here the boolean mask bounds the work: the columns after
the last one any row may attend to hold nothing a query can see, so they are dropped before the
scores are formed (exact: a masked column's softmax weight is exactly 0). The query heads that
share a KV head are stacked as rows of one attention against that head, so the cache is not
repeated; with a mask that differs per head the prefix is repeated instead (only the prefix).

The bound is a number read from the mask at run time, inside the op, so the graph around it keeps
static shapes and compiles once. No hand-written Triton kernel yet (no GPU has been lent to this
work to check one); on every device the op runs this reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def valid_prefix(mask: Tensor) -> int:
    """One past the last key column that any query may attend to (the whole length if none may)."""
    length = mask.shape[-1]
    columns = mask.reshape(-1, length).any(dim=0)
    if not bool(columns.any()):
        return length
    return length - int(columns.flip(0).to(torch.int8).argmax())


def cache_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None = None) -> Tensor:
    """``scaled_dot_product_attention(q, repeat_kv(k), repeat_kv(v), mask, scale=scale)`` over the mask's valid prefix.

    ``q``: ``[batch, heads, queries, dim]``; ``k``/``v``: ``[batch, kv_heads, slots, dim]`` with
    ``kv_heads`` dividing ``heads`` (query head ``h`` reads KV head ``h // (heads // kv_heads)``);
    ``mask``: boolean, broadcastable to ``[batch, heads, queries, slots]``, True where attended.
    """
    batch, heads, queries, _ = q.shape
    kv_heads = k.shape[1]
    rep = heads // kv_heads
    n = valid_prefix(mask)
    k, v = k[:, :, :n], v[:, :, :n]
    mask = mask[..., :n]
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    if rep == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    if mask.shape[1] != 1:  # a mask per head: repeat the prefix (not the cache) per query head
        return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask, scale=scale)
    # the `rep` query heads of one KV head as rows of one attention against it
    grouped = q.reshape(batch, kv_heads, rep * queries, q.shape[-1])
    rows = mask.expand(mask.shape[0], 1, queries, n).unsqueeze(2).expand(mask.shape[0], 1, rep, queries, n)
    out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=rows.reshape(mask.shape[0], 1, rep * queries, n), scale=scale)
    return out.reshape(batch, heads, queries, v.shape[-1])
