"""The engine extensions of mixed precision: the loss scaler and reduction dtype (every engine), bf16 master weights.

The graph does the casts; what runs outside graphs (loss scaling, the reductions of ZeRO-1, data parallelism and
pipeline replicas, low-precision masters) lives in ``dscompile/runtime/loss_scaler.py``, installed from here.
"""

from __future__ import annotations

from typing import Any

import torch

from dscompile.passes.mixed_precision.config import COMM_DTYPES, LOW_DTYPES, _bf16_masters, communication_dtype, precision_of
from dscompile.runtime.engine_core import register_engine_extension
from dscompile.runtime.loss_scaler import LowPrecisionMasters, MixedPrecision


# Order 9: before ZeRO (10) partitions the parameters, so that its shards are the bf16 masters.
@register_engine_extension(9, "low_precision_masters")
def _low_precision_masters_extension(config: Any) -> LowPrecisionMasters | None:
    return LowPrecisionMasters(torch.bfloat16) if _bf16_masters(config) else None


@register_engine_extension(40, "mixed_precision")
def _mixed_precision_extension(config: Any) -> MixedPrecision | None:
    """Every engine: fp16 gets DeepSpeed's loss scaler, bf16 a scale of 1 that skips steps with inf/NaN
    gradients (``bf16.check_grad_overflow``, DeepSpeed's default); the graph does the casts. The
    reductions done outside graphs (ZeRO-1, data parallelism, pipeline replicas) use
    ``communication_data_type``."""
    from dscompile.runtime.loss_scaler import StaticLossScaler, build_loss_scaler

    precision = precision_of(config)
    explicit = config.sections.get("communication_data_type")
    if precision is None and not explicit:
        return None
    scaler = None
    if precision == "fp16":
        scaler = build_loss_scaler(config.sections["fp16"])
    elif precision == "bf16" and config.sections["bf16"].check_grad_overflow:
        scaler = StaticLossScaler(1.0)
    return MixedPrecision(
        precision,
        LOW_DTYPES[precision] if precision else None,
        COMM_DTYPES[communication_dtype(config)],
        scaler,
        torch.bfloat16 if _bf16_masters(config) else torch.float32,
    )
