"""DeepSpeed's 16-bit convention at an engine's boundary, over dscompile's fp32 master weights.

With ``bf16`` or ``fp16`` enabled DeepSpeed casts the module itself to 16 bits, so its users cast
their inputs to match (``inputs.to(torch.bfloat16)``) and get 16-bit outputs back. dscompile keeps
the module in fp32 (the optimizer's master weights) and lets the ``amp`` graph pass
(``passes/mixed_precision/``) pick each op's compute dtype. The two meet here, around the
compiled module an engine calls:

- inputs: every bf16/fp16 floating tensor is upcast to fp32 before the call. The upcast is exact,
  and the graph casts it back to the low precision wherever the cast policy computes in it (a
  round trip that loses nothing), so a script written for DeepSpeed's 16-bit module runs
  unchanged: Dynamo never sees a bf16 input meet an fp32 weight.
- outputs: each floating output comes back in the dtype DeepSpeed's 16-bit module would give it.
  That dtype is found once, on the first call, by running the module on fake tensors (no compute,
  no memory) with its floating parameters and buffers cast to the low precision, as
  ``module.bfloat16()`` would; an output the module upcasts itself (a loss computed from
  ``logits.float()``, as Hugging Face models do) stays fp32. One exception, on purpose: a scalar
  output (a loss the model computes) keeps the graph's fp32, since rounding a loss to 16 bits only
  loses precision and, once fp16 loss scaling multiplies it, overflows (DeepSpeed upcasts the loss
  before scaling for the same reason). When the fake run fails (an op the fake tensors cannot
  follow) the outputs keep the compiled graph's dtypes, and the reason is logged.
"""

from __future__ import annotations

import contextvars
import logging
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.hooks import RemovableHandle

from dscompile.runtime.devices import forked_rng

log = logging.getLogger("dscompile.runtime.sixteen_bit")

LOW_PRECISION = (torch.bfloat16, torch.float16)


def upcast_low_precision(tree: Any) -> Any:
    """``tree`` with every bf16/fp16 tensor replaced by its (exact) fp32 copy."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.float() if t.dtype in LOW_PRECISION else t, tree)


def module_output_dtypes(module: nn.Module, low: torch.dtype, args: tuple, kwargs: dict) -> list[torch.dtype | None]:
    """The dtype of each output leaf of ``module(*args, **kwargs)`` once the module is cast to ``low``.

    A fake-tensor run (shapes and dtypes only); raises whatever the module raises under fake tensors.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=False)

    def fake(t: torch.Tensor, lower: bool) -> torch.Tensor:
        value = mode.from_tensor(t)
        return value.to(low) if lower and value.is_floating_point() else value

    state = {name: fake(t, True) for name, t in module.named_parameters()}
    state.update({name: fake(t, True) for name, t in module.named_buffers()})
    fake_args, fake_kwargs = pytree.tree_map_only(torch.Tensor, lambda t: fake(t, False), (args, kwargs))
    with forked_rng(), mode, torch.no_grad():
        out = torch.func.functional_call(module, state, fake_args, fake_kwargs)
    return [leaf.dtype if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() else None for leaf in pytree.tree_leaves(out)]


class OutputDtypes:
    """The output dtypes of DeepSpeed's 16-bit module, found on the first call (module docstring)."""

    def __init__(self, module: nn.Module, low: torch.dtype) -> None:
        self.module = module
        self.low = low
        self.dtypes: list[torch.dtype | None] | None = None
        self._probed = False

    def probe(self, args: tuple, kwargs: dict) -> None:
        """Once, with the caller's own (16-bit) inputs."""
        if self._probed:
            return
        self._probed = True
        try:
            self.dtypes = module_output_dtypes(self.module, self.low, args, kwargs)
        except Exception as exc:  # the module cannot run on fake tensors: keep the graph's dtypes
            log.warning("the outputs keep the compiled graph's dtypes: finding the 16-bit module's failed (%s)", exc)

    def cast(self, out: Any) -> Any:
        leaves, spec = pytree.tree_flatten(out)
        if self.dtypes is None or len(leaves) != len(self.dtypes):
            return out
        cast = [
            leaf.to(dtype) if dtype is not None and isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.dtype != dtype else leaf
            for leaf, dtype in zip(leaves, self.dtypes)  # scalars (losses) keep fp32: module docstring
        ]
        return pytree.tree_unflatten(cast, spec)


# -- state dicts in DeepSpeed's dtype ------------------------------------------------------------
# DeepSpeed's module is the 16-bit copy, so ``engine.module.state_dict()`` holds 16-bit tensors; dscompile's module holds
# the fp32 masters. A state-dict hook on the model gives users DeepSpeed's dtype; dscompile's own checkpoint code reads the
# masters through ``master_state_dict`` (exact resume) and stores them beside the 16-bit copy.
_reading_masters: contextvars.ContextVar[bool] = contextvars.ContextVar("dscompile_reading_masters", default=False)
FP32_MODULE = "fp32_module"
"""Checkpoint key of the fp32 masters when the ``module`` entry is the 16-bit copy."""


def cast_state_dict_to(module: nn.Module, dtype: torch.dtype) -> RemovableHandle:
    """From now on ``module.state_dict()`` casts floating-point tensors to ``dtype`` (as DeepSpeed's 16-bit module's);
    remove the returned handle to stop."""

    def hook(_module: nn.Module, state: dict[str, Any], prefix: str, _metadata: Any) -> None:
        if _reading_masters.get():
            return
        for key, value in state.items():
            if key.startswith(prefix) and isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
                state[key] = value.detach().to(dtype)

    handle = module.register_state_dict_post_hook(hook)
    module._dscompile_16bit_state_dict = dtype  # type: ignore[assignment]  # read by checkpoint writers (module_states)
    return handle


def master_state_dict(module: nn.Module) -> dict[str, Any]:
    """``module.state_dict()`` with the fp32 masters (no 16-bit cast)."""
    token = _reading_masters.set(True)
    try:
        return module.state_dict()
    finally:
        _reading_masters.reset(token)


def module_states(module: nn.Module) -> dict[str, Any]:
    """A checkpoint's module entries: ``module`` as the user's ``state_dict()`` gives it (16 bits under bf16/fp16, as
    DeepSpeed writes it) and, when that is a cast, the fp32 masters under ``fp32_module``."""
    states = {"module": module.state_dict()}
    if getattr(module, "_dscompile_16bit_state_dict", None) is not None:
        states[FP32_MODULE] = master_state_dict(module)
    return states


def saved_module_state(state: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint reader loads into the model: the fp32 masters when saved, else ``module``."""
    return state.get(FP32_MODULE) or state["module"]
