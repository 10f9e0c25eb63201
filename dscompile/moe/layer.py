"""``deepspeed.moe.layer.MoE``: refused when built, naming what is missing."""

from __future__ import annotations

from typing import Any

from torch import nn

from dscompile.errors import DSCompileNotSupportedError


class MoE(nn.Module):
    """DeepSpeed's Mixture-of-Experts layer. Constructing it raises: dscompile has no expert
    parallelism or gating yet (use a dense layer, or DeepSpeed itself for MoE)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise DSCompileNotSupportedError("deepspeed.moe.layer.MoE", "Mixture-of-Experts layers and expert parallelism")
