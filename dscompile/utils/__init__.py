"""``deepspeed.utils``: ``RepeatingLoader``, ``logger``, ``log_dist``, ``OnDevice`` and ``groups`` for DeepSpeed scripts."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from dscompile import comm
from dscompile.runtime.dataloader import RepeatingLoader, set_random_seed
from dscompile.runtime.devices import OnDevice
from dscompile.utils import groups, zero_to_fp32

__all__ = ["OnDevice", "RepeatingLoader", "groups", "log_dist", "logger", "set_random_seed", "zero_to_fp32"]

logger = logging.getLogger("dscompile")


def log_dist(message: str, ranks: Iterable[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the listed ranks only (all when ``ranks`` is None or holds -1)."""
    wanted = None if ranks is None else set(ranks)
    if wanted is None or -1 in wanted or comm.get_rank() in wanted:
        logger.log(level, "[Rank %d] %s", comm.get_rank(), message)
