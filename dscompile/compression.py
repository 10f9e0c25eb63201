"""``dscompile.compression``: DeepSpeed Compression's public functions (``deepspeed.compression``).

A DeepSpeed compression script ports by changing its import::

    from dscompile.compression import init_compression, redundancy_clean
    model = init_compression(model, "ds_config.json", teacher_model=teacher)
    ...train (torch.compile(model, backend="dscompile", options=config), or dscompile.initialize)...
    model = redundancy_clean(model, "ds_config.json")

``init_compression`` applies layer reduction and prepares the matched layers; the ``quantize`` and
``prune`` passes then compress them in every graph compiled from the model; the schedule advances
through ``get_compression_scheduler(model).step(global_step)`` in a plain training loop, and by
itself under ``dscompile.initialize`` (whose engine also calls ``init_compression`` when the
script did not). ``redundancy_clean`` returns a model
that is really smaller (packed int8/int4 weights, pruned rows, heads and channels removed). The
work is done in ``dscompile.passes.compression``, ``layer_reduction``, ``redundancy_clean`` and
``dscompile.runtime.compression``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from dscompile.config import DSConfig, read_json_config
from dscompile.errors import DSCompileConfigError, DSCompileNotSupportedError
from dscompile.passes.compression import SECTION, CompressionConfig, parse_compression, prepare_model
from dscompile.passes.redundancy_clean import clean_model
from dscompile.runtime.compression import CompressionScheduler
from dscompile.runtime.compression.scheduler import scheduler_of

__all__ = [
    "CompressionScheduler",
    "compression_scheduler",
    "convert_conv1d_to_linear",
    "get_compression_scheduler",
    "init_compression",
    "redundancy_clean",
]

def _section(deepspeed_config: Any) -> CompressionConfig:
    """The ``compression_training`` section of a ds_config given as a path, a dict or a DSConfig."""
    if isinstance(deepspeed_config, DSConfig):
        parsed = deepspeed_config.sections.get(SECTION)
        return parsed if parsed is not None else parse_compression({})
    if isinstance(deepspeed_config, (str, os.PathLike)):
        deepspeed_config = read_json_config(Path(deepspeed_config), "deepspeed_config")
    if not isinstance(deepspeed_config, Mapping):
        raise DSCompileConfigError("deepspeed_config", f"expected a dict or a path to a JSON file, got {type(deepspeed_config).__name__}")
    return parse_compression(deepspeed_config.get(SECTION, {}))


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(getattr(model, "module", None), nn.Module) else model


def _no_mpu(mpu: Any) -> None:
    if mpu is not None:
        raise DSCompileNotSupportedError("mpu", "compression of Megatron-style tensor-parallel layers")


def init_compression(model: nn.Module, deepspeed_config: Any, teacher_model: nn.Module | None = None, mpu: Any = None) -> nn.Module:
    """Prepare ``model`` for compression training (DeepSpeed's signature); returns ``model``.

    Layer reduction first (the chosen teacher layers' weights copied in; without ``teacher_model``
    the model's own), then every layer an enabled technique matches gets its compression state,
    and the schedule is set for step 0 (``get_compression_scheduler(model)`` advances it).
    Compression then happens in the graphs compiled with the same config
    (``torch.compile(model, backend="dscompile", options=config)``, whose ``compression_training``
    section puts the ``quantize``/``prune`` passes in the pipeline); run eagerly, or compiled
    without that section, the prepared model computes in full precision.
    """
    _no_mpu(mpu)
    prepare_model(_unwrap(model), _section(deepspeed_config), None if teacher_model is None else _unwrap(teacher_model))
    return model


def get_compression_scheduler(model: nn.Module) -> CompressionScheduler:
    """The schedule ``init_compression`` created for ``model``: call ``.step(global_step)`` before each
    step's forward and ``.after_backward()`` once gradients are ready (snip_momentum)."""
    scheduler = scheduler_of(_unwrap(model))
    if scheduler is None:
        raise DSCompileConfigError(SECTION, "this model was not prepared for compression", "call init_compression(model, config) first")
    return scheduler


class compression_scheduler:  # noqa: N801 - DeepSpeed's class name
    """DeepSpeed's ``compression_scheduler(model, compression_config)``: ``step()`` counts steps itself
    (``step(step_zero_check=True)`` sets step 0 without counting)."""

    def __init__(self, model: nn.Module, compression_config: Any = None) -> None:
        target = _unwrap(model)
        self.scheduler = scheduler_of(target) or CompressionScheduler(target)
        self.training_steps = 0

    def step(self, step_zero_check: bool = False) -> None:
        if not step_zero_check:
            self.training_steps += 1
        self.scheduler.step(self.training_steps)


def redundancy_clean(model: nn.Module, deepspeed_config: Any, mpu: Any = None) -> nn.Module:
    """Bake the compression into ``model`` (DeepSpeed's signature); returns ``model``, now smaller.

    Needs the model ``init_compression`` prepared with the same config.
    """
    _no_mpu(mpu)
    section = _section(deepspeed_config)
    target = _unwrap(model)
    if section.enabled_techniques() and scheduler_of(target) is None:
        raise DSCompileConfigError(
            SECTION, "redundancy_clean needs the model init_compression prepared", "call init_compression(model, config) before training"
        )
    clean_model(target)
    return model


def convert_conv1d_to_linear(model: nn.Module, convert_type: type[nn.Module]) -> nn.Module:
    """Replace every ``convert_type`` layer (Hugging Face's GPT-2 ``Conv1D``: ``y = x @ W + b`` with W
    ``[in, out]``) by the equivalent ``nn.Linear``, so compression can match it."""
    import torch

    target = _unwrap(model)
    for name, module in list(target.named_modules()):
        if not isinstance(module, convert_type):
            continue
        weight = module.weight.detach()
        bias = getattr(module, "bias", None)
        linear = nn.Linear(weight.shape[0], weight.shape[1], bias=bias is not None).to(device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            linear.weight.copy_(weight.t())
            if bias is not None:
                linear.bias.copy_(bias.detach().reshape(-1))
        parent_name, _, leaf = name.rpartition(".")
        setattr(target.get_submodule(parent_name) if parent_name else target, leaf, linear)
    return model
