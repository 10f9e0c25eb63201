"""Layers that store their weights quantized: what ``redundancy_clean`` puts in a compressed model.

``QuantizedLinear``, ``QuantizedConv2d`` and ``QuantizedEmbedding`` keep a ``PackedWeight``'s tensors
as buffers (int8 codes, or 4-/2-bit codes packed into bytes, float32 scales and zero points), so
the model's ``state_dict`` really is about a quarter (int8) or an eighth (int4) of the fp32 bytes.
The Linear runs ``kernels.quantized_matmul`` (Triton on CUDA, an Inductor-friendly torch path on
CPU); the Conv2d dequantizes into ``F.conv2d``; the Embedding dequantizes only the looked-up rows.
A layer trained with activation quantization quantizes its input the same way (ZeroQuant's
token-wise INT8 activations). The packing metadata travels in the ``state_dict`` as extra state.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dscompile.kernels.quantize import PackedWeight, activation_values, embedding_rows, static_values
from dscompile.kernels.quantized_matmul import dequantize_torch, quantized_matmul
from dscompile.runtime.compression.state import ActQuantSpec


class _PackedStorage(nn.Module):
    """Holds a ``PackedWeight`` as buffers plus its metadata (and an optional input quantizer)."""

    def __init__(self, packed: PackedWeight, bias: torch.Tensor | None, act: ActQuantSpec | None, act_range: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("qweight", packed.data)
        self.register_buffer("scales", packed.scale)
        self.register_buffer("zeros", packed.zero)
        self.bits = packed.bits
        self.group_size = packed.group_size
        self.weight_shape = tuple(packed.shape)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.act = act
        if act is not None and act.static:
            self.register_buffer("act_range", act_range.detach().clone())

    @property
    def packed(self) -> PackedWeight:
        return PackedWeight(self.qweight, self.scales, self.zeros, self.bits, self.group_size, self.weight_shape)

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        act = self.act
        if act is None:
            return x
        if act.static:
            return static_values(x, self.act_range, bits=act.bits, symmetric=act.symmetric)
        return activation_values(x, bits=act.bits, symmetric=act.symmetric, per=act.per)

    def get_extra_state(self) -> dict[str, Any]:
        act = None if self.act is None else vars(self.act).copy()
        return {"bits": self.bits, "group_size": self.group_size, "shape": list(self.weight_shape), "act": act}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self.bits = int(state["bits"])
        self.group_size = int(state["group_size"])
        self.weight_shape = tuple(state["shape"])
        self.act = None if state["act"] is None else ActQuantSpec(**state["act"])

    def weight_bytes(self) -> int:
        return self.packed.nbytes()


class QuantizedLinear(_PackedStorage):
    """``y = x @ W.T + b`` with W packed; ``impl`` selects the matmul (see ``quantized_matmul``)."""

    def __init__(
        self,
        packed: PackedWeight,
        bias: torch.Tensor | None = None,
        act: ActQuantSpec | None = None,
        act_range: torch.Tensor | None = None,
        impl: str = "auto",
    ) -> None:
        super().__init__(packed, bias, act, act_range)
        self.in_features = packed.columns
        self.out_features = packed.rows
        self.impl = impl

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quantized_matmul(self.quantize_input(x), self.packed, self.bias, impl=self.impl)

    def extra_repr(self) -> str:
        act = "" if self.act is None else f", activations={self.act.bits} bits"
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, group_size={self.group_size}{act}"


class QuantizedConv2d(_PackedStorage):
    """A Conv2d whose kernel is stored packed and dequantized for ``F.conv2d``."""

    def __init__(
        self, conv: nn.Conv2d, packed: PackedWeight, bias: torch.Tensor | None, act: ActQuantSpec | None = None, act_range: torch.Tensor | None = None
    ) -> None:
        if conv.padding_mode != "zeros":
            raise ValueError(f"QuantizedConv2d supports padding_mode='zeros', not {conv.padding_mode!r}")
        super().__init__(packed, bias, act, act_range)
        self.in_channels = packed.shape[1] * conv.groups
        self.out_channels = packed.shape[0]
        self.kernel_size, self.stride, self.padding = conv.kernel_size, conv.stride, conv.padding
        self.dilation, self.groups = conv.dilation, conv.groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = dequantize_torch(self.packed, x.dtype).reshape(self.weight_shape)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.conv2d(self.quantize_input(x), weight, bias, self.stride, self.padding, self.dilation, self.groups)


class QuantizedEmbedding(_PackedStorage):
    """An embedding table stored packed; a lookup dequantizes only the rows it reads."""

    def __init__(self, embedding: nn.Embedding, packed: PackedWeight) -> None:
        if embedding.max_norm is not None:
            raise ValueError("QuantizedEmbedding cannot renormalise rows (max_norm) of a quantized table")
        super().__init__(packed, None, None, None)
        self.num_embeddings, self.embedding_dim = packed.shape
        self.padding_idx = embedding.padding_idx

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        return embedding_rows(self.packed, indices)


class QuantizedTiedLinear(nn.Module):
    """A Linear that reads the packed table of a ``QuantizedEmbedding`` (tied input/output embeddings)."""

    def __init__(self, embedding: QuantizedEmbedding, bias: torch.Tensor | None = None, act: ActQuantSpec | None = None, impl: str = "auto") -> None:
        super().__init__()
        object.__setattr__(self, "embedding", embedding)  # shared, not a child: saved once
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.act = act
        self.in_features, self.out_features = embedding.embedding_dim, embedding.num_embeddings
        self.impl = impl

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act is not None:
            x = activation_values(x, bits=self.act.bits, symmetric=self.act.symmetric, per=self.act.per)
        return quantized_matmul(x, self.embedding.packed, self.bias, impl=self.impl)


def packed_bytes(model: nn.Module) -> int:
    """Bytes of the packed weights (codes, scales, zero points) of a model's quantized layers."""
    return sum(m.weight_bytes() for m in model.modules() if isinstance(m, _PackedStorage))
