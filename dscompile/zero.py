"""``deepspeed.zero``: ``Init`` (build a model already partitioned for ZeRO-3) and ``GatheredParameters``.

Both translate to ``dscompile.runtime.zero_init``: inside ``Init`` each module's parameters are
broadcast from rank 0 and sharded when the module is built; ``dscompile.initialize`` with
``zero_optimization.stage`` 3 then trains those shards (the engine's ``ZeroPartition`` adopts them,
same storage); stages 1-2 and 0 gather the full values back first, since they keep them.

``Init`` keeps parameters in the dtype they were built in: DeepSpeed also converts them to
16 bits while building, a precision convention dscompile's engine sets itself from the config
(pass ``dtype=`` to convert here). Refused clearly: ``mpu``, a parameter offload device other than
the model's own, ZeRO++ quantized or hierarchical weights, ``MiCS_Init``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from dscompile.accelerator import get_accelerator
from dscompile.comm import init_distributed
from dscompile.config import load_config
from dscompile.errors import DSCompileNotSupportedError
from dscompile.runtime.zero_init import ShardOnCreation, gathered, shard_module
from dscompile.runtime.zero_shard import ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "MiCS_Init", "ZeroParamStatus", "register_external_parameter", "unregister_external_parameter"]


class Init:
    """``with zero.Init(): model = Model()`` builds ``model`` sharded; ``zero.Init(module=model)``
    shards a built one."""

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        zero_param_parallel_group: Any = None,
        zero_quantized_weights: bool = False,
        zero_quantized_nontrainable_weights: bool = False,
        sequence_data_parallel_group: Any = None,
        param_swapper: Any = None,
        tensor_overrides: Any = None,
    ) -> None:
        self.enabled = enabled
        self._context: ShardOnCreation | None = None
        if not enabled:
            return
        if mpu is not None:
            raise DSCompileNotSupportedError("zero.Init(mpu)", "model-parallel units (tensor parallelism)")
        if zero_param_parallel_group is not None or zero_quantized_weights or zero_quantized_nontrainable_weights:
            raise DSCompileNotSupportedError("zero.Init(zero_param_parallel_group / zero_quantized_weights)", "ZeRO++")
        if param_swapper is not None:
            raise DSCompileNotSupportedError("zero.Init(param_swapper)", "NVMe parameter swapping")
        override_apply = True
        source = config_dict_or_path if config_dict_or_path is not None else config
        if source is not None:
            zero = load_config(source).sections.get("zero_optimization")  # validates the whole config
            if zero is not None:
                override_apply = zero.override_module_apply
                # offload_param: the engine moves the shards cut here to the host or NVMe at construction
        if remote_device not in (None, "none", get_accelerator().device_name()):
            raise DSCompileNotSupportedError(f"zero.Init(remote_device={remote_device!r})", "ZeRO-Infinity parameter offload")
        init_distributed()  # as DeepSpeed's Init: the process group from the launcher (or one process) when none exists yet
        group = data_parallel_group if data_parallel_group is not None else sequence_data_parallel_group
        if module is not None:
            shard_module(module, group, dtype)
            return
        self._context = ShardOnCreation(group, dtype, override_module_apply=override_apply)

    def __enter__(self) -> Init:
        if self._context is not None:
            self._context.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._context is not None:
            self._context.__exit__(*exc)


class MiCS_Init(Init):  # noqa: N801 - DeepSpeed's name
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise DSCompileNotSupportedError("zero.MiCS_Init", "MiCS sharding")


class GatheredParameters:
    """``with GatheredParameters(params, modifier_rank=0): ...``: full values inside; with a
    ``modifier_rank``, that rank's changes become every rank's when the block ends."""

    def __init__(
        self,
        params: Iterable[nn.Parameter] | nn.Parameter,
        modifier_rank: int | None = None,
        fwd_module: nn.Module | None = None,
        enabled: bool = True,
    ) -> None:
        # fwd_module registers external parameters with DeepSpeed's hooks; compiled graphs see every use already
        self._context = gathered(params, modifier_rank) if enabled else None

    def __enter__(self) -> None:
        if self._context is not None:
            self._context.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self._context is not None:
            self._context.__exit__(*exc)


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """DeepSpeed's hooks need to be told of a parameter used outside its owner's forward; the
    ZeRO-3 graph pass sees every use in the captured graph, so there is nothing to register."""
    if not isinstance(parameter, torch.Tensor):
        raise TypeError(f"register_external_parameter: expected a parameter, got {type(parameter).__name__}")


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Counterpart of ``register_external_parameter``; nothing was registered."""
    if not isinstance(parameter, torch.Tensor):
        raise TypeError(f"unregister_external_parameter: expected a parameter, got {type(parameter).__name__}")
