"""DeepSpeed's ``deepspeed.runtime.zero.offload_config`` names, for ``engine.offload_states(include=..., device=...)``."""

from dscompile.runtime.offload.states import OffloadDeviceEnum, OffloadStateTypeEnum

__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum"]
