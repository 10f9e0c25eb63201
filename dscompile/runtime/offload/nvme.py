"""``NvmeOffloadedOptimizer``: the offloaded states (and masters) in NVMe swap files, stepped tile by tile (``device: nvme``).

The offloaded elements are cut into tiles of ``sub_group_size`` elements (``tiles.py``); each tile is one file
under ``nvme_path/rank_N`` holding every element-wise optimizer state of its pieces, and their fp32 masters where
those are separate from the shards (an accelerator run, or ``separate_master``). Where the shard is itself an fp32
host tensor (a CPU-only run; with ``offload_param`` the shard made resident from its own swap file) it is its own
master: a second copy on disk would only be read and written back each step, so the files hold the states alone.
The step reads tile t+1 while stepping tile t and writes tile t back while stepping t+1 (``buffer_count`` tile
buffers in flight). The first tiles are read ahead of the step, from the forward of the micro-step that ends a
batch (``prefetch``), and the last writes finish behind it, during the next forward; a tile is never read before its
write has finished. Between steps no buffer is kept: the states are on disk only. Scalar states (Adam's ``step``)
stay in memory.

The early NVMe step (ZeRO-2/3, the gate of ``OffloadedOptimizer.hand_off``): each shard's final gradient is
recorded, and a tile is stepped, in the backward, on the main thread, as soon as every shard cut into it has one
(``_early_hand_off``): its read was started ahead, its write is left in flight, and the next tiles are read into the
buffers that free up, so the disk works while backward computes instead of during ``step()``, which only waits for
the last writes and steps tiles left over (a shard with no gradient). The first early backward records the order
the tiles became ready in; from then on the forward reads ahead the first tiles of that order and backward reads
ahead along it. Still at most ``buffer_count`` tile buffers alive; with ``offload_param`` a shard stays resident
until its last tile is stepped. Each element is stepped once, by the same fused kernel over the same tile cuts,
with the same accumulated gradient: bitwise the step at ``step()``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from typing import Any

import torch

from dscompile.errors import DSCompileConfigError
from dscompile.runtime.offload.host import Piece, state_slots
from dscompile.runtime.offload.optimizer import OffloadedOptimizer
from dscompile.runtime.offload.swap import ALIGN, SwapDirectory, aligned_buffer
from dscompile.runtime.offload.tiles import Tile, cut_tiles, lay_out, read_states, segment, state_segments, write_masters, write_states

log = logging.getLogger("dscompile.offload")


class NvmeOffloadedOptimizer(OffloadedOptimizer):
    """The offloaded part's states in swap files, streamed through ``buffer_count`` tile buffers (module docstring)."""

    def _init_state(self) -> None:
        self.tiles: list[Tile] = []
        self.slots: list[list[tuple[str, torch.dtype]]] = []
        """Each param group's element-wise states (name, dtype), in the order their segments follow in a tile."""
        self.masters_in_files = True  # False where each shard is its own fp32 master (the files hold states only)
        self._prefetched: dict[int, tuple[torch.Tensor, Future[None] | None]] = {}
        """Tiles read ahead of the step (``prefetch``, and the early step's read-ahead): tile index -> (its buffer, the read)."""
        self._pending_writes: list[Future[None]] = []
        """The last tiles' writes, finishing behind the step (each holds its buffer until done)."""
        self.prefetched_tiles = 0
        # The early step: tiles stepped from the backward graph on the main thread, as their shards' gradients become
        # final (``_early_hand_off``); the tile I/O stays asynchronous, so it overlaps the rest of backward.
        self._tiles_of: dict[int, list[int]] = {}
        """Shard index -> the tiles holding a piece of it."""
        self._early_grads: dict[int, torch.Tensor] = {}
        """Shard index -> its final gradient of this batch, handed off before AccumulateGrad set ``.grad``."""
        self._waiting: dict[int, set[int]] = {}
        """Tile -> the shards whose final gradient it still waits for (this backward)."""
        self._early_tiles: set[int] = set()
        """Tiles stepped during this batch's backward (``step()`` steps only the others)."""
        self._held: dict[int, contextlib.ExitStack] = {}
        """Shards made resident (``offload_param``) for early tiles, until the last early tile that holds them."""
        self._free: list[torch.Tensor] = []
        self._writes: deque[tuple[torch.Tensor, Future[None]]] = deque()
        self._ready_order: list[int] | None = None
        """Tiles in the order the first early backward stepped them: what ``prefetch`` and the read-ahead read."""
        self._order_now: list[int] = []
        self._in_use = 0  # the buffer of the tile being stepped early
        self.early_tiles = 0

    # -- construction ----------------------------------------------------------------------------
    def _init_host(self, group_of: dict[int, int], rank: int) -> None:
        s = self.settings
        if not s.nvme_path:
            raise DSCompileConfigError(
                "zero_optimization.offload_optimizer.nvme_path", "is required with device nvme", "set it to a directory on the fast disk"
            )
        self.swap = SwapDirectory(s.nvme_path, rank, block_size=s.block_size, threads=s.io_threads, verify=s.verify_reads)
        stale = sorted(self.swap.root.glob("tile_*.swp"))
        for path in stale:  # an earlier run's tiles: never read again (runs resume from checkpoints), only taking disk space
            path.unlink(missing_ok=True)
        if stale:
            log.info("NVMe offload: removed %d swap file(s) of an earlier run from %s", len(stale), self.swap.root)
        self.masters_in_files = not all(self._own_master(self.shards[i]) and self.shards[i].is_contiguous() for i in self.offloaded)
        self.tiles = cut_tiles(self.shards, self.offloaded, group_of, s.tile_elements)
        self.pieces = [p for t in self.tiles for p in t.pieces]
        self.slots = [state_slots(self.cls, g, torch.float32) for g in self.param_groups]
        for tile in self.tiles:
            lay_out(tile, self.slots, self.masters_in_files)
        write_masters(self.swap, self.tiles, self.shards, self.masters_in_files, preallocate_states=s.preallocate_states)
        for t, tile in enumerate(self.tiles):
            for piece in tile.pieces:
                if t not in self._tiles_of.setdefault(piece.shard, []):
                    self._tiles_of[piece.shard].append(t)

    def _handed_shards(self) -> Iterable[int]:
        return self._tiles_of

    def steps_in_place(self, i: int) -> bool:
        return True  # in place, or its master copied back into it

    def _state_segments(self, piece: Piece) -> Iterator[tuple[int, str, torch.dtype]]:
        return state_segments(piece, self.slots, self.masters_in_files)

    # -- tile reads and writes -------------------------------------------------------------------
    def _read_depth(self) -> int:
        """Tile buffers alive at once: ``buffer_count`` (at least 1)."""
        return max(1, self.settings.buffer_count)

    def _start_read(self, t: int, buf: torch.Tensor | None = None, after: Future[None] | None = None) -> tuple[int, torch.Tensor, Future[None] | None]:
        """Read what tile ``t``'s step needs into a buffer: its states once they exist, and its masters where the
        files hold them (nothing at all before the first step when the shards are their own masters). ``after``: a
        write from the same buffer, which finishes first (then the returned future is never None)."""
        assert self.swap is not None
        tile = self.tiles[t]
        if buf is None:
            buf = aligned_buffer(self._buffer_bytes(), self.settings.pin_memory)
        wanted = tile.nbytes if any(p.initialized for p in tile.pieces) else tile.master_bytes
        return t, buf, (self.swap.read(tile.name, buf[:wanted], after=after) if wanted else after)

    def _buffer_bytes(self) -> int:
        return max(ALIGN, max(t.nbytes for t in self.tiles))

    def prefetch(self) -> None:
        """Read the first tiles ahead of the step (the engine calls this as the micro-step that ends a batch begins,
        so the reads overlap its forward and backward). A no-op when they are already in flight."""
        if self.swap is None or self._prefetched or not self.tiles:
            return
        self._retire_writes()  # a tile is read only after its last write has landed
        depth = self._read_depth() if self.settings.pipeline_read else 1
        for t in self._read_order()[:depth]:
            _, buf, fut = self._start_read(t)
            self._prefetched[t] = (buf, fut)
        self.prefetched_tiles += len(self._prefetched)

    def _read_order(self) -> list[int]:
        """The order the tiles are needed in: as the first early backward stepped them, else their own order."""
        return self._ready_order if self._ready_order is not None else list(range(len(self.tiles)))

    def _retire_writes(self) -> None:
        """Wait for the writes left finishing behind the last step (their errors, naming the file, are raised here)."""
        assert self.swap is not None
        pending, self._pending_writes = self._pending_writes, []
        for fut in pending:
            self.swap.wait(fut)

    def _drop_prefetched(self) -> None:
        """Forget tiles read ahead (their files are about to be rewritten from elsewhere: a checkpoint load)."""
        assert self.swap is not None
        prefetched, self._prefetched = self._prefetched, {}
        for _, fut in prefetched.values():
            if fut is not None:
                with contextlib.suppress(Exception):
                    fut.result()

    # -- the step at step() ----------------------------------------------------------------------
    def _step_host(self, early: set[int]) -> None:
        """Tile by tile: read ahead, step, write behind, with at most ``buffer_count`` tile buffers alive. Tiles already
        stepped from this batch's backward (``_early_hand_off``) are skipped; the tiles read ahead go first."""
        assert self.swap is not None and self.host_opt is not None
        s = self.settings
        swap = self.swap
        self._retire_writes()
        reads: dict[int, tuple[torch.Tensor, Future[None] | None]] = self._prefetched
        self._prefetched = {}
        todo = [t for t in range(len(self.tiles)) if t not in self._early_tiles]
        order = [t for t in reads if t not in self._early_tiles] + [t for t in todo if t not in reads]
        pending = deque(t for t in order if t not in reads)
        free = [aligned_buffer(self._buffer_bytes(), s.pin_memory) for _ in range(max(0, self._read_depth() - len(reads)))]
        writes: deque[tuple[torch.Tensor, Future[None]]] = deque()

        def issue(limit: int) -> None:
            while pending and free and len(reads) < limit:
                t = pending.popleft()
                _, buf, fut = self._start_read(t, free.pop())
                reads[t] = (buf, fut)

        def retire_write() -> None:
            buf, fut = writes.popleft()
            swap.wait(fut)
            free.append(buf)

        # offload_param: a shard is made resident (read from its file) once for the run of consecutive tiles that cut it,
        # and written back after the last of them, not once per tile.
        held: dict[int, contextlib.ExitStack] = {}
        try:
            for k, t in enumerate(order):
                issue(len(self.tiles) if s.pipeline_read else 1)
                while t not in reads:  # every buffer is in a write: the oldest frees one
                    retire_write()
                    issue(1)
                buf, fut = reads.pop(t)
                if fut is not None:
                    swap.wait(fut)
                for i in sorted({p.shard for p in self.tiles[t].pieces} - held.keys()):
                    held[i] = contextlib.ExitStack()
                    held[i].enter_context(self._resident([i]))
                self._step_tile(self.tiles[t], buf)
                writes.append((buf, swap.write(self.tiles[t].name, buf[: self.tiles[t].nbytes])))
                following = {p.shard for p in self.tiles[order[k + 1]].pieces} if k + 1 < len(order) else set()
                for i in [i for i in held if i not in following]:
                    held.pop(i).close()
                if not s.pipeline_write:
                    retire_write()
            # The last writes finish behind the step; only their futures are kept, so each buffer is freed when its write is done.
            self._pending_writes = [fut for _, fut in writes]
            writes.clear()
        finally:
            for stack in held.values():
                stack.close()
            for _, fut in reads.values():
                if fut is not None:
                    fut.cancel()
            for _, fut in writes:  # an error mid-step: let the writes already issued land before reporting it
                with contextlib.suppress(Exception):
                    fut.result()
            for piece in self.pieces:
                self._unbind(piece)
            self._early_tiles.clear()
            self._early_grads.clear()

    def _step_tile(self, tile: Tile, buf: torch.Tensor, grads: dict[int, torch.Tensor] | None = None) -> None:
        """Step ``tile``'s pieces from ``buf`` (its states, and masters where the files hold them) with each shard's
        ``.grad``, or with ``grads[shard]`` (the early step: handed off before AccumulateGrad set ``.grad``)."""
        assert self.host_opt is not None
        for j, piece in enumerate(tile.pieces):
            shard = self.shards[piece.shard]
            own = shard.detach().reshape(-1)[piece.start : piece.stop]
            if self.masters_in_files:
                master = segment(buf, tile, 0, j, torch.float32)
                if self._stale(piece):
                    master.copy_(own)
            else:
                master = own  # the shard is its own fp32 master: stepped in place
            piece.master.data = master
            state = self.host_opt.state[piece.master]
            if piece.initialized:
                for k, name, dtype in self._state_segments(piece):
                    state[name] = segment(buf, tile, k, j, dtype)
            grad = grads[piece.shard] if grads is not None else shard.grad
            piece.master.grad = None if grad is None else grad.detach().reshape(-1)[piece.start : piece.stop].to("cpu", torch.float32)
        for g in range(len(self._host_group_params)):
            self.host_opt.param_groups[g]["params"] = [p.master for p in tile.pieces if p.group == g]
        try:
            self.host_opt.step()
        finally:
            for g, params in enumerate(self._host_group_params):
                self.host_opt.param_groups[g]["params"] = params
        for j, piece in enumerate(tile.pieces):
            state = self.host_opt.state[piece.master]
            if not piece.initialized and state:
                for k, name, dtype in self._state_segments(piece):
                    segment(buf, tile, k, j, dtype).copy_(state[name])  # states created at this first step
                piece.initialized = True
            if piece.master.grad is not None and self.masters_in_files:
                self.shards[piece.shard].reshape(-1)[piece.start : piece.stop].copy_(piece.master)
            self._unbind(piece)  # no view of the tile buffer or of a shard made resident for this tile outlives it

    def _unbind(self, piece: Piece) -> None:
        """Drop the views into a tile buffer: between steps only scalar states stay in memory."""
        assert self.host_opt is not None
        piece.master.data = torch.empty(0, dtype=torch.float32)
        piece.master.grad = None
        state = self.host_opt.state.get(piece.master)
        if state:
            for name, _ in self.slots[piece.group]:
                state.pop(name, None)

    # -- the early step: tiles stepped from the backward graph ------------------------------------
    def _early_hand_off(self, i: int, grad: torch.Tensor) -> None:
        """Shard ``i``'s final gradient (``hand_off``): every tile whose shards all have theirs now is stepped here,
        on the main thread, in the backward: its read was started ahead (in the order the first early backward
        stepped the tiles), its write is left in flight, so the disk works while backward computes. What the step at
        ``step()`` would do, bit for bit (each element is stepped once, by the same fused kernel over the same tile
        cuts, with the same accumulated gradient)."""
        tiles = self._tiles_of.get(i)
        shard = self.shards[i]
        if tiles is None or grad.shape != shard.shape:
            return
        if i in self._early_grads:
            raise self._handed_twice(i)
        assert self.host_opt is not None and self.swap is not None
        if not self._early_grads and not self._early_tiles:  # the first of this backward
            self._sync_hyperparameters(self.host_opt)
            self._retire_writes()
            self._waiting = {t: {p.shard for p in tile.pieces} for t, tile in enumerate(self.tiles)}
            self._order_now = []
        self._early_grads[i] = self._final_gradient(i, grad).detach()
        self.early_steps["submitted"] += 1
        for t in tiles:
            self._waiting[t].discard(i)
        for t in tiles:
            if not self._waiting[t] and t not in self._early_tiles:
                self._early_step_tile(t)

    def _buffers_alive(self) -> int:
        return len(self._free) + len(self._writes) + len(self._prefetched) + self._in_use

    def _take_buffer(self) -> torch.Tensor:
        """A tile buffer for a read, keeping at most ``buffer_count`` alive: a free one, a new one, the oldest write's
        once it landed, or (every buffer holding a read ahead of a tile not ready yet) the last read ahead's."""
        assert self.swap is not None
        if self._free:
            return self._free.pop()
        if self._buffers_alive() < self._read_depth():
            return aligned_buffer(self._buffer_bytes(), self.settings.pin_memory)
        if self._writes:
            buf, fut = self._writes.popleft()
            self.swap.wait(fut)
            return buf
        t = next(reversed(self._prefetched))
        buf, fut = self._prefetched.pop(t)
        if fut is not None:
            with contextlib.suppress(Exception):
                fut.result()  # read again when its tile is ready
        return buf

    def _read_ahead(self, current: int) -> None:
        """Start reading the tiles expected next (``_next_to_read``: never ``current``, the tile being stepped) into
        the buffers that are free now."""
        assert self.swap is not None
        while self._writes and self._writes[0][1].done():
            buf, fut = self._writes.popleft()
            self.swap.wait(fut)
            self._free.append(buf)
        while self._free or self._buffers_alive() < self._read_depth():
            t = self._next_to_read(current)
            if t is None:
                return
            _, buf, fut = self._start_read(t, self._take_buffer())
            self._prefetched[t] = (buf, fut)

    def _next_to_read(self, current: int) -> int | None:
        """The first tile of the recorded order not stepped, not being stepped and not read ahead yet (None before the
        order is known, or without ``pipeline_read``)."""
        if self._ready_order is None or not self.settings.pipeline_read:
            return None
        return next((t for t in self._ready_order if t != current and t not in self._early_tiles and t not in self._prefetched), None)

    def _early_step_tile(self, t: int) -> None:
        assert self.swap is not None
        start = time.perf_counter()
        tile = self.tiles[t]
        entry = self._prefetched.pop(t, None)
        if entry is None:
            _, buf, fut = self._start_read(t, self._take_buffer())
        else:
            buf, fut = entry
        self._in_use = 1
        self._read_ahead(t)
        if fut is not None:
            self.swap.wait(fut)
        shards = {p.shard for p in tile.pieces}
        for i in sorted(shards - self._held.keys()):
            self._held[i] = contextlib.ExitStack()
            self._held[i].enter_context(self._resident([i], in_backward=True))
        self._step_tile(tile, buf, self._early_grads)
        write = self.swap.write(tile.name, buf[: tile.nbytes])
        following = self._next_to_read(t)
        if following is None:
            self._writes.append((buf, write))
        else:  # the buffer goes on to the next tile's read as soon as its write has landed, with no wait here
            _, _, read = self._start_read(following, buf, after=write)
            self._prefetched[following] = (buf, read)
            self._pending_writes.append(write)
        self._in_use = 0
        self._early_tiles.add(t)
        self._order_now.append(t)
        self.early_tiles += 1
        for i in sorted(shards):
            if all(u in self._early_tiles for u in self._tiles_of[i]):
                self._held.pop(i).close()
        self.early_step_seconds += time.perf_counter() - start

    def end_backward(self) -> None:
        """After a backward that stepped tiles: shards still resident are written back, the writes finish behind, and
        the first such backward fixes the order the tiles are read ahead in."""
        if not (self._early_grads or self._order_now or self._held or self._writes):
            return
        for stack in self._held.values():
            stack.close()
        self._held.clear()
        self._pending_writes.extend(fut for _, fut in self._writes)
        self._writes.clear()
        self._free.clear()
        self.early_steps["started_in_backward"] += len(self._order_now)
        self.early_steps["finished_in_backward"] += len(self._order_now)
        if self._ready_order is None:
            self._ready_order = self._order_now + [t for t in range(len(self.tiles)) if t not in self._order_now]
        self._order_now = []
        self._early_grads.clear()

    # -- checkpoints -----------------------------------------------------------------------------
    def _host_states(self) -> dict[int, dict[str, Any]]:
        """Every offloaded shard's states read back from its tiles (whole tensors in memory, for a checkpoint)."""
        assert self.swap is not None and self.host_opt is not None
        self._retire_writes()
        return read_states(self.swap, self.tiles, self.slots, self.masters_in_files, self.shards, self.host_opt.state)

    def _load_host(self, states: dict[int, dict[str, Any]]) -> None:
        assert self.swap is not None and self.host_opt is not None
        self._drop_prefetched()
        self._retire_writes()
        write_states(self.swap, self.tiles, self.slots, self.masters_in_files, self.shards, self.host_opt.state, states)

    # -- what tools read -------------------------------------------------------------------------
    def _extra_counters(self) -> dict[str, Any]:
        if self.swap is None:
            return {}
        return {
            "tiles": len(self.tiles),
            "prefetched_tiles": self.prefetched_tiles,
            "early_tiles": self.early_tiles,
            "masters_in_files": self.masters_in_files,
            "bytes_read": self.swap.bytes_read,
            "bytes_written": self.swap.bytes_written,
            "io_wait_seconds": self.swap.wait_seconds,
            "direct_io": self.swap.direct,
            "swap_dir": str(self.swap.root),
        }

    def swap_file_bytes(self) -> int:
        """Bytes of this rank's tile files on disk, once the writes behind the last step have landed (``offload_param``
        may keep its shard files in the same directory: those are not counted)."""
        if self.swap is None:
            return 0
        self._retire_writes()
        tiles = {tile.name for tile in self.tiles}
        return sum(size for name, size in self.swap.file_bytes().items() if name in tiles)

    def expected_swap_bytes(self) -> int:
        """What the swap files hold once every state exists: masters plus each element-wise state, segments padded to 4 KiB."""
        return sum(t.nbytes for t in self.tiles)


__all__ = ["NvmeOffloadedOptimizer"]
