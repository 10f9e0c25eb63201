"""Layer reduction (DeepSpeed's ``layer_reduction``, XTC's student initialisation) as a module rewrite.

``reduce_layers`` keeps ``keep_number_layer`` layers of the layer list named ``module_name_prefix``
(dropping the rest when the student has more) and copies into student layer ``i`` the weights of
teacher layer ``teacher_layer[i]``, plus the modules named in ``other_module_name`` (embeddings,
pooler, head), exactly (``load_state_dict``, strict: a structural mismatch is an error naming
both layers). Config objects that record the layer count (Hugging Face's ``num_hidden_layers``,
``n_layer``; the zoo's ``n_layers``) follow the new count. Without a teacher model the student's
own layers are the teacher's (DeepSpeed requires a teacher; dscompile accepts the model itself).

Why on modules and not on the graph: dropping layers removes parameters, and the optimizer, the
engine's parameter partitioning and the checkpoints are all built from the module tree. A graph
rewrite after capture could skip the layers' computation but never free their parameters or take
them out of the optimizer, so the student is built before anything else sees the model; the graph
captured afterwards simply has fewer layers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from dscompile.errors import DSCompileConfigError

log = logging.getLogger("dscompile.passes.layer_reduction")
SECTION = "compression_training"  # the config section this key sits in (passes/compression.py parses it)


@dataclass
class LayerReductionConfig:
    enabled: bool = False
    keep_number_layer: int | None = None
    module_name_prefix: str = ""
    teacher_layer: list[int] = field(default_factory=list)
    other_module_name: list[str] = field(default_factory=list)

    def validate(self, path: str) -> None:
        if not self.enabled:
            return
        if not self.module_name_prefix:
            raise DSCompileConfigError(f"{path}.module_name_prefix", "must name the layer list, e.g. 'bert.encoder.layer' or 'transformer.h'")
        if not self.teacher_layer:
            raise DSCompileConfigError(f"{path}.teacher_layer", "must list the teacher layers the student keeps, e.g. [1, 3, 5]")
        if self.keep_number_layer is None:
            self.keep_number_layer = len(self.teacher_layer)
        if self.keep_number_layer != len(self.teacher_layer):
            raise DSCompileConfigError(
                f"{path}.keep_number_layer", f"({self.keep_number_layer}) must equal the length of teacher_layer ({len(self.teacher_layer)})"
            )
        if any(i < 0 for i in self.teacher_layer):
            raise DSCompileConfigError(f"{path}.teacher_layer", "layer indices must be >= 0")

_COUNT_ATTRIBUTES = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")


def _layer_list(model: nn.Module, prefix: str, role: str) -> nn.Module:
    try:
        layers = model.get_submodule(prefix)
    except AttributeError:
        raise DSCompileConfigError(f"{SECTION}.layer_reduction.module_name_prefix", f"the {role} model has no module {prefix!r}") from None
    if not isinstance(layers, (nn.ModuleList, nn.Sequential)):
        raise DSCompileConfigError(f"{SECTION}.layer_reduction.module_name_prefix", f"{prefix!r} is a {type(layers).__name__}, not the ModuleList of layers")
    return layers


def _snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _copy(target: nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    try:
        target.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise DSCompileConfigError(f"{SECTION}.layer_reduction", f"cannot copy {what}: {exc}") from None


def _set_count(model: nn.Module, old: int, new: int) -> list[str]:
    """Point layer-count fields of config objects held by the model at the new count."""
    changed = []
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if config is None or isinstance(config, nn.Module):
            continue
        for attribute in _COUNT_ATTRIBUTES:
            if getattr(config, attribute, None) == old:
                try:
                    setattr(config, attribute, new)
                except (AttributeError, TypeError):
                    continue
                changed.append(f"{name or 'model'}.config.{attribute}")
    return changed


def reduce_layers(student: nn.Module, teacher: nn.Module | None, cfg: LayerReductionConfig) -> dict[str, object]:
    """Drop the student's extra layers and copy the chosen teacher layers into it (see the module docstring)."""
    prefix = cfg.module_name_prefix
    keep = int(cfg.keep_number_layer or len(cfg.teacher_layer))
    layers = _layer_list(student, prefix, "student")
    source_model = teacher if teacher is not None else student
    source_layers = _layer_list(source_model, prefix, "teacher")
    for index in cfg.teacher_layer:
        if index >= len(source_layers):
            raise DSCompileConfigError(f"{SECTION}.layer_reduction.teacher_layer", f"layer {index} does not exist: the teacher has {len(source_layers)}")
    if len(layers) < keep:
        raise DSCompileConfigError(f"{SECTION}.layer_reduction.keep_number_layer", f"the student has {len(layers)} layers, fewer than {keep}")
    # Copies first: without a teacher the sources are the student's own layers, about to move.
    sources = [_snapshot(source_layers[i]) for i in cfg.teacher_layer]
    others = {}
    for name in cfg.other_module_name:
        try:
            others[name] = _snapshot(source_model.get_submodule(name))
        except AttributeError:
            raise DSCompileConfigError(f"{SECTION}.layer_reduction.other_module_name", f"the teacher has no module {name!r}") from None
    old = len(layers)
    if old > keep:
        kept = type(layers)(*list(layers)[:keep]) if isinstance(layers, nn.Sequential) else nn.ModuleList(list(layers)[:keep])
        parent_name, _, leaf = prefix.rpartition(".")
        setattr(student.get_submodule(parent_name) if parent_name else student, leaf, kept)
        layers = kept
    for position, (teacher_index, state) in enumerate(zip(cfg.teacher_layer, sources)):
        _copy(layers[position], state, f"teacher layer {teacher_index} into student layer {position}")
    for name, state in others.items():
        try:
            target = student.get_submodule(name)
        except AttributeError:
            raise DSCompileConfigError(f"{SECTION}.layer_reduction.other_module_name", f"the student has no module {name!r}") from None
        _copy(target, state, f"module {name!r}")
    changed = _set_count(student, old, keep) if old != keep else []
    log.info("layer reduction: %d -> %d layers of %s from teacher layers %s", old, keep, prefix, cfg.teacher_layer)
    return {"layers_before": old, "layers_after": keep, "teacher_layer": list(cfg.teacher_layer), "config_fields": changed}
