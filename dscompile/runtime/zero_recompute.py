"""Checkpointed blocks that run outside the compiled graph recompute on ZeRO's parameters.

ZeRO-2/3 run the model through ``functional_call`` over parameters built from the shards inside the graph. When
Dynamo cannot keep a checkpointed block in one graph (Hugging Face's ``gradient_checkpointing_enable()`` with a
graph break inside the layer), ``torch.utils.checkpoint`` runs eagerly and recomputes the block during backward,
after ``functional_call`` has put the module's own parameters back: the recompute would read other tensors than the
forward did (empty ones under ZeRO-3) and their gradients would never reach the shards. Each layer's checkpointing
function (``_gradient_checkpointing_func``, the attribute transformers' layers call) is wrapped so that its
recompute runs on the tensors the forward used.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module

CHECKPOINT_FUNCTION = "_gradient_checkpointing_func"
_BOUND = "_dscompile_recomputes_on_forward_tensors"
log = logging.getLogger("dscompile.runtime.zero_recompute")


def _checkpoint_on_forward_tensors(checkpoint: Callable[..., Any], layer: nn.Module, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    used = {**dict(layer.named_parameters(remove_duplicate=False)), **dict(layer.named_buffers(remove_duplicate=False))}

    def on_forward_tensors(*inner_args: Any, **inner_kwargs: Any) -> Any:
        with _reparametrize_module(layer, used):
            return function(*inner_args, **inner_kwargs)

    return _non_reentrant(checkpoint)(on_forward_tensors, *args, **kwargs)


@functools.cache
def _runs_as_python() -> Callable[..., Any]:
    """The wrapper runs as Python (the layer's code inside still compiles), so ``used`` holds real tensors. Applied at
    the first bind: ``torch.compiler.disable`` imports Dynamo, which ``import dscompile`` does not."""
    return torch.compiler.disable(_checkpoint_on_forward_tensors, recursive=False)


def _non_reentrant(checkpoint: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.utils.checkpoint.checkpoint`` with ``use_reentrant=True`` recomputes in a nested backward that would run
    ZeRO's gather graph a second time (its tensors are not leaves); the non-reentrant form computes the same gradients."""
    if isinstance(checkpoint, functools.partial) and checkpoint.func is torch.utils.checkpoint.checkpoint and checkpoint.keywords.get("use_reentrant"):
        _log_once()
        return functools.partial(torch.utils.checkpoint.checkpoint, *checkpoint.args, **{**checkpoint.keywords, "use_reentrant": False})
    return checkpoint


@functools.cache
def _log_once() -> None:
    log.info("ZeRO: the model's checkpointed layers recompute with use_reentrant=False (the same gradients; see %s)", __name__)


def bind_recompute_to_forward_tensors(model: nn.Module) -> int:
    """Wrap every layer's checkpointing function not yet wrapped (``gradient_checkpointing_enable()`` may come after
    ``initialize``); returns how many were wrapped now."""
    wrapped = 0
    for layer in model.modules():
        checkpoint = layer.__dict__.get(CHECKPOINT_FUNCTION)
        if checkpoint is None or getattr(checkpoint, _BOUND, False):
            continue
        bound = functools.partial(_runs_as_python(), checkpoint, layer)
        setattr(bound, _BOUND, True)
        setattr(layer, CHECKPOINT_FUNCTION, bound)
        wrapped += 1
    return wrapped
