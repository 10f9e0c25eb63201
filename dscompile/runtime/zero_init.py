"""Build a model already partitioned for ZeRO-3: parameters are sharded as their module is built.

Inside ``ShardOnCreation()`` every ``nn.Module`` subclass's ``__init__`` is wrapped: when the
outermost ``__init__`` of a module returns (its own weight initialisation done), each of its
parameters that is not sharded yet is broadcast from the group's first rank (so every rank holds
the same values whatever its seed) and cut into this rank's flat, padded shard
(``zero_shard.shard_of``, the layout ``ZeroPartition`` uses); the full tensor is freed. So at most
one module's parameters exist in full while the model is built, never the whole model. A parent's
``self.apply(init_fn)`` during construction (how Hugging Face models initialise weights) sees each
module's own parameters gathered, and the result is broadcast and re-sharded
(DeepSpeed's ``override_module_apply``), together with its direct children's parameters, which such
functions also set. Weight initialisation that bypasses ``nn.Module.apply`` (Hugging Face
transformers 5 walks modules with its own ``smart_apply``; it gathers only under the real
DeepSpeed's integration) would write into empty shards, so building a transformers model inside is
refused: build it normally and let ZeRO-3 partition it at ``initialize``.

The shard is recorded on the parameter under DeepSpeed's names (``ds_shape``, ``ds_numel``,
``ds_tensor``, with ``ds_id`` and ``ds_status``: ``zero_shard.mark_zero3``); ``ZeroPartition`` adopts
those shards instead of cutting new ones (``zero_shard.initial_shard``). ``gathered(params,
modifier_rank)`` (DeepSpeed's ``GatheredParameters``) materialises full values for a while
(``ds_status`` AVAILABLE) and, with a modifier rank, writes that rank's changes back into every
rank's shard; it works alike on the parameters the engine partitioned at stage 3.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dscompile.errors import DSCompileConfigError, DSCompileNotSupportedError
from dscompile.runtime.zero_shard import (
    ZERO3_ATTRIBUTES,
    attach_shard,
    gather_sharded,
    is_sharded,
    mark_zero3,
    refresh_status,
    shard_of,
)

_ZERO_INIT_DEPTH = 0  # nested ShardOnCreation contexts patch only once


def _group_rank_world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise DSCompileConfigError(
            "zero.Init", "needs a process group to shard across", "call dscompile.init_distributed() (or launch with torchrun) before building the model"
        )
    return dist.get_rank(group), dist.get_world_size(group)


@torch.no_grad()
def shard_parameter(param: nn.Parameter, group: dist.ProcessGroup | None = None, dtype: torch.dtype | None = None) -> None:
    """Replace ``param``'s data by this rank's shard of the group's first rank's value."""
    if is_sharded(param):
        return
    rank, world = _group_rank_world(group)
    value = param.data
    if dtype is not None and value.is_floating_point():
        value = value.to(dtype)
    if world > 1:
        value = value.contiguous()
        dist.broadcast(value, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    attach_shard(param, shard_of(value, rank, world), tuple(value.shape), group)
    param.data = torch.empty(0, dtype=value.dtype, device=value.device)
    mark_zero3(param, persistent=False)


def shard_module(module: nn.Module, group: dist.ProcessGroup | None = None, dtype: torch.dtype | None = None) -> nn.Module:
    """Shard every parameter of an already built ``module`` (DeepSpeed's ``zero.Init(module=m)``)."""
    for param in module.parameters():
        shard_parameter(param, group, dtype)
    return module


@torch.no_grad()
def _write_back(param: nn.Parameter, modifier_rank: int, group: dist.ProcessGroup | None) -> None:
    rank, world = _group_rank_world(group)
    value = param.data.contiguous()
    if world > 1:
        dist.broadcast(value, src=dist.get_global_rank(group, modifier_rank) if group is not None else modifier_rank, group=group)
    param.ds_tensor.copy_(shard_of(value, rank, world))


@contextlib.contextmanager
def gathered(params: Iterable[nn.Parameter] | nn.Parameter, modifier_rank: int | None = None) -> Iterator[None]:
    """Full values of sharded ``params`` inside the block; with ``modifier_rank``, that rank's values
    afterwards become everyone's (shards rewritten). Parameters that are not sharded, or whose full
    copy is kept anyway, are left as they are (their shard is still rewritten on modification)."""
    if isinstance(params, torch.Tensor):
        params = [params]
    sharded = [p for p in dict.fromkeys(params) if p is not None and is_sharded(p)]
    materialised = []
    with contextlib.ExitStack() as shards_resident:
        for resident in dict.fromkeys(getattr(p, "_ds_resident", None) for p in sharded):
            if resident is not None:  # offloaded shards (offload_param) hold their values while read and rewritten
                shards_resident.enter_context(resident())
        for p in sharded:
            if p.data.numel() == 0 and p.ds_numel > 0:
                p.data = gather_sharded(p)
                materialised.append(p)
                refresh_status(p)
        try:
            yield
        finally:
            for p in sharded:
                if modifier_rank is not None:
                    _write_back(p, modifier_rank, p.ds_process_group)
            for p in materialised:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                refresh_status(p)


def _refuse_own_initialisation(module: nn.Module) -> None:
    if any(cls.__name__ == "PreTrainedModel" for cls in type(module).__mro__):
        raise DSCompileNotSupportedError(
            "zero.Init",
            "Hugging Face transformers models built under zero.Init (their weight initialisation bypasses nn.Module.apply and "
            "would write into empty shards; build the model normally and ZeRO-3 partitions it at initialize)",
        )


class ShardOnCreation:
    """Context: modules built inside come out with their parameters sharded (see module doc)."""

    def __init__(self, group: dist.ProcessGroup | None = None, dtype: torch.dtype | None = None, override_module_apply: bool = True) -> None:
        _group_rank_world(group)  # fail at once, not at the first module
        self.group = group
        self.dtype = dtype
        self.override_module_apply = override_module_apply
        self._patched: list[tuple[type, Callable[..., None]]] = []
        self._building: set[int] = set()
        self._saved_apply: Callable[..., Any] | None = None
        self._saved_init_subclass: Any = None

    # -- wrapping __init__ ---------------------------------------------------------------------
    def _wrap(self, cls: type) -> None:
        original = cls.__dict__.get("__init__")
        if original is None or getattr(original, "_dscompile_zero_init", False):
            return
        building = self._building

        @functools.wraps(original)
        def __init__(module: nn.Module, *args: Any, **kwargs: Any) -> None:
            outermost = id(module) not in building
            building.add(id(module))
            try:
                original(module, *args, **kwargs)
            finally:
                if outermost:
                    building.discard(id(module))
            if outermost:
                _refuse_own_initialisation(module)
                shard_module(module, self.group, self.dtype)

        __init__._dscompile_zero_init = True  # type: ignore[attr-defined]
        cls.__init__ = __init__  # type: ignore[misc]
        self._patched.append((cls, original))

    def _all_subclasses(self) -> list[type]:
        seen: list[type] = []
        todo = list(nn.Module.__subclasses__())
        while todo:
            cls = todo.pop()
            if cls not in seen:
                seen.append(cls)
                todo.extend(cls.__subclasses__())
        return seen

    def __enter__(self) -> ShardOnCreation:
        global _ZERO_INIT_DEPTH
        _ZERO_INIT_DEPTH += 1
        if _ZERO_INIT_DEPTH > 1:
            return self
        for cls in self._all_subclasses():
            self._wrap(cls)
        context = self
        self._saved_init_subclass = nn.Module.__dict__.get("__init_subclass__")

        def __init_subclass__(cls: type, **kwargs: Any) -> None:  # classes defined inside the context
            super(nn.Module, cls).__init_subclass__(**kwargs)
            context._wrap(cls)

        nn.Module.__init_subclass__ = classmethod(__init_subclass__)  # type: ignore[assignment]
        if self.override_module_apply:
            self._saved_apply = nn.Module.apply
            original_apply = nn.Module.apply

            def apply(module: nn.Module, fn: Callable[[nn.Module], None]) -> nn.Module:
                for child in module.children():
                    child.apply(fn)
                # fn may also set its direct children's weights (GPT-2 scales ``module.c_proj.weight``)
                params = list(module.parameters(recurse=False)) + [p for c in module.children() for p in c.parameters(recurse=False)]
                with gathered(params, modifier_rank=0):
                    fn(module)
                return module

            apply.__doc__ = original_apply.__doc__
            nn.Module.apply = apply  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        global _ZERO_INIT_DEPTH
        _ZERO_INIT_DEPTH -= 1
        if _ZERO_INIT_DEPTH > 0:
            return
        for cls, original in reversed(self._patched):
            cls.__init__ = original  # type: ignore[misc]
        self._patched.clear()
        if self._saved_init_subclass is None:
            del nn.Module.__init_subclass__
        else:
            nn.Module.__init_subclass__ = self._saved_init_subclass
        if self._saved_apply is not None:
            nn.Module.apply = self._saved_apply  # type: ignore[method-assign]


def materialize(module: nn.Module) -> None:
    """Gather every sharded parameter back to its full value on every rank and forget the shard
    (for engines that do not run ZeRO-3 over a model built under ``ShardOnCreation``)."""
    with torch.no_grad():
        for param in module.parameters():
            if is_sharded(param):
                if param.data.numel() == 0 and param.ds_numel > 0:
                    param.data = gather_sharded(param)
                for name in ("ds_tensor", "ds_shape", "ds_numel", "ds_process_group", *ZERO3_ATTRIBUTES, "_ds_resident"):
                    if hasattr(param, name):
                        delattr(param, name)
