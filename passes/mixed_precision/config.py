"""The ``fp16``, ``bf16`` and ``communication_data_type`` config sections, and the rule that puts the passes in the pipeline.

DeepSpeed's keys and defaults; what dscompile does not build is refused here, naming the key. ``precision_of`` and
``communication_dtype`` are the one reading of the precision that the passes and the engine extensions share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dscompile.config import log_no_effect_keys, parse_dataclass, register_section
from dscompile.deepspeed_config import autocast_precision
from dscompile.errors import DSCompileConfigError, DSCompileNotSupportedError
from dscompile.pipeline import PassInvocation, invocation, register_config_rule

LOW_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}
COMM_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, **LOW_DTYPES}


@dataclass
class FP16Config:
    """``fp16``: DeepSpeed's keys and defaults; ``loss_scale: 0`` selects the dynamic scaler."""

    enabled: bool = False
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    auto_cast: bool = False
    fp16_master_weights_and_grads: bool = False

    def validate(self, path: str) -> None:
        if self.loss_scale < 0:
            raise DSCompileConfigError(f"{path}.loss_scale", f"must be >= 0 (0 means dynamic), got {self.loss_scale}")
        if not 0 <= self.initial_scale_power <= 63:
            raise DSCompileConfigError(f"{path}.initial_scale_power", f"must be in [0, 63], got {self.initial_scale_power}")
        if self.loss_scale_window < 1:
            raise DSCompileConfigError(f"{path}.loss_scale_window", f"must be >= 1, got {self.loss_scale_window}")
        if self.hysteresis < 1:
            raise DSCompileConfigError(f"{path}.hysteresis", f"must be >= 1, got {self.hysteresis}")
        if not self.min_loss_scale > 0:
            raise DSCompileConfigError(f"{path}.min_loss_scale", f"must be > 0, got {self.min_loss_scale}")
        if self.auto_cast:
            raise DSCompileNotSupportedError(
                f"{path}.auto_cast", "casting the model inputs to fp16 (the graph casts where the policy says)"
            )
        if self.fp16_master_weights_and_grads:
            raise DSCompileNotSupportedError(
                f"{path}.fp16_master_weights_and_grads", "fp16 master weights (master weights stay fp32)"
            )


@dataclass
class BF16Config:
    """``bf16``: bf16 needs no loss scaling. ``check_grad_overflow`` (DeepSpeed's default, on)
    skips a step whose gradients hold inf/NaN on any rank; ``immediate_grad_update`` only picks
    when DeepSpeed's bf16 optimizer copies gradients (the maths is the same).
    ``bf16_master_weights_and_grads`` with ``bf16_optimizer_states`` (ZeRO 1-3, as in DeepSpeed) keeps
    the master weights, gradients and optimizer states in bf16 (``LowPrecisionMasters``); bf16 masters
    with fp32 optimizer states (DeepSpeed: ZeRO-Offload's CPU Adam only) are not built."""

    enabled: bool = False
    immediate_grad_update: bool = False
    check_grad_overflow: bool = True
    bf16_master_weights_and_grads: bool = False
    bf16_optimizer_states: bool = False

    def validate(self, path: str) -> None:
        if self.bf16_optimizer_states and not self.bf16_master_weights_and_grads:
            raise DSCompileConfigError(
                f"{path}.bf16_optimizer_states", "needs bf16_master_weights_and_grads (as in DeepSpeed)", "set bf16_master_weights_and_grads to true"
            )
        if self.bf16_master_weights_and_grads and not self.bf16_optimizer_states:
            raise DSCompileNotSupportedError(
                f"{path}.bf16_master_weights_and_grads",
                "bf16 master weights with fp32 optimizer states (DeepSpeed's ZeRO-Offload CPU Adam)",
                "also set bf16_optimizer_states to true (bf16 moments), or drop bf16_master_weights_and_grads",
            )


register_section("fp16", lambda value, path: parse_dataclass(FP16Config, value, path), "fp16 mixed precision")


