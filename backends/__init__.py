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

# The registry lives with the pass registry (dscompile.pipeline, below this package); re-exported here for backends.
from dscompile.pipeline import LowerFn, Lowering, PrepareFn, get_lowering, lowerings, register_lowering

__all__ = ["LowerFn", "Lowering", "PrepareFn", "get_lowering", "lowerings", "register_lowering"]

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
