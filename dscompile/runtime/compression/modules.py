"""Module-tree edits compression scripts make around ``init_compression`` (DeepSpeed's ``compression.helper``)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn


def recursive_getattr(model: nn.Module, module_name: str) -> Any:
    """``model.a.b.c`` for ``"a.b.c"`` (any attribute, not only sub-modules)."""
    return functools.reduce(getattr, module_name.split("."), model)


def recursive_setattr(model: nn.Module, module_name: str, module: Any) -> None:
    """Set ``model.a.b.c = module`` for ``"a.b.c"``."""
    parent_name, _, leaf = module_name.rpartition(".")
    parent = recursive_getattr(model, parent_name) if parent_name else model
    setattr(parent, leaf, module)


def convert_conv1d_to_linear(model: nn.Module, convert_type: type[nn.Module]) -> nn.Module:
    """Replace every ``convert_type`` layer (Hugging Face's GPT-2 ``Conv1D``: ``y = x @ W + b`` with W
    ``[in, out]``) by the equivalent ``nn.Linear``, so compression can match it. Each new Linear is
    built as DeepSpeed builds it (its initializer draws from the global generator, then the weights
    are copied in), so a seeded script's random stream continues as under DeepSpeed."""
    target = model.module if isinstance(getattr(model, "module", None), nn.Module) else model
    for name, module in list(target.named_modules()):
        if not isinstance(module, convert_type):
            continue
        weight = module.weight.detach()
        bias = getattr(module, "bias", None)
        linear = nn.Linear(weight.shape[0], weight.shape[1], bias=bias is not None).to(device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            linear.weight.copy_(weight.t())
            if bias is not None:
                linear.bias.copy_(bias.detach().reshape(-1))
        recursive_setattr(target, name, linear)
    return model
