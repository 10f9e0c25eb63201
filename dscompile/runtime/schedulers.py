"""DeepSpeed's learning-rate schedules (``scheduler.type``) as torch LR schedulers.

The learning rate used by optimizer step k (k = 0, 1, ...) is ``lr(k)``; warm-up grows from
``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps`` steps, logarithmically or linearly.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from dscompile.config import SchedulerConfig
from dscompile.errors import DSCompileConfigError, DSCompileNotSupportedError, suggest


class WarmupLR(LRScheduler):
    """Warm up from ``warmup_min_lr`` to ``warmup_max_lr``, then hold."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        if warmup_type not in ("log", "linear"):
            raise DSCompileConfigError("scheduler.params.warmup_type", f"{warmup_type!r} is not 'log' or 'linear'")
        if warmup_num_steps < 1:
            raise DSCompileConfigError("scheduler.params.warmup_num_steps", "must be at least 1")
        self.warmup_min_lr, self.warmup_max_lr = warmup_min_lr, warmup_max_lr
        self.warmup_num_steps, self.warmup_type = warmup_num_steps, warmup_type
        super().__init__(optimizer, last_epoch=last_batch_iteration)

    def warmup_gamma(self, step: int) -> float:
        if step >= self.warmup_num_steps:
            return 1.0
        if self.warmup_type == "log":
            return math.log(step + 1) / math.log(self.warmup_num_steps + 1)
        return step / self.warmup_num_steps

    def gamma(self, step: int) -> float:
        return self.warmup_gamma(step)

    def get_lr(self) -> list[float]:
        step = max(self.last_epoch, 0)
        lr = self.warmup_min_lr + (self.warmup_max_lr - self.warmup_min_lr) * self.gamma(step)
        return [lr for _ in self.optimizer.param_groups]


class WarmupDecayLR(WarmupLR):
    """Warm up as WarmupLR, then decay linearly to ``warmup_min_lr`` at ``total_num_steps``."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, **kwargs: Any) -> None:
        self.total_num_steps = total_num_steps
        warmup = kwargs.get("warmup_num_steps", 1000)
        if total_num_steps < warmup:
            raise DSCompileConfigError("scheduler.params.total_num_steps", f"{total_num_steps} is below warmup_num_steps {warmup}")
        super().__init__(optimizer, **kwargs)

    def gamma(self, step: int) -> float:
        if step < self.warmup_num_steps:
            return self.warmup_gamma(step)
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        return max(0.0, (self.total_num_steps - step) / span)


_SCHEDULERS = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR}
_UNBUILT = {"OneCycle": "the OneCycle schedule", "LRRangeTest": "the LR range test", "WarmupCosineLR": "the WarmupCosineLR schedule"}


def build_scheduler(section: SchedulerConfig, optimizer: torch.optim.Optimizer) -> LRScheduler:
    if section.type in _UNBUILT:
        raise DSCompileNotSupportedError("scheduler.type", _UNBUILT[section.type])
    if section.type not in _SCHEDULERS:
        raise DSCompileConfigError(
            "scheduler.type", f"unknown scheduler {section.type!r}", suggest(section.type, _SCHEDULERS) or f"use one of {sorted(_SCHEDULERS)}"
        )
    cls = _SCHEDULERS[section.type]
    accepted = set(inspect.signature(cls).parameters) | set(inspect.signature(WarmupLR).parameters)
    accepted -= {"optimizer", "kwargs", "self"}
    for key in section.params:
        if key not in accepted:
            raise DSCompileConfigError(f"scheduler.params.{key}", f"is not a parameter of {section.type}", suggest(key, accepted))
    return cls(optimizer, **section.params)
