"""``redundancy_clean``: bake the trained compression into a model that is really smaller.

After compression training, every prepared layer is replaced by what the graph computed, stored
compactly:

- weight quantization: the weights at ``target_bits`` as packed integer codes with float32 scales
  (and zero points): ``QuantizedLinear`` (runs the quantized matmul kernel), ``QuantizedConv2d``,
  ``QuantizedEmbedding`` (a tied output projection reads the embedding's table:
  ``QuantizedTiedLinear``); the stored values are exactly the fake-quantized ones;
- sparse pruning: the masked weights are zero (the zero code of a quantized layer);
- row / head / channel pruning with ``related_modules``: the pruned rows, heads or channels are
  removed, so the matrices are physically smaller, and the shapes are propagated: the related
  layers lose the matching input columns (attention Q/K/V lose the pruned heads' rows; a fused
  QKV projection is recognised by its 3x width; BatchNorm2d loses the pruned channels); the
  attention module's head count (``num_heads``, ``n_heads``, ``num_attention_heads``, ``n_head``,
  ``all_head_size``, ``split_size``) is left as it was, as DeepSpeed leaves it (its BERT example
  sets it afterwards), and named in a warning; without related modules the pruned outputs are
  zeroed, as in DeepSpeed;
- activation quantization: the layer keeps quantizing its input (dynamic, or with the calibrated
  range).

Quantization codes are computed from the full (unpruned) matrix, as in training, then rows and
columns are selected: scales follow their columns, so the cleaned layer computes exactly what the
compressed-training forward did. Then the compression state is removed.

Why on modules and not as a graph pass: it changes parameter shapes, dtypes and the module tree,
which the state_dict, the optimizer and every later compile see; it runs once, after training.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dscompile.errors import DSCompileConfigError
from dscompile.kernels.quantize import PackedWeight, dequantize, mask_packed, quantize_weight, select_columns, select_rows
from dscompile.passes.compression import SECTION, detach_compression
from dscompile.runtime.compression.quantized import QuantizedConv2d, QuantizedEmbedding, QuantizedLinear, QuantizedTiedLinear
from dscompile.runtime.compression.scheduler import SCHEDULER_ATTRIBUTE
from dscompile.runtime.compression.state import ActQuantSpec, CompressionState
from dscompile.runtime.compression.state import log as state_log

log = logging.getLogger("dscompile.passes.redundancy_clean")

HEAD_COUNT_ATTRIBUTES = ("num_heads", "n_heads", "num_attention_heads", "n_head")
HEAD_WIDTH_ATTRIBUTES = ("all_head_size", "split_size")


@dataclass
class CleanLayer:
    """A layer on its way out: its effective weight (float, for checks and unquantized layers),
    its packed form, bias and input quantization."""

    name: str
    module: nn.Module
    weight: torch.Tensor
    bias: torch.Tensor | None
    packed: PackedWeight | None = None
    act: ActQuantSpec | None = None
    act_range: torch.Tensor | None = None
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # BatchNorm running statistics

    def keep_rows(self, keep: torch.Tensor) -> None:
        index = keep.nonzero().reshape(-1)
        self.weight = self.weight[index]
        self.bias = None if self.bias is None else self.bias[index]
        self.packed = None if self.packed is None else select_rows(self.packed, keep)
        self.extra = {k: v[index] for k, v in self.extra.items()}

    def keep_columns(self, keep: torch.Tensor) -> None:
        """Keep input features (a conv's input channels: each spans its kernel window)."""
        if self.weight.dim() == 1:  # BatchNorm2d: its features are its channels
            self.keep_rows(keep)
            return
        index = keep.nonzero().reshape(-1)
        self.weight = self.weight[:, index]
        inner = self.weight[0, 0].numel() if self.weight.dim() > 2 else 1
        self.packed = None if self.packed is None else select_columns(self.packed, keep, inner)

    def zero_rows(self, keep: torch.Tensor) -> None:
        shape = (-1,) + (1,) * (self.weight.dim() - 1)
        self.weight = self.weight * keep.reshape(shape).to(self.weight.dtype)
        self.bias = None if self.bias is None else self.bias * keep.to(self.bias.dtype)
        self._mask_packed(keep.reshape(shape).expand(self.weight.shape))

    def zero_elements(self, keep: torch.Tensor) -> None:
        self.weight = self.weight * keep.reshape(self.weight.shape).to(self.weight.dtype)
        self._mask_packed(keep.reshape(self.weight.shape))

    def _mask_packed(self, keep: torch.Tensor) -> None:
        if self.packed is not None:
            try:
                self.packed = mask_packed(self.packed, keep)
            except ValueError as exc:
                raise DSCompileConfigError(f"{SECTION}.weight_quantization", f"{self.name}: {exc}", "use symmetric quantization with pruning") from None


def _float_layer(module: nn.Module, name: str) -> CleanLayer:
    if isinstance(module, nn.BatchNorm2d):
        extra = {"running_mean": module.running_mean.detach().clone(), "running_var": module.running_var.detach().clone()}
        return CleanLayer(name, module, module.weight.detach().clone(), module.bias.detach().clone(), extra=extra)
    bias = getattr(module, "bias", None)
    return CleanLayer(name, module, module.weight.detach().clone(), None if bias is None else bias.detach().clone())


def _warn_off(state: CompressionState, technique: str) -> None:
    if not state.enabled(technique):
        log.warning(
            "%s: %s is baked in although the schedule has not switched it on (the cleaned model differs from the last training forward)",
            state.layer_name,
            technique,
        )


def _own_layer(model: nn.Module, state: CompressionState, shrinks: list[tuple[str, str, torch.Tensor, Any]]) -> CleanLayer:
    """Quantize and mask one prepared layer; queue the shrinking of its related layers."""
    module = model.get_submodule(state.layer_name)
    layer = _float_layer(module, state.layer_name)
    weight = module.weight.detach()
    wq = state.weight_quant
    if wq is not None:
        _warn_off(state, "weight_quant")
        if wq.bits_at(10**12) != wq.target_bits:  # pragma: no cover - specs always end at the target
            raise AssertionError("weight schedule does not end at target_bits")
        layer.packed = quantize_weight(weight, wq.target_bits, wq.num_groups, wq.symmetric)
        layer.weight = dequantize(layer.packed).to(weight.dtype)
    for technique in ("sparse", "row", "head", "channel"):
        spec = state.masks.get(technique)
        if spec is None:
            continue
        _warn_off(state, technique)
        mask = state.mask(technique).to(torch.bool)
        related = state.related.get(technique, [])
        if technique == "sparse":
            layer.zero_elements(mask)
        elif technique in ("row", "channel"):
            if related:
                layer.keep_rows(mask)
                shrinks.extend((name, "columns", mask, None) for name in related)
            else:
                layer.zero_rows(mask)
        else:  # head: the output projection's input columns, grouped by head
            columns = mask.repeat_interleave(weight.shape[1] // spec.num_heads)
            if related:
                layer.keep_columns(columns)
                shrinks.extend((name, "heads", mask, weight.shape[1]) for name in related)
            else:
                layer.zero_elements(columns.reshape(1, -1).expand(weight.shape))
    if state.act_quant is not None:
        _warn_off(state, "act_quant")
        layer.act = state.act_quant
        layer.act_range = getattr(state, "aq_range", None)
    return layer


def _head_rows(layer: CleanLayer, heads: torch.Tensor, width: int) -> torch.Tensor:
    """Which rows of a Q/K/V (or fused QKV) projection belong to the kept heads."""
    rows = layer.weight.shape[0]
    per_head = heads.repeat_interleave(width // heads.numel())
    if rows % width:
        raise DSCompileConfigError(
            f"{SECTION}.head_pruning.different_groups",
            f"related module {layer.name!r} has {rows} outputs, not a multiple of the {width} inputs of the pruned output projection",
        )
    return per_head.repeat(rows // width)


def _stale_head_counts(model: nn.Module, related: str, old_heads: int, new_heads: int, head_dim: int) -> list[str]:
    """The attention module's head-count attributes, which still say ``old_heads`` after the clean.

    DeepSpeed's ``redundancy_clean`` leaves them as they are and its BERT example sets them itself
    afterwards (``num_attention_heads = ceil(num_attention_heads * dense_ratio)``, ``all_head_size``):
    changing them here would make such a script shrink them twice. They are reported instead."""
    parent_name = related.rpartition(".")[0]
    parent = model.get_submodule(parent_name) if parent_name else model
    stale = []
    for attribute in HEAD_COUNT_ATTRIBUTES:
        if getattr(parent, attribute, None) == old_heads:
            stale.append(f"{parent_name}.{attribute} = {old_heads} (kept heads: {new_heads})")
    for attribute in HEAD_WIDTH_ATTRIBUTES:
        if getattr(parent, attribute, None) == old_heads * head_dim:
            stale.append(f"{parent_name}.{attribute} = {old_heads * head_dim} (kept: {new_heads * head_dim})")
    return stale


def _replacement(layer: CleanLayer) -> nn.Module:
    """The cleaned module, in the train/eval mode of the one it replaces (a BatchNorm built fresh would
    otherwise normalize an evaluated model with batch statistics)."""
    return _built(layer).train(layer.module.training)


def _built(layer: CleanLayer) -> nn.Module:
    module = layer.module
    if isinstance(module, nn.BatchNorm2d):
        new = nn.BatchNorm2d(layer.weight.shape[0], module.eps, module.momentum, module.affine, module.track_running_stats)
        with torch.no_grad():
            new.weight.copy_(layer.weight)
            new.bias.copy_(layer.bias)
            new.running_mean.copy_(layer.extra["running_mean"])
            new.running_var.copy_(layer.extra["running_var"])
            new.num_batches_tracked.copy_(module.num_batches_tracked)
        return new.to(module.weight.device)
    if layer.packed is not None:
        if isinstance(module, nn.Embedding):
            return QuantizedEmbedding(module, layer.packed)
        if isinstance(module, nn.Conv2d):
            return QuantizedConv2d(module, layer.packed, layer.bias, layer.act, layer.act_range)
        return QuantizedLinear(layer.packed, layer.bias, layer.act, layer.act_range)
    if isinstance(module, nn.Linear):
        new = nn.Linear(layer.weight.shape[1], layer.weight.shape[0], bias=layer.bias is not None)
    elif isinstance(module, nn.Conv2d):
        w = layer.weight
        new = nn.Conv2d(
            w.shape[1] * module.groups,
            w.shape[0],
            module.kernel_size,
            module.stride,
            module.padding,
            module.dilation,
            module.groups,
            layer.bias is not None,
            module.padding_mode,
        )
    else:
        new = nn.Embedding(layer.weight.shape[0], layer.weight.shape[1], module.padding_idx)
    new = new.to(device=module.weight.device, dtype=module.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(layer.weight)
        if layer.bias is not None:
            new.bias.copy_(layer.bias)
    if layer.act is not None:
        return InputQuantized(new, layer.act, layer.act_range)
    return new


class InputQuantized(nn.Module):
    """A float layer that quantizes its input (activation quantization on an unquantized weight)."""

    def __init__(self, layer: nn.Module, act: ActQuantSpec, act_range: torch.Tensor | None) -> None:
        super().__init__()
        self.layer = layer
        self.act = act
        if act.static:
            self.register_buffer("act_range", act_range.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from dscompile.kernels.quantize import activation_values, static_values

        if self.act.static:
            x = static_values(x, self.act_range, bits=self.act.bits, symmetric=self.act.symmetric)
        else:
            x = activation_values(x, bits=self.act.bits, symmetric=self.act.symmetric, per=self.act.per)
        return self.layer(x)


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, module)


def clean_model(model: nn.Module) -> dict[str, Any]:
    """Replace every prepared layer of ``model`` by its compact, cleaned form; returns a report."""
    states: list[CompressionState] = []
    seen: set[int] = set()
    for module in model.modules():
        state = getattr(module, "ds_compression", None)
        if isinstance(state, CompressionState) and id(state) not in seen:
            seen.add(id(state))
            states.append(state)
    layers: dict[str, CleanLayer] = {}
    shrinks: list[tuple[str, str, torch.Tensor, Any]] = []
    with torch.no_grad():
        for state in states:
            layers[state.layer_name] = _own_layer(model, state, shrinks)
        report: dict[str, Any] = {"layers": {}, "head_counts": []}
        updated: set[str] = set()
        for name, how, mask, width in shrinks:
            layer = layers.get(name) or _float_layer(model.get_submodule(name), name)
            layers[name] = layer
            if how == "columns":
                layer.keep_columns(mask)
            else:
                layer.keep_rows(_head_rows(layer, mask, width))
                if name.rpartition(".")[0] not in updated:
                    updated.add(name.rpartition(".")[0])
                    report["head_counts"] += _stale_head_counts(model, name, mask.numel(), int(mask.sum()), width // mask.numel())
        for state in states:
            layer = layers.pop(state.layer_name)
            new = _replacement(layer)
            _set(model, state.layer_name, new)
            report["layers"][state.layer_name] = _describe(layer, new)
            for sharer in state.sharers[1:]:
                old = model.get_submodule(sharer)
                bias = getattr(old, "bias", None)
                if isinstance(new, QuantizedEmbedding):
                    shared = QuantizedTiedLinear(new, bias)
                elif isinstance(new, QuantizedLinear):
                    shared = QuantizedLinear(new.packed, bias)
                else:
                    shared = None
                if shared is not None:
                    _set(model, sharer, shared)
                    report["layers"][sharer] = f"reads the packed weight of {state.layer_name}"
        for name, layer in layers.items():  # related layers that were not compressed themselves
            new = _replacement(layer)
            _set(model, name, new)
            report["layers"][name] = _describe(layer, new)
    if report["head_counts"]:
        log.warning(
            "redundancy_clean removed pruned attention heads; as in DeepSpeed, the attention modules' head counts are left as they "
            "were: %s. Set them to the kept heads where the model's forward reads them (DeepSpeed's BERT example does)",
            "; ".join(report["head_counts"]),
        )
    detach_compression(model)
    if SCHEDULER_ATTRIBUTE in vars(model):
        delattr(model, SCHEDULER_ATTRIBUTE)
    state_log.debug("redundancy_clean: %s", report)
    return report


def _describe(layer: CleanLayer, new: nn.Module) -> str:
    shape = "x".join(str(s) for s in layer.weight.shape)
    if layer.packed is not None:
        return f"{type(new).__name__} {shape} at {layer.packed.bits}-bit storage, group {layer.packed.group_size}"
    return f"{type(new).__name__} {shape}"
