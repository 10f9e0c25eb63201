"""The prepared model's own calls (``model(x)``) run through dscompile, so they are compressed too.

DeepSpeed's ``init_compression`` swaps the model's layers for compressing ones, so every call of the
model computes the compressed function, not only the engine's forward: DeepSpeed's compression
examples call ``model(x)`` directly (CIFAR) and evaluate the model after ``redundancy_clean`` (GPT-2).
Here compression is the ``quantize``/``prune`` graph passes, so ``init_compression`` routes the
model's ``__call__`` through a dscompile compile of the same model (PyTorch's own hook for a module
compiled in place, ``Module._compiled_call_impl``), with the config's ``compression_training``
section: the one capture path, the same passes, the same numerics as the engine's graphs.
The passes find a layer's compression from its weight, so any part of the model compiles the same way:
every sub-module holding a compressed layer is routed too (DeepSpeed's layer-wise distillation example
trains ``model.bert.encoder.layer[l]`` called alone), each compiled on its first direct call only.

- Inside another trace (the engine's ``torch.compile``, or the user's) the route steps aside and the
  model's plain call is inlined there: the outer compile's config applies (``is_compiling``).
- Each compressed layer carries a forward pre-hook that refuses an eager call: a copy of the model
  (``copy.deepcopy`` and pickling drop the route, as they drop ``Module.compile``) or Dynamo falling
  back to eager would otherwise compute the dense layer, silently.
- ``redundancy_clean`` removes both: the cleaned model computes its compression in plain modules.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dscompile.errors import DSCompileError
from dscompile.runtime.dynamo_room import make_room

ROUTE_ATTRIBUTE = "_ds_compression_route"
"""Where the route keeps what it installed (a plain attribute of the model, not a sub-module)."""

_ENTRIES_PER_ROUTE = 2
"""Dynamo cache entries one routed model may add (its train and eval graphs)."""


def _callable_parts(model: nn.Module) -> list[nn.Module]:
    """``model`` and every sub-module that holds a compressed layer and can be called (containers cannot)."""
    compressed = [name for name, module in model.named_modules() if getattr(module, "ds_compression", None) is not None]
    holders = {".".join(name.split(".")[:depth]) for name in compressed for depth in range(name.count(".") + 2)}
    containers = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)
    return [module for name, module in model.named_modules() if name in holders and (module is model or not isinstance(module, containers))]


def _route_one(module: nn.Module, options: dict[str, Any]) -> None:
    from torch._dynamo.external_utils import wrap_inline  # a frame Dynamo compiles even for torch.nn forwards

    compiled: list[Any] = []  # made on the first direct call: most sub-modules are only ever called inside the model's graph

    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return module._call_impl(*args, **kwargs)  # traced by someone else's compile (or the model's): its passes apply
        if not compiled:
            make_room(_ENTRIES_PER_ROUTE)
            compiled.append(torch.compile(wrap_inline(module._call_impl), backend="dscompile", options=options))
        return compiled[0](*args, **kwargs)

    module._compiled_call_impl = call
    object.__setattr__(module, ROUTE_ATTRIBUTE, call)


def route_calls(model: nn.Module, options: dict[str, Any]) -> None:
    """Make ``model(...)``, and a call of any sub-module holding a compressed layer, run a dscompile
    compile of what was called with ``options`` (outside other traces)."""
    parts = _callable_parts(model)
    for module in parts:
        if module._compiled_call_impl is not None and vars(module).get(ROUTE_ATTRIBUTE) is None:
            raise DSCompileError(
                "init_compression: this model (or a part of it) was compiled in place (module.compile()); its compiled call would "
                "skip compression. Call init_compression before compiling, or compile a separate "
                "torch.compile(model, backend='dscompile', options=config)"
            )
    for module in parts:
        _route_one(module, options)


def unroute_calls(model: nn.Module) -> None:
    """Undo ``route_calls`` (``redundancy_clean``): the model and its parts run eagerly again."""
    for module in model.modules():
        if vars(module).pop(ROUTE_ATTRIBUTE, None) is not None:
            module._compiled_call_impl = None


def is_routed(model: nn.Module) -> bool:
    return vars(model).get(ROUTE_ATTRIBUTE) is not None and model._compiled_call_impl is vars(model)[ROUTE_ATTRIBUTE]


def refuse_eager_call(module: nn.Module, args: Any) -> None:
    """Forward pre-hook of every compressed layer: its compression exists only in dscompile's graphs."""
    if torch.compiler.is_compiling():
        return
    state = getattr(module, "ds_compression", None)
    name = getattr(state, "layer_name", type(module).__name__)
    raise DSCompileError(
        f"compressed layer {name!r} was called outside dscompile's compiled graphs, where it would compute its dense weights. "
        "Call the model init_compression prepared, or a part of it holding this layer (their calls run through dscompile), or "
        "torch.compile(module, backend='dscompile', "
        "options=config). A copy of a prepared model (copy.deepcopy, pickle) loses that routing: prepare the copy with "
        "init_compression, or copy the model before preparing it. If Dynamo fell back to eager (see its warnings), "
        "raise torch._dynamo.config.recompile_limit."
    )


def guard_layer(module: nn.Module) -> None:
    """Install ``refuse_eager_call`` on a compressed layer (once)."""
    if refuse_eager_call not in module._forward_pre_hooks.values():
        module.register_forward_pre_hook(refuse_eager_call)


def unguard_layers(model: nn.Module) -> None:
    """Remove ``refuse_eager_call`` from every layer of ``model``."""
    for module in model.modules():
        for key, hook in list(module._forward_pre_hooks.items()):
            if hook is refuse_eager_call:
                del module._forward_pre_hooks[key]
