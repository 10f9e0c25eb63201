"""``deepspeed.checkpointing``: ``checkpoint(fn, *args)`` and ``configure(...)`` for scripts that
checkpoint by hand.

``checkpoint`` is ``torch.utils.checkpoint.checkpoint`` (non-reentrant): run eagerly it recomputes
``fn`` in backward; inside a model the dscompile backend compiles, Dynamo records the region and
its nodes reach the checkpointing pass tagged for recomputation (user tags win over the pass's
policy). ``configure`` takes DeepSpeed's settings (from its arguments or the
``activation_checkpointing`` section of a ds_config) and applies what has a meaning without a
model-parallel unit: ``partition_activations`` splits across the model-parallel group, which
without ``mpu`` is this rank alone (so, as in DeepSpeed, nothing is split); ``cpu_checkpointing``
keeps checkpoints in host memory, where they already are on the host; ``synchronize`` waits for the
device around each call (timing only); ``number_checkpoints`` sizes DeepSpeed's contiguous buffers.
Refused clearly: an ``mpu``, ``contiguous_memory_optimization``, ``profile``, and
``cpu_checkpointing`` on a GPU. For checkpointing chosen by the compiler instead, set the
``activation_checkpointing`` section in the engine's config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint

from dscompile.accelerator import get_accelerator
from dscompile.config import load_config
from dscompile.errors import DSCompileConfigError, DSCompileNotSupportedError

__all__ = ["checkpoint", "configure", "is_configured", "non_reentrant_checkpoint", "reset"]


@dataclass
class _Settings:
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    synchronize: bool = False
    num_checkpoints: int | None = None
    configured: bool = False


_settings = _Settings()


def configure(
    mpu_: Any,
    deepspeed_config: Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """DeepSpeed's ``configure``: arguments given override the config's section."""
    global _settings
    if mpu_ is not None:
        raise DSCompileNotSupportedError("checkpointing.configure(mpu_)", "model-parallel units (tensor parallelism)")
    settings = _Settings(configured=True)
    if deepspeed_config is not None:
        section = load_config(deepspeed_config).sections.get("activation_checkpointing")
        if section is not None:
            settings.partition_activations = section.partition_activations
            settings.cpu_checkpointing = section.cpu_checkpointing
            settings.synchronize = section.synchronize_checkpoint_boundary
            settings.num_checkpoints = section.number_checkpoints
            if section.profile:
                profile = True if profile is None else profile
    if contiguous_checkpointing:
        raise DSCompileNotSupportedError("checkpointing.configure(contiguous_checkpointing=True)", "contiguous checkpoint buffers")
    if profile:
        raise DSCompileNotSupportedError("checkpointing.configure(profile=True)", "per-checkpoint timing logs (use torch.profiler)")
    if partition_activations is not None:
        settings.partition_activations = partition_activations
    if checkpoint_in_cpu is not None:
        settings.cpu_checkpointing = checkpoint_in_cpu
    if synchronize is not None:
        settings.synchronize = synchronize
    if num_checkpoints is not None:
        if num_checkpoints <= 0:
            raise DSCompileConfigError("checkpointing.configure(num_checkpoints)", f"must be positive, got {num_checkpoints}")
        settings.num_checkpoints = num_checkpoints
    if settings.cpu_checkpointing and get_accelerator().device_name() != "cpu":
        raise DSCompileNotSupportedError(
            "checkpointing.configure(checkpoint_in_cpu=True)",
            "host copies of hand-placed checkpoints on a GPU (set activation_checkpointing.cpu_checkpointing in the engine config)",
        )
    _settings = settings


def is_configured() -> bool:
    """True once ``configure`` ran (DeepSpeed's name for it)."""
    return _settings.configured


def reset() -> None:
    """Forget the configuration (DeepSpeed resets its buffers here; dscompile keeps none)."""
    global _settings
    _settings = _Settings()


def checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)``, its activations recomputed in backward instead of kept."""
    if _settings.synchronize:
        get_accelerator().synchronize()
    out = torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)
    if _settings.synchronize:
        get_accelerator().synchronize()
    return out


non_reentrant_checkpoint = checkpoint
