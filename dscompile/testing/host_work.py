"""Count the host work of a call: the ATen ops that would launch a device kernel, and the host syncs.

On a GPU each such op is a kernel launch (a few microseconds of host time and a gap on the device), and each
``.item()``-like read waits for the device to drain. Counted on CPU with the torch profiler, so a test can pin
a hot path's per-call host work without a GPU: an op whose per-call cost must be "the kernels and nothing else"
(block-sparse attention, a decode step) is checked by ``count_host_work(call).launches == {}``.

Leaf events only (``aten::zeros`` launches once, through its ``fill_``), and only ops that touch data:
allocations, views and metadata ops launch nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

NON_LAUNCHING = frozenset(
    f"aten::{name}"
    for name in (
        "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_",
        "view", "_unsafe_view", "reshape", "expand", "as_strided", "alias", "slice", "select", "narrow", "permute",
        "transpose", "t", "unsqueeze", "squeeze", "detach", "lift_fresh", "contiguous", "to", "set_", "split",
        "unbind", "chunk", "view_as", "expand_as", "unflatten", "flatten", "result_type", "is_nonzero",
    )
)  # fmt: skip
SYNCS = frozenset({"aten::_local_scalar_dense", "aten::nonzero"})


@dataclass
class HostWork:
    """``launches``: ATen ops that touch data, by name (each a kernel launch on a device); ``syncs``: host reads
    of device values (``.item()``, ``.tolist()``, ``nonzero``)."""

    launches: Counter[str]
    syncs: int


def count_host_work(fn: Callable[[], Any]) -> HostWork:
    """Run ``fn`` once under the profiler (CPU activity) and count its leaf ATen ops and host syncs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    launches: Counter[str] = Counter()
    syncs = 0
    for event in prof.events():
        name = event.name
        if not name.startswith("aten::"):
            continue
        if name in SYNCS:
            syncs += 1
        if event.cpu_children or name in NON_LAUNCHING:
            continue
        launches[name] += 1
    return HostWork(launches, syncs)
