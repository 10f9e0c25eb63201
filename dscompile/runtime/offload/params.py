"""``ParamStore``: ZeRO-3 parameter shards kept on the host or in NVMe swap files (``offload_param``).

The shard parameters keep their shape, dtype and device (the optimizer, the compiled graphs and the
checkpoints see the same tensors), but their storage is released (resized to 0 bytes) while offloaded.
The authoritative copy lives in a host tensor (``device: cpu``, pinned when asked and CUDA exists) or in
``nvme_path/rank_N/param_XXXXX.swp`` (``device: nvme``, written and read by ``swap.SwapDirectory``).

- In the graphs, ``zero_param_load`` (``runtime/zero_ops.py``) sits right before each shard's all-gather
  (forward, and again in backward: it is always recomputed, never saved). It returns the shard from the
  store: a host→device copy for ``cpu``; for ``nvme`` the file read into a fresh buffer, which dies with
  the graph's last use of it (after the gather; at world 1 the ``zero`` pass uses it in place as the
  parameter, with no gather). The first step records the order the shards are read in: the graphs' loads
  and then the optimizer step's reads (``resident`` with explicit shards); afterwards every read issues the
  reads of the next ``prefetch_distance`` shards of that order, so the step's first shards are read during
  backward and the next forward's first ones during the step.
- Around the optimizer step, checkpoints and ``full_parameters`` the shards are made resident
  (``resident``): the shard's data becomes the read buffer (or the host copy); on exit that buffer is
  written back and the shard holds no storage again. The step's writes are left in flight (write-behind,
  at most ``write_behind`` of them, on their own threads): the next read of the same shard is queued
  behind its write, a read of it started earlier is dropped as stale, and nothing else waits for them.
  Checkpoints and ``full_parameters`` (``resident()`` of every shard) wait for every write.
  With ``offload_optimizer`` the step does this tile by tile (``OffloadedOptimizer.residency``, set to ``resident``). When
  the NVMe optimizer steps its tiles in backward (``in_backward``), a shard's step read follows closely the
  backward load that gathered it: the order recorded at the first step marks such loads, and their buffer
  is kept (at most ``KEEP_LIMIT``) and copied for the step instead of reading the file again.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass

import torch
from torch import nn

from dscompile.runtime import zero_ops
from dscompile.runtime.offload.swap import SwapDirectory, align_up, aligned_buffer

log = logging.getLogger("dscompile.offload")

KEEP_DISTANCE = 16
"""How close (in reads of the recorded order) a step read must follow a graph load of its shard for the load's buffer to be kept."""
KEEP_LIMIT = 4
"""Most buffers kept at once (the oldest is let go): bounds the memory when the step comes later than recorded."""
_UNREFERENCED = 2
"""A pooled buffer's storage use count when only the pool holds it (the pool's own tensor, and the storage object asked)."""


@dataclass
class ParamOffloadSettings:
    """What the planner decided for the parameter shards (from ``zero_optimization.offload_param``)."""

    device: str  # "cpu" or "nvme"
    nvme_path: str | None = None
    pin_memory: bool = False
    prefetch_distance: int = 1
    write_behind: int = 1  # shard writes left in flight after the step (their buffers alive) before the oldest is waited on
    block_size: int = 1 << 20
    io_threads: int = 4
    verify_reads: bool = False


def _release(shard: torch.Tensor) -> None:
    shard.data.untyped_storage().resize_(0)


def _is_released(shard: torch.Tensor) -> bool:
    return shard.data.untyped_storage().nbytes() == 0 and shard.numel() > 0


