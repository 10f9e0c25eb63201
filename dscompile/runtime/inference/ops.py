"""The ops the kernel-injection passes put in inference graphs: ``dscompile::cache_attention`` and
``dscompile::rotary_embedding``.

``torch.library`` custom ops, so that AOTAutograd traces each as one node (its fake implementation
gives the output's shape) and every lowering calls it as one kernel.

- ``dscompile::cache_attention``: the attention over the static KV cache that reads only the slots
  the mask attends (``dscompile.kernels.cache_attention``), with GQA query heads grouped against
  their KV head. On CUDA tensors it runs the Triton flash-decoding kernel, which finds the bound on
  the device (no host read: a decode step holding it can be captured in a CUDA graph); elsewhere
  the torch path, which reads the bound on the host. Either way the graphs around it keep static
  shapes and compile once.
- ``dscompile::rotary_embedding``: the rotary embedding as the Triton kernel
  (``dscompile.kernels.rotary``). The rotary pass emits it only for graphs on CUDA; on CPU it emits
  the plain function, whose few pointwise ops Inductor fuses with their neighbours.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dscompile.kernels.cache_attention import cache_attention
from dscompile.kernels.rotary import rotary, rotary_dtype


@torch.library.custom_op("dscompile::cache_attention", mutates_args=())
def cache_attention_op(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None = None) -> Tensor:
    """Attention of ``q`` over the cache ``k``/``v`` (GQA by head groups), masked by boolean ``mask``, over attended slots only."""
    return cache_attention(q, k, v, mask, scale).contiguous()


@cache_attention_op.register_fake
def _cache_attention_fake(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None = None) -> Tensor:
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


@torch.library.custom_op("dscompile::rotary_embedding", mutates_args=())
def rotary_embedding_op(x: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int | None = None) -> Tensor:
    """``x * cos + rotate_half(x) * sin`` on the first ``rotary_dim`` channels: the Triton kernel where it can run, torch elsewhere."""
    return rotary(x, cos, sin, rotary_dim).contiguous()


@rotary_embedding_op.register_fake
def _rotary_embedding_fake(x: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int | None = None) -> Tensor:
    return x.new_empty(x.shape, dtype=rotary_dtype(x, cos, sin))


CACHE_ATTENTION = torch.ops.dscompile.cache_attention.default
ROTARY_EMBEDDING = torch.ops.dscompile.rotary_embedding.default
