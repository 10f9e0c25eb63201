"""DeepSpeed Compression's ``compression_training`` config section, module matching and the plan.

The section keeps DeepSpeed's keys and defaults: ``weight_quantization``,
``activation_quantization``, ``sparse_pruning``, ``row_pruning``, ``head_pruning``,
``channel_pruning`` (each ``{"shared_parameters": {...}, "different_groups": {NAME: {"params":
{...}, "modules": [...], "related_modules": [[...]]}}}``) and ``layer_reduction``. Unknown keys and
values DeepSpeed would reject are errors naming the key.

Module matching follows DeepSpeed: each entry of ``modules`` is a regular expression searched in
the qualified module names of ``model.named_modules()`` (``"*"``, DeepSpeed's default, matches every
module); only modules a technique supports match (Linear, Conv2d, Embedding as below), and a module
matched by two groups of one technique is an error. An entry matching nothing is ignored, as
DeepSpeed ignores it, with a warning naming it. ``related_modules`` (row, head, channel pruning)
pairs the j-th module matched by a related entry with the j-th module matched by its ``modules``
entry: the layers whose inputs shrink when ``redundancy_clean`` removes the pruned outputs; a
related entry matching nothing is ignored (DeepSpeed's CIFAR config names ``bn1`` layers that a
ResNet built without batch norm does not have), one matching another number of modules is an error.

``attach_compression`` (``init_compression``) works on modules, the passes on graphs: the state a
technique needs (bit width, switches, masks, learned mask scores, calibrated ranges) must exist
before the optimizer is built (scores are parameters it trains) and live in the model's
``state_dict`` (checkpoints), so each compressed layer gets a ``CompressionState`` child; the
layers keep their class and forward, and the ``quantize``/``prune`` passes decide where in the
captured graph the state applies. The model's own calls are routed through a dscompile compile
(``runtime/compression/direct_calls.py``), so ``model(x)`` is compressed as DeepSpeed's swapped
layers are.

As in DeepSpeed, ``init_compression`` decides ``l1`` masks from the weights it sees, and draws the
global random numbers DeepSpeed's draws (its layer replacement initializes a fresh layer per
compressible module; then the learned ``topk`` scores, in its order), so a seeded script picks the
same random scores and shuffles its data the same way afterwards.

What differs from DeepSpeed, on purpose:
- ``quantize_weight_in_forward: false`` (DeepSpeed's MoQ, which rewrites the weights in place after
  each optimizer step) quantizes in the forward graph too, with the same bit schedule, so the fp32
  master weights are never rounded; ``true`` uses ``target_bits`` from ``schedule_offset`` on, as in
  DeepSpeed. ``quantizer_kernel`` chooses DeepSpeed's CUDA kernel for the same formulas and changes
  nothing here.
- ``head_pruning`` and ``channel_pruning`` also implement ``l1`` (DeepSpeed accepts it in the config
  and fails in the layer).
- ``snip_momentum`` is dscompile's own implementation (DeepSpeed calls Intel Neural Compressor):
  block scores ``s <- 0.9 s + |w * grad|`` accumulated after each backward, sparsity raised on a
  cubic schedule from ``schedule_offset`` to ``schedule_offset_end`` every
  ``schedule_offset_stride`` steps, blocks of ``block_pattern`` = "RxC" rows x columns.
- ``layer_reduction`` without a teacher model uses the model's own layers as the teacher's.
- ``init_compression`` sets the schedule at step 0; DeepSpeed's layers switch on at its engine's
  first forward (or ``compression_scheduler`` step). The same for scripts that build their engine
  before computing, as DeepSpeed's examples do.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from dscompile.config import DSConfig, parse_dataclass, read_json_config, register_section
from dscompile.errors import DSCompileConfigError, DSCompileError, suggest
from dscompile.passes.layer_reduction import LayerReductionConfig, reduce_layers
from dscompile.pipeline import PassInvocation, invocation, register_config_rule
from dscompile.runtime.compression.direct_calls import guard_layer, route_calls, unguard_layers, unroute_calls
from dscompile.runtime.compression.scheduler import CompressionScheduler, attach_scheduler, scheduler_of
from dscompile.runtime.compression.state import PREPARED, ActQuantSpec, CompressionState, MaskSpec, WeightQuantSpec, draw_scores, state_of
from dscompile.runtime.engine_core import register_engine_extension

log = logging.getLogger("dscompile.passes.compression")

SECTION = "compression_training"
TECHNIQUES = ("weight_quantization", "activation_quantization", "sparse_pruning", "row_pruning", "head_pruning", "channel_pruning")

# Module kinds each technique acts on (DeepSpeed's compressible layers and what each one implements).
KINDS: dict[str, tuple[type[nn.Module], ...]] = {
    "weight_quantization": (nn.Linear, nn.Conv2d, nn.Embedding),
    "activation_quantization": (nn.Linear, nn.Conv2d),
    "sparse_pruning": (nn.Linear, nn.Conv2d),
    "row_pruning": (nn.Linear,),
    "head_pruning": (nn.Linear,),
    "channel_pruning": (nn.Conv2d,),
}
RELATED_KINDS: dict[str, tuple[type[nn.Module], ...]] = {
    "row_pruning": (nn.Linear,),
    "head_pruning": (nn.Linear,),
    "channel_pruning": (nn.Conv2d, nn.BatchNorm2d),
}


# ---------------------------------------------------------------------------------------------
# dataclasses: DeepSpeed's keys and defaults
# ---------------------------------------------------------------------------------------------
@dataclass
class FP16MixedQuantize:
    """``fp16_mixed_quantize``: blend ``r * w + (1 - r) * q(w)``, ``r`` falling by the ratio each step."""

    enabled: bool = False
    quantize_change_ratio: float = 0.001


@dataclass
class WeightQuantizationShared:
    enabled: bool = False
    quantizer_kernel: bool = False
    schedule_offset: int = 0
    quantize_groups: int = 1
    quantize_verbose: bool = False
    quantization_type: Literal["symmetric", "asymmetric"] = "symmetric"
    rounding: Literal["nearest", "stochastic"] = "nearest"
    quantize_weight_in_forward: bool = False
    fp16_mixed_quantize: FP16MixedQuantize = field(default_factory=FP16MixedQuantize)

    def validate(self, path: str) -> None:
        _non_negative(self.schedule_offset, f"{path}.schedule_offset")
        if self.quantize_groups < 1:
            raise DSCompileConfigError(f"{path}.quantize_groups", f"must be >= 1, got {self.quantize_groups}")
        if not 0 <= self.fp16_mixed_quantize.quantize_change_ratio <= 1:
            raise DSCompileConfigError(f"{path}.fp16_mixed_quantize.quantize_change_ratio", "must be in [0, 1]")


@dataclass
class WeightQuantizationParams:
    start_bits: int
    target_bits: int
    quantization_period: int = 1

    def validate(self, path: str) -> None:
        if not 1 <= self.target_bits <= 8:
            raise DSCompileConfigError(f"{path}.target_bits", f"must be in [1, 8] (1 binary, 2 ternary), got {self.target_bits}")
        if self.start_bits < self.target_bits:
            raise DSCompileConfigError(f"{path}.start_bits", f"({self.start_bits}) must be >= target_bits ({self.target_bits})")
        if self.quantization_period < 0:  # 0 (DeepSpeed's examples): one bit less at every quantization
            raise DSCompileConfigError(f"{path}.quantization_period", f"must be >= 0, got {self.quantization_period}")


@dataclass
class ActivationQuantizationShared:
    enabled: bool = False
    quantization_type: Literal["symmetric", "asymmetric"] = "symmetric"
    range_calibration: Literal["dynamic", "static"] = "dynamic"
    schedule_offset: int = 1000

    def validate(self, path: str) -> None:
        _non_negative(self.schedule_offset, f"{path}.schedule_offset")


@dataclass
class ActivationQuantizationParams:
    bits: int

    def validate(self, path: str) -> None:
        if self.bits not in (4, 8):
            raise DSCompileConfigError(f"{path}.bits", f"activations are quantized to 4 or 8 bits (as in DeepSpeed), got {self.bits}")


@dataclass
class SparsePruningShared:
    """``block_pattern``, ``dense_ratio``, ``schedule_offset_stride``, ``excluded_modules`` and
    ``schedule_offset_end`` (default ``schedule_offset``) belong to ``snip_momentum``; DeepSpeed
    ignores them for the other methods (a warning names them)."""

    enabled: bool = False
    method: Literal["l1", "topk", "snip_momentum"] = "l1"
    schedule_offset: int = 1000
    schedule_offset_end: int | None = None
    block_pattern: str = "4x1"
    dense_ratio: float = 0.1
    schedule_offset_stride: int = 1
    excluded_modules: list[str] = field(default_factory=list)

    def validate(self, path: str) -> None:
        _non_negative(self.schedule_offset, f"{path}.schedule_offset")
        if self.schedule_offset_end is None:
            self.schedule_offset_end = self.schedule_offset
        if self.schedule_offset_end < self.schedule_offset:
            raise DSCompileConfigError(f"{path}.schedule_offset_end", f"({self.schedule_offset_end}) must be >= schedule_offset ({self.schedule_offset})")
        if not 0 < self.dense_ratio < 1:
            raise DSCompileConfigError(f"{path}.dense_ratio", f"must be in (0, 1), got {self.dense_ratio}")
        if self.schedule_offset_stride < 1:
            raise DSCompileConfigError(f"{path}.schedule_offset_stride", f"must be >= 1, got {self.schedule_offset_stride}")
        block_shape(self.block_pattern, f"{path}.block_pattern")


@dataclass
class PruningShared:
    """``row_pruning``/``channel_pruning`` shared parameters."""

    enabled: bool = False
    method: Literal["l1", "topk"] = "l1"
    schedule_offset: int = 1000

    def validate(self, path: str) -> None:
        _non_negative(self.schedule_offset, f"{path}.schedule_offset")


@dataclass
class HeadPruningShared:
    enabled: bool = False
    method: Literal["topk", "l1"] = "topk"
    schedule_offset: int = 1000
    num_heads: int | None = None

    def validate(self, path: str) -> None:
        _non_negative(self.schedule_offset, f"{path}.schedule_offset")
        if self.enabled and (self.num_heads is None or self.num_heads < 1):
            raise DSCompileConfigError(f"{path}.num_heads", "must be given (a positive integer) when head pruning is enabled")


@dataclass
class DenseRatioParams:
    dense_ratio: float

    def validate(self, path: str) -> None:
        if not 0 < self.dense_ratio <= 1:
            raise DSCompileConfigError(f"{path}.dense_ratio", f"must be in (0, 1], got {self.dense_ratio}")


@dataclass
class Group:
    """One entry of ``different_groups``: its ``params``, the ``modules`` it matches and, for row,
    head and channel pruning, the ``related_modules`` whose inputs shrink with them."""

    name: str
    params: Any
    modules: list[str]
    related_modules: list[list[str]] | None = None


@dataclass
class Technique:
    shared: Any
    groups: list[Group] = field(default_factory=list)

    @property
    def enabled(self) -> bool:
        return bool(self.shared.enabled)


@dataclass
class CompressionConfig:
    """The parsed ``compression_training`` section."""

    weight_quantization: Technique
    activation_quantization: Technique
    sparse_pruning: Technique
    row_pruning: Technique
    head_pruning: Technique
    channel_pruning: Technique
    layer_reduction: LayerReductionConfig

    def technique(self, name: str) -> Technique:
        return getattr(self, name)

    def enabled_techniques(self) -> list[str]:
        return [name for name in TECHNIQUES if self.technique(name).enabled]

    @property
    def any_enabled(self) -> bool:
        return bool(self.enabled_techniques()) or self.layer_reduction.enabled


_SHARED: dict[str, type] = {
    "weight_quantization": WeightQuantizationShared,
    "activation_quantization": ActivationQuantizationShared,
    "sparse_pruning": SparsePruningShared,
    "row_pruning": PruningShared,
    "head_pruning": HeadPruningShared,
    "channel_pruning": PruningShared,
}
_PARAMS: dict[str, type] = {
    "weight_quantization": WeightQuantizationParams,
    "activation_quantization": ActivationQuantizationParams,
    "sparse_pruning": DenseRatioParams,
    "row_pruning": DenseRatioParams,
    "head_pruning": DenseRatioParams,
    "channel_pruning": DenseRatioParams,
}
_SNIP_ONLY = ("block_pattern", "dense_ratio", "schedule_offset_stride", "excluded_modules", "schedule_offset_end")


def _non_negative(value: int, path: str) -> None:
    if value < 0:
        raise DSCompileConfigError(path, f"must be >= 0, got {value}")


def block_shape(pattern: str, path: str = "block_pattern") -> tuple[int, int]:
    """``"RxC"`` -> (R, C): blocks of R rows by C columns of the ``[out, in]`` weight."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", pattern)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise DSCompileConfigError(path, f"{pattern!r} is not a block pattern", "write it as 'RxC', e.g. '4x1'")
    return int(m.group(1)), int(m.group(2))


