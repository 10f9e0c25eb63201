"""What the host step of an offloaded optimizer is built from.

The planner's ``OffloadSettings``, the ``Piece`` (a run of one shard that the host optimizer steps as one
tensor), and the helpers that build the inner optimizers of the user's class and probe which element-wise
states it keeps. Kept apart from the optimizer classes so that the engine extension, the planner's CLI and
both step paths (``cpu.py``, ``nvme.py``) read them without importing either path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

IMPLEMENTATION_KEYS = frozenset({"foreach", "fused", "capturable", "differentiable"})
"""Group keys that pick an implementation, not a hyper-parameter: not copied onto the inner optimizers at each step."""


@dataclass
class OffloadSettings:
    """What the planner decided for the optimizer states (from ``zero_optimization.offload_optimizer``)."""

    device: str  # "cpu" or "nvme"
    nvme_path: str | None = None
    pin_memory: bool = False
    buffer_count: int = 4
    ratio: float = 1.0
    tile_elements: int = 1_000_000_000
    pipeline_read: bool = True
    pipeline_write: bool = True
    preallocate_states: bool = True  # False with fast_init: state segments are written at the first step
    block_size: int = 1 << 20
    io_threads: int = 1
    host_threads: int | None = None
    separate_master: bool = False  # cpu: a host master copy even where the shard is already on the host (what an accelerator run does)
    verify_reads: bool = False  # debug mode: CRC-32 of every swap file checked on read-back


@dataclass
class Piece:
    """A contiguous run ``[start, stop)`` of one shard, stepped by the host optimizer as one tensor."""

    shard: int
    start: int
    stop: int
    group: int
    master: nn.Parameter
    initialized: bool = False  # its element-wise states exist in its tile's file
    inplace: bool = False  # cpu: the master is an alias of the shard's own storage (the shard is its own master)

    @property
    def numel(self) -> int:
        return self.stop - self.start


def build_optimizer(cls: type[torch.optim.Optimizer], groups: list[dict[str, Any]], defaults: dict[str, Any]) -> torch.optim.Optimizer:
    try:
        return cls(groups)
    except TypeError:
        return cls(groups, lr=defaults.get("lr", 1e-3))


def host_group(group: dict[str, Any]) -> dict[str, Any]:
    """The group for the host optimizer: the user's implementation flags (``fused=True`` is torch's fused CPU
    step, about 2x faster than the default loop on CPU but not bit-identical to it), never ``capturable``."""
    entry = {k: v for k, v in group.items() if k != "params"}
    entry.pop("capturable", None)
    return entry


def state_slots(cls: type[torch.optim.Optimizer], group: dict[str, Any], dtype: torch.dtype) -> list[tuple[str, torch.dtype]]:
    """The element-wise state tensors ``cls`` keeps per parameter under ``group``'s settings (one probe step)."""
    probe = nn.Parameter(torch.zeros(3, dtype=dtype))
    entry = {k: v for k, v in group.items() if k not in ("params", "fused", "foreach", "capturable")}
    opt = build_optimizer(cls, [{**entry, "params": [probe]}], entry)
    probe.grad = torch.zeros_like(probe)
    opt.step()
    return [(k, v.dtype) for k, v in opt.state[probe].items() if isinstance(v, torch.Tensor) and v.shape == probe.shape]


def state_bytes_per_element(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of element-wise optimizer state per fp32 parameter element (8 for Adam), from one probe step."""
    group = optimizer.param_groups[0] if optimizer.param_groups else dict(optimizer.defaults)
    return sum(torch.empty((), dtype=dtype).element_size() for _, dtype in state_slots(type(optimizer), group, torch.float32))


def host_threads_from_fraction(fraction: float | None) -> int | None:
    """``cpuadam_cores_perc`` as a thread count for the host step (None: leave torch's setting)."""
    if fraction is None:
        return None
    return max(1, int(round(fraction * (os.cpu_count() or 1))))


__all__ = [
    "IMPLEMENTATION_KEYS",
    "OffloadSettings",
    "Piece",
    "build_optimizer",
    "host_group",
    "host_threads_from_fraction",
    "state_bytes_per_element",
    "state_slots",
]
