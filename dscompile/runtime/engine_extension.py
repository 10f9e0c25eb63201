"""The engine-extension protocol: the hooks a capability's runtime part implements, and the registry of factories
every engine calls at construction. Apart from ``engine_core`` so that extensions the core itself installs (the
loss scaler's) can subclass it without importing the core."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from dscompile.runtime.engine_core import EngineCore


class EngineExtension:
    """A capability's part of the engine; override only the hooks it needs (see the module docstring)."""

    name: str = "extension"
    checks_overflow: bool = False
    """True when ``check_overflow`` can report an overflow: the core then agrees the answer across ranks."""

    def configure(self, engine: EngineCore) -> None:
        """Once, at engine construction, before the model is compiled."""

    def before_forward(self, engine: EngineCore) -> None:
        """Before each forward."""

    def after_forward(self, engine: EngineCore) -> None:
        """After each forward."""

    def scale_loss(self, engine: EngineCore, loss: torch.Tensor) -> torch.Tensor:
        """Before backward: the loss to differentiate (a multiple of ``loss``)."""
        return loss

    def after_backward(self, engine: EngineCore) -> None:
        """After each backward."""

    def on_gradients_ready(self, engine: EngineCore, params: list[nn.Parameter]) -> None:
        """At the boundary, after the gradient strategy reduced every gradient."""

    def check_overflow(self, engine: EngineCore, params: list[nn.Parameter]) -> bool:
        """Unscale and report inf/NaN gradients (True skips the step on every rank)."""
        return False

    def before_optimizer_step(self, engine: EngineCore, params: list[nn.Parameter]) -> None:
        """After clipping, before ``optimizer.step()`` (clean steps only)."""

    def after_optimizer_step(self, engine: EngineCore, overflow: bool) -> None:
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


def register_engine_extension(order: int, name: str) -> Callable[[ExtensionFactory], ExtensionFactory]:
    """Register ``factory(config) -> EngineExtension | None``; every engine calls it at construction."""

    def decorator(factory: ExtensionFactory) -> ExtensionFactory:
        _FACTORIES[:] = [f for f in _FACTORIES if f[1] != name]
        _FACTORIES.append((order, name, factory))
        _FACTORIES.sort(key=lambda f: (f[0], f[1]))
        return factory

    return decorator


def registered_engine_extensions() -> list[tuple[int, str]]:
    return [(order, name) for order, name, _ in _FACTORIES]


def engine_extension_factories() -> list[tuple[int, str, ExtensionFactory]]:
    """The registered factories in the order engines build them."""
    return list(_FACTORIES)
