"""DeepSpeed's learning-rate schedules (``scheduler.type``), value for value.

Every schedule follows DeepSpeed's convention (``deepspeed/runtime/lr_schedules.py``, 0.19), not
torch's ``LRScheduler``'s, so a DeepSpeed script sees the same learning rate at every step:

- ``last_batch_iteration`` starts at -1. Construction with -1 sets the optimizer to the value
  *before* the first step (``warmup_min_lr``, the cycle's minimum, 0 for ``WarmupCosineLR``); it
  does not step. ``step()`` (the engine calls it after each optimizer step that was not skipped)
  advances the iteration, then sets the value for it. So optimizer step ``k`` (0, 1, ...) runs
  with the value of iteration ``k - 1``: torch's schedulers are one step ahead of this.
- ``state_dict()`` is ``{"last_batch_iteration": n}``, the format DeepSpeed checkpoints hold;
  ``load_state_dict`` restores the iteration only (the optimizer's own state holds its lr).
- Warm-ups divide by ``log(W)`` with ``W = max(2, warmup_num_steps)``, so the log warm-up
  reaches the maximum at iteration ``W - 1``.
- Values given per parameter group are lists; a scalar applies to every group.

One difference, on purpose: an unknown ``warmup_type`` is refused with an error naming the key
(DeepSpeed logs a warning and warms up logarithmically).
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Sequence
from typing import Any

import torch

from dscompile.config import SchedulerConfig, check_hyperparameters
from dscompile.errors import DSCompileConfigError, suggest

log = logging.getLogger("dscompile.runtime.schedulers")

WARMUP_TYPES = ("log", "linear")


def _optimizer_of(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer to drive: ``optimizer`` itself, or the one a wrapper holds as ``.optimizer``."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    raise TypeError(f"{type(optimizer).__name__} is not a torch.optim.Optimizer (nor wraps one as .optimizer)")


def _per_group(optimizer: torch.optim.Optimizer, value: Any, key: str) -> list[Any]:
    """One value per parameter group: a scalar for all, or a list with one entry per group."""
    groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise DSCompileConfigError(f"scheduler.params.{key}", f"has {len(value)} values for {groups} parameter groups",
                                       "give one value per parameter group, or a single number")
        return list(value)
    return [value] * groups


def _positive_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise DSCompileConfigError(f"scheduler.params.{key}", f"must be a positive integer, got {value!r}")
    return value


def _warmup_type(value: str) -> str:
    if value not in WARMUP_TYPES:
        raise DSCompileConfigError("scheduler.params.warmup_type", f"{value!r} is not one of {', '.join(WARMUP_TYPES)}")
    return value


def _warmup_fraction(iteration: int, steps: int, kind: str) -> float:
    """How far warm-up has come at ``iteration`` (0 at 0; ``steps`` is already at least 2).
    The log form multiplies by ``1 / log(steps)``, DeepSpeed's rounding, so values agree to the bit."""
    if kind == "log":
        return (1.0 / math.log(steps)) * math.log(iteration + 1)
    return iteration / steps


def _set_lrs(optimizer: torch.optim.Optimizer, lrs: Sequence[float]) -> list[Any]:
    """Write one lr per group (in place when the group keeps its lr as a tensor); returns the groups' lrs."""
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr.squeeze() if isinstance(lr, torch.Tensor) else lr)
        else:
            group["lr"] = lr
    return [group["lr"] for group in optimizer.param_groups]


