"""Mixed precision outside the graphs: fp16 loss scaling with DeepSpeed's schedule, and the reduction dtype.

``MixedPrecision`` is the engine extension (``dscompile.runtime.engine_core``) the ``bf16``/``fp16``
sections install in every engine (``DSCompileEngine`` and ``PipelineEngine`` alike): it sets the
dtype of the gradient reductions done outside graphs (``communication_data_type``) and, for fp16,
drives a loss scaler through the scaler protocol: ``scale(loss)`` before backward (a pipeline
scales the loss gradient it seeds backward with), ``unscale_and_check(params)`` before clipping and
the optimizer step (True means "overflow: skip this step"; the engine core agrees it across ranks),
then ``update(overflow)``. The current scale is ``engine.loss_scaler.loss_scale`` (alias
``cur_scale``, DeepSpeed's name); the scaler's state is the extension's share of a checkpoint.

Schedule (DeepSpeed's ``fp16`` section, ``loss_scale: 0``):

- the scale starts at ``2 ** initial_scale_power``;
- an overflow with no hysteresis left halves it (never below ``min_loss_scale``); while hysteresis
  remains (``hysteresis`` overflows are tolerated), an overflow only uses one up;
- after ``loss_scale_window`` steps without overflow (counted from the last overflow) the scale
  doubles and the hysteresis is restored; with ``consecutive_hysteresis`` every clean step
  restores it (so only consecutive overflows lower the scale);
- an overflow while the scale already sits at ``min_loss_scale`` with no hysteresis left is fatal
  (``raise_error_at_min_scale``), as in DeepSpeed: training cannot recover by itself.

``loss_scale > 0`` is a static scale: overflowing steps are still skipped, the scale never moves.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from dscompile.errors import DSCompileConfigError
from dscompile.runtime.devices import collective_device
from dscompile.runtime.engine_extension import EngineExtension
from dscompile.runtime.sixteen_bit import cast_state_dict_to

if TYPE_CHECKING:
    from dscompile.runtime.training_core import TrainingCore

log = logging.getLogger("dscompile.runtime.loss_scaler")


class LossScaleAtMinimumError(RuntimeError):
    """The scale cannot go lower and gradients still overflow: the run has diverged."""


def grads_overflow(parameters: Iterable[nn.Parameter], group: Any = None) -> bool:
    """True when any gradient on any rank holds inf or NaN.

    One fused reduction per rank (no host sync per tensor); with torch.distributed initialised
    the flag is all-reduced (MAX) so that every rank skips the same steps.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    flag = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else "cpu")
    if grads:
        norms = torch._foreach_norm(grads, float("inf"))  # inf or NaN anywhere makes the max-norm non-finite
        flag = (~torch.isfinite(torch.stack([n.float() for n in norms]))).any().float()
    if dist.is_available() and dist.is_initialized():
        flag = flag.to(collective_device(group, like=flag))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item() > 0)