def _expect_mapping(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise DSCompileConfigError(path, f"expected a JSON object, got {type(value).__name__}")
    return value


def _parse_group(technique: str, name: str, value: Any, path: str) -> Group:
    data = _expect_mapping(value, path)
    allowed = {"params", "modules", "related_modules"}
    for key in data:
        if key not in allowed:
            raise DSCompileConfigError(f"{path}.{key}", "unknown key", suggest(key, allowed) or f"valid keys: {', '.join(sorted(allowed))}")
    if "params" not in data:
        raise DSCompileConfigError(f"{path}.params", "is required")
    params = parse_dataclass(_PARAMS[technique], data["params"], f"{path}.params")
    modules = data.get("modules", ["*"])
    if isinstance(modules, str):
        modules = [modules]
    if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules) or not modules:
        raise DSCompileConfigError(f"{path}.modules", "expected a non-empty list of module-name patterns")
    for pattern in modules:
        _check_pattern(pattern, f"{path}.modules")
    related = data.get("related_modules")
    if related is not None:
        if technique not in RELATED_KINDS:
            raise DSCompileConfigError(f"{path}.related_modules", f"only row, head and channel pruning shrink related modules, not {technique}")
        if not isinstance(related, list) or not all(isinstance(r, list) and all(isinstance(s, str) for s in r) for r in related):
            raise DSCompileConfigError(f"{path}.related_modules", "expected a list of lists of module-name patterns, one list per 'modules' entry")
        if len(related) != len(modules):
            raise DSCompileConfigError(
                f"{path}.related_modules",
                f"has {len(related)} entries for {len(modules)} 'modules' entries",
                "give one list of related patterns per modules entry",
            )
        for entry in related:
            for pattern in entry:
                _check_pattern(pattern, f"{path}.related_modules")
    return Group(name, params, list(modules), related)


