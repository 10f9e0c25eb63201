"""``dscompile::offload_gradient``: the backward graph hands a shard's final gradient to its offloaded optimizer.

The ``offload_gradients`` pass (``passes/offload.py``) puts this op in each backward graph where a host-stepped
shard's gradient is final; at run time it finds the live offloaded optimizer whose engine runs this backward
(its ``early_gate`` is open) and calls its ``hand_off``. Optimizers register here (``register``) rather than
being named in the graph, because Dynamo may reuse one compiled graph for another engine over a model of the
same structure. This module knows optimizers only through that small interface, so it sits below them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch


class GradientSink(Protocol):
    """What the op needs of an offloaded optimizer (``optimizer.OffloadedOptimizer``)."""

    shards: list[torch.nn.Parameter]
    sink_index: dict[int, int]
    early_gate: Callable[[], bool] | None

    def steps_in_place(self, i: int) -> bool: ...

    def hand_off(self, i: int, grad: torch.Tensor) -> None: ...


_SINKS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
"""Live offloaded optimizers with host-stepped shards, by key: where ``dscompile::offload_gradient`` hands gradients."""
_SINK_KEYS = iter(range(1, 1 << 62))


def register(sink: GradientSink) -> int:
    """Make ``sink`` reachable from the graphs (held weakly); its key, for ``unregister``."""
    key = next(_SINK_KEYS)
    _SINKS[key] = sink
    return key


def unregister(key: int) -> None:
    _SINKS.pop(key, None)


def gradient_sink_of(tensor: Any) -> tuple[int, int, bool] | None:
    """(optimizer key, shard index, stepped in place) of a host-stepped shard of a live offloaded optimizer; None otherwise."""
    if not isinstance(tensor, torch.Tensor):
        return None
    for key, opt in list(_SINKS.items()):
        i = opt.sink_index.get(id(tensor))
        if i is not None and opt.shards[i] is tensor:
            return key, i, opt.steps_in_place(i)
    return None


@torch.library.custom_op("dscompile::offload_gradient", mutates_args=())
def offload_gradient(grad: torch.Tensor, after: list[torch.Tensor], shard: int) -> None:
    """Shard ``shard``'s final gradient of this backward, handed to the offloaded optimizer whose engine runs this
    backward (``hand_off``; every other one's gate is closed).

    The optimizer is found when the graph runs, not named in it: Dynamo may reuse a compiled graph for another
    engine over a model of the same structure (the same shard order). ``after``: values whose computation last
    reads the shard in this graph; they are inputs only so that every lowering runs this op after them (the early
    step may update an in-place shard)."""
    for opt in list(_SINKS.values()):
        if opt.early_gate is not None and opt.early_gate():
            opt.hand_off(shard, grad)
            return


@offload_gradient.register_fake
def _offload_gradient_fake(grad: torch.Tensor, after: list[torch.Tensor], shard: int) -> None:
    return None


torch.fx.node.has_side_effect(torch.ops.dscompile.offload_gradient.default)  # kept by DCE and by Inductor
OFFLOAD_GRADIENT = torch.ops.dscompile.offload_gradient.default

__all__ = ["OFFLOAD_GRADIENT", "GradientSink", "gradient_sink_of", "offload_gradient", "register", "unregister"]
