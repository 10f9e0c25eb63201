"""``deepspeed.accelerator``: ``get_accelerator()``, the device-agnostic handle DeepSpeed scripts use.

Each method maps onto torch (``torch.cuda`` on a GPU, the host otherwise), so a script written
against DeepSpeed's accelerator runs unchanged. ``DS_ACCELERATOR=cpu|cuda`` picks one explicitly.
On the host, memory queries report the process's resident set (sampled when asked; the peak is the
largest sample since ``reset_peak_memory_stats``), as DeepSpeed's CPU accelerator does; ``memory_allocated`` leaves
out the states ``engine.offload_states()`` parked on the host (``runtime/offload/states.py``), which on a GPU would
have left the device: ``memory_reserved`` still counts them.
"""

from __future__ import annotations

import contextlib
import os
import resource
from collections.abc import Callable
from typing import Any

import torch

from dscompile.errors import DSCompileConfigError, DSCompileNotSupportedError
from dscompile.runtime.offload.states import host_parked_bytes

__all__ = ["CPUAccelerator", "CUDAAccelerator", "get_accelerator", "set_accelerator"]


class _Accelerator:
    """What both devices share: RNG, dtype support, tensors' placement, op builders refused."""

    _name = ""
    _communication_backend_name = ""
    _compile_backend = "dscompile"

    # -- identity ------------------------------------------------------------------------------
    def device_name(self, device_index: int | None = None) -> str:
        return self._name if device_index is None else f"{self._name}:{device_index}"

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def is_available(self) -> bool:
        return True

    # -- RNG -----------------------------------------------------------------------------------
    def random(self) -> Any:
        return torch.random

    def manual_seed(self, seed: int) -> Any:
        return torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> Any:
        return torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    # -- dtypes --------------------------------------------------------------------------------
    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float32]
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        if self.is_fp16_supported():
            dtypes.append(torch.float16)
        return dtypes

    # -- placement -----------------------------------------------------------------------------
    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def range_push(self, msg: str, domain: Any = None, category: Any = None) -> None:
        return None  # profiler ranges exist on the GPU only (NVTX)

    def range_pop(self, domain: Any = None) -> None:
        return None

    def lazy_call(self, callback: Callable[[], Any]) -> Any:
        return callback()

    def get_compile_backend(self) -> str:
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        self._compile_backend = backend

    def create_op_builder(self, op_name: str) -> Any:
        raise DSCompileNotSupportedError(
            f"accelerator.create_op_builder({op_name!r})", "DeepSpeed's C++/CUDA op builders (dscompile generates its kernels)"
        )

    get_op_builder = create_op_builder

    def export_envs(self) -> list[str]:
        return []

    @property
    def BFloat16Tensor(self) -> Callable[..., torch.Tensor]:
        return lambda *a, **k: torch.tensor(*a, **k, dtype=torch.bfloat16, device=self._name)

    @property
    def HalfTensor(self) -> Callable[..., torch.Tensor]:
        return lambda *a, **k: torch.tensor(*a, **k, dtype=torch.float16, device=self._name)

    @property
    def FloatTensor(self) -> Callable[..., torch.Tensor]:
        return lambda *a, **k: torch.tensor(*a, **k, dtype=torch.float32, device=self._name)

    @property
    def LongTensor(self) -> Callable[..., torch.Tensor]:
        return lambda *a, **k: torch.tensor(*a, **k, dtype=torch.int64, device=self._name)

    @property
    def IntTensor(self) -> Callable[..., torch.Tensor]:
        return lambda *a, **k: torch.tensor(*a, **k, dtype=torch.int32, device=self._name)

    @property
    def ByteTensor(self) -> Callable[..., torch.Tensor]:
        return lambda *a, **k: torch.tensor(*a, **k, dtype=torch.uint8, device=self._name)

    @property
    def DoubleTensor(self) -> Callable[..., torch.Tensor]:
        return lambda *a, **k: torch.tensor(*a, **k, dtype=torch.float64, device=self._name)


