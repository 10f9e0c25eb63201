"""``deepspeed.compression.scheduler``: the compression schedule of a prepared model."""

from __future__ import annotations

from typing import Any

from torch import nn

from dscompile.errors import DSCompileConfigError
from dscompile.runtime.compression.scheduler import CompressionScheduler, scheduler_of

__all__ = ["CompressionScheduler", "compression_scheduler", "get_compression_scheduler"]


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(getattr(model, "module", None), nn.Module) else model


def get_compression_scheduler(model: nn.Module) -> CompressionScheduler:
    """The schedule ``init_compression`` created for ``model``: call ``.step(global_step)`` before each
    step's forward (0 first) and ``.after_backward()`` once gradients are ready (snip_momentum)."""
    scheduler = scheduler_of(_unwrap(model))
    if scheduler is None:
        raise DSCompileConfigError("compression_training", "this model was not prepared for compression", "call init_compression(model, config) first")
    return scheduler


class compression_scheduler:  # noqa: N801 - DeepSpeed's class name
    """DeepSpeed's ``compression_scheduler(model, compression_config)``: ``step()`` counts steps itself
    (``step(step_zero_check=True)`` sets the current step without counting)."""

    def __init__(self, model: nn.Module, compression_config: Any = None) -> None:
        target = _unwrap(model)
        self.scheduler = scheduler_of(target) or CompressionScheduler(target)
        self.training_steps = 0

    def step(self, step_zero_check: bool = False) -> None:
        if not step_zero_check:
            self.training_steps += 1
        self.scheduler.step(self.training_steps)