def _check_pattern(pattern: str, path: str) -> None:
    if pattern == "*":
        return
    try:
        re.compile(pattern)
    except re.error as exc:
        raise DSCompileConfigError(path, f"{pattern!r} is not a regular expression: {exc}", "use '*' for every module") from None


def _parse_technique(technique: str, value: Any, path: str) -> Technique:
    data = _expect_mapping(value, path)
    allowed = {"shared_parameters", "different_groups"}
    for key in data:
        if key not in allowed:
            raise DSCompileConfigError(f"{path}.{key}", "unknown key", suggest(key, allowed) or "valid keys: shared_parameters, different_groups")
    shared_raw = data.get("shared_parameters", {})
    shared = parse_dataclass(_SHARED[technique], shared_raw, f"{path}.shared_parameters")
    groups_raw = _expect_mapping(data.get("different_groups", {}), f"{path}.different_groups")
    groups = [_parse_group(technique, name, g, f"{path}.different_groups.{name}") for name, g in groups_raw.items()]
    if technique == "sparse_pruning" and shared.method != "snip_momentum":
        for key in (k for k in _SNIP_ONLY if k in _expect_mapping(shared_raw, f"{path}.shared_parameters")):
            log.warning("%s.shared_parameters.%s is ignored: a snip_momentum setting, and method is %r (DeepSpeed ignores it too)", path, key, shared.method)
        shared.schedule_offset_end = shared.schedule_offset
    needs_groups = not (technique == "sparse_pruning" and shared.method == "snip_momentum")
    if shared.enabled and needs_groups and not groups:
        raise DSCompileConfigError(f"{path}.different_groups", f"{technique} is enabled, so different_groups must name the modules it applies to")
    if technique == "weight_quantization":
        for group in groups:
            low, high = group.params.target_bits, group.params.start_bits
            reach = range(group.params.target_bits, group.params.target_bits + 1) if shared.quantize_weight_in_forward else range(low, high + 1)
            if min(reach) <= 2 and shared.quantization_type != "symmetric":
                raise DSCompileConfigError(f"{path}.shared_parameters.quantization_type", "binary and ternary (1-, 2-bit) quantization is symmetric")
            if min(reach) <= 2 and shared.rounding != "nearest":
                raise DSCompileConfigError(f"{path}.shared_parameters.rounding", "binary and ternary (1-, 2-bit) quantization rounds to nearest")
    return Technique(shared, groups)