def _resident_bytes() -> int:
    """This process's resident set size now (Linux ``/proc``), else its peak so far."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class CPUAccelerator(_Accelerator):
    """The host as the device: gloo collectives, no streams, memory is the process's resident set."""

    _name = "cpu"
    _communication_backend_name = "gloo"

    def __init__(self) -> None:
        self._peak = _resident_bytes()

    def device_name(self, device_index: int | None = None) -> str:
        return "cpu"  # one host device whatever the index (a local rank), as DeepSpeed's CPU accelerator

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device("cpu")

    def set_device(self, device_index: int) -> None:
        return None

    def current_device(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    def current_device_name(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", 1)))

    def is_synchronized_device(self) -> bool:
        return True

    def use_host_timers(self) -> bool:
        return True

    def resolves_data_dependency(self) -> bool:
        return True

    def handles_memory_backpressure(self) -> bool:
        return True

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.set_rng_state(new_state)

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.get_rng_state()

    def default_generator(self, device_index: int | None = None) -> torch.Generator:
        return torch.default_generator

    @property
    def Stream(self) -> Any:
        return torch.cpu.Stream

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None) -> Any:
        return torch.cpu.current_stream()

    def default_stream(self, device_index: int | None = None) -> Any:
        return torch.cpu.current_stream()

    @property
    def Event(self) -> Any:
        return None  # the host has no device events; DeepSpeed's CPU accelerator answers None too

    def empty_cache(self) -> None:
        return None

    def memory_allocated(self, device_index: int | None = None) -> int:
        now = _resident_bytes() - host_parked_bytes()  # parked states are the host's (as on a GPU), not the device's
        self._peak = max(self._peak, now)
        return now

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return max(self._peak, self.memory_allocated())

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        self._peak = _resident_bytes() - host_parked_bytes()

    def memory_reserved(self, device_index: int | None = None) -> int:
        return _resident_bytes()

    reset_max_memory_allocated = reset_peak_memory_stats
    reset_max_memory_cached = reset_peak_memory_stats
    memory_cached = memory_reserved
    max_memory_cached = max_memory_allocated
    max_memory_reserved = max_memory_allocated

    def memory_stats(self, device_index: int | None = None) -> dict[str, int]:
        return {"allocated_bytes.all.current": self.memory_allocated(), "allocated_bytes.all.peak": self.max_memory_allocated()}

    def total_memory(self, device_index: int | None = None) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index: int | None = None) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        return True  # fp16 arithmetic runs on the host in torch (slowly where the CPU lacks it)

    def is_triton_supported(self) -> bool:
        return False  # Triton runs on the host only in its interpreter

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor  # nothing to pin: the host is the device

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return False


class CUDAAccelerator(_Accelerator):
    """An NVIDIA GPU through ``torch.cuda``; NCCL collectives."""

    _name = "cuda"
    _communication_backend_name = "nccl"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device("cuda", device_index)

    def set_device(self, device_index: int) -> None:
        torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}"

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def is_synchronized_device(self) -> bool:
        return False

    def use_host_timers(self) -> bool:
        return False

    def resolves_data_dependency(self) -> bool:
        return False

    def handles_memory_backpressure(self) -> bool:
        return False

    def synchronize(self, device_index: int | None = None) -> None:
        torch.cuda.synchronize(device_index)

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)

    def manual_seed(self, seed: int) -> Any:
        return torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> Any:
        return torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed()

    def default_generator(self, device_index: int | None = None) -> torch.Generator:
        return torch.cuda.default_generators[torch.cuda.current_device() if device_index is None else device_index]

    @property
    def Stream(self) -> Any:
        return torch.cuda.Stream

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def current_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.default_stream(device_index)

    @property
    def Event(self) -> Any:
        return torch.cuda.Event

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    reset_peak_memory_stats = reset_max_memory_allocated
    reset_max_memory_cached = reset_max_memory_allocated

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    memory_cached = memory_reserved
    max_memory_cached = max_memory_reserved

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        return torch.cuda.memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        return torch.cuda.get_device_properties(torch.cuda.current_device() if device_index is None else device_index).total_memory

    def available_memory(self, device_index: int | None = None) -> int:
        return torch.cuda.mem_get_info(device_index)[0]

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        return True

    def is_triton_supported(self) -> bool:
        return torch.cuda.get_device_capability()[0] >= 7

    def range_push(self, msg: str, domain: Any = None, category: Any = None) -> None:
        torch.cuda.nvtx.range_push(msg)

    def range_pop(self, domain: Any = None) -> None:
        torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback: Callable[[], Any]) -> Any:
        return torch.cuda._lazy_call(callback)

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cuda"


_ACCELERATORS: dict[str, Callable[[], _Accelerator]] = {"cpu": CPUAccelerator, "cuda": CUDAAccelerator}
_current: _Accelerator | None = None


def get_accelerator() -> _Accelerator:
    """The process's accelerator: ``DS_ACCELERATOR`` if set, else CUDA when a GPU is visible, else the host."""
    global _current
    if _current is None:
        name = os.environ.get("DS_ACCELERATOR") or ("cuda" if torch.cuda.is_available() else "cpu")
        if name not in _ACCELERATORS:
            raise DSCompileConfigError("DS_ACCELERATOR", f"{name!r} is not an accelerator dscompile runs on", "use 'cpu' or 'cuda'")
        if name == "cuda" and not torch.cuda.is_available():
            raise DSCompileConfigError("DS_ACCELERATOR", "is 'cuda' but torch sees no GPU", "unset it or install a CUDA build of torch")
        _current = _ACCELERATORS[name]()
    return _current


def set_accelerator(accelerator: _Accelerator) -> None:
    """Replace the process's accelerator (DeepSpeed's hook for custom devices)."""
    global _current
    _current = accelerator


def is_current_accelerator_supported() -> bool:
    return get_accelerator()._name in _ACCELERATORS
