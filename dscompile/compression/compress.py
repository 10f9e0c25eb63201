"""``deepspeed.compression.compress``: ``init_compression`` and ``redundancy_clean`` with DeepSpeed's signatures."""

from __future__ import annotations

from typing import Any

from torch import nn

from dscompile.errors import DSCompileConfigError, DSCompileNotSupportedError
from dscompile.passes.compression import (
    SECTION,
    direct_call_options,
    keep_teacher_dense,
    parse_compression,
    prepare_model,
    read_deepspeed_config,
)
from dscompile.passes.redundancy_clean import clean_model
from dscompile.runtime.compression.scheduler import scheduler_of

__all__ = ["init_compression", "redundancy_clean"]


def _unwrap(model: nn.Module) -> nn.Module:
    """DeepSpeed compresses ``model.module`` when there is one (an engine, a DDP wrapper)."""
    return model.module if isinstance(getattr(model, "module", None), nn.Module) else model


def _no_mpu(mpu: Any) -> None:
    if mpu is not None:
        raise DSCompileNotSupportedError("mpu", "compression of Megatron-style tensor-parallel layers")


def init_compression(model: nn.Module, deepspeed_config: Any, teacher_model: nn.Module | None = None, mpu: Any = None) -> nn.Module:
    """Prepare ``model`` for compression training; returns ``model``.

    Layer reduction first (the chosen teacher layers' weights copied in; without ``teacher_model``
    the model's own), then every layer an enabled technique matches gets its compression state,
    and the model's calls go through dscompile with the config's ``compression_training`` section;
    the schedule is at step 0 (``get_compression_scheduler(model)`` advances it; an engine does by itself).
    The teacher stays dense, also under an engine built over it with the same config (as in DeepSpeed).
    """
    _no_mpu(mpu)
    raw = read_deepspeed_config(deepspeed_config)
    teacher = None if teacher_model is None else _unwrap(teacher_model)
    prepare_model(_unwrap(model), parse_compression(raw.get(SECTION, {})), teacher, call_options=direct_call_options(raw))
    if teacher is not None:
        keep_teacher_dense(teacher)
    return model


def redundancy_clean(model: nn.Module, deepspeed_config: Any, mpu: Any = None) -> nn.Module:
    """Bake the compression into ``model``; returns ``model``, now smaller and computing in plain
    modules (its calls no longer go through dscompile). Needs the model ``init_compression``
    prepared with the same config."""
    _no_mpu(mpu)
    section = parse_compression(read_deepspeed_config(deepspeed_config).get(SECTION, {}))
    target = _unwrap(model)
    if section.enabled_techniques() and scheduler_of(target) is None:
        raise DSCompileConfigError(
            SECTION, "redundancy_clean needs the model init_compression prepared", "call init_compression(model, config) before training"
        )
    clean_model(target)
    return model