def _parse_bf16(value: Any, path: str) -> BF16Config:
    log_no_effect_keys(path, value, {"immediate_grad_update": "it picks when DeepSpeed's bf16 optimizer copies gradients; the maths is the same"})
    return parse_dataclass(BF16Config, value, path)


register_section("bf16", _parse_bf16, "bf16 mixed precision")


def precision_of(config: Any) -> str | None:
    """``"bf16"``, ``"fp16"`` or None for a config; both enabled is a contradiction."""
    fp16 = config.sections.get("fp16")
    bf16 = config.sections.get("bf16")
    fp16_on = bool(fp16 and fp16.enabled)
    bf16_on = bool(bf16 and bf16.enabled)
    if fp16_on and bf16_on:
        raise DSCompileConfigError(
            "bf16.enabled",
            "cannot be combined with fp16.enabled: choose one low precision",
            "set fp16.enabled or bf16.enabled to false",
        )
    precision = "fp16" if fp16_on else "bf16" if bf16_on else None
    _check_torch_autocast(config, precision)
    return precision


def _check_torch_autocast(config: Any, precision: str | None) -> None:
    """DeepSpeed's ``torch_autocast`` beside ``bf16``/``fp16`` runs the 16-bit module under torch.autocast; the ``amp`` pass
    is autocast's cast policy, so that is what dscompile runs anyway. Alone (an fp32 module under autocast) it is refused."""
    autocast = autocast_precision(config.sections.get("torch_autocast"))
    if autocast is None:
        return
    if precision is None:
        raise DSCompileNotSupportedError(
            "torch_autocast.enabled", "torch.autocast without the bf16/fp16 section", "enable bf16 (or fp16) instead: the graph casts"
        )
    if autocast not in ("default", precision):
        raise DSCompileConfigError("torch_autocast.dtype", f"is {autocast} while {precision} is enabled", f"use the {precision} dtype or drop the key")


def _parse_communication_data_type(value: Any, path: str) -> str | None:
    """DeepSpeed's ``communication_data_type``: null, "fp32", "fp16" or "bf16" (any letter case)."""
    if value is None:
        return None
    if not isinstance(value, str) or value.lower() not in COMM_DTYPES:
        raise DSCompileConfigError(
            path,
            f"{value!r} is not a communication data type",
            f"use one of {', '.join(map(repr, COMM_DTYPES))} (or null for the training precision)",
        )
    return value.lower()


register_section("communication_data_type", _parse_communication_data_type, "mixed-precision communication")


def communication_dtype(config: Any) -> str:
    """The dtype gradients are reduced in, as DeepSpeed picks it: the key, else the training precision."""
    explicit = config.sections.get("communication_data_type")
    return explicit or precision_of(config) or "fp32"


def _zero_stage(config: Any) -> int:
    section = config.sections.get("zero_optimization")
    return int(section.stage) if section is not None else 0


# Rule order 15: after the Dynamo-graph rewrites (10) and before sharding (20), so that ZeRO
# sees the parameter casts and can gather the low-precision copies, and ``comm_dtype`` sees the
# ZeRO-2/3 reduce-scatter ops before ``zero`` turns them into collectives.
@register_config_rule(15, "mixed_precision")
def _mixed_precision_rule(config: Any) -> list[PassInvocation]:
    precision = precision_of(config)
    items = [invocation("amp", dtype=precision)] if precision else []
    if _zero_stage(config) >= 2 and (precision or config.sections.get("communication_data_type")):
        items.append(invocation("comm_dtype", dtype=communication_dtype(config)))
    return items


def _bf16_masters(config: Any) -> bool:
    """Whether ``bf16.bf16_master_weights_and_grads`` is on; it needs ZeRO 1-3, as DeepSpeed asserts."""
    bf16 = config.sections.get("bf16")
    if not (bf16 is not None and bf16.enabled and bf16.bf16_master_weights_and_grads):
        return False
    if _zero_stage(config) == 0:
        raise DSCompileConfigError("bf16.bf16_master_weights_and_grads", "needs ZeRO stage 1, 2 or 3 (as in DeepSpeed)", "set zero_optimization.stage")
    return True