class _Schedule:
    """What every schedule shares: the iteration counter, ``step``, and DeepSpeed's state format."""

    optimizer: torch.optim.Optimizer
    last_batch_iteration: int

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def _after_step(self) -> None:
        """Anything besides the lr a schedule sets each step (OneCycle: momentum)."""

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to ``last_batch_iteration`` (default: the next one) and set its learning rate."""
        self.last_batch_iteration = self.last_batch_iteration + 1 if last_batch_iteration is None else last_batch_iteration
        self._last_lr = _set_lrs(self.optimizer, self.get_lr())
        self._after_step()

    def get_last_lr(self) -> list[Any]:
        """The learning rates this schedule last set."""
        last = getattr(self, "_last_lr", None)
        if last is None:
            raise RuntimeError(f"{type(self).__name__}.get_last_lr(): no learning rate set yet; call step() first")
        return last

    def state_dict(self) -> dict[str, int]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "last_batch_iteration" not in state:
            raise ValueError(f"{type(self).__name__}.load_state_dict: the state has no 'last_batch_iteration' "
                             f"(keys: {sorted(state)}); it was not saved by a DeepSpeed-style schedule")
        self.last_batch_iteration = state["last_batch_iteration"]


class WarmupLR(_Schedule):
    """Warm up from ``warmup_min_lr`` to ``warmup_max_lr`` (default: the optimizer's lr) over
    ``warmup_num_steps`` iterations, logarithmically or linearly, then hold."""

    def __init__(
        self,
        optimizer: Any,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.optimizer = _optimizer_of(optimizer)
        _positive_int(warmup_num_steps, "warmup_num_steps")
        if warmup_max_lr is None:
            warmup_max_lr = [group["lr"] for group in self.optimizer.param_groups]
        self.min_lrs = _per_group(self.optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(self.optimizer, warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = _warmup_type(warmup_type)
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            self._last_lr = _set_lrs(self.optimizer, self.get_lr())

    def gamma(self) -> float:
        """The fraction of the way from the minimum to the maximum lr at the current iteration."""
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_fraction(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)  # before the first step
        gamma = self.gamma()
        return [low + (high - low) * gamma for low, high in zip(self.min_lrs, self.max_lrs, strict=True)]


class WarmupDecayLR(WarmupLR):
    """Warm up as ``WarmupLR``, then decay linearly to ``warmup_min_lr`` at ``total_num_steps``."""

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        if total_num_steps < self.warmup_num_steps:
            log.warning("WarmupDecayLR: total_num_steps %d is below warmup_num_steps %d; the decay starts at the warm-up's end "
                        "from a value already below the maximum", total_num_steps, warmup_num_steps)

    def gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return super().gamma()
        remaining = self.total_num_steps - self.last_batch_iteration
        return max(0.0, remaining / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_Schedule):
    """Scale the optimizer's own lr by a ratio: warm up from ``warmup_min_ratio`` to 1 over
    ``warmup_num_steps``, then follow a half cosine down to ``cos_min_ratio`` at ``total_num_steps``."""

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.optimizer = _optimizer_of(optimizer)
        _positive_int(warmup_num_steps, "warmup_num_steps")
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = _warmup_type(warmup_type)
        self.warmup_num_steps = max(2, warmup_num_steps)
        if total_num_steps < self.warmup_num_steps:
            log.warning("WarmupCosineLR: total_num_steps %d is below warmup_num_steps %d; the ratio drops to cos_min_ratio "
                        "right after warm-up", total_num_steps, warmup_num_steps)
        self.org_lrs = [group["lr"].clone() if isinstance(group["lr"], torch.Tensor) else group["lr"]
                        for group in self.optimizer.param_groups]
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            self._last_lr = _set_lrs(self.optimizer, self.get_lr())

    def get_lr_ratio(self) -> float:
        step = self.last_batch_iteration
        if step < 0:
            return 0.0
        if step < self.warmup_num_steps:
            fraction = _warmup_fraction(step, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + fraction * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (step - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        half_cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * half_cosine)

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


class OneCycle(_Schedule):
    """One triangular cycle from ``cycle_min_lr`` up to ``cycle_max_lr`` (``cycle_first_step_size``
    iterations) and back (``cycle_second_step_size``, default the same), optionally in stairs, then
    a decay of ``1 / (1 + decay_lr_rate * k / decay_step_size)``; with ``cycle_momentum`` the
    optimizer's first beta moves the opposite way between ``cycle_max_mom`` and ``cycle_min_mom``
    (the second beta is set to 0.99, as DeepSpeed does)."""

    def __init__(
        self,
        optimizer: Any,
        cycle_min_lr: float | Sequence[float],
        cycle_max_lr: float | Sequence[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | Sequence[float] = 0.8,
        cycle_max_mom: float | Sequence[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        self.optimizer = _optimizer_of(optimizer)
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        if first <= 0:
            raise DSCompileConfigError("scheduler.params.cycle_first_step_size", f"must be positive, got {cycle_first_step_size}")
        if second < 0:
            raise DSCompileConfigError("scheduler.params.cycle_second_step_size", f"must not be negative, got {cycle_second_step_size}")
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        self.decay_step_size = decay_step_size
        no_decay = math.isclose(decay_step_size, 0)
        self.min_lrs = _per_group(self.optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(self.optimizer, cycle_max_lr, "cycle_max_lr")
        if last_batch_iteration == -1:
            _set_lrs(self.optimizer, self.min_lrs)
        self.decay_lr_rate = decay_lr_rate
        self.skip_lr_decay = no_decay or math.isclose(decay_lr_rate, 0)
        self.skip_mom_decay = no_decay
        self.cycle_momentum = cycle_momentum
        if cycle_momentum and "betas" not in self.optimizer.defaults:
            log.warning("OneCycle: cycle_momentum is off: %s has no betas to cycle", type(self.optimizer).__name__)
            self.cycle_momentum = False
        if self.cycle_momentum:
            self.decay_mom_rate = decay_mom_rate
            self.min_moms = [(mom, 0.99) for mom in _per_group(self.optimizer, cycle_min_mom, "cycle_min_mom")]
            self.max_moms = [(mom, 0.99) for mom in _per_group(self.optimizer, cycle_max_mom, "cycle_max_mom")]
            if last_batch_iteration == -1:
                for group, betas in zip(self.optimizer.param_groups, self.min_moms, strict=True):
                    group["betas"] = betas
            self.skip_mom_decay = self.skip_mom_decay or math.isclose(decay_mom_rate, 0)
        self.last_batch_iteration = last_batch_iteration

    def _scale(self) -> float:
        """Where in the cycle the next batch is: 0 at the minimum lr, 1 at the maximum."""
        batch = self.last_batch_iteration + 1
        cycles = batch / self.total_size
        position = 1.0 + cycles - math.floor(1.0 + cycles)  # fraction of the current cycle (DeepSpeed's rounding)
        rising = position <= self.step_ratio
        scale = position / self.step_ratio if rising else (position - 1) / (self.step_ratio - 1)
        stairs = self.first_stair_count if rising else self.second_stair_count
        if stairs > 0:
            # count stairs from the integer offset in the cycle: the float scale can land a hair under a stair
            offset = batch % self.total_size
            if offset <= self.first_step_size:
                level = offset * stairs / self.first_step_size
            else:
                level = (self.total_size - offset) * stairs / self.second_step_size
            scale = math.floor(level) / stairs
        return scale

    def _decay_factor(self, rate: float) -> float:
        intervals = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        return 1.0 + rate * intervals

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [low + (high - low) * scale for low, high in zip(self.min_lrs, self.max_lrs, strict=True)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = self._decay_factor(self.decay_lr_rate)
        return [low / factor for low in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [(high[0] - (high[0] - low[0]) * scale, low[1]) for low, high in zip(self.min_moms, self.max_moms, strict=True)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = self._decay_factor(self.decay_mom_rate)
        return [(beta1 * factor, beta2) for beta1, beta2 in self.max_moms]

    def _after_step(self) -> None:
        moms = self.get_mom()
        if moms is not None:
            for group, betas in zip(self.optimizer.param_groups, moms, strict=True):
                group["betas"] = betas


class LRRangeTest(_Schedule):
    """Grow the lr from ``lr_range_test_min_lr`` by ``lr_range_test_step_rate`` every
    ``lr_range_test_step_size`` iterations (continuously, or in stairs with ``lr_range_test_staircase``)."""

    def __init__(
        self,
        optimizer: Any,
        lr_range_test_min_lr: float | Sequence[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        self.optimizer = _optimizer_of(optimizer)
        self.min_lr = _per_group(self.optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = _positive_int(lr_range_test_step_size, "lr_range_test_step_size")
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            self._last_lr = _set_lrs(self.optimizer, self.min_lr)

    def get_lr(self) -> list[float]:
        intervals = (self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            intervals = math.floor(intervals)
        return [lr * (1 + self.step_rate * intervals) for lr in self.min_lr]


SCHEDULERS: dict[str, type[_Schedule]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle,
    "LRRangeTest": LRRangeTest,
}


def build_scheduler(section: SchedulerConfig, optimizer: torch.optim.Optimizer) -> _Schedule:
    """The schedule of a config's ``scheduler`` section over ``optimizer``; unknown types and params are refused."""
    if section.type not in SCHEDULERS:
        raise DSCompileConfigError(
            "scheduler.type", f"unknown scheduler {section.type!r}", suggest(section.type, SCHEDULERS) or f"use one of {sorted(SCHEDULERS)}"
        )
    cls = SCHEDULERS[section.type]
    parameters = inspect.signature(cls).parameters
    accepted = set(parameters) - {"optimizer"}
    for key in section.params:
        if key not in accepted:
            raise DSCompileConfigError(f"scheduler.params.{key}", f"is not a parameter of {section.type}", suggest(key, accepted))
    check_hyperparameters("scheduler.params", section.params, cls)
    missing = [name for name, p in parameters.items() if p.default is inspect.Parameter.empty and name != "optimizer" and name not in section.params]
    if missing:
        raise DSCompileConfigError(f"scheduler.params.{missing[0]}", f"{section.type} needs it", f"add \"{missing[0]}\" to scheduler.params")
    return cls(optimizer, **section.params)


__all__ = ["SCHEDULERS", "LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR", "build_scheduler"]
