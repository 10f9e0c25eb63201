"""``deepspeed.module_inject``: the names AutoTP training scripts import (``layers.set_autotp_mode``)."""

from __future__ import annotations

from dscompile.module_inject import layers

__all__ = ["layers"]