class ParamStore:
    """The offloaded shards of one ZeRO partition (see the module docstring)."""

    def __init__(self, shards: list[nn.Parameter], indices: list[int], settings: ParamOffloadSettings, rank: int = 0) -> None:
        self.shards = shards
        self.indices = list(indices)
        self.settings = settings
        self.swap: SwapDirectory | None = None
        self.host: dict[int, torch.Tensor] = {}
        self.released: dict[int, torch.Tensor] = {}
        self.order: list[int] = []
        self.step_positions: set[int] = set()  # positions in ``order`` of step reads made during backward (the early NVMe step)
        self.keep_positions: set[int] = set()  # graph loads whose buffer the step reads again shortly after (kept, not re-read)
        self.kept: dict[int, torch.Tensor] = {}  # shard -> the buffer a graph load read, until its step takes it (oldest first)
        self.recording = True
        self.cursor = 0
        self.inflight: dict[int, tuple[torch.Tensor, Future[None]]] = {}
        self.writes: dict[int, tuple[torch.Tensor, Future[None]]] = {}  # write-behind: shard -> (buffer, its write)
        self.loads = 0
        self.prefetch_hits = 0
        self.step_reads = 0
        self.step_prefetch_hits = 0
        self.reads_after_write = 0
        self.step_reuses = 0
        self._pool: dict[int, list[torch.Tensor]] = {}  # read buffers by size, reused once nothing references them
        self.pool_reuses = 0
        self.write_waits = 0
        self.bytes_loaded = 0
        if settings.device == "nvme":
            if not settings.nvme_path:
                from dscompile.errors import DSCompileConfigError

                raise DSCompileConfigError("zero_optimization.offload_param.nvme_path", "is required with device nvme", "set it to a fast disk directory")
            self.swap = SwapDirectory(
                settings.nvme_path, rank, block_size=settings.block_size, threads=settings.io_threads, verify=settings.verify_reads,
                key="zero_optimization.offload_param", contents="parameter shards", write_pool=True,
            )
            for path in sorted(self.swap.root.glob("param_*.swp")):  # an earlier run's shards: never read again
                path.unlink(missing_ok=True)
        pin = settings.pin_memory and torch.cuda.is_available()
        for i in self.indices:
            shard = self.shards[i]
            if self.swap is not None:
                self._write(i, shard.detach())
            else:
                host = torch.empty(shard.shape, dtype=shard.dtype, pin_memory=pin)
                host.copy_(shard.detach())
                self.host[i] = host
            _release(shard)
            self.released[i] = shard.data  # the shape with no storage: what the shard holds while offloaded
        self.id = id(self)
        zero_ops.PARAM_SOURCES[self.id] = self

    # -- files -------------------------------------------------------------------------------------
    @staticmethod
    def file_name(i: int) -> str:
        return f"param_{i:05d}.swp"

    def _nbytes(self, i: int) -> int:
        shard = self.shards[i]
        return shard.numel() * shard.element_size()

    def _write(self, i: int, value: torch.Tensor) -> None:
        assert self.swap is not None
        buf = aligned_buffer(align_up(self._nbytes(i)), self.settings.pin_memory)
        buf.zero_()
        buf[: self._nbytes(i)].view(value.dtype).copy_(value.reshape(-1))
        self.swap.wait(self.swap.write(self.file_name(i), buf))

    def _read_buffer(self, nbytes: int) -> torch.Tensor:
        """A read buffer of ``nbytes``: one of this size from the pool that nothing references any more, else a new
        one (kept in the pool while it holds fewer than ``prefetch_distance`` of this size). New memory costs a page
        fault and a zeroed page per 4 KiB on every read; a reused buffer costs nothing, and the pool holds no more
        buffers of a size than the reads in flight use at once."""
        pool = self._pool.setdefault(nbytes, [])
        for anchor in pool:
            if torch._C._storage_Use_Count(anchor.untyped_storage()._cdata) <= _UNREFERENCED:
                self.pool_reuses += 1
                return anchor.view(-1)
        anchor = aligned_buffer(nbytes, self.settings.pin_memory)
        if len(pool) < max(1, self.settings.prefetch_distance):
            pool.append(anchor)
        # every user gets a tensor of its own over the storage: each holder (a read in flight, a write, the graph's
        # views) then counts in the storage's use count, which is how the pool knows the buffer is free again
        return anchor.view(-1)

    def _start_read(self, i: int) -> tuple[torch.Tensor, Future[None]]:
        """Read shard ``i``'s file into a buffer (``_read_buffer``); queued behind the shard's own write when one is in flight."""
        assert self.swap is not None
        buf = self._read_buffer(align_up(self._nbytes(i)))
        pending = self.writes.get(i)
        after = pending[1] if pending is not None and not pending[1].done() else None
        if after is not None:
            self.reads_after_write += 1
        return buf, self.swap.read(self.file_name(i), buf, after=after)

    def _start_write(self, i: int, buf: torch.Tensor) -> None:
        """Write shard ``i`` back from ``buf`` in the background (write-behind): nothing waits for it but the next read
        of the same shard (queued behind it) and, past ``write_behind`` writes in flight, the oldest write."""
        assert self.swap is not None
        self.inflight.pop(i, None)  # a read of the old value started earlier is stale: dropped (it only fills its own buffer)
        self._reap_writes()
        previous = self.writes.pop(i, None)
        if previous is not None:
            self.swap.wait(previous[1])
        self.writes[i] = (buf, self.swap.write(self.file_name(i), buf))
        while sum(not fut.done() for _, fut in self.writes.values()) > max(1, self.settings.write_behind):
            oldest = next(k for k, (_, fut) in self.writes.items() if not fut.done())
            self.write_waits += 1
            self.swap.wait(self.writes.pop(oldest)[1])

    def _reap_writes(self) -> None:
        """Forget finished writes (their buffers die here), raising a failed one's error (it names the file)."""
        for k in [k for k, (_, fut) in self.writes.items() if fut.done()]:
            _, fut = self.writes.pop(k)
            assert self.swap is not None
            self.swap.wait(fut)

    def flush(self) -> None:
        """Wait for every write in flight (the files then hold the current values)."""
        if self.swap is None:
            return
        while self.writes:
            _, fut = self.writes.pop(next(iter(self.writes)))
            self.swap.wait(fut)

    def _value(self, i: int, buf: torch.Tensor) -> torch.Tensor:
        shard = self.shards[i]
        return buf[: self._nbytes(i)].view(shard.dtype).view(shard.shape)

    def expected_file_bytes(self) -> int:
        return sum(align_up(self._nbytes(i)) for i in self.indices) if self.swap is not None else 0

    def file_bytes(self) -> int:
        return sum(n for name, n in self.swap.file_bytes().items() if name.startswith("param_")) if self.swap is not None else 0

    def read_value(self, i: int) -> torch.Tensor:
        """Shard ``i``'s stored value (a fresh host tensor), whatever its residency."""
        if self.swap is None:
            return self.host[i].clone()
        buf, fut = self._start_read(i)  # behind the shard's write in flight, if any
        self.swap.wait(fut)
        return self._value(i, buf).clone()

    # -- the graphs' loads --------------------------------------------------------------------------
    def load(self, i: int, like: torch.Tensor) -> torch.Tensor:
        """Shard ``i``'s value for its all-gather (``zero_param_load``), reading the next ones ahead."""
        self._advance(i)
        self.loads += 1
        self.bytes_loaded += self._nbytes(i)
        if self.swap is None:
            out = self.host[i].to(like.device, copy=True, non_blocking=self.host[i].is_pinned())
        else:
            self._reap_writes()
            entry = self.inflight.pop(i, None)
            if entry is None:
                entry = self._start_read(i)
            else:
                self.prefetch_hits += 1
            buf, fut = entry
            self.swap.wait(fut)
            value = self._value(i, buf)
            out = value if like.device.type == "cpu" else value.to(like.device, non_blocking=value.is_pinned())
            if not self.recording and (self.cursor - 1) % len(self.order) in self.keep_positions:
                self._keep(i, buf)
        self._prefetch()
        return out

    def _keep(self, i: int, buf: torch.Tensor) -> None:
        """Hold the buffer a graph load just read for the step read of the same shard that follows it closely (the
        early NVMe step in backward steps a shard right after its last gather): that read then costs no I/O. The
        graphs never write a loaded value and nothing writes the shard's file before its step, so it is current."""
        self.kept.pop(i, None)
        self.kept[i] = buf
        while len(self.kept) > KEEP_LIMIT:
            self.kept.pop(next(iter(self.kept)))

    def _advance(self, i: int, in_backward_step: bool = False) -> None:
        if self.recording:
            if in_backward_step:
                self.step_positions.add(len(self.order))
            self.order.append(i)
            return
        n = len(self.order)
        if n == 0:
            return
        for step in range(n):  # where this load is in the recorded order (normally the very next one)
            if self.order[(self.cursor + step) % n] == i:
                self.cursor = (self.cursor + step + 1) % n
                return

    def _prefetch(self) -> None:
        if self.swap is None or self.recording or not self.order:
            return
        n = len(self.order)
        for step in range(min(self.settings.prefetch_distance, n)):
            if len(self.inflight) >= self.settings.prefetch_distance:
                break
            key = self.order[(self.cursor + step) % n]
            if key not in self.inflight and key not in self.kept:
                self.inflight[key] = self._start_read(key)

    def _drop_prefetches(self) -> None:
        assert self.swap is not None or not self.inflight
        for _, fut in self.inflight.values():
            with contextlib.suppress(Exception):
                fut.result()
        self.inflight.clear()

    def end_step(self) -> None:
        """After an optimizer step (values being written back): fix the read order, read the first shards ahead."""
        if self.recording and self.order:
            self.recording = False
            self.keep_positions = self._positions_to_keep()
            log.info(
                "offload_param: %d shard reads per step recorded (forward, backward, optimizer step); reading %d ahead, %d write(s) behind",
                len(self.order), self.settings.prefetch_distance, self.settings.write_behind,
            )
        self.cursor = 0
        self.kept.clear()
        self._prefetch()

    def _positions_to_keep(self) -> set[int]:
        """Graph loads whose shard a step read made in the backward (the early NVMe step) reads again within
        ``KEEP_DISTANCE`` reads, with no graph load of it between. Step reads at ``step()`` keep nothing: a buffer held
        from backward to the step would hold parameter memory offload is meant to free."""
        keep = set()
        for p, i in enumerate(self.order):
            if p in self.step_positions:
                continue
            for q in range(p + 1, min(len(self.order), p + 1 + KEEP_DISTANCE)):
                if self.order[q] == i:
                    if q in self.step_positions:
                        keep.add(p)
                    break
        return keep

    # -- residency around the step and checkpoints ----------------------------------------------------
    @contextlib.contextmanager
    def resident(self, indices: Iterable[int] | None = None, in_backward: bool = False) -> Iterator[None]:
        """Shards ``indices`` (default: all offloaded) hold their value inside; written back and released on exit.

        No copy where it can be avoided: for nvme the shard's data becomes the read buffer itself (the step
        updates it in place and the same buffer is written back); for cpu on a host-only run, the host copy itself.

        With explicit ``indices`` (the optimizer step, shard by shard or tile by tile) the reads are part of the
        recorded read order, so they are read ahead like the graphs' loads (the step's first shards during
        backward), and the writes are left in flight (``_start_write``). Without (checkpoints, full parameters)
        every shard is read, and every write waited for on exit.
        """
        every = indices is None
        if every:
            self._drop_prefetches()
            self.flush()
            self.kept.clear()
        offloaded = set(self.indices)
        wanted = [i for i in (self.indices if every else indices) if i in offloaded and _is_released(self.shards[i])]
        buffers: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            entries: dict[int, tuple[torch.Tensor, Future[None]]] = {}
            if self.swap is not None:
                for i in wanted:
                    if not every:
                        self._advance(i, in_backward_step=in_backward)
                        self.step_reads += 1
                    entry = None if every else self.inflight.pop(i, None)
                    kept = None if every else self.kept.pop(i, None)
                    if kept is not None:  # read by the graph's load just before: copied, no I/O (a read ahead of it is dropped)
                        # a copy, not the buffer itself: the step updates it in place, and the graph may still read
                        # its load (the early step follows the shard's gradient, not every use of its gathered value)
                        self.step_reuses += 1
                        self.step_prefetch_hits += 1  # found ready, as a read ahead would be
                        fresh = self._read_buffer(kept.numel())
                        fresh.copy_(kept)
                        done: Future[None] = Future()
                        done.set_result(None)
                        entry = (fresh, done)
                    elif entry is not None:
                        self.step_prefetch_hits += 1
                    entries[i] = entry if entry is not None else self._start_read(i)
                if not every:
                    self._prefetch()
            for i in wanted:
                shard = self.shards[i]
                if self.swap is not None:
                    buf, fut = entries[i]
                    self.swap.wait(fut)
                    buffers[i] = buf
                    value = self._value(i, buf)
                else:
                    value = self.host[i]
                # ``.data =`` keeps the parameter object and its version counter (the optimizer's staleness check)
                shard.data = value if value.device == shard.device else value.to(shard.device)
        try:
            yield
        finally:
            with torch.no_grad():
                for i in wanted:
                    shard = self.shards[i]
                    if self.swap is not None:
                        self._start_write(i, buffers[i])
                    elif shard.data.data_ptr() != self.host[i].data_ptr():
                        self.host[i].copy_(shard.data)
                    shard.data = self.released[i]
                if every:
                    self.flush()

    def counters(self) -> dict[str, int]:
        return {
            "param_loads": self.loads,
            "param_prefetch_hits": self.prefetch_hits,
            "param_step_reads": self.step_reads,
            "param_step_prefetch_hits": self.step_prefetch_hits,
            "param_reads_after_write": self.reads_after_write,
            "param_step_reuses": self.step_reuses,
            "param_pool_reuses": self.pool_reuses,
            "param_write_waits": self.write_waits,
            "param_bytes_loaded": self.bytes_loaded,
            "param_offloaded_shards": len(self.indices),
        }

    def close(self) -> None:
        self._drop_prefetches()
        self.flush()
        self._pool.clear()
        self.kept.clear()
        zero_ops.PARAM_SOURCES.pop(self.id, None)
        if self.swap is not None:
            self.swap.close()
