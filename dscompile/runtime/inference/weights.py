"""Weight-only quantization of a model for inference: its layers swapped for packed ones.

Every ``nn.Linear`` (and Hugging Face's ``Conv1D``, a Linear with its weight stored ``[in, out]``)
becomes ``QuantizedLinear`` and every plain ``nn.Embedding`` a packed embedding, from
``dscompile.runtime.compression.quantized`` (the layers ``redundancy_clean`` produces): int8 codes,
or int4 codes two per byte, with float32 scales (and zero points when asymmetric) per group. A
Linear whose weight *is* an embedding's table (tied input/output embeddings) reads the packed
table (``QuantizedTiedLinear``), so it is stored once. The matmul dequantizes inside
(``kernels.quantized_matmul``: a Triton kernel on CUDA, a torch path Inductor fuses on CPU).

Groups are DeepSpeed's ``q_groups``: equal chunks of the weight flattened as ``[out, in]``.
"""

from __future__ import annotations

import torch
from torch import nn

from dscompile.errors import DSCompileConfigError
from dscompile.kernels.quantize import quantize_weight
from dscompile.runtime.compression.quantized import QuantizedEmbedding, QuantizedLinear, QuantizedTiedLinear, _PackedStorage


class InferenceQuantizedEmbedding(QuantizedEmbedding):
    """A packed embedding whose lookups come back in the model's compute dtype."""

    def __init__(self, embedding: nn.Embedding, packed, dtype: torch.dtype) -> None:
        super().__init__(embedding, packed)
        self.compute_dtype = dtype

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        return super().forward(indices).to(self.compute_dtype)


def _is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2): ``x @ weight + bias`` with ``weight`` ``[in, out]``."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and isinstance(getattr(module, "weight", None), torch.Tensor)


def _pack(weight: torch.Tensor, bits: int, groups: int, symmetric: bool, name: str):
    if weight.numel() % groups:
        raise DSCompileConfigError(
            "quant.weight.q_groups",
            f"{groups} groups do not split {name}'s {weight.numel()} weights ({tuple(weight.shape)}) evenly",
            "choose a q_groups that divides every weight's size (a power of two usually does)",
        )
    return quantize_weight(weight.detach().float(), bits, groups, symmetric)


def quantize_model_weights(model: nn.Module, bits: int, groups: int, symmetric: bool) -> dict[str, int]:
    """Swap ``model``'s Linear/Conv1D/Embedding layers for packed ones in place; returns counts by kind."""
    dtype = next(model.parameters()).dtype
    embeddings: dict[int, InferenceQuantizedEmbedding] = {}
    counts = {"linear": 0, "embedding": 0, "tied": 0}
    named = list(model.named_modules())
    for name, module in named:  # embeddings first, so tied heads find their packed table
        if type(module) is nn.Embedding:
            packed = _pack(module.weight, bits, groups, symmetric, name)
            replacement = InferenceQuantizedEmbedding(module, packed, dtype)
            embeddings[id(module.weight)] = replacement
            _replace(model, name, replacement)
            counts["embedding"] += 1
    for name, module in named:
        if isinstance(module, nn.Linear) and id(module.weight) in embeddings:
            _replace(model, name, QuantizedTiedLinear(embeddings[id(module.weight)], module.bias))
            counts["tied"] += 1
        elif isinstance(module, nn.Linear):
            _replace(model, name, QuantizedLinear(_pack(module.weight, bits, groups, symmetric, name), module.bias))
            counts["linear"] += 1
        elif _is_conv1d(module):
            _replace(model, name, QuantizedLinear(_pack(module.weight.t().contiguous(), bits, groups, symmetric, name), module.bias))
            counts["linear"] += 1
    return counts


def _replace(model: nn.Module, name: str, replacement: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, replacement)


def model_bytes(model: nn.Module) -> int:
    """Bytes of a model's parameters and buffers in memory (each tensor once)."""
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


def packed_weight_bytes(model: nn.Module) -> int:
    """Bytes of the packed weights (codes, scales, zero points) of a model's quantized layers."""
    return sum(m.weight_bytes() for m in model.modules() if isinstance(m, _PackedStorage))
