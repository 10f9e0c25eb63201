"""Attention over a static KV cache that reads only the cache's valid prefix (PyTorch reference).

A static cache of ``S`` slots keeps every decode step's shapes fixed (one compiled decode graph),
but attention as models write it then reads all ``S`` slots each step, the future ones masked, and
under grouped-query attention first copies the whole cache once per query head group
(``repeat_kv``: an expand and a reshape). Here the boolean mask bounds the work: the columns after
the last one any row may attend to hold nothing a query can see, so they are dropped before the
scores are formed (exact: a masked column's softmax weight is exactly 0). The query heads that
share a KV head are stacked as rows of one attention against that head, so the cache is not
repeated; with a mask that differs per head the prefix is repeated instead (only the prefix).

Two implementations of the same attention, chosen by ``impl`` (``kernels.triton_dispatch``):

- ``cache_attention_torch``, the CPU path: the bound is a number read from the mask on the host
  (``valid_prefix``), inside the op, so the graph around it keeps static shapes and compiles once;
  then SDPA over the prefix. On CPU the host read costs nothing; on CUDA it would be a device sync
  per layer, which a CUDA graph cannot capture.
- ``cache_attention_triton``, the GPU path (``kernels/_cache_attention_triton.py``): a
  flash-decoding kernel that finds the attended range on the device (no host read: capturable in a
  CUDA graph), reads each KV tile once for the query heads sharing it, skips key blocks the mask
  leaves unattended and never loads a masked-out column; the key range is split over programs when
  batch × KV heads alone would leave the GPU idle, the splits merged by log-sum-exp. It serves the
  prefill (many queries: blocks of rows) and the decode step alike. Tested against the torch path
  under Triton's interpreter on CPU; not yet run on a GPU.

``impl="auto"`` (the op's) is the Triton kernel on CUDA tensors and the torch path elsewhere.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from dscompile.kernels.triton_dispatch import interpreting, resolve_impl, triton_available


def valid_prefix(mask: Tensor) -> int:
    """One past the last key column that any query may attend to (the whole length if none may)."""
    length = mask.shape[-1]
    columns = mask.reshape(-1, length).any(dim=0)
    if not bool(columns.any()):
        return length
    return length - int(columns.flip(0).to(torch.int8).argmax())


def cache_attention_torch(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None = None) -> Tensor:
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


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _splits(programs: int, key_blocks: int, device: torch.device) -> int:
    """Key splits per (batch, KV head, row block): enough programs to fill the GPU twice over, each split
    at least 4 key blocks. One on CPU (the interpreter gains nothing from more)."""
    if device.type != "cuda":
        return 1
    units = _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
    wanted = -(-2 * units // programs)
    return max(1, min(wanted, key_blocks // 4, 64))


def cache_attention_triton(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None = None, splits: int | None = None) -> Tensor:
    """``cache_attention`` as one Triton launch (two with several key splits), bounds found on the device.

    ``splits`` forces the number of key splits (default: from the GPU's size; 1 on CPU).
    """
    if not triton_available(q):
        raise RuntimeError("the Triton cache attention needs a CUDA tensor or TRITON_INTERPRET=1 set before triton is imported")
    if mask.dtype != torch.bool:
        raise ValueError(f"cache_attention: the mask must be boolean, got {mask.dtype}")
    from dscompile.kernels import _cache_attention_triton as kernels

    batch, heads, queries, dim = q.shape
    kv_heads, slots, dim_v = k.shape[1], k.shape[2], v.shape[-1]
    if heads % kv_heads:
        raise ValueError(f"cache_attention: {heads} query heads over {kv_heads} KV heads")
    rep = heads // kv_heads
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)).expand(batch, heads, queries, slots)
    out = torch.empty((batch, heads, queries, dim_v), dtype=q.dtype, device=q.device)
    if out.numel() == 0 or slots == 0:
        return out.zero_()
    rows = rep * queries
    cpu = not q.is_cuda
    block_m = 16 if cpu else min(64, max(16, 1 << (rows - 1).bit_length()))
    block_n = 16 if cpu else 64
    row_blocks = -(-rows // block_m)
    n_splits = splits or _splits(batch * kv_heads * row_blocks, -(-slots // block_n), q.device)
    part = stats = out
    if n_splits > 1:
        part = torch.empty((batch * kv_heads * rows * n_splits, dim_v), dtype=torch.float32, device=q.device)
        stats = torch.empty((batch * kv_heads * rows * n_splits, 2), dtype=torch.float32, device=q.device)
    block_d = max(16, 1 << (dim - 1).bit_length())
    block_dv = max(16, 1 << (dim_v - 1).bit_length())
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    kernels.cache_attention_kernel[(batch * kv_heads, row_blocks, n_splits)](
        q,
        k,
        v,
        mask,
        out,
        part,
        stats,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *mask.stride(),
        *out.stride(),
        kv_heads,
        queries,
        rows,
        slots,
        dim,
        dim_v,
        rep,
        scale,
        SPLITS=n_splits,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
        DOT_FP32=interpreting() and q.dtype == torch.bfloat16,
    )
    if n_splits > 1:
        kernels.combine_kernel[(batch * kv_heads, rows)](
            part,
            stats,
            out,
            *out.stride(),
            kv_heads,
            queries,
            rows,
            dim_v,
            rep,
            SPLITS=n_splits,
            BLOCK_S=max(2, 1 << (n_splits - 1).bit_length()),
            BLOCK_DV=block_dv,
        )
    return out


def cache_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None = None, impl: str = "auto") -> Tensor:
    """``scaled_dot_product_attention(q, repeat_kv(k), repeat_kv(v), mask, scale=scale)`` reading only attended slots.

    ``impl``: ``auto`` (Triton on CUDA when triton imports, torch elsewhere), ``triton`` or ``torch``.
    """
    if resolve_impl(impl, q.device) == "triton":
        return cache_attention_triton(q, k, v, mask, scale)
    return cache_attention_torch(q, k, v, mask, scale)
