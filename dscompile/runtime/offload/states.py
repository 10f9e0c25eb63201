"""``engine.offload_states()`` / ``engine.reload_states()``: park a ZeRO engine's states on the host.

DeepSpeed's API for freeing accelerator memory between training phases (e.g. while an RLHF
generation step runs): the chosen model states are copied to host memory and their device
storage is released (each tensor keeps its identity and dtype, its data becomes an empty tensor),
then ``reload_states`` copies them back bit for bit into the same tensor objects, so the
optimizer, the compiled graphs and the ZeRO shards keep working on them.

What each ``OffloadStateTypeEnum`` member moves here (dscompile keeps per-parameter shards, not
DeepSpeed's flat buffers):

- ``optim_states``: the optimizer's per-shard state tensors (AdamW's ``exp_avg``, ``exp_avg_sq``).
- ``hp_params``: the shards the optimizer steps (the fp32 master copy).
- ``lp_params``: the full parameter copies the model runs on (ZeRO-1/2, persistent ZeRO-3 ones).
- ``lp_grads``: gradients held by shards and full copies (none between steps, unless accumulating).
- ``contiguous_grad_buffer``: DeepSpeed's reduction bucket; dscompile keeps no such buffer between
  steps (its buckets are transient), so there is nothing to move.

On CPU the device is the host: a state is parked by keeping its storage aside (no copy: there is nowhere else to
put it), and the bytes parked so count as host memory, not the device's: ``get_accelerator().memory_allocated()``
on CPU (the process's resident set, as DeepSpeed's CPU accelerator reports it) leaves them out
(``host_parked_bytes``), so a script that checks the device's memory drops after ``offload_states`` and comes back
after ``reload_states`` (DeepSpeedExamples' ``training/offload_states``) sees on CPU what it sees on a GPU.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from dscompile.errors import DSCompileConfigError
from dscompile.runtime.offload.optimizer import OffloadedOptimizer


class OffloadDeviceEnum(str, Enum):
    """DeepSpeed's offload targets (``deepspeed.runtime.zero.offload_config``)."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    """DeepSpeed's kinds of model state ``offload_states`` can move."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


@dataclass
class _Parked:
    tensor: torch.Tensor  # the tensor object users and graphs hold (its data is empty while parked)
    host: torch.Tensor  # the host copy
    device: torch.device


@dataclass
class OffloadedStates:
    """What ``offload_states`` moved, by kind (``reload_states`` restores and clears it)."""

    parked: dict[OffloadStateTypeEnum, list[_Parked]] = field(default_factory=dict)

    def host_bytes(self) -> int:
        return sum(p.host.numel() * p.host.element_size() for items in self.parked.values() for p in items)


def _states_of(kind: OffloadStateTypeEnum, partition: Any, optimizer: Any) -> list[torch.Tensor]:
    if kind is OffloadStateTypeEnum.optim_states:
        return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    if kind is OffloadStateTypeEnum.hp_params:
        return list(partition.shards)
    if kind is OffloadStateTypeEnum.lp_params:
        return [p for p in partition.full_params if p.numel() > 0]
    if kind is OffloadStateTypeEnum.lp_grads:
        return [t.grad for t in [*partition.shards, *partition.full_params] if t.grad is not None]
    return []  # contiguous_grad_buffer: none is kept between steps


def _distinct(tensors: Iterable[torch.Tensor], seen: set[int]) -> list[torch.Tensor]:
    out = []
    for t in tensors:
        if id(t) not in seen and t.numel() > 0:
            seen.add(id(t))
            out.append(t)
    return out


_PARKED_FROM_HOST_DEVICE = [0]  # bytes parked by offload_states from tensors whose device is the host (CPU), this process


def host_parked_bytes() -> int:
    """Bytes of CPU-device states ``offload_states`` holds parked on the host now (the CPU accelerator's
    ``memory_allocated`` leaves them out: they are the host's, as they would be on a GPU)."""
    return _PARKED_FROM_HOST_DEVICE[0]


def _cpu_bytes(items: Iterable[_Parked]) -> int:
    return sum(p.host.numel() * p.host.element_size() for p in items if p.device.type == "cpu")


def _host_copy(t: torch.Tensor, pin_memory: bool, non_blocking: bool) -> torch.Tensor:
    if t.device.type == "cpu":
        return t.detach()  # the device is the host: keep the storage aside (the tensor itself is emptied below)
    pin = pin_memory  # pinning serves device-to-host copies
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
    host.copy_(t.detach(), non_blocking=non_blocking and pin)
    return host


def check_offload_request(engine: Any, device: Any) -> None:
    """Refuse what is not built, naming the fix (DeepSpeed's own preconditions included)."""
    if engine.context.zero is None:
        raise DSCompileConfigError(
            "offload_states", "needs ZeRO (zero_optimization.stage 1, 2 or 3): the engine has no partitioned states", "enable zero_optimization"
        )
    if OffloadDeviceEnum(device) is not OffloadDeviceEnum.cpu:
        raise DSCompileConfigError("offload_states(device=...)", f"only OffloadDeviceEnum.cpu is supported, got {device}", "pass device=OffloadDeviceEnum.cpu")
    if isinstance(engine.optimizer, OffloadedOptimizer):
        raise DSCompileConfigError(
            "offload_states",
            "the optimizer states are already offloaded (zero_optimization.offload_optimizer), as DeepSpeed also refuses",
            "drop offload_optimizer or do not call offload_states",
        )


def offload(
    engine: Any, include: Iterable[Any] | None, device: Any, pin_memory: bool, non_blocking: bool, current: OffloadedStates | None
) -> OffloadedStates:
    """Copy the chosen states to the host and release their device storage."""
    check_offload_request(engine, device)
    kinds = [OffloadStateTypeEnum(k) for k in include] if include is not None else list(OffloadStateTypeEnum)
    result = current or OffloadedStates()
    seen = {id(p.tensor) for items in result.parked.values() for p in items}
    for kind in kinds:
        for t in _distinct(_states_of(kind, engine.zero, engine.optimizer), seen):
            parked = _Parked(t, _host_copy(t, pin_memory, non_blocking), t.device)
            result.parked.setdefault(kind, []).append(parked)
            _PARKED_FROM_HOST_DEVICE[0] += _cpu_bytes([parked])
    if non_blocking and any(p.device.type != "cpu" for items in result.parked.values() for p in items):
        torch.accelerator.synchronize()  # the copies must land before the device storage goes
    with torch.no_grad():
        for items in result.parked.values():
            for p in items:
                if p.tensor.numel() > 0:
                    p.tensor.data = torch.empty(0, dtype=p.tensor.dtype, device=p.device)
    return result


def reload(current: OffloadedStates, include: Iterable[Any] | None, non_blocking: bool) -> None:
    """Copy parked states back into their tensors (bit for bit); drop them from ``current``."""
    kinds = [OffloadStateTypeEnum(k) for k in include] if include is not None else list(current.parked)
    with torch.no_grad():
        for kind in kinds:
            for p in current.parked.pop(kind, []):
                p.tensor.data = p.host.to(p.device, non_blocking=non_blocking)
                _PARKED_FROM_HOST_DEVICE[0] -= _cpu_bytes([p])
