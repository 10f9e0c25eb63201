"""Which device a tensor must live on: the one rule for collective buffers and for RNG state.

Everything dscompile builds outside graphs follows two rules, kept here so they are written once:

- A tensor handed to a collective must be on a device its process group's backend serves: gloo
  serves CPU (and CUDA), NCCL only CUDA. ``collective_device(group, like=...)`` is the device of
  ``like`` (the parameters, the gradients) when the backend serves it, else the backend's own
  device (NCCL: the current CUDA device). Without a process group it is ``like``'s device or CPU.
- Code that replays random ops (recomputing a pipeline stage, resuming a checkpoint) must save
  and restore the generator of every device the ops ran on, not only the CPU generator: dropout
  on CUDA draws from the CUDA generator. ``capture_rng`` / ``restore_rng`` / ``forked_rng`` do that
  for the CPU and every accelerator device named.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

Device = torch.device | str | torch.Tensor | None


def _as_device(like: Device) -> torch.device | None:
    if like is None:
        return None
    if isinstance(like, torch.Tensor):
        return like.device
    return torch.device(like)


def _current(device_type: str) -> torch.device:
    """The current device of an accelerator type (``cuda`` -> ``cuda:<current index>``)."""
    if device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, device_type, None)
    index = module.current_device() if module is not None and hasattr(module, "current_device") else 0
    return torch.device(device_type, index)


def backend_device_types(group: dist.ProcessGroup | None = None) -> list[str]:
    """Device types the group's backend serves, in its own order (``["cpu", "cuda"]`` for gloo, ``["cuda"]`` for NCCL)."""
    config = dist.get_backend_config(group)  # e.g. "cpu:gloo,cuda:gloo" or "cuda:nccl"
    types = [entry.split(":", 1)[0] for entry in config.split(",") if ":" in entry]
    if types:
        return types
    backend = str(dist.get_backend(group))
    return ["cuda"] if backend == "nccl" else ["cpu"]


def backend_serving(group: dist.ProcessGroup | None, device_type: str) -> str:
    """The backend that moves ``device_type`` tensors for ``group``: ``"gloo"`` for CPU tensors of a
    ``"cpu:gloo,cuda:nccl"`` group, ``"nccl"`` for its CUDA tensors; the group's backend where its
    configuration names no such device."""
    for entry in dist.get_backend_config(group).split(","):
        device, _, name = entry.partition(":")
        if name and device == device_type:
            return name
    return str(dist.get_backend(group))


def collective_device(group: dist.ProcessGroup | None = None, like: Device = None) -> torch.device:
    """The device a collective's buffers must be on for ``group``; ``like``'s device when the backend serves it."""
    wanted = _as_device(like)
    if not (dist.is_available() and dist.is_initialized()):
        return wanted or torch.device("cpu")
    types = backend_device_types(group)
    if wanted is not None and wanted.type in types:
        return wanted
    if wanted is None and "cpu" in types:
        return torch.device("cpu")  # small flags and counters: no device copy needed
    return _current(next(t for t in types if t != "cpu"))


def device_of(tensors: Iterable[Any], default: torch.device | None = None) -> torch.device:
    """The device of the first tensor among ``tensors`` (``default`` or CPU when there is none)."""
    for value in tensors:
        if isinstance(value, torch.Tensor):
            return value.device
    return default or torch.device("cpu")


def accelerator_devices(tensors: Iterable[Any]) -> list[torch.device]:
    """The distinct non-CPU devices ``tensors`` live on (what a replay must fork the RNG of)."""
    found: list[torch.device] = []
    for value in tensors:
        if isinstance(value, torch.Tensor) and value.device.type not in ("cpu", "meta") and value.device not in found:
            found.append(value.device)
    return found


@dataclass
class RngState:
    """The CPU generator's state and that of each accelerator device given."""

    cpu: torch.Tensor
    devices: dict[torch.device, torch.Tensor] = field(default_factory=dict)

    def to_dict(self) -> dict[str, torch.Tensor]:
        return {"cpu": self.cpu, **{str(d): s for d, s in self.devices.items()}}

    @staticmethod
    def from_dict(state: dict[str, torch.Tensor]) -> RngState:
        return RngState(state["cpu"], {torch.device(k): v for k, v in state.items() if k != "cpu"})


def _module(device: torch.device) -> Any:
    module = getattr(torch, device.type, None)
    if module is None or not hasattr(module, "get_rng_state"):
        raise ValueError(f"no generator state API for device type {device.type!r}")
    return module


def capture_rng(devices: Iterable[torch.device] = ()) -> RngState:
    """Snapshot the CPU generator and the generators of ``devices`` (accelerators)."""
    states = {}
    for device in devices:
        if device.type not in ("cpu", "meta"):
            index = device.index if device.index is not None else _current(device.type).index
            states[torch.device(device.type, index)] = _module(device).get_rng_state(index)
    return RngState(torch.get_rng_state(), states)


def restore_rng(state: RngState) -> None:
    torch.set_rng_state(state.cpu)
    for device, value in state.devices.items():
        _module(device).set_rng_state(value, device.index)


@contextlib.contextmanager
def forked_rng(devices: Iterable[torch.device] = ()) -> Iterator[None]:
    """Run a block on forked generators (CPU and ``devices``); the callers' generators are untouched after it."""
    by_type: dict[str, list[int]] = {}
    for device in devices:
        if device.type not in ("cpu", "meta"):
            index = device.index if device.index is not None else _current(device.type).index
            by_type.setdefault(device.type, []).append(index)
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=[]))  # the CPU generator
        for device_type, indices in by_type.items():
            stack.enter_context(torch.random.fork_rng(devices=sorted(set(indices)), device_type=device_type))
        yield


class OnDevice:
    """DeepSpeed's ``OnDevice(dtype, device="meta", enabled=True)``: modules built inside get their tensors on
    ``device`` and their floating-point tensors in ``dtype`` (``device="meta"``: shapes only, no memory).

    torch's own mechanisms: ``torch.device`` as a context (factory functions default to it) and the default
    dtype. A tensor created with an explicit ``dtype=`` keeps it (DeepSpeed's casts it as well).
    """

    def __init__(self, dtype: torch.dtype | None, device: Device = "meta", enabled: bool = True) -> None:
        self.dtype = dtype
        self.device = device
        self.enabled = enabled
        self._stack = contextlib.ExitStack()
        self._previous_dtype: torch.dtype | None = None

    def __enter__(self) -> OnDevice:
        if self.enabled:
            if self.device is not None:
                self._stack.enter_context(torch.device(self.device))
            if self.dtype is not None and self.dtype.is_floating_point:
                self._previous_dtype = torch.get_default_dtype()
                torch.set_default_dtype(self.dtype)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous_dtype is not None:
            torch.set_default_dtype(self._previous_dtype)
            self._previous_dtype = None
        self._stack.close()
