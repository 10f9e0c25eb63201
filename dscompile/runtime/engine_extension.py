"""The engine-extension protocol: the hooks a capability's runtime part implements, and the registry of factories
every engine calls at construction. Apart from ``engine_core`` so that extensions the core itself installs (the
loss scaler's) can subclass it without importing the core.

Factories register for one kind of engine: ``TRAINING`` (the default; ``DSCompileEngine`` and ``PipelineEngine``
call them with their ``DSConfig``) or ``INFERENCE`` (``InferenceEngine`` calls them with its ``InferenceConfig``).
Every engine runs ``configure``, ``counters`` and ``destroy``; the forward, backward and optimizer-step hooks are
the training core's (``runtime/training_core.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from dscompile.runtime.engine_core import EngineCore
    from dscompile.runtime.training_core import TrainingCore

TRAINING = "training"
INFERENCE = "inference"


class EngineExtension:
    """A capability's part of the engine; override only the hooks it needs (see the module docstring)."""

    name: str = "extension"
    checks_overflow: bool = False
    """True when ``check_overflow`` can report an overflow: the core then agrees the answer across ranks."""

    def configure(self, engine: EngineCore) -> None:
        """Once, at engine construction, before the model is compiled."""

    def before_forward(self, engine: TrainingCore) -> None:
        """Before each forward."""

    def after_forward(self, engine: TrainingCore) -> None:
        """After each forward."""

    def scale_loss(self, engine: TrainingCore, loss: torch.Tensor) -> torch.Tensor:
        """Before backward: the loss to differentiate (a multiple of ``loss``)."""
        return loss

    def after_backward(self, engine: TrainingCore) -> None:
        """After each backward."""

    def on_gradients_ready(self, engine: TrainingCore, params: list[nn.Parameter]) -> None:
        """At the boundary, after the gradient strategy reduced every gradient."""

    def check_overflow(self, engine: TrainingCore, params: list[nn.Parameter]) -> bool:
        """Unscale and report inf/NaN gradients (True skips the step on every rank)."""
        return False

    def before_optimizer_step(self, engine: TrainingCore, params: list[nn.Parameter]) -> None:
        """After clipping, before ``optimizer.step()`` (clean steps only)."""

    def after_optimizer_step(self, engine: TrainingCore, overflow: bool) -> None:
        """After every boundary, skipped or not."""

    def state_dict(self) -> dict[str, Any] | None:
        """This extension's share of a checkpoint (None: nothing to save)."""
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""

    def counters(self) -> dict[str, Any]:
        """Numbers for ``engine.communication_stats()``."""
        return {}

    def destroy(self, engine: EngineCore) -> None:
        """From ``engine.destroy()``: release buffers and hooks (called once)."""


ExtensionFactory = Callable[[Any], "EngineExtension | None"]
_FACTORIES: list[tuple[int, str, ExtensionFactory]] = []
_KINDS: dict[str, str] = {}  # factory name -> the kind of engine that builds it


def register_engine_extension(order: int, name: str, kind: str = TRAINING) -> Callable[[ExtensionFactory], ExtensionFactory]:
    """Register ``factory(config) -> EngineExtension | None``; every engine of ``kind`` calls it at construction."""
    if kind not in (TRAINING, INFERENCE):
        raise ValueError(f"engine extension {name!r}: kind must be {TRAINING!r} or {INFERENCE!r}, got {kind!r}")

    def decorator(factory: ExtensionFactory) -> ExtensionFactory:
        _FACTORIES[:] = [f for f in _FACTORIES if f[1] != name]
        _FACTORIES.append((order, name, factory))
        _FACTORIES.sort(key=lambda f: (f[0], f[1]))
        _KINDS[name] = kind
        return factory

    return decorator


def registered_engine_extensions(kind: str = TRAINING) -> list[tuple[int, str]]:
    return [(order, name) for order, name, _ in engine_extension_factories(kind)]


def engine_extension_factories(kind: str = TRAINING) -> list[tuple[int, str, ExtensionFactory]]:
    """The factories registered for ``kind``, in the order engines build them."""
    return [f for f in _FACTORIES if _KINDS.get(f[1], TRAINING) == kind]