def parse_compression(value: Any, path: str = SECTION) -> CompressionConfig:
    """Parse a ``compression_training`` section (DeepSpeed's keys and defaults)."""
    data = _expect_mapping(value, path)
    allowed = set(TECHNIQUES) | {"layer_reduction"}
    for key in data:
        if key not in allowed:
            raise DSCompileConfigError(f"{path}.{key}", "unknown key", suggest(key, allowed) or f"valid keys: {', '.join(sorted(allowed))}")
    techniques = {name: _parse_technique(name, data.get(name, {}), f"{path}.{name}") for name in TECHNIQUES}
    layer_reduction = parse_dataclass(LayerReductionConfig, data.get("layer_reduction", {}), f"{path}.layer_reduction")
    return CompressionConfig(layer_reduction=layer_reduction, **techniques)


register_section(SECTION, parse_compression, "compression training")


def compression_of(config: Any) -> CompressionConfig | None:
    """The parsed section of a ``DSConfig``, or None."""
    return config.sections.get(SECTION)


# The compression passes run first on the Dynamo graph (after the attention rewrites, order 10),
# before mixed precision (15) casts the weights and ZeRO (20) schedules gathers, so they see
# fp32 weights and full (gathered) parameters.
@register_config_rule(12, "compression")
def _compression_rule(config: Any) -> list[PassInvocation]:
    section = compression_of(config)
    if section is None:
        return []
    enabled = section.enabled_techniques()
    items = []
    if {"weight_quantization", "activation_quantization"} & set(enabled):
        items.append(invocation("quantize"))
    if {"sparse_pruning", "row_pruning", "head_pruning", "channel_pruning"} & set(enabled):
        items.append(invocation("prune"))
    return items


@register_engine_extension(5, "compression")
def _compression_engine_extension(config: Any) -> Any:
    """Every engine runs the schedule with its optimizer steps (``runtime/compression/extension.py``),
    before ZeRO (10) partitions the model it prepares."""
    from dscompile.runtime.compression.extension import CompressionExtension

    section = compression_of(config)
    if section is None or not section.any_enabled:
        return None
    return CompressionExtension(lambda model: prepare_model(model, section, call_options=direct_call_options(config.raw)))


# ---------------------------------------------------------------------------------------------
# module matching
# ---------------------------------------------------------------------------------------------
def pattern_matches(pattern: str, name: str) -> bool:
    """DeepSpeed's rule: ``re.search(pattern, name)``; ``"*"`` matches every name."""
    return pattern == "*" or re.search(pattern, name) is not None


def matching_modules(model: nn.Module, pattern: str, kinds: tuple[type[nn.Module], ...]) -> list[str]:
    """Names of the modules of ``kinds`` that ``pattern`` matches, in ``named_modules`` order."""
    return [name for name, module in model.named_modules() if name and isinstance(module, kinds) and pattern_matches(pattern, name)]


