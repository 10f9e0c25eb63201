"""Weight-only quantization of a model for inference: its layers swapped for packed ones.

Every ``nn.Linear`` (and Hugging Face's ``Conv1D``, a Linear with its weight stored ``[in, out]``)
becomes ``QuantizedLinear`` and every plain ``nn.Embedding`` a packed embedding, from
``dscompile.runtime.compression.quantized`` (the layers ``redundancy_clean`` produces): int8 codes,
or int4 codes two per byte, with float32 scales (and zero points when asymmetric) per group. A
Linear whose weight *is* an embedding's table (tied input/output embeddings) reads the packed
table (``QuantizedTiedLinear``), so it is stored once. The matmul dequantizes inside
(``kernels.quantized_matmul``: a Triton kernel on CUDA, a torch path Inductor fuses on CPU).

Groups are DeepSpeed's ``q_groups`` when it is given: equal chunks of the weight flattened as
``[out, in]``. Without it (``groups=None``) each row is cut into groups of ``DEFAULT_GROUP_COLUMNS``
(128) consecutive input columns (the largest divisor of the row's width up to 128): one scale per
128 weights whatever the layer's size, as int4 weight-only schemes commonly do (gpt-fast, torchao:
groups of 32 to 256), where DeepSpeed's default of one group per tensor lets one outlier row set the
step of every row.

Embedding tables (every plain ``nn.Embedding``) and the output head (Hugging Face's
``get_output_embeddings()``, tied to the input embedding or not) stay in the model's float dtype
unless ``quantize_embeddings=True`` (``quant.weight.quantize_embeddings``), as DeepSpeed's int8 kernel
injection (it quantizes the transformer layers' weights only), bitsandbytes through Hugging Face,
GPTQ and AWQ leave them: an embedding's or the head's error reaches the logits without passing
through a layer, and an embedding costs memory but no bandwidth (a step reads one row per token).
Measured on the tiny random Llama of the tests (top-1 next token against fp32, teacher-forced, mean
of 4 x 4,096 positions of random prompts; ``tests/test_inference_quant.py``): everything quantized,
one group per weight 98.1%, 128-column groups 98.7%; head float 99.0%; embeddings and head float
99.6% (99.5% to 99.7% per set of 4,096). GPT-2 99.7% -> 99.9%, OPT 99.4% -> 99.8% the same way.

Under tensor parallelism (``quantize_model_weights(..., slices=...)``, called by
``passes/inference_tensor_parallel.py`` once the first graph has fixed the slices) a weight the pass
splits is packed as this rank's slice, and a weight left whole (embeddings, the LM head) whole. How
groups relate to slices: ``q_groups`` stays the number of groups of the *full* weight, as in a
single process, so a TP engine stores exactly the codes and scales of the single-process one, cut:
each rank computes the groups' scales from the full weight it still holds when it slices (one
layer at a time), and keeps its slice of the codes and of the per-element scales. A group that
lies inside one rank's slice is kept as it is; a group cut by a slice boundary (a row-parallel
linear whose row groups are wider than a rank's columns, or a padded head) keeps its scale on
both sides and is stored as smaller row groups of the same scale (``group_size`` refined to the
largest divisor of the slice's width that no boundary cuts; logged). The dequantized slice is
then bit for bit the slice of the single-process dequantized weight; only the scales' bytes grow
where groups were cut. ``q_groups`` that does not divide a full weight is refused as in a single
process (``quant.weight.q_groups``).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from dscompile.errors import DSCompileConfigError
from dscompile.kernels.quantize import PackedWeight, dequantize, embedding_rows, quantize_weight, store_codes, stored_codes
from dscompile.kernels.quantized_matmul import quantized_matmul
from dscompile.runtime.compression.quantized import QuantizedEmbedding, QuantizedLinear, QuantizedTiedLinear, _PackedStorage
from dscompile.runtime.tensor_parallel import SliceSpec

log = logging.getLogger("dscompile.runtime.inference.weights")


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


DEFAULT_GROUP_COLUMNS = 128


def weight_groups(weight: torch.Tensor, groups: int | None) -> int:
    """Quantization groups of an ``[out, in]`` weight: DeepSpeed's ``q_groups`` when given, else rows
    cut into groups of the largest divisor of ``in`` up to ``DEFAULT_GROUP_COLUMNS``."""
    if groups is not None:
        return groups
    rows, columns = weight.shape[0], weight[0].numel()
    size = max(d for d in range(1, min(DEFAULT_GROUP_COLUMNS, columns) + 1) if columns % d == 0)
    return rows * (columns // size)


def float_modules(model: nn.Module) -> set[int]:
    """Ids of the modules left unquantized by default: the embeddings and the output head."""
    keep = {id(m) for m in model.modules() if type(m) is nn.Embedding}
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if isinstance(head, nn.Module) and isinstance(getattr(head, "weight", None), torch.Tensor):
        keep.add(id(head))
    else:
        log.info("%s names no output head (get_output_embeddings): every linear layer is quantized", type(model).__name__)
    return keep


def _pack(weight: torch.Tensor, bits: int, groups: int | None, symmetric: bool, name: str):
    groups = weight_groups(weight, groups)
    if weight.numel() % groups:
        raise DSCompileConfigError(
            "quant.weight.q_groups",
            f"{groups} groups do not split {name}'s {weight.numel()} weights ({tuple(weight.shape)}) evenly",
            "choose a q_groups that divides every weight's size (a power of two usually does)",
        )
    return quantize_weight(weight.detach().float(), bits, groups, symmetric)


def check_q_groups(model: nn.Module, groups: int | None) -> None:
    """The error ``quantize_model_weights`` would raise, before anything is quantized (under TP the layers are packed at the first split)."""
    if groups is None:
        return
    for name, module in model.named_modules():
        if type(module) is nn.Embedding or isinstance(module, nn.Linear) or _is_conv1d(module):
            if module.weight.numel() % groups:
                _pack(module.weight, 8, groups, True, name)


def pack_slice(weight: torch.Tensor, spec: SliceSpec, rank: int, tp: int, bits: int, groups: int | None, symmetric: bool, name: str) -> PackedWeight:
    """This rank's slice of ``weight`` (``[out, in]``; ``spec`` cuts it along its ``dim``), packed with the full weight's groups.

    The codes and per-element scales (and zero points) of the full weight's quantization are cut by
    ``spec`` like the weight; the row-group size of the slice is the largest divisor of its width whose
    row segments never span two of the full weight's groups (group ids cut alongside, padding its own
    id), so every stored scale is one of the full weight's, unchanged."""
    full = _pack(weight, bits, groups, symmetric, name)
    rows, columns, size = full.rows, full.columns, full.group_size
    codes = stored_codes(full)
    scale = full.scale.repeat_interleave(size, dim=1)
    zero = None if full.zero is None else full.zero.repeat_interleave(size, dim=1)
    ids = torch.arange(rows)[:, None] * (columns // size) + torch.arange(columns)[None, :] // size + 1  # 0: padding

    def cut(t: torch.Tensor) -> torch.Tensor:
        return spec.take(t, rank, tp)

    codes, scale, ids = cut(codes), cut(scale), cut(ids)
    zero = None if zero is None else cut(zero)
    local_rows, width = codes.shape
    group = next(g for g in range(min(size, width), 0, -1) if width % g == 0 and bool((ids.reshape(local_rows, -1, g) == ids[:, ::g, None]).all()))
    if group < size:
        log.info("%s: quantization groups of %d columns cut by the tensor-parallel slice; stored as groups of %d with the same scales", name, size, group)
    data = store_codes(codes, full.bits, zero is None)
    packed = PackedWeight(data, scale[:, ::group].contiguous(), None if zero is None else zero[:, ::group].contiguous(), full.bits, group, (local_rows, width))
    expected = cut(dequantize(full))
    if not torch.equal(dequantize(packed), expected):  # the construction above is exact; this is its guard
        raise AssertionError(f"{name}: the packed slice does not dequantize to the slice of the full weight's quantization")
    return packed


def quantize_model_weights(
    model: nn.Module,
    bits: int,
    groups: int | None,
    symmetric: bool,
    slices: dict[str, SliceSpec] | None = None,
    rank: int = 0,
    tp: int = 1,
    quantize_embeddings: bool = False,
) -> dict[str, int]:
    """Swap ``model``'s Linear/Conv1D/Embedding layers for packed ones in place; returns counts by kind.

    ``groups``: DeepSpeed's ``q_groups``, or None for rows of 128-column groups (``weight_groups``).
    ``quantize_embeddings``: quantize the embeddings and the output head too; by default they stay float
    (counted under ``"float"``).

    ``slices`` (tensor parallelism): the weights this rank holds a slice of, by parameter name, still
    full in ``model``; each is packed as its slice (``pack_slice``), the others whole. Biases are left
    to the caller, under their same names."""
    slices = slices or {}
    dtype = next(model.parameters()).dtype
    embeddings: dict[int, InferenceQuantizedEmbedding] = {}
    counts = {"linear": 0, "embedding": 0, "tied": 0, "float": 0, "sliced": 0}
    keep = set() if quantize_embeddings else float_modules(model)

    def pack(name: str, weight: torch.Tensor, transposed: bool = False) -> PackedWeight:
        spec = slices.get(f"{name}.weight")
        if spec is None:
            return _pack(weight.t().contiguous() if transposed else weight, bits, groups, symmetric, name)
        counts["sliced"] += 1
        if transposed:  # Conv1D stores [in, out]; the packed weight is [out, in]
            spec = dataclasses.replace(spec, dim=1 - spec.dim)
            weight = weight.t().contiguous()
        return pack_slice(weight, spec, rank, tp, bits, groups, symmetric, name)

    named = list(model.named_modules())
    for name, module in named:  # embeddings first, so tied heads find their packed table
        if id(module) in keep:
            counts["float"] += 1
        elif type(module) is nn.Embedding:
            replacement = InferenceQuantizedEmbedding(module, pack(name, module.weight), dtype)
            embeddings[id(module.weight)] = replacement
            _replace(model, name, replacement)
            counts["embedding"] += 1
    for name, module in named:
        if id(module) in keep:
            continue
        if isinstance(module, nn.Linear) and id(module.weight) in embeddings:
            _replace(model, name, QuantizedTiedLinear(embeddings[id(module.weight)], module.bias))
            counts["tied"] += 1
        elif isinstance(module, nn.Linear):
            _replace(model, name, QuantizedLinear(pack(name, module.weight), module.bias))
            counts["linear"] += 1
        elif _is_conv1d(module):
            _replace(model, name, QuantizedLinear(pack(name, module.weight, transposed=True), module.bias))
            counts["linear"] += 1
    if not slices:
        counts.pop("sliced")
    return counts


def packed_storage(model: nn.Module) -> dict[str, str]:
    """Each quantized weight's parameter name in the float model -> the path of the module holding its packed tensors."""
    out: dict[str, str] = {}
    paths = {id(m): n for n, m in model.named_modules()}
    for name, module in model.named_modules():
        if isinstance(module, _PackedStorage):
            out[f"{name}.weight"] = name
        elif isinstance(module, QuantizedTiedLinear):
            out[f"{name}.weight"] = paths[id(module.embedding)]
    return out


def packed_linear(
    x: torch.Tensor,
    data: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bias: torch.Tensor | None,
    bits: int,
    group_size: int,
    rows: int,
    columns: int,
) -> torch.Tensor:
    """``QuantizedLinear``'s product as one function of tensors: what a graph calls for a linear whose weight is packed."""
    return quantized_matmul(x, PackedWeight(data, scale, zero, bits, group_size, (rows, columns)), bias)


def packed_embedding(
    data: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    indices: torch.Tensor,
    bits: int,
    group_size: int,
    rows: int,
    columns: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``InferenceQuantizedEmbedding``'s lookup as one function of tensors (only the looked-up rows dequantized)."""
    return embedding_rows(PackedWeight(data, scale, zero, bits, group_size, (rows, columns)), indices).to(dtype)


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
