"""Counters of the communication an engine causes: ``engine.communication_stats()``.

Two kinds of collective are counted, per ``(source, op)``:

- collectives the engine (its gradient strategy, its extensions, the pipeline transport) issues
  outside the compiled graphs: calls, message bytes and host wall time of each blocking call
  (``CommStats.timed``; on CUDA that is the time to enqueue unless ``synchronize`` is set);
- collectives inside compiled graphs (ZeRO-2/3 gathers and reduce-scatters, any functional
  collective a pass inserted): the frontend wraps every lowered graph that holds one
  (``count_graph_runs``) so that each run adds the graph's collectives, with their message
  bytes read from the graph's fake values, to the engine that is running it. Their time is not
  measured (they overlap compute by design); ``zero_optimization.profile_steps`` times them.

Message bytes follow DeepSpeed's comms logger: the full buffer of an all-gather (its output), the
input of a reduce-scatter or all-reduce, the tensor of a send/recv/broadcast.

The engine makes its ``CommStats`` the active one (``collecting``) while it runs forward,
backward and the step. It is a process-wide slot, not a context variable, because on CUDA the
compiled backward runs on autograd's device threads.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from dscompile.runtime import zero_ops


@dataclass
class CommCounter:
    """What one kind of collective cost so far."""

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0
    timed: bool = False

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"calls": self.calls, "bytes": self.bytes}
        if self.timed:
            out["seconds"] = self.seconds
        return out


class CommStats:
    """Per ``(source, op)`` counters; ``summary()`` is what ``engine.communication_stats()`` returns."""

    def __init__(self, synchronize: bool = False) -> None:
        self.counters: dict[tuple[str, str], CommCounter] = {}
        self.synchronize = synchronize

    def record(self, source: str, op: str, nbytes: int, seconds: float | None = None, calls: int = 1) -> None:
        counter = self.counters.setdefault((source, op), CommCounter())
        counter.calls += calls
        counter.bytes += int(nbytes)
        if seconds is not None:
            counter.seconds += seconds
            counter.timed = True

    @contextlib.contextmanager
    def timed(self, source: str, op: str, nbytes: int) -> Iterator[None]:
        """Count one blocking collective issued outside the graphs, with its wall time."""
        sync = self.synchronize and torch.cuda.is_available() and torch.cuda.is_initialized()
        begin = time.perf_counter()
        try:
            yield
        finally:
            if sync:
                torch.cuda.synchronize()
            self.record(source, op, nbytes, time.perf_counter() - begin)

    def summary(self) -> dict[str, dict[str, dict[str, Any]]]:
        """``{source: {op: {"calls", "bytes"[, "seconds"]}}}`` since the engine was built (or ``reset``)."""
        out: dict[str, dict[str, dict[str, Any]]] = {}
        for (source, op), counter in sorted(self.counters.items()):
            out.setdefault(source, {})[op] = counter.as_dict()
        return out

    def total_bytes(self) -> int:
        return sum(c.bytes for c in self.counters.values())

    def reset(self) -> None:
        self.counters.clear()


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


_ACTIVE: list[CommStats] = []


@contextlib.contextmanager
def collecting(stats: CommStats) -> Iterator[CommStats]:
    """Make ``stats`` receive the counts of graph runs and transport calls made inside the block."""
    _ACTIVE.append(stats)
    try:
        yield stats
    finally:
        _ACTIVE.pop()


def active() -> CommStats | None:
    return _ACTIVE[-1] if _ACTIVE else None


def record(source: str, op: str, nbytes: int, seconds: float | None = None) -> None:
    """Count a collective in the active engine's stats (a no-op outside an engine)."""
    if _ACTIVE:
        _ACTIVE[-1].record(source, op, nbytes, seconds)


# ---------------------------------------------------------------------------------------------
# collectives inside compiled graphs
# ---------------------------------------------------------------------------------------------
_c10d = torch.ops._c10d_functional
_GRAPH_OPS: dict[Any, tuple[str, Callable[[torch.Tensor, tuple], int]]] = {
    # op -> (name, message bytes from the input value and the node's args)
    _c10d.all_gather_into_tensor.default: ("all_gather", lambda t, args: tensor_bytes(t) * int(args[1])),
    _c10d.reduce_scatter_tensor.default: ("reduce_scatter", lambda t, args: tensor_bytes(t)),
    _c10d.all_reduce.default: ("all_reduce", lambda t, args: tensor_bytes(t)),
    _c10d.all_to_all_single.default: ("all_to_all", lambda t, args: tensor_bytes(t)),
    _c10d.broadcast.default: ("broadcast", lambda t, args: tensor_bytes(t)),
    zero_ops.BROADCAST_GATHER: ("all_gather", lambda t, args: tensor_bytes(t) * int(args[1])),  # gloo's big ZeRO gathers
}


def graph_collectives(gm: torch.fx.GraphModule) -> list[tuple[str, int]]:
    """``(op, message bytes)`` of every functional collective in ``gm`` (0 bytes where a size is symbolic)."""
    found: list[tuple[str, int]] = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _GRAPH_OPS:
            continue
        name, size = _GRAPH_OPS[node.target]
        name = node.meta.get("dscompile", {}).get("zero", {}).get("kind", name)  # ZeRO's collectives as gloo moves them (zero_gloo)
        source = node.args[0]
        value = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
        nbytes = 0
        if isinstance(value, torch.Tensor):
            try:
                nbytes = int(size(value, node.args))
            except (TypeError, ValueError, RuntimeError):
                nbytes = 0  # a symbolic size: the call is still counted
        found.append((name, nbytes))
    return found


def count_graph_runs(compiled: Callable[..., Any], entries: list[tuple[str, int]], source: str = "in_graph") -> Callable[..., Any]:
    """Wrap a lowered graph so each run adds ``entries`` to the active stats (boxed calling convention kept)."""
    boxed = getattr(compiled, "_boxed_call", False)

    def run(args: list[Any]) -> Any:
        if _ACTIVE:
            stats = _ACTIVE[-1]
            for op, nbytes in entries:
                stats.record(source, op, nbytes)
        return compiled(args) if boxed else compiled(*args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run