def unscale_gradients(parameters: Iterable[nn.Parameter], scale: float) -> None:
    """Divide every gradient by ``scale`` in place (a power of two, so exact in floating point)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if grads and scale != 1.0:
        torch._foreach_mul_(grads, 1.0 / scale)


class StaticLossScaler:
    """A fixed loss scale (DeepSpeed's ``loss_scale > 0``); overflowing steps are still skipped."""

    dynamic = False

    def __init__(self, scale: float, group: Any = None) -> None:
        if not scale > 0 or not math.isfinite(scale):
            raise ValueError(f"a static loss scale must be a positive finite number, got {scale}")
        self.cur_scale = float(scale)
        self.group = group

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.cur_scale

    def unscale_and_check(self, parameters: list[nn.Parameter]) -> bool:
        """Check the scaled gradients for inf/NaN (all ranks); unscale them only when clean."""
        if grads_overflow(parameters, self.group):
            return True
        unscale_gradients(parameters, self.cur_scale)
        return False

    def update(self, overflow: bool) -> None:
        if overflow:
            log.warning("gradient overflow with static loss scale %g: step skipped", self.cur_scale)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "static", "cur_scale": self.cur_scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cur_scale = float(state["cur_scale"])


class DynamicLossScaler(StaticLossScaler):
    """DeepSpeed's dynamic loss scale schedule (see the module docstring)."""

    dynamic = True

    def __init__(
        self,
        initial_scale_power: int = 16,
        loss_scale_window: int = 1000,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        min_loss_scale: float = 1.0,
        scale_factor: float = 2.0,
        raise_error_at_min_scale: bool = True,
        group: Any = None,
    ) -> None:
        if loss_scale_window < 1:
            raise ValueError(f"loss_scale_window must be >= 1, got {loss_scale_window}")
        if hysteresis < 1:
            raise ValueError(f"hysteresis must be >= 1, got {hysteresis}")
        if not min_loss_scale > 0:
            raise ValueError(f"min_loss_scale must be > 0, got {min_loss_scale}")
        super().__init__(2.0**initial_scale_power, group)
        self.scale_window = int(loss_scale_window)
        self.delayed_shift = int(hysteresis)
        self.cur_hysteresis = int(hysteresis)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.min_scale = float(min_loss_scale)
        self.scale_factor = float(scale_factor)
        self.raise_error_at_min_scale = raise_error_at_min_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1

    def update(self, overflow: bool) -> None:
        """Advance the schedule by one optimizer step."""
        if overflow:
            if self.cur_hysteresis <= 1:
                if self.cur_scale <= self.min_scale and self.raise_error_at_min_scale:
                    raise LossScaleAtMinimumError(
                        f"gradient overflow with the loss scale already at min_loss_scale={self.min_scale:g}; "
                        "the run has diverged (lower the learning rate, use bf16, or lower fp16.min_loss_scale)"
                    )
                new_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
                log.warning("gradient overflow: step skipped, loss scale %g -> %g", self.cur_scale, new_scale)
                self.cur_scale = new_scale
            else:
                self.cur_hysteresis -= 1
                log.warning(
                    "gradient overflow: step skipped, loss scale stays %g (hysteresis left %d)",
                    self.cur_scale,
                    self.cur_hysteresis,
                )
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": "dynamic",
            "cur_scale": self.cur_scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cur_scale = float(state["cur_scale"])
        self.cur_iter = int(state["cur_iter"])
        self.last_overflow_iter = int(state["last_overflow_iter"])
        self.cur_hysteresis = int(state["cur_hysteresis"])


def build_loss_scaler(fp16: Any, group: Any = None) -> StaticLossScaler:
    """The scaler an ``fp16`` config section asks for (``loss_scale == 0`` means dynamic)."""
    if fp16.loss_scale > 0:
        return StaticLossScaler(fp16.loss_scale, group)
    return DynamicLossScaler(
        initial_scale_power=fp16.initial_scale_power,
        loss_scale_window=fp16.loss_scale_window,
        hysteresis=fp16.hysteresis,
        consecutive_hysteresis=fp16.consecutive_hysteresis,
        min_loss_scale=fp16.min_loss_scale,
        group=group,
    )


class MixedPrecision(EngineExtension):
    """The engine's part of mixed precision: reduction dtype, master weights (fp32, or bf16 with
    ``bf16_master_weights_and_grads``), loss scaling, and DeepSpeed's 16-bit ``state_dict``."""

    name = "mixed_precision"

    def __init__(
        self,
        precision: str | None = None,
        compute_dtype: torch.dtype | None = None,
        comm_dtype: torch.dtype | None = None,
        scaler: Any = None,
        master_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.precision = precision
        self.compute_dtype = compute_dtype
        self.comm_dtype = comm_dtype
        self.scaler = scaler
        self.master_dtype = master_dtype
        self._state_dict_hook: Any = None
        self._module: nn.Module | None = None

    def configure(self, engine: TrainingCore) -> None:
        if self.comm_dtype is not None:
            engine.context.communication_data_type = self.comm_dtype
        if self.precision is None:
            return
        engine.context.compute_dtype = self.compute_dtype
        odd = sorted({str(p.dtype) for p in engine.module.parameters() if p.requires_grad and p.dtype != self.master_dtype})
        if odd:
            raise DSCompileConfigError(
                f"{self.precision}.enabled",
                f"the model's trainable parameters must be {'bf16' if self.master_dtype == torch.bfloat16 else 'fp32'} master weights, found {', '.join(odd)}",
                "do not call model.half()/bfloat16(): the compiled graph casts them",
            )
        if self.compute_dtype is not None and self.compute_dtype != self.master_dtype:
            self._module = engine.module
            self._state_dict_hook = cast_state_dict_to(engine.module, self.compute_dtype)  # DeepSpeed's module is the 16-bit copy

    def destroy(self, engine: TrainingCore) -> None:
        if self._state_dict_hook is not None:
            self._state_dict_hook.remove()
            del self._module._dscompile_16bit_state_dict  # type: ignore[union-attr]
            self._state_dict_hook = None

    @property
    def checks_overflow(self) -> bool:  # type: ignore[override]
        return self.scaler is not None

    def scale_loss(self, engine: TrainingCore, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def check_overflow(self, engine: TrainingCore, params: list[nn.Parameter]) -> bool:
        return bool(self.scaler.unscale_and_check(params)) if self.scaler is not None else False

    def after_optimizer_step(self, engine: TrainingCore, overflow: bool) -> None:
        if self.scaler is not None:
            self.scaler.update(overflow)

    def state_dict(self) -> dict[str, Any] | None:
        return self.scaler.state_dict() if hasattr(self.scaler, "state_dict") else None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if hasattr(self.scaler, "load_state_dict"):
            self.scaler.load_state_dict(state)


class LowPrecisionMasters(EngineExtension):
    """``bf16.bf16_master_weights_and_grads`` (with ``bf16_optimizer_states``): the model's parameters themselves become
    bf16 before ZeRO partitions them, so the masters ZeRO shards and the optimizer steps, the gradients and the
    optimizer's moments are bf16, as in DeepSpeed (whose fp32 partition is then bf16)."""

    name = "low_precision_masters"

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def configure(self, engine: TrainingCore) -> None:
        engine.module.to(self.dtype)  # in place: the parameters stay the objects the optimizer holds
