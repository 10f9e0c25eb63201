"""Compressed all-reduce with error feedback over torch.distributed, and byte counters.

The 1-bit algorithm of DeepSpeed's compressed backends (1-bit Adam, arXiv:2102.02888), on any
torch.distributed backend (gloo on CPU, NCCL on GPU) instead of cupy/MPI:

1. each rank adds its *worker error* to its flat buffer (padded to ``world x chunk``), compresses
   it to signs (8 per byte) and one scale ``||x|| / sqrt(n)`` per block, and keeps what the
   compression lost as its new worker error;
2. one ``all_to_all`` sends chunk ``r`` (its signs and scales) to rank ``r``;
3. rank ``r`` averages the ``world`` decompressed copies of its chunk, adds its *server error*,
   compresses again (new server error);
4. one ``all_gather`` of the compressed chunks: every rank decompresses the same full result.

Both errors are per rank: checkpoints must keep each rank's own. A block is ``block_size``
values, or a whole chunk when ``block_size`` is None (DeepSpeed's server side: one scale per
rank's chunk). Every rank ends with bitwise the same result.

``CompressedAllReduce`` runs the algorithm in two asynchronous halves (steps 1-2 when built, 3-4 in
``gather()``, the result from ``wait()``), so an engine can start an exchange from backward and let
the rest of backward run while it travels; ``compressed_all_reduce`` is the blocking form, with the
same arithmetic. ``compressed_reduce_scatter`` (``CompressedReduceScatter``) is steps 1-3 alone, for ZeRO-1: the rows of a ``[world, n]``
buffer are the ranks' shards, and rank ``r`` ends with the mean of row ``r`` (no server error,
no all-gather: ZeRO-1's parameter all-gather follows the optimizer step instead).

Bytes are counted as what this rank puts on the wire under the usual bandwidth-optimal
algorithms, from the tensors handed to each collective: all-reduce (ring) ``2 (w-1)/w x bytes``,
all-to-all ``(w-1)/w x bytes`` (its own chunk stays), all-gather ``(w-1) x`` its input bytes.
Inside an engine every collective is also counted in ``engine.communication_stats()`` under the
source ``onebit`` (op ``<purpose>.<collective>``), with the engine's message-size convention and
its wall time.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dscompile.kernels import onebit as onebit_kernels
from dscompile.runtime import comm_stats as engine_comm_stats


def wire_bytes(op: str, nbytes: int, world: int) -> int:
    """Bytes one rank sends for collective ``op`` over ``nbytes`` (its input) among ``world`` ranks."""
    if world <= 1:
        return 0
    if op == "all_reduce":
        return 2 * (world - 1) * nbytes // world
    if op == "all_to_all":
        return (world - 1) * nbytes // world
    if op == "all_gather":
        return (world - 1) * nbytes
    raise ValueError(f"unknown collective {op!r}")


class CommStats:
    """Counts the collectives a rank issued and the bytes it sent, per collective and per purpose.

    ``record`` is called once per collective, before it runs; a subclass may also act there
    (``bench/onebit.py`` sleeps in proportion to the bytes to emulate a slow network)."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)

    def record(self, op: str, purpose: str, sent: int) -> None:
        self.calls[op] += 1
        self.bytes[op] += sent
        self.bytes[f"purpose:{purpose}"] += sent

    @property
    def total_bytes(self) -> int:
        return sum(v for k, v in self.bytes.items() if not k.startswith("purpose:"))

    def as_dict(self) -> dict[str, Any]:
        """``{"total_bytes", "calls": {op: n}, "bytes": {op: n}, "bytes_by_purpose": {purpose: n}}``."""
        return {
            "total_bytes": self.total_bytes,
            "calls": dict(self.calls),
            "bytes": {k: v for k, v in self.bytes.items() if not k.startswith("purpose:")},
            "bytes_by_purpose": {k.split(":", 1)[1]: v for k, v in self.bytes.items() if k.startswith("purpose:")},
        }

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()


