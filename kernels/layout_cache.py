"""Caches of what the kernels derive from a layout (device copies, look-up tables, block masks).

Every attention layer calls the op with the same layout at every step, so the tables built from
it (Triton's row/column look-up tables, the reference's nonzero-block lists, FlexAttention's
BlockMask) are built once, not per call; on CUDA that also saves a host sync per call.

An entry is keyed by the layout tensor's identity (storage address, offset, shape, strides,
dtype, device) and its version counter, which every in-place write bumps, plus whatever else
the derived value depends on (``causal``, ``block``, ...). Entries hold the layout itself, so its
storage cannot be freed and reused by another tensor under the same key. Tensors without a
version counter (inference tensors) or storage are not cached.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import torch

T = TypeVar("T")

MAX_ENTRIES = 256

_entries: OrderedDict[tuple[Hashable, ...], tuple[torch.Tensor, Any]] = OrderedDict()
_lock = threading.Lock()
stats = {"hits": 0, "misses": 0}


def _identity(layout: torch.Tensor) -> tuple[Hashable, ...] | None:
    try:
        version = layout._version
        address = layout.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return (str(layout.device), layout.dtype, address, layout.storage_offset(), tuple(layout.shape), layout.stride(), version)


def cached(kind: str, layout: torch.Tensor, extra: tuple[Hashable, ...], build: Callable[[], T]) -> T:
    """``build()`` for this layout, ``kind`` and ``extra``, computed once while the layout is unchanged."""
    identity = _identity(layout)
    if identity is None:
        return build()
    key = (kind, *identity, *extra)
    with _lock:
        hit = _entries.get(key)
        if hit is not None:
            _entries.move_to_end(key)
            stats["hits"] += 1
            return hit[1]
    value = build()
    with _lock:
        stats["misses"] += 1
        _entries[key] = (layout, value)
        while len(_entries) > MAX_ENTRIES:
            _entries.popitem(last=False)
    return value


def on_device(layout: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``layout`` on ``device``, copied once (a layout made on the CPU is reused by every CUDA call)."""
    if layout.device == device:
        return layout
    return cached("to", layout, (str(device),), lambda: layout.to(device))


def clear() -> None:
    """Drop every entry (tests, or to free memory after changing models)."""
    with _lock:
        _entries.clear()
        stats.update(hits=0, misses=0)
