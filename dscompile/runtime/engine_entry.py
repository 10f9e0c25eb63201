"""What stands between a user's ``engine(batch)`` and the module an engine compiled.

``EngineEntry`` wraps the compiled module (it stays a submodule, so ``train()``/``eval()`` reach it)
and keeps two of DeepSpeed's conventions that live outside the graph:

- the 16-bit convention (``runtime/sixteen_bit.py``): with ``bf16``/``fp16`` on, 16-bit inputs are
  accepted and outputs come back in the dtypes DeepSpeed's 16-bit module gives;
- ``loss.backward()`` in place of ``engine.backward(loss)``: DeepSpeed divides the gradient by the
  accumulation steps with hooks on the forward's outputs, so both spellings train alike. Here too:
  each output that carries a gradient gets a hook that, for a backward the engine did not start,
  multiplies the gradient arriving at it by ``1 / gradient_accumulation_steps`` times the loss scale
  (fp16), which is what ``engine.backward`` does to the loss. The step then reduces, unscales and
  clips as usual.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from dscompile.runtime.sixteen_bit import OutputDtypes, upcast_low_precision

if TYPE_CHECKING:
    from dscompile.runtime.training_core import TrainingCore


class EngineEntry(nn.Module):
    """``compiled(*args)`` with DeepSpeed's 16-bit convention and ``loss.backward()`` support (module docstring)."""

    def __init__(self, compiled: nn.Module, engine: TrainingCore, low: torch.dtype | None, module: nn.Module) -> None:
        super().__init__()
        self.compiled = compiled
        self._engine = [engine]  # a list: the engine owns this module, not the other way round
        self._dtypes = OutputDtypes(module, low) if low is not None else None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._dtypes is not None:
            self._dtypes.probe(args, kwargs)
            args, kwargs = upcast_low_precision(args), upcast_low_precision(kwargs)
        out = self.compiled(*args, **kwargs)
        if self._dtypes is not None:
            out = self._dtypes.cast(out)
        if torch.is_grad_enabled():
            for leaf in pytree.tree_leaves(out):
                if isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None:
                    leaf.register_hook(self._direct_backward)
        return out

    def _direct_backward(self, grad: torch.Tensor) -> torch.Tensor:
        engine = self._engine[0]
        if engine.in_engine_backward:
            return grad  # engine.backward already scaled the loss
        factor = engine.loss_gradient_seed(1.0 / engine.gradient_accumulation_steps())
        return grad if factor == 1.0 else grad * factor
