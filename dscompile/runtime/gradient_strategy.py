"""The gradient strategy: which tensors a training engine's optimizer steps and how their gradients agree across ranks.

Exactly one per training engine (``TrainingCore.gradients``): ``DataParallelGradients`` by default
(``runtime/data_parallel.py``), ``ZeroGradients`` (``runtime/zero_extension.py``), ``TensorParallelGradients``
(``runtime/tensor_parallel_gradients.py``), ``PipelineGradients`` (``runtime/pipeline_gradients.py``).
Apart from the core so that each strategy imports only the protocol."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from dscompile.runtime.training_core import TrainingCore


class GradientStrategy:
    """How the optimizer's tensors get consistent gradients across ranks (one per engine)."""

    name: str = "gradients"

    def trainable_parameters(self) -> list[nn.Parameter]:
        raise NotImplementedError

    def reduce(self, engine: TrainingCore) -> None:
        """At the accumulation boundary: make every rank's gradients the global ones."""

    def clip(self, engine: TrainingCore, params: list[nn.Parameter], max_norm: float) -> float:
        """Scale gradients so that their global L2 norm is at most ``max_norm``; return the norm."""
        raise NotImplementedError

    def after_optimizer_step(self, engine: TrainingCore) -> None:
        """After ``optimizer.step()``: refresh what other ranks or copies hold."""

    def zero_grad(self) -> None:
        """Drop gradients the optimizer's ``zero_grad`` does not reach."""

    def full_parameters(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def model_state_tensors(self, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
        raise NotImplementedError

    def failure_context(self, rank: int, what: str) -> contextlib.AbstractContextManager[None]:
        """Wraps forward/backward: turns a failed collective into an error that names the likely cause."""
        return contextlib.nullcontext()

    def save_checkpoint(self, engine: TrainingCore, directory: Any, client_state: dict | None) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not write DSCompileEngine checkpoints")

    def load_checkpoint(
        self, engine: TrainingCore, directory: Any, load_optimizer_states: bool, load_lr_scheduler_states: bool, load_module_only: bool
    ) -> dict | None:
        raise NotImplementedError(f"{type(self).__name__} does not read DSCompileEngine checkpoints")


def scale_gradients_to_norm(params: Iterable[nn.Parameter], total: float, max_norm: float) -> float:
    """Clip by a global norm computed elsewhere (each gradient strategy sums its own partial norms): scale every
    gradient by ``max_norm / total`` when that is below 1. Returns ``total``."""
    coef = min(1.0, max_norm / (total + 1e-6))
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return total