class Collectives:
    """The blocking torch.distributed collectives the 1-bit runtime issues, each counted in ``stats``.

    Without an initialised process group (or built with ``local()``) it is a world of one, where
    every exchange is the identity."""

    def __init__(self, group: dist.ProcessGroup | None = None, stats: CommStats | None = None) -> None:
        self.group = group
        self.stats = stats if stats is not None else CommStats()
        initialised = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(group) if initialised else 1
        self.rank = dist.get_rank(group) if initialised else 0

    @classmethod
    def local(cls, stats: CommStats | None = None) -> Collectives:
        """A world of one whatever the process group: for an optimizer whose communication a caller does (ZeRO-1)."""
        out = cls.__new__(cls)
        out.group, out.stats, out.world, out.rank = None, stats if stats is not None else CommStats(), 1, 0
        return out

    def all_reduce_sum_(self, tensor: torch.Tensor, purpose: str) -> None:
        self.stats.record("all_reduce", purpose, wire_bytes("all_reduce", _nbytes(tensor), self.world))
        with _engine_counted("all_reduce", purpose, _nbytes(tensor)):
            dist.all_reduce(tensor, group=self.group)

    def all_to_all_(self, out: torch.Tensor, inp: torch.Tensor, purpose: str, async_op: bool = False) -> dist.Work | None:
        """``async_op``: start it and return its work handle (counted, not timed: it overlaps what follows)."""
        self.stats.record("all_to_all", purpose, wire_bytes("all_to_all", _nbytes(inp), self.world))
        if async_op:
            engine_comm_stats.record("onebit", f"{purpose}.all_to_all", _nbytes(inp))
            return dist.all_to_all_single(out, inp, group=self.group, async_op=True)
        with _engine_counted("all_to_all", purpose, _nbytes(inp)):
            dist.all_to_all_single(out, inp, group=self.group)
        return None

    def all_gather_(self, out: torch.Tensor, inp: torch.Tensor, purpose: str, async_op: bool = False) -> dist.Work | None:
        """``async_op``: as ``all_to_all_``."""
        self.stats.record("all_gather", purpose, wire_bytes("all_gather", _nbytes(inp), self.world))
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
        if async_op:
            engine_comm_stats.record("onebit", f"{purpose}.all_gather", _nbytes(out))
            return gather(out, inp, group=self.group, async_op=True)
        with _engine_counted("all_gather", purpose, _nbytes(out)):
            gather(out, inp, group=self.group)
        return None


@contextlib.contextmanager
def _engine_counted(op: str, purpose: str, message_bytes: int) -> Iterator[None]:
    """Also count the collective in the running engine's ``communication_stats()`` (a no-op in a plain loop)."""
    begin = time.perf_counter()
    try:
        yield
    finally:
        engine_comm_stats.record("onebit", f"{purpose}.{op}", message_bytes, time.perf_counter() - begin)


