"""Lowering backends: turn a transformed forward/backward FX graph into a callable.

Each backend module registers itself with ``register_lowering``; every module in this package
is imported on first use, so adding a backend is adding a file. A lowering states what it
needs from the graphs it is handed, beside ``compile`` itself:

- ``decompositions``: the table AOTAutograd traces with (and that ``decompose.py`` re-applies to
  ops that passes insert after tracing);
- ``prepare_joint``: a rewrite of the joint graph after dscompile's joint passes and before the
  partitioner (Inductor's joint-graph passes, which turn random ops into its seeded RNG), also
  run on inference graphs, which have no joint graph.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.fx

LowerFn = Callable[[torch.fx.GraphModule, Sequence[Any], Any], Callable[..., Any]]
PrepareFn = Callable[[torch.fx.GraphModule, Sequence[Any]], torch.fx.GraphModule]


@dataclass(frozen=True)
class Lowering:
    """A lowering: ``compile(gm, example_inputs, ctx)``, the decompositions it wants AOTAutograd to
    apply, and what it must do to the joint graph before partitioning (None: nothing)."""

    name: str
    compile: LowerFn
    decompositions: Callable[[], dict | None]
    doc: str
    prepare_joint: PrepareFn | None = None


_LOWERINGS: dict[str, Lowering] = {}


def register_lowering(
    name: str, *, decompositions: Callable[[], dict | None] = lambda: None, prepare_joint: PrepareFn | None = None
) -> Callable[[LowerFn], LowerFn]:
    def decorator(fn: LowerFn) -> LowerFn:
        _LOWERINGS[name] = Lowering(name, fn, decompositions, (fn.__doc__ or "").strip(), prepare_joint)
        return fn

    return decorator


def get_lowering(name: str) -> Lowering:
    from dscompile.errors import DSCompileConfigError, suggest

    if name not in _LOWERINGS:
        raise DSCompileConfigError("lower", f"unknown lowering {name!r}", suggest(name, _LOWERINGS) or f"use one of {sorted(_LOWERINGS)}")
    return _LOWERINGS[name]


def lowerings() -> dict[str, Lowering]:
    return dict(_LOWERINGS)


for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
