"""The op the cache-attention pass puts in inference graphs: ``dscompile::cache_attention``.

A ``torch.library`` custom op, so that AOTAutograd traces it as one node (its fake implementation
gives the output's shape) and every lowering calls it as one kernel: the attention over the static
KV cache bounded by the valid prefix the mask allows (``dscompile.kernels.cache_attention``). The
bound is read inside the op, so the graphs around it keep static shapes and compile once.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dscompile.kernels.cache_attention import cache_attention


@torch.library.custom_op("dscompile::cache_attention", mutates_args=())
def cache_attention_op(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None = None) -> Tensor:
    """Attention of ``q`` over the cache ``k``/``v`` (GQA by head groups), masked by boolean ``mask``, over its valid prefix."""
    return cache_attention(q, k, v, mask, scale).contiguous()


@cache_attention_op.register_fake
def _cache_attention_fake(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None = None) -> Tensor:
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


CACHE_ATTENTION = torch.ops.dscompile.cache_attention.default