@dataclass(frozen=True)
class CompressedLayout:
    """How a flat buffer of ``numel`` values is padded and cut for the compressed all-reduce.

    ``padded = world x chunk``; rank ``r`` serves values ``[r x chunk, (r+1) x chunk)``; every
    ``block`` values (a multiple of 8 that divides ``chunk``) share one scale."""

    numel: int
    world: int
    chunk: int
    block: int

    @classmethod
    def plan(cls, numel: int, world: int, block_size: int | None = None) -> CompressedLayout:
        if numel < 1 or world < 1:
            raise ValueError(f"a compressed buffer needs numel >= 1 and world >= 1, got {numel} and {world}")
        if block_size is None:
            chunk = math.ceil(numel / (8 * world)) * 8
            return cls(numel, world, chunk, chunk)
        if block_size < 8 or block_size % 8:
            raise ValueError(f"block_size must be a positive multiple of 8 (signs travel 8 to a byte), got {block_size}")
        chunk = math.ceil(numel / (world * block_size)) * block_size
        return cls(numel, world, chunk, block_size)

    @property
    def padded(self) -> int:
        return self.world * self.chunk

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk // self.block

    def new_errors(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Zero ``(worker_error [padded], server_error [chunk])``."""
        return torch.zeros(self.padded, device=device), torch.zeros(self.chunk, device=device)


class CompressedAllReduce:
    """One compressed all-reduce in flight, in its two halves, so that backward can run between them.

    Built: step 1 (compress with the worker error) and the all-to-all, started asynchronously.
    ``gather()``: waits for the all-to-all, does step 3 (average the chunk, server error, recompress) and
    starts the all-gather. ``wait()``: the result (``gather()`` first if it was not called). Every rank
    must call ``gather()`` on its exchanges in the same order (collectives pair up by issue order); the
    arithmetic is the blocking algorithm's, so results do not depend on when the halves ran.
    The buffers a collective reads or writes stay referenced here until it has been waited."""

    def __init__(
        self,
        flat: torch.Tensor,
        worker_error: torch.Tensor,
        server_error: torch.Tensor,
        layout: CompressedLayout,
        comm: Collectives,
        purpose: str = "compressed",
        impl: str | None = None,
    ) -> None:
        if comm.world != layout.world or flat.numel() != layout.numel:
            raise ValueError(f"layout {layout} does not match a buffer of {flat.numel()} values on {comm.world} ranks")
        self.layout, self.comm, self.purpose, self.impl = layout, comm, purpose, impl
        self.server_error = server_error
        self._result: torch.Tensor | None = None
        self._work: dist.Work | None = None
        self._gathered: torch.Tensor | None = None
        if comm.world == 1:
            self._result = flat  # nothing to send, so nothing is lost
            return
        padded = F.pad(flat.reshape(-1).float(), (0, layout.padded - layout.numel))
        # steps 1-2 are the compressed reduce-scatter of the padded buffer's [world, chunk] rows: rank r gets chunk r
        self._scatter = CompressedReduceScatter(padded.view(layout.world, layout.chunk), worker_error, layout.block, comm, purpose, impl)

    @property
    def gathering(self) -> bool:
        """True once the second half (the all-gather) has started, or when there is nothing to send."""
        return self._gathered is not None or self._result is not None

    def gather(self) -> None:
        """The server half: wait for this exchange's all-to-all, average, recompress, start the all-gather."""
        if self.gathering:
            return
        k, block = self.layout.blocks_per_chunk, self.layout.block
        mine = self._scatter.wait().view(k, block)
        del self._scatter  # its buffers are done with
        s_packed, s_scales = onebit_kernels.compress(mine, self.server_error.view(k, block), self.impl)
        self._message = torch.cat([s_packed.view(-1), s_scales.view(torch.uint8)])
        self._gathered = torch.empty(self.layout.world * self._message.numel(), dtype=torch.uint8, device=mine.device)
        self._work = self.comm.all_gather_(self._gathered, self._message, self.purpose, async_op=True)

    def wait(self) -> torch.Tensor:
        """The mean over the ranks (a new tensor, bitwise equal on every rank)."""
        if self._result is None:
            self.gather()
            assert self._work is not None and self._gathered is not None
            self._work.wait()
            w, k, block = self.layout.world, self.layout.blocks_per_chunk, self.layout.block
            chunk_bytes = self.layout.chunk // 8
            rows = self._gathered.view(w, -1)
            out = onebit_kernels.decompress(rows[:, :chunk_bytes].reshape(w * k, block // 8), _floats(rows[:, chunk_bytes:], (w * k,)), self.impl)
            self._result = out.view(-1)[: self.layout.numel]
            self._work = self._gathered = None
        return self._result


def compressed_all_reduce(
    flat: torch.Tensor,
    worker_error: torch.Tensor,
    server_error: torch.Tensor,
    layout: CompressedLayout,
    comm: Collectives,
    purpose: str = "compressed",
    impl: str | None = None,
) -> torch.Tensor:
    """The mean of ``flat`` (fp32, ``layout.numel`` values) over the ranks of ``comm``, sent 1-bit, blocking.

    Updates ``worker_error`` and ``server_error`` in place and returns a new tensor, equal on every
    rank. A world of one returns ``flat`` itself: there is nothing to send, so nothing is lost."""
    return CompressedAllReduce(flat, worker_error, server_error, layout, comm, purpose, impl).wait()


def reduce_scatter_chunk(row: int, block_size: int | None) -> tuple[int, int]:
    """``(chunk, block)`` of ``compressed_reduce_scatter`` for rows of ``row`` values: each row is
    padded to ``chunk`` (a multiple of ``block``, itself a multiple of 8) and every ``block`` values
    share a scale (``block_size`` None: one scale per row)."""
    if row < 1:
        raise ValueError(f"a compressed reduce-scatter needs rows of at least one value, got {row}")
    if block_size is None:
        chunk = math.ceil(row / 8) * 8
        return chunk, chunk
    if block_size < 8 or block_size % 8:
        raise ValueError(f"block_size must be a positive multiple of 8 (signs travel 8 to a byte), got {block_size}")
    return math.ceil(row / block_size) * block_size, block_size


class CompressedReduceScatter:
    """The mean over the ranks of row ``comm.rank`` of ``rows`` (fp32 ``[world, n]``), sent 1-bit; started when built,
    ``wait()`` returns it.

    Each rank adds its ``worker_error`` (fp32 ``[world x chunk]``, see ``reduce_scatter_chunk``) to
    its rows, compresses them (the error keeps what was lost) and sends row ``r`` to rank ``r`` with
    one all-to-all (asynchronous); rank ``r`` averages the ``world`` decompressed copies of its row.
    ZeRO-1 lays its shards out as these rows, so each rank receives exactly its shard."""

    def __init__(
        self,
        rows: torch.Tensor,
        worker_error: torch.Tensor,
        block_size: int | None,
        comm: Collectives,
        purpose: str = "compressed_gradient",
        impl: str | None = None,
    ) -> None:
        w, row = rows.shape
        if w != comm.world:
            raise ValueError(f"{w} rows for a world of {comm.world} ranks")
        chunk, block = reduce_scatter_chunk(row, block_size)
        if worker_error.numel() != w * chunk:
            raise ValueError(f"worker_error holds {worker_error.numel()} values, {w * chunk} expected")
        self.row, self.chunk, self.block, self.impl = row, chunk, block, impl
        self._result: torch.Tensor | None = None
        self._work: dist.Work | None = None
        if comm.world == 1:
            self._result = rows[0].float().clone()
            return
        k = chunk // block
        padded = F.pad(rows.float(), (0, chunk - row)) if chunk != row else rows.float()  # compress reads it, never writes
        packed, scales = onebit_kernels.compress(padded.reshape(w * k, block), worker_error.view(w * k, block), impl)
        self._send = torch.cat([packed.view(w, chunk // 8), scales.view(torch.uint8).view(w, 4 * k)], dim=1)
        self._recv = torch.empty_like(self._send)
        self._work = comm.all_to_all_(self._recv, self._send, purpose, async_op=True)

    def wait(self) -> torch.Tensor:
        if self._result is None:
            assert self._work is not None
            self._work.wait()
            w, k, chunk_bytes = self._recv.shape[0], self.chunk // self.block, self.chunk // 8
            recv = self._recv
            mine = onebit_kernels.decompress_mean(recv[:, :chunk_bytes].reshape(w, k, self.block // 8), _floats(recv[:, chunk_bytes:], (w, k)), self.impl)
            self._result = mine.reshape(-1)[: self.row]
            self._work = None
            del self._send, self._recv
        return self._result


def compressed_reduce_scatter(
    rows: torch.Tensor,
    worker_error: torch.Tensor,
    block_size: int | None,
    comm: Collectives,
    purpose: str = "compressed_gradient",
    impl: str | None = None,
) -> torch.Tensor:
    """``CompressedReduceScatter``, blocking."""
    return CompressedReduceScatter(rows, worker_error, block_size, comm, purpose, impl).wait()


def _floats(raw: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """fp32 values sent as bytes (a slice of a uint8 message) back to fp32."""
    return raw.contiguous().view(torch.float32).view(shape)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
