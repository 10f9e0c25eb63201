"""Build the optimizer a DeepSpeed config's ``optimizer`` section names, with DeepSpeed's meanings.

DeepSpeed's ``Adam`` decouples weight decay unless ``adam_w_mode`` is false, so ``Adam`` maps to
``torch.optim.AdamW`` by default; ``torch_adam`` and ``fused`` only choose an implementation there
and are accepted for compatibility. Defaults are DeepSpeed's: for ``Adam``/``AdamW`` an absent
``weight_decay`` is 0 (DeepSpeed's FusedAdam and CPU Adam), except with ``torch_adam: true``, where
DeepSpeed builds torch's class with torch's defaults (AdamW: 0.01). ``OneBitAdam``, ``ZeroOneAdam`` and ``OneBitLamb`` are
``dscompile.runtime.onebit``'s compressed-communication optimizers.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable
from typing import Any

import torch

from dscompile.config import OptimizerConfig, check_hyperparameters
from dscompile.errors import DSCompileConfigError, DSCompileNotSupportedError, suggest
from dscompile.runtime.onebit import OPTIMIZERS as ONEBIT_OPTIMIZERS

log = logging.getLogger("dscompile.runtime.optimizers")

_TORCH_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW,
    "sgd": torch.optim.SGD,
    "adagrad": torch.optim.Adagrad,
    "rmsprop": torch.optim.RMSprop,
}
_UNBUILT = {
    "lamb": "the LAMB optimizer",
    "muadam": "MuP optimizers",
    "muadamw": "MuP optimizers",
    "musgd": "MuP optimizers",
    "lion": "the Lion optimizer",
}
# Implementation switches DeepSpeed accepts that do not change the maths.
_IMPLEMENTATION_FLAGS = {"torch_adam", "fused", "foreach", "capturable"}


def build_optimizer(section: OptimizerConfig, params: Iterable[Any]) -> torch.optim.Optimizer:
    """Instantiate ``section.type`` over ``params`` after checking every parameter name."""
    kind = section.type.lower().replace("_", "")
    kwargs = dict(section.params)
    if kind in _UNBUILT:
        raise DSCompileNotSupportedError("optimizer.type", _UNBUILT[kind])
    if kind in ("adam", "adamw"):
        adam_w_mode = kwargs.pop("adam_w_mode", True)
        if not isinstance(adam_w_mode, bool):
            raise DSCompileConfigError("optimizer.params.adam_w_mode", f"expected true or false, got {adam_w_mode!r}")
        cls: type[torch.optim.Optimizer] = torch.optim.AdamW if adam_w_mode or kind == "adamw" else torch.optim.Adam
        if not kwargs.get("torch_adam", False):
            kwargs.setdefault("weight_decay", 0.0)  # DeepSpeed's FusedAdam/CPU Adam default, not torch AdamW's 0.01
    elif kind in _TORCH_OPTIMIZERS:
        cls = _TORCH_OPTIMIZERS[kind]
    elif kind in ONEBIT_OPTIMIZERS:
        cls = ONEBIT_OPTIMIZERS[kind]  # the engines hand it their gradient communication (runtime/onebit/engine.py)
    else:
        known = ["Adam", "AdamW", "SGD", "Adagrad", "RMSprop", "OneBitAdam", "ZeroOneAdam", "OneBitLamb"]
        raise DSCompileConfigError("optimizer.type", f"unknown optimizer {section.type!r}", suggest(section.type, known) or f"use one of {known}")
    for flag in _IMPLEMENTATION_FLAGS & set(kwargs):
        if flag in ("foreach", "fused") and flag in inspect.signature(cls).parameters:
            continue
        kwargs.pop(flag)
    accepted = [p for p in inspect.signature(cls).parameters if p != "params"]
    for key in kwargs:
        if key not in accepted:
            raise DSCompileConfigError(
                f"optimizer.params.{key}", f"is not a parameter of {cls.__name__}", suggest(key, accepted) or f"valid: {', '.join(accepted)}"
            )
    check_hyperparameters("optimizer.params", kwargs, cls)
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    try:
        return cls(params, **kwargs)
    except (TypeError, ValueError) as exc:
        raise DSCompileConfigError("optimizer.params", str(exc)) from None


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's ``FusedAdam`` (``deepspeed.ops.adam``) with its signature: torch's Adam, weight decay decoupled
    (AdamW) unless ``adam_w_mode=False``, as DeepSpeed's kernel computes it. ``fused``/``foreach`` pick torch's kernel."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
        **torch_options: Any,
    ) -> None:
        _refuse_adam_options(type(self).__name__, bias_correction, amsgrad)
        torch_options.setdefault("decoupled_weight_decay", adam_w_mode)
        super().__init__(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, **torch_options)


class DeepSpeedCPUAdam(torch.optim.Adam):
    """DeepSpeed's ``DeepSpeedCPUAdam`` with its signature: torch's Adam on the parameters' device, weight decay
    decoupled unless ``adamw_mode=False``. ``fp32_optimizer_states`` keeps the moments in the parameters' dtype
    when false (DeepSpeed's meaning); true with low-precision parameters is refused (torch keeps them in that dtype)."""

    def __init__(
        self,
        model_params: Any,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
        **torch_options: Any,
    ) -> None:
        _refuse_adam_options(type(self).__name__, bias_correction, amsgrad)
        torch_options.setdefault("decoupled_weight_decay", adamw_mode)
        super().__init__(model_params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, **torch_options)
        low = sorted({str(p.dtype) for g in self.param_groups for p in g["params"] if p.dtype != torch.float32})
        if fp32_optimizer_states and low:
            raise DSCompileNotSupportedError(
                "DeepSpeedCPUAdam(fp32_optimizer_states=True)", f"fp32 Adam moments for {', '.join(low)} parameters", "pass fp32_optimizer_states=False"
            )


def _refuse_adam_options(name: str, bias_correction: bool, amsgrad: bool) -> None:
    if amsgrad:
        raise DSCompileConfigError(f"{name}(amsgrad=True)", "DeepSpeed's kernel has no AMSGrad variant", "use torch.optim.Adam(amsgrad=True)")
    if not bias_correction:
        raise DSCompileNotSupportedError(f"{name}(bias_correction=False)", "Adam without bias correction")