@dataclass
class ModuleAssignment:
    """One module a technique applies to: its group's parameters, the shared ones, and the modules
    whose inputs shrink with its outputs (``related``, possibly empty)."""

    technique: str
    module: str
    group: str
    shared: Any
    params: Any
    related: list[str] = field(default_factory=list)


def _describe_kinds(model: nn.Module, kinds: tuple[type[nn.Module], ...]) -> str:
    names = [n for n, m in model.named_modules() if n and isinstance(m, kinds)]
    sample = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
    return f"{'/'.join(k.__name__ for k in kinds)} modules here: {sample or 'none'}"


def assign_modules(model: nn.Module, section: CompressionConfig) -> list[ModuleAssignment]:
    """Every (technique, module) pair the enabled techniques of ``section`` apply to, in DeepSpeed's
    order: techniques, then groups, then ``modules`` entries, then ``named_modules`` order."""
    result: list[ModuleAssignment] = []
    for technique in section.enabled_techniques():
        entry = section.technique(technique)
        kinds = KINDS[technique]
        base = f"{SECTION}.{technique}.different_groups"
        taken: dict[str, str] = {}
        if technique == "sparse_pruning" and entry.shared.method == "snip_momentum" and not entry.groups:
            for name in matching_modules(model, "*", kinds):
                if not any(pattern_matches(p, name) for p in entry.shared.excluded_modules):
                    result.append(ModuleAssignment(technique, name, "snip_momentum", entry.shared, DenseRatioParams(entry.shared.dense_ratio)))
            continue
        for group in entry.groups:
            for index, pattern in enumerate(group.modules):
                names = matching_modules(model, pattern, kinds)
                if technique == "sparse_pruning" and entry.shared.method == "snip_momentum":
                    names = [n for n in names if not any(pattern_matches(p, n) for p in entry.shared.excluded_modules)]
                if not names:
                    log.warning("%s.%s.modules: pattern %r matches no module, ignored as DeepSpeed ignores it (%s)", base, group.name, pattern,
                                _describe_kinds(model, kinds))  # fmt: skip
                    continue
                for name in names:
                    if name in taken:
                        raise DSCompileConfigError(
                            f"{base}.{group.name}.modules",
                            f"module {name!r} is already compressed by group {taken[name]!r} of {technique}",
                            "match each module once",
                        )
                    taken[name] = group.name
                related_lists: list[list[str]] = []
                for related_pattern in (group.related_modules or [[]] * len(group.modules))[index]:
                    related_names = matching_modules(model, related_pattern, RELATED_KINDS[technique])
                    if not related_names:
                        log.warning("%s.%s.related_modules: pattern %r matches no module, ignored as DeepSpeed ignores it (%s)", base, group.name,
                                    related_pattern, _describe_kinds(model, RELATED_KINDS[technique]))  # fmt: skip
                        continue
                    if len(related_names) != len(names):
                        raise DSCompileConfigError(
                            f"{base}.{group.name}.related_modules",
                            f"pattern {related_pattern!r} matches {len(related_names)} modules for the {len(names)} matched by {pattern!r}",
                            "each related pattern must match one module per pruned module, in the same order",
                        )
                    related_lists.append(related_names)
                for position, name in enumerate(names):
                    related = [names_[position] for names_ in related_lists]
                    result.append(ModuleAssignment(technique, name, group.name, entry.shared, group.params, related))
    return result


def compressed_module_names(assignments: Iterable[ModuleAssignment]) -> list[str]:
    seen: dict[str, None] = {}
    for a in assignments:
        seen.setdefault(a.module, None)
    return list(seen)


# ---------------------------------------------------------------------------------------------
# init_compression: one CompressionState per compressed layer
# ---------------------------------------------------------------------------------------------
def _kind(module: nn.Module) -> str:
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Conv2d):
        return "conv2d"
    if isinstance(module, nn.Embedding):
        return "embedding"
    raise DSCompileConfigError(SECTION, f"{type(module).__name__} layers are not compressible")


def _weight_quant_spec(a: ModuleAssignment, module: nn.Module) -> WeightQuantSpec:
    shared: WeightQuantizationShared = a.shared
    params: WeightQuantizationParams = a.params
    # DeepSpeed quantizes embedding tables token-wise (one group per row) whatever quantize_groups says.
    groups = module.weight.shape[0] if isinstance(module, nn.Embedding) else shared.quantize_groups
    if module.weight.numel() % groups:
        raise DSCompileConfigError(
            f"{SECTION}.weight_quantization.shared_parameters.quantize_groups",
            f"{groups} groups do not divide the {module.weight.numel()} weights of {a.module!r}",
            "choose a divisor of every matched layer's weight count (e.g. its number of rows)",
        )
    return WeightQuantSpec(
        group=a.group,
        start_bits=params.start_bits,
        target_bits=params.target_bits,
        period=params.quantization_period,
        offset=shared.schedule_offset,
        in_forward=shared.quantize_weight_in_forward,
        symmetric=shared.quantization_type == "symmetric",
        stochastic=shared.rounding == "stochastic",
        num_groups=groups,
        mix_real=shared.fp16_mixed_quantize.enabled and not shared.quantize_weight_in_forward,
        change_ratio=shared.fp16_mixed_quantize.quantize_change_ratio,
        verbose=shared.quantize_verbose,
    )


