"""``deepspeed.utils``: ``RepeatingLoader``, ``logger``, ``log_dist``, ``OnDevice``, ``groups`` and the ZeRO-3 leaf-module
helpers (``set_z3_leaf_modules``, ...) for DeepSpeed scripts."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from dscompile import comm
from dscompile.runtime.dataloader import RepeatingLoader, set_random_seed
from dscompile.runtime.devices import OnDevice
from dscompile.runtime.zero_leaf import (
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)
from dscompile.utils import groups, zero_to_fp32

__all__ = [
    "OnDevice",
    "RepeatingLoader",
    "get_z3_leaf_modules",
    "groups",
    "log_dist",
    "logger",
    "set_random_seed",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
    "zero_to_fp32",
]

logger = logging.getLogger("dscompile")


def log_dist(message: str, ranks: Iterable[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the listed ranks only (all when ``ranks`` is None or holds -1)."""
    wanted = None if ranks is None else set(ranks)
    if wanted is None or -1 in wanted or comm.get_rank() in wanted:
        logger.log(level, "[Rank %d] %s", comm.get_rank(), message)
