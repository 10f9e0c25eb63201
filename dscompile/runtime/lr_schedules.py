"""``deepspeed.runtime.lr_schedules``: DeepSpeed's schedulers (``dscompile.runtime.schedulers``), re-exported only."""

from dscompile.runtime.schedulers import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = ["LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]