def _mask_spec(a: ModuleAssignment, module: nn.Module) -> MaskSpec:
    technique = a.technique.removesuffix("_pruning")
    shared = a.shared
    weight = module.weight
    path = f"{SECTION}.{a.technique}"
    if technique == "sparse":
        spec = MaskSpec("sparse", shared.method, a.params.dense_ratio, shared.schedule_offset, shared.schedule_offset_end)
        if shared.method == "snip_momentum":
            rows, cols = block_shape(shared.block_pattern, f"{path}.shared_parameters.block_pattern")
            flat = weight.reshape(weight.shape[0], -1)
            if flat.shape[0] % rows or flat.shape[1] % cols:
                raise DSCompileConfigError(
                    f"{path}.shared_parameters.block_pattern", f"{rows}x{cols} blocks do not tile the {tuple(flat.shape)} weight of {a.module!r}"
                )
            spec = MaskSpec(
                "sparse",
                "snip_momentum",
                a.params.dense_ratio,
                shared.schedule_offset,
                shared.schedule_offset_end,
                block=(rows, cols),
                stride=shared.schedule_offset_stride,
            )
        return spec
    if technique == "head":
        heads = shared.num_heads
        if weight.shape[1] % heads:
            raise DSCompileConfigError(
                f"{path}.shared_parameters.num_heads", f"{heads} heads do not divide the {weight.shape[1]} input features of {a.module!r}"
            )
        return MaskSpec("head", shared.method, a.params.dense_ratio, shared.schedule_offset, shared.schedule_offset, num_heads=heads)
    return MaskSpec(technique, shared.method, a.params.dense_ratio, shared.schedule_offset, shared.schedule_offset)


def _merge_tied(state: CompressionState, name: str, wq: WeightQuantSpec | None, aq: ActQuantSpec | None, masks: dict[str, MaskSpec]) -> None:
    """A weight shared by several compressed layers (tied embeddings) is compressed once."""
    path = f"{SECTION}.different_groups"
    if wq is not None and state.weight_quant is not None:
        same = {**vars(wq), "num_groups": 0, "group": ""} == {**vars(state.weight_quant), "num_groups": 0, "group": ""}
        if not same:
            raise DSCompileConfigError(
                path, f"{name!r} shares its weight with {state.sharers[0]!r} but gets different weight quantization", "match only one of them"
            )
        if state.kind != "embedding" and wq.num_groups != state.weight_quant.num_groups:
            raise DSCompileConfigError(path, f"{name!r} shares its weight with {state.sharers[0]!r} with other quantize_groups")
    elif wq is not None or state.weight_quant is not None:
        raise DSCompileConfigError(path, f"{name!r} shares its weight with {state.sharers[0]!r}: quantize both or neither")
    if masks or state.masks:
        raise DSCompileConfigError(path, f"{name!r} shares its weight with {state.sharers[0]!r}: a shared weight cannot be pruned")
    if aq is not None:
        raise DSCompileConfigError(path, f"{name!r} shares its weight with {state.sharers[0]!r}: quantize the activations of unshared layers only")
    state.sharers.append(name)


def draw_like_deepspeed_replacement(model: nn.Module) -> None:
    """Draw the global random numbers DeepSpeed's ``init_compression`` draws before its scores.

    DeepSpeed replaces every Linear, Conv2d, Embedding and BatchNorm2d of the model by its own
    compressing subclass, built fresh (its initializers draw, then the old weights are copied in).
    The same draws here keep a seeded script's random stream where DeepSpeed leaves it: the learned
    scores drawn next, and the data order of a loader shuffled afterwards, match.
    """
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.Conv2d)):
                torch.empty(module.weight.shape).uniform_()  # kaiming_uniform_ draws as uniform_ does
                if module.bias is not None:
                    torch.empty(module.bias.shape).uniform_()
            elif isinstance(module, nn.Embedding):
                torch.empty(module.weight.shape).normal_()


