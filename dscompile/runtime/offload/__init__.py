"""ZeRO-Offload and ZeRO-Infinity: optimizer states and parameter shards on the host or in NVMe swap files.

The modules and their rules are in this folder's ``README.md``. What other code imports lives here:
``build_offloaded_optimizer`` (the ``OffloadedOptimizer`` for ``settings.device``), the settings, and the swap
directory. Both config sections are parsed in ``passes/offload.py``.
"""

from __future__ import annotations

from torch import nn
from torch.optim import Optimizer

from dscompile.errors import DSCompileConfigError
from dscompile.runtime.offload.cpu import CpuOffloadedOptimizer
from dscompile.runtime.offload.host import OffloadSettings
from dscompile.runtime.offload.nvme import NvmeOffloadedOptimizer
from dscompile.runtime.offload.optimizer import OffloadedOptimizer
from dscompile.runtime.offload.swap import SwapDirectory, SwapError


def build_offloaded_optimizer(
    sharded: Optimizer, shards: list[nn.Parameter], settings: OffloadSettings, rank: int = 0, chosen: list[nn.Parameter] | None = None
) -> OffloadedOptimizer:
    """ZeRO's sharded optimizer ``sharded`` (over ``shards``) with its offloaded part (``chosen``, else the first
    ``settings.ratio`` of the elements) stepped on the host: in host memory (``device: cpu``) or from swap files
    under ``settings.nvme_path`` (``device: nvme``)."""
    kinds: dict[str, type[OffloadedOptimizer]] = {"cpu": CpuOffloadedOptimizer, "nvme": NvmeOffloadedOptimizer}
    if settings.device not in kinds:
        raise DSCompileConfigError("zero_optimization.offload_optimizer.device", f"must be cpu or nvme to offload, got {settings.device!r}")
    return kinds[settings.device](sharded, shards, settings, rank=rank, chosen=chosen)


__all__ = [
    "CpuOffloadedOptimizer",
    "NvmeOffloadedOptimizer",
    "OffloadSettings",
    "OffloadedOptimizer",
    "SwapDirectory",
    "SwapError",
    "build_offloaded_optimizer",
]
