"""Pruning masks (DeepSpeed Compression's formulas), as the prune pass inserts them into graphs.

``topk_mask`` keeps exactly ``ceil(dense_ratio * numel)`` entries, the largest scores (DeepSpeed's
TopKBinarizer); ``learned_mask`` is the same with a straight-through gradient to the scores
(movement pruning). Each ``apply_*`` multiplies a weight by its mask once ``enabled`` (a 0-d tensor
the schedule sets), broadcasting it the way the technique prunes:

- sparse: element-wise (the mask has the weight's shape);
- row: output rows of a Linear weight ``[out, in]`` (and the bias: ``mask_vector``);
- head: the input columns of an attention output projection, in ``num_heads`` equal blocks;
- channel: output channels of a Conv2d weight ``[out, in, kh, kw]`` (and the bias).
"""

from __future__ import annotations

import math

import torch

from dscompile.kernels.quantize import straight_through


def topk_mask(scores: torch.Tensor, dense_ratio: float) -> torch.Tensor:
    """1 for the ``ceil(dense_ratio * numel)`` largest scores, 0 elsewhere."""
    keep = math.ceil(dense_ratio * scores.numel())
    flat = scores.reshape(-1)
    mask = torch.zeros_like(flat)
    if keep > 0:
        mask = mask.scatter(0, flat.topk(keep).indices, 1.0)
    return mask.reshape(scores.shape)


def learned_mask(scores: torch.Tensor, dense_ratio: float) -> torch.Tensor:
    """``topk_mask`` whose gradient reaches the scores unchanged."""
    return straight_through(topk_mask(scores.detach(), dense_ratio), scores)


def _gate(mask: torch.Tensor, enabled: torch.Tensor) -> torch.Tensor:
    return torch.where(enabled > 0, mask, torch.ones_like(mask))


def apply_sparse_mask(w: torch.Tensor, mask: torch.Tensor, enabled: torch.Tensor) -> torch.Tensor:
    return w * _gate(mask, enabled).reshape(w.shape).to(w.dtype)


def apply_row_mask(w: torch.Tensor, mask: torch.Tensor, enabled: torch.Tensor) -> torch.Tensor:
    return w * _gate(mask, enabled).reshape(-1, *([1] * (w.dim() - 1))).to(w.dtype)


def apply_head_mask(w: torch.Tensor, mask: torch.Tensor, enabled: torch.Tensor, *, num_heads: int) -> torch.Tensor:
    columns = _gate(mask, enabled).reshape(num_heads, 1).expand(num_heads, w.shape[1] // num_heads).reshape(1, -1)
    return w * columns.to(w.dtype)


def mask_vector(b: torch.Tensor, mask: torch.Tensor, enabled: torch.Tensor) -> torch.Tensor:
    """A bias masked with the rows/channels of its layer."""
    return b * _gate(mask, enabled).reshape(-1).to(b.dtype)