def attach_compression(model: nn.Module, section: CompressionConfig) -> list[CompressionState]:
    """Give every layer an enabled technique matches its ``CompressionState`` (``init_compression``).

    The layers keep their class and forward: the compression passes find the state from the
    weight in the captured graph. Returns the states, in module order.
    """
    assignments = assign_modules(model, section)
    draw_like_deepspeed_replacement(model)
    plans: dict[str, dict[str, Any]] = {}
    for a in assignments:  # DeepSpeed's order, which is the order its learned scores are drawn in
        module = model.get_submodule(a.module)
        plan = plans.setdefault(a.module, {"wq": None, "aq": None, "masks": {}, "related": {}, "scores": {}})
        if a.technique == "weight_quantization":
            plan["wq"] = _weight_quant_spec(a, module)
        elif a.technique == "activation_quantization":
            shared = a.shared
            per = "token" if isinstance(module, nn.Linear) else "sample"
            plan["aq"] = ActQuantSpec(a.params.bits, shared.quantization_type == "symmetric", shared.range_calibration == "static", shared.schedule_offset, per)
        else:
            spec = _mask_spec(a, module)
            plan["masks"][spec.technique] = spec
            if spec.method == "topk":
                plan["scores"][spec.technique] = draw_scores(spec.technique, module.weight, spec)
            if a.related:
                plan["related"][spec.technique] = list(a.related)
    states: list[CompressionState] = []
    for name, plan in plans.items():
        module = model.get_submodule(name)
        if isinstance(getattr(module, "ds_compression", None), CompressionState):
            raise DSCompileConfigError(SECTION, f"layer {name!r} is already prepared for compression", "call init_compression once per model")
        weight = module.weight
        existing = state_of(weight)
        if existing is not None:
            _merge_tied(existing, name, plan["wq"], plan["aq"], plan["masks"])
            guard_layer(module)
            continue
        state = CompressionState(name, _kind(module), weight, plan["wq"], plan["aq"], plan["masks"], plan["related"], plan["scores"])
        module.ds_compression = state
        weight.ds_compression = state
        guard_layer(module)
        states.append(state)
    mark_prepared(model)
    return states


def direct_call_options(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The compile options of the prepared model's own calls: its ``compression_training`` section and
    dscompile's lowering keys of the same config (precision, ZeRO and the rest belong to an engine)."""
    options = {SECTION: raw.get(SECTION, {})}
    options.update({key: raw[key] for key in ("lower", "debug", "dump", "partitioner") if key in raw})
    return options


def prepare_model(
    model: nn.Module, section: CompressionConfig, teacher: nn.Module | None = None, call_options: Mapping[str, Any] | None = None
) -> CompressionScheduler:
    """``init_compression``'s work, shared with the engine: layer reduction (the chosen teacher layers'
    weights copied in; without ``teacher`` the model's own), every matched layer's state, the model's
    scheduler (nothing switched on yet) and, with ``call_options``, the model's own calls routed
    through a dscompile compile with those options."""
    if section.layer_reduction.enabled:

        reduce_layers(model, teacher, section.layer_reduction)
    states = attach_compression(model, section)
    if states and call_options is not None:
        route_calls(model, dict(call_options))
    return attach_scheduler(model)


def keep_teacher_dense(teacher: nn.Module) -> None:
    """The teacher ``init_compression`` was given stays the dense model it is, as in DeepSpeed (whose
    engine only schedules layers ``init_compression`` swapped): it gets an empty scheduler, so an
    engine built over it with the same config (the BERT example's) does not prepare it, and its
    compiled forward is not refused as never prepared."""
    if scheduler_of(teacher) is None:
        mark_prepared(teacher)
        attach_scheduler(teacher)


def detach_compression(model: nn.Module) -> None:
    """Remove every ``CompressionState``, its guards and the call routing (after ``redundancy_clean``
    baked them into the layers). The parameters keep the prepared mark: compiled again with its
    config (DeepSpeed's BERT example evaluates through its engine after ``redundancy_clean``), the
    cleaned model computes its baked layers instead of being refused as never prepared."""
    for module in list(model.modules()):
        state = getattr(module, "ds_compression", None)
        if isinstance(state, CompressionState):
            del module.ds_compression
    for p in model.parameters():
        if hasattr(p, "ds_compression"):
            delattr(p, "ds_compression")
    unguard_layers(model)
    unroute_calls(model)
    mark_prepared(model)


def read_deepspeed_config(deepspeed_config: Any) -> dict[str, Any]:
    """A ds_config given as a path, a dict or a DSConfig, as the dict its keys came from."""
    if isinstance(deepspeed_config, DSConfig):
        return dict(deepspeed_config.raw)
    if isinstance(deepspeed_config, (str, os.PathLike)):
        deepspeed_config = read_json_config(Path(deepspeed_config), "deepspeed_config")
    if not isinstance(deepspeed_config, Mapping):
        raise DSCompileConfigError("deepspeed_config", f"expected a dict or a path to a JSON file, got {type(deepspeed_config).__name__}")
    return dict(deepspeed_config)


# ---------------------------------------------------------------------------------------------
# where the compressed weights are in a captured graph
# ---------------------------------------------------------------------------------------------
LINEAR_OPS = {torch._C._nn.linear, torch.nn.functional.linear}
CONV_OPS = {torch.conv2d, torch.nn.functional.conv2d}
EMBEDDING_OPS = {torch.nn.functional.embedding}
_ZERO_OPS = ("dscompile::zero_gather", "dscompile::zero_use")


def _is_zero_op(node: torch.fx.Node) -> bool:
    target = node.target
    if node.op != "call_function":
        return False
    if isinstance(target, torch._ops.OpOverload):
        return target.name() in _ZERO_OPS
    return isinstance(target, torch._ops.OpOverloadPacket) and target._qualified_op_name in _ZERO_OPS


@dataclass
class Site:
    """A compressed weight in a Dynamo graph: its state, the parameter input and the node whose
    value the layers read (the parameter, or ZeRO's gather of its shard)."""

    state: CompressionState
    param: torch.fx.Node
    weight: torch.fx.Node

    def head(self) -> torch.fx.Node:
        """The newest value of the weight: past the compression nodes already inserted on it."""
        node = self.weight
        while True:
            nxt = [u for u in node.users if ds_role(u) == "weight" and u.args[0] is node]
            if len(nxt) != 1:
                return node
            node = nxt[0]

    def consumers(self) -> list[torch.fx.Node]:
        return list(self.head().users)


def ds_role(node: torch.fx.Node) -> str | None:
    from dscompile.graph import ds_meta

    info = ds_meta(node).get("compression") if "dscompile" in node.meta else None
    return info.get("role") if isinstance(info, dict) else None


def compression_sites(gm: torch.fx.GraphModule, ctx: Any) -> list[Site]:
    """The weights with a ``CompressionState`` among the graph's parameter inputs."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    sites: list[Site] = []
    seen: set[int] = set()
    for index in sorted(ctx.param_names):
        if index >= len(placeholders) or index >= len(ctx.example_inputs):
            continue
        state = state_of(ctx.example_inputs[index])
        if state is None or id(state) in seen:
            continue
        seen.add(id(state))
        param = placeholders[index]
        weight = param
        users = list(param.users)
        if len(users) == 1 and _is_zero_op(users[0]):
            weight = users[0]  # ZeRO-2/3: the full weight is the gathered (or kept) copy
        sites.append(Site(state, param, weight))
    return sites


def insert_after(gm: torch.fx.GraphModule, anchor: torch.fx.Node, fn: Any, args: tuple, kwargs: dict, layer: str, role: str, technique: str) -> torch.fx.Node:
    """A ``call_function`` node right after ``anchor`` with its fake value and compression metadata."""
    from dscompile.graph import ds_meta, set_fake_value

    with gm.graph.inserting_after(anchor):
        node = gm.graph.call_function(fn, args, kwargs)
    set_fake_value(node)
    ds_meta(node)["compression"] = {"layer": layer, "role": role, "technique": technique}
    return node


def insert_before(gm: torch.fx.GraphModule, anchor: torch.fx.Node, fn: Any, args: tuple, kwargs: dict, layer: str, role: str, technique: str) -> torch.fx.Node:
    from dscompile.graph import ds_meta, set_fake_value

    with gm.graph.inserting_before(anchor):
        node = gm.graph.call_function(fn, args, kwargs)
    set_fake_value(node)
    ds_meta(node)["compression"] = {"layer": layer, "role": role, "technique": technique}
    for key in ("nn_module_stack", "stack_trace"):
        if key in anchor.meta:
            node.meta[key] = anchor.meta[key]
    return node


def replace_weight(site: Site, new: torch.fx.Node) -> None:
    """Every reader of the weight's newest value reads ``new`` (whose first argument is that value)."""
    old = new.args[0]
    old.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)


def lift(gm: torch.fx.GraphModule, site: Site, attribute: str) -> torch.fx.Node:
    """The graph input reading one tensor of a layer's state (see ``dscompile.graph.lift_tensor``):
    on every call it is read from the state of that call's own weight parameter."""
    from dscompile.graph import lift_tensor

    state = site.state
    index = [n for n in gm.graph.nodes if n.op == "placeholder"].index(site.param)
    tag = re.sub(r"\W", "_", state.layer_name)
    return lift_tensor(gm, f"ds_compression_{tag}_{attribute}", getattr(state, attribute), _state_reader(index, state.layer_name, attribute))


def _state_reader(index: int, layer: str, attribute: str) -> Any:
    def resolve(inputs: Any) -> torch.Tensor:
        state = state_of(inputs[index])
        if state is None or not hasattr(state, attribute):
            raise DSCompileError(
                f"compression: this graph was compiled for a model whose layer {layer!r} carries {attribute!r}, but the model it now "
                "runs (same class) was not prepared the same way; call dscompile.compression.init_compression(model, config) on it"
            )
        return getattr(state, attribute)

    return resolve


def mark_prepared(model: nn.Module) -> None:
    """Tag every parameter of a model ``init_compression`` prepared (to catch a forgotten call)."""
    for p in model.parameters():
        setattr(p, PREPARED, True)


def require_prepared(ctx: Any, techniques: tuple[str, ...]) -> None:
    """Fail when the config enables ``techniques`` but the compiled model never went through
    ``init_compression`` (its parameters carry no mark): training would silently skip them."""
    section = compression_of(ctx.config)
    if section is None or not set(techniques) & set(section.enabled_techniques()):
        return
    params = [ctx.example_inputs[i] for i in ctx.param_names if i < len(ctx.example_inputs)]
    if params and not any(getattr(p, PREPARED, False) or state_of(p) is not None for p in params):
        raise DSCompileConfigError(
            SECTION,
            f"{', '.join(sorted(set(techniques) & set(section.enabled_techniques())))} enabled, but the compiled model was not prepared",
            "call dscompile.compression.init_compression(model, config) before compiling",
        )
