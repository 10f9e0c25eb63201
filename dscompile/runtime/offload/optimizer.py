"""``OffloadedOptimizer``: ZeRO's sharded optimizer with its fp32 master shards and states on the host or NVMe.

The engine keeps stepping "the optimizer over this rank's shards" (``runtime/zero_extension.py``);
this class is that optimizer, so the engine, LR schedulers and checkpoints see the same
``param_groups`` (the shards) and the same ``state_dict`` layout as without offload. Inside:

- the first ``ratio`` of the shard elements (in parameter order; DeepSpeed's ``ratio``) are
  offloaded: a host optimizer of the user's class and hyper-parameters steps fp32 master copies of
  them, the rest is stepped in place on the device by a device optimizer of the same class;
- ``device: cpu``: masters and states stay in host memory (pinned when ``pin_memory`` and CUDA
  exists). Gradients are copied device→host into a host buffer, the host steps, parameters are copied
  back. Where the shard already lives in host memory as fp32 (a CPU-only run) it is its own master
  (the host optimizer steps an alias of its storage): nothing is copied. Masters are fp32 whatever the
  shard's dtype (DeepSpeed's fp32 master weights; dscompile's shards are fp32 already under
  ``bf16``/``fp16``, the graphs cast).

  The early host step (ZeRO-2/3): the ``offload_gradients`` pass (``passes/offload.py``) puts a
  ``dscompile::offload_gradient`` node in each backward graph right where a host-stepped shard's
  gradient is final (after its bucket's reduce-scatter wait, and after the graph's last read of the
  shard). When the engine's gate allows it (``OptimizerOffload.early_step_allowed``: the engine's
  backward of one forward, on the micro-step that ends a batch, no ``gradient_clipping``, no fp16 loss
  scaling or other overflow check, no extension acting on ready gradients), ``hand_off`` adds the
  accumulated ``.grad`` as AccumulateGrad would, copies the gradient to the host and submits that
  shard's host step to one worker thread (``host_threads``, else the cores torch's own threads leave
  free), so the host steps while backward computes the remaining gradients. ``step()`` waits for those
  steps, steps the rest and copies every separate master back to its shard (the device shard is not
  written during backward; an in-place shard is, which is why its hand-off waits for the graph's last
  read of it). Stepping a subset of the shards runs the same per-tensor arithmetic, so results are
  bitwise those of the step at ``step()`` (``tests/test_zero_offload_overlap.py``). How much overlaps
  depends on ZeRO's schedule: a gradient is final only when its bucket's reduce-scatter is waited for
  (with one bucket for the whole model, at the end of backward).

  Otherwise (the gate refuses, ZeRO-1, an uncompiled model), each shard's gradient is copied from its
  post-accumulate-grad hook (``copy_gradients_during_backward``) on the micro-step that ends a batch;
  under compiled graphs those hooks run once the backward graph has returned, so that copy does not
  overlap it. The step copies again only a gradient changed since (unscaled, clipped) or never copied
  (ZeRO-1 reduces at the step);
- ``device: nvme``: the offloaded elements are cut into tiles of ``sub_group_size`` elements; each tile
  is one file under ``nvme_path/rank_N`` holding every element-wise optimizer state of its pieces, and
  their fp32 masters where those are separate from the shards (an accelerator run, or ``separate_master``).
  Where the shard is itself an fp32 host tensor (a CPU-only run; with ``offload_param`` the shard made
  resident from its own swap file) it is its own master: a second copy on disk would only be read and
  written back each step, so the files hold the states alone. Tiles are cut at multiples of
  ``CUT_ELEMENTS`` within each shard, so a fused kernel (torch's fused CPU AdamW, which rounds by the
  position within a vector) steps every element as it would step the whole shard. The step reads tile t+1
  while stepping tile t and writes tile t back while stepping t+1 (``buffer_count`` tile buffers in flight).
  The first tiles are read ahead of the step, from the forward of the micro-step that ends a batch
  (``prefetch``), and the last writes finish behind it, during the next forward; a tile is never read
  before its write has finished. Between steps no buffer is kept: the states are on disk only. Scalar
  states (Adam's ``step``) stay in memory.

  The early NVMe step (ZeRO-2/3, the same pass and gate as the cpu one): ``hand_off`` records each shard's
  final gradient, and a tile is stepped, in the backward, on the main thread, as soon as every shard cut
  into it has one (``_hand_off_nvme``): its read was started ahead, its write is left in flight, and the
  next tiles are read into the buffers that free up, so the disk works while backward computes instead
  of during ``step()``, which only waits for the last writes and steps tiles left over (a shard with no
  gradient). The first early backward records the order the tiles became ready in; from then on the
  forward reads ahead the first tiles of that order and backward reads ahead along it. Still at most
  ``buffer_count`` tile buffers alive; with ``offload_param`` a shard stays resident until its last tile
  is stepped. Each element is stepped once, by the same fused kernel over the same tile cuts, with the same
  accumulated gradient: bitwise the step at ``step()``.

Swapping is lossless: the host step runs the same implementation as the un-offloaded step (the user's
``foreach``/``fused`` flags, or the fused kernel ZeRO picks when they are left open), so on a CPU-only machine
training with and without offload is bitwise equal (``tests/test_zero_offload.py``); an accelerator run
steps on the host instead of the device, equal to rounding. A shard changed outside the optimizer (a checkpoint load) is noticed
through its version counter and its master refreshed before the next step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dscompile.errors import DSCompileConfigError, DSCompileError
from dscompile.runtime.offload.swap import ALIGN, SwapDirectory, align_up, aligned_buffer

log = logging.getLogger("dscompile.offload")

CUT_ELEMENTS = 64
"""Tiles cut a shard only at multiples of this many elements from its start: wider than any CPU's vector of
fp32 (16 with AVX-512, 64 with 2048-bit SVE), so vectorized kernels see the same lanes as over the whole shard."""

IMPLEMENTATION_KEYS = frozenset({"foreach", "fused", "capturable", "differentiable"})
"""Group keys that pick an implementation, not a hyper-parameter: not copied onto the inner optimizers at each step."""


@dataclass
class OffloadSettings:
    """What the planner decided for the optimizer states (from ``zero_optimization.offload_optimizer``)."""

    device: str  # "cpu" or "nvme"
    nvme_path: str | None = None
    pin_memory: bool = False
    buffer_count: int = 4
    ratio: float = 1.0
    tile_elements: int = 1_000_000_000
    pipeline_read: bool = True
    pipeline_write: bool = True
    preallocate_states: bool = True  # False with fast_init: state segments are written at the first step
    block_size: int = 1 << 20
    io_threads: int = 1
    host_threads: int | None = None
    separate_master: bool = False  # cpu: a host master copy even where the shard is already on the host (what an accelerator run does)
    verify_reads: bool = False  # debug mode: CRC-32 of every swap file checked on read-back


@dataclass
class _Piece:
    """A contiguous run ``[start, stop)`` of one shard, stepped by the host optimizer as one tensor."""

    shard: int
    start: int
    stop: int
    group: int
    master: nn.Parameter
    initialized: bool = False  # its element-wise states exist in its tile's file
    inplace: bool = False  # cpu: the master is an alias of the shard's own storage (the shard is its own master)

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass
class _Tile:
    """One swap file: the masters of its pieces, then each state slot of each piece, every segment aligned."""

    name: str
    pieces: list[_Piece]
    offsets: list[list[int]] = field(default_factory=list)  # offsets[slot][j], slot 0 = master
    master_bytes: int = 0
    nbytes: int = 0


def _build_optimizer(cls: type[torch.optim.Optimizer], groups: list[dict[str, Any]], defaults: dict[str, Any]) -> torch.optim.Optimizer:
    try:
        return cls(groups)
    except TypeError:
        return cls(groups, lr=defaults.get("lr", 1e-3))


def _host_group(group: dict[str, Any]) -> dict[str, Any]:
    """The group for the host optimizer: the user's implementation flags (``fused=True`` is torch's fused CPU
    step, about 2x faster than the default loop on CPU but not bit-identical to it), never ``capturable``."""
    entry = {k: v for k, v in group.items() if k != "params"}
    entry.pop("capturable", None)
    return entry


def _state_slots(cls: type[torch.optim.Optimizer], group: dict[str, Any], dtype: torch.dtype) -> list[tuple[str, torch.dtype]]:
    """The element-wise state tensors ``cls`` keeps per parameter under ``group``'s settings (one probe step)."""
    probe = nn.Parameter(torch.zeros(3, dtype=dtype))
    entry = {k: v for k, v in group.items() if k not in ("params", "fused", "foreach", "capturable")}
    opt = _build_optimizer(cls, [{**entry, "params": [probe]}], entry)
    probe.grad = torch.zeros_like(probe)
    opt.step()
    return [(k, v.dtype) for k, v in opt.state[probe].items() if isinstance(v, torch.Tensor) and v.shape == probe.shape]


class OffloadedOptimizer(torch.optim.Optimizer):
    """The sharded optimizer with its offloaded part stepped on the host (see the module docstring)."""

    def __init__(
        self,
        sharded: torch.optim.Optimizer,
        shards: list[nn.Parameter],
        settings: OffloadSettings,
        rank: int = 0,
        chosen: list[nn.Parameter] | None = None,
    ) -> None:
        if sharded.state:
            raise DSCompileConfigError("optimizer", "already holds state; offload must take it over before the first step", "build the engine before training")
        self.cls = type(sharded)
        self.settings = settings
        groups = [dict(g) for g in sharded.param_groups]
        super().__init__(groups, dict(sharded.defaults))
        self.shards: list[nn.Parameter] = [p for g in self.param_groups for p in g["params"]]
        index = {id(p): i for i, p in enumerate(self.shards)}
        group_of = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        known = {id(s) for s in shards}
        if any(id(p) not in known for p in self.shards):
            raise DSCompileConfigError("zero_optimization.offload_optimizer", "the optimizer steps tensors that are not ZeRO shards")
        # Which shards are offloaded: the planner's choice, else the first `ratio` of the elements in parameter order.
        total = sum(p.numel() for p in self.shards)
        budget, taken = settings.ratio * total, 0
        picked = {id(p) for p in chosen} if chosen is not None else None
        self.offloaded: list[int] = []
        self.on_device: list[int] = []
        for i, p in enumerate(self.shards):
            if (id(p) in picked) if picked is not None else (taken + p.numel() <= budget + 1e-9 or settings.ratio >= 1.0):
                self.offloaded.append(i)
                taken += p.numel()
            else:
                self.on_device.append(i)
        self.offloaded_elements = taken
        self.device_opt: torch.optim.Optimizer | None = None
        if self.on_device:
            device_groups = [
                {**{k: v for k, v in g.items() if k != "params"}, "params": [p for p in g["params"] if index[id(p)] in set(self.on_device)]}
                for g in self.param_groups
            ]
            self.device_opt = _build_optimizer(self.cls, device_groups, self.defaults)
        self.pieces: list[_Piece] = []
        self.tiles: list[_Tile] = []
        self.swap: SwapDirectory | None = None
        self.host_opt: torch.optim.Optimizer | None = None
        self._versions: dict[int, int] = {}
        self.host_step_seconds = 0.0
        self._copied: dict[int, tuple[torch.Tensor, int]] = {}
        """Shard index -> (the gradient copied to the host during backward, its version then)."""
        self.gradient_copies = {"during_backward": 0, "at_step": 0}
        self.masters_in_files = True  # nvme: False where each shard is its own fp32 master (the files hold states only)
        self._prefetched: dict[int, tuple[torch.Tensor, Future[None] | None]] = {}
        """Tiles read ahead of the step (``prefetch``, and the early NVMe step's read-ahead): tile index -> (its buffer, the read)."""
        self._pending_writes: list[Future[None]] = []
        """The last tiles' writes, finishing behind the step (each holds its buffer until done)."""
        self.prefetched_tiles = 0
        self._copy_hooks: list[Any] = []
        # The early host step (cpu): shard index -> its step, submitted from the backward graph (``hand_off``).
        self.early_gate: Callable[[], bool] | None = None
        """Set by the engine: true while a backward runs whose gradients are final as the graph produces them."""
        self._early: dict[int, Future[None]] = {}
        self._early_started: set[int] = set()
        self._early_lock = threading.Lock()
        self._worker: ThreadPoolExecutor | None = None
        self._piece_of: dict[int, _Piece] = {}
        self._sink_index: dict[int, int] = {}
        self.early_steps = {"submitted": 0, "started_in_backward": 0, "finished_in_backward": 0}
        self.early_step_seconds = 0.0
        # The early NVMe step: tiles stepped from the backward graph on the main thread, as their shards' gradients
        # become final (``_hand_off_nvme``); the tile I/O stays asynchronous, so it overlaps the rest of backward.
        self._tiles_of: dict[int, list[int]] = {}
        """Shard index -> the tiles holding a piece of it (nvme)."""
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
        # offload_param: a context manager making the given shards' values resident (their storage is released
        # between uses); the step holds only the shards of the tile it steps.
        self.residency: Any = None
        if not self.offloaded:
            return
        if settings.device == "cpu":
            self._init_cpu(group_of)
        else:
            self._init_nvme(group_of, rank)
        host_groups = [{**_host_group(g), "params": []} for g in self.param_groups]
        for piece in self.pieces:
            host_groups[piece.group]["params"].append(piece.master)
        self.host_opt = _build_optimizer(self.cls, [g for g in host_groups], self.defaults) if self.pieces else None
        self._host_group_params = [list(g["params"]) for g in self.host_opt.param_groups] if self.host_opt else []
        for i in self.offloaded:
            self._versions[i] = self.shards[i]._version
        self._publish_states()
        if self.host_opt is not None:
            if self.swap is None:
                self._piece_of = {piece.shard: piece for piece in self.pieces}
            else:
                for t, tile in enumerate(self.tiles):
                    for piece in tile.pieces:
                        if t not in self._tiles_of.setdefault(piece.shard, []):
                            self._tiles_of[piece.shard].append(t)
            self._sink_index = {id(self.shards[i]): i for i in (self._piece_of if self.swap is None else self._tiles_of)}
            self.sink = next(_SINK_KEYS)
            _SINKS[self.sink] = self

    def steps_in_place(self, i: int) -> bool:
        """Whether an early step of shard ``i`` changes the shard itself (then the backward graph must have read it
        for the last time before the hand-off). NVMe always does: in place, or its master copied back into it."""
        return self.swap is not None or self._piece_of[i].inplace

    def copy_gradients_during_backward(self, when: Any) -> None:
        """Copy each host-mastered shard's gradient to the host from its post-accumulate-grad hook whenever ``when()``
        is true then (the engine passes "this backward ends a batch": earlier micro-steps' gradients still change)."""
        for i in getattr(self, "_host_grads", {}):
            shard = self.shards[i]
            self._copy_hooks.append(shard.register_post_accumulate_grad_hook(lambda p, i=i: self._copy_gradient(i, p) if when() else None))

    def detach_gradient_copies(self) -> None:
        for handle in self._copy_hooks:
            handle.remove()
        self._copy_hooks.clear()

    @torch.no_grad()
    def _copy_gradient(self, i: int, shard: torch.Tensor) -> None:
        grad = shard.grad
        if grad is None or i in self._early:  # stepped from the graph already
            return
        host = self._host_grads[i]
        host.copy_(grad.detach(), non_blocking=host.is_pinned())
        self._copied[i] = (grad, grad._version)  # the reference keeps the tensor (and so its identity) until the step
        self.gradient_copies["during_backward"] += 1

    def _publish_states(self) -> None:
        """``self.state``: the states held in memory, by shard (device ones; host ones for cpu offload), for memory accounting."""
        self.state.clear()
        if self.device_opt is not None:
            for i in self.on_device:
                if self.shards[i] in self.device_opt.state:
                    self.state[self.shards[i]] = self.device_opt.state[self.shards[i]]
        if self.host_opt is not None and self.swap is None:
            for piece in self.pieces:
                if piece.master in self.host_opt.state:
                    self.state[self.shards[piece.shard]] = self.host_opt.state[piece.master]

    # -- construction ----------------------------------------------------------------------------
    def _own_master(self, shard: torch.Tensor) -> bool:
        """The shard is an fp32 host tensor (the host is the device), so it serves as its own master: no copy to keep."""
        return shard.device.type == "cpu" and shard.dtype == torch.float32 and not self.settings.separate_master

    def _init_cpu(self, group_of: dict[int, int]) -> None:
        pin = self.settings.pin_memory and torch.cuda.is_available()
        self._host_grads: dict[int, torch.Tensor] = {}
        for i in self.offloaded:
            shard = self.shards[i]
            inplace = self._own_master(shard)
            if inplace:
                # the host is the device and the shard is fp32: it is its own master. The host optimizer steps an alias
                # (same storage and version counter) whose .grad is its own, so a step may run while autograd sets the shard's.
                master = nn.Parameter(shard.detach())
            else:
                master = nn.Parameter(torch.empty(shard.shape, dtype=torch.float32, pin_memory=pin))
                with torch.no_grad():
                    master.copy_(shard.detach())
                self._host_grads[i] = torch.empty(shard.shape, dtype=torch.float32, pin_memory=pin)  # reused every step
            self.pieces.append(_Piece(i, 0, shard.numel(), group_of[id(shard)], master, initialized=True, inplace=inplace))

    def _init_nvme(self, group_of: dict[int, int], rank: int) -> None:
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
        tile_elements = max(CUT_ELEMENTS, int(s.tile_elements))
        current: list[_Piece] = []
        filled = 0
        for i in self.offloaded:
            shard = self.shards[i]
            start = 0
            while start < shard.numel():
                room = tile_elements - filled
                stop = shard.numel() if shard.numel() - start <= room else start + room // CUT_ELEMENTS * CUT_ELEMENTS
                if stop == start:  # too little room left for an aligned cut: the piece starts the next tile
                    self.tiles.append(_Tile(f"tile_{len(self.tiles):05d}.swp", current))
                    current, filled = [], 0
                    continue
                current.append(_Piece(i, start, stop, group_of[id(shard)], nn.Parameter(torch.empty(0, dtype=torch.float32))))
                filled += stop - start
                start = stop
                if filled >= tile_elements:
                    self.tiles.append(_Tile(f"tile_{len(self.tiles):05d}.swp", current))
                    current, filled = [], 0
        if current:
            self.tiles.append(_Tile(f"tile_{len(self.tiles):05d}.swp", current))
        self.pieces = [p for t in self.tiles for p in t.pieces]
        self.slots = [_state_slots(self.cls, g, torch.float32) for g in self.param_groups]
        for tile in self.tiles:
            self._lay_out(tile)
        for tile in self.tiles:  # write the masters now (and zeroed states: a full disk shows here, not mid-training)
            buf = aligned_buffer(tile.nbytes if s.preallocate_states else tile.master_bytes)
            if not buf.numel():
                continue  # fast_init and no masters in the files: each file is written at the first step
            buf.zero_()
            for j, piece in enumerate(tile.pieces):
                if self.masters_in_files:
                    self._segment(buf, tile, 0, j, torch.float32).copy_(self.shards[piece.shard].detach().reshape(-1)[piece.start : piece.stop])
            self.swap.wait(self.swap.write(tile.name, buf))

    @property
    def _first_state_slot(self) -> int:
        """Slot 0 of a tile holds the masters when they are in the files; the element-wise states follow."""
        return 1 if self.masters_in_files else 0

    def _lay_out(self, tile: _Tile) -> None:
        slot_count = self._first_state_slot + max((len(self.slots[p.group]) for p in tile.pieces), default=0)
        offset = 0
        tile.offsets = []
        for slot in range(slot_count):
            row = []
            for piece in tile.pieces:
                row.append(offset)
                offset += align_up(piece.numel * 4)
            tile.offsets.append(row)
            if slot == 0 and self.masters_in_files:
                tile.master_bytes = offset
        tile.nbytes = offset

    def _state_segments(self, piece: _Piece) -> Iterator[tuple[int, str, torch.dtype]]:
        """(slot, state name, dtype) of each element-wise state of ``piece`` in its tile."""
        for k, (name, dtype) in enumerate(self.slots[piece.group], start=self._first_state_slot):
            yield k, name, dtype

    @staticmethod
    def _segment(buf: torch.Tensor, tile: _Tile, slot: int, j: int, dtype: torch.dtype) -> torch.Tensor:
        start = tile.offsets[slot][j]
        numel = tile.pieces[j].numel
        return buf[start : start + numel * torch.empty((), dtype=dtype).element_size()].view(dtype)

    # -- the step --------------------------------------------------------------------------------
    def _sync_hyperparameters(self, inner: torch.optim.Optimizer) -> None:
        for outer, group in zip(self.param_groups, inner.param_groups, strict=True):
            for key, value in outer.items():
                if key != "params" and key not in IMPLEMENTATION_KEYS:
                    group[key] = value

    @contextlib.contextmanager
    def _host_threads(self) -> Iterator[None]:
        wanted = self.settings.host_threads
        if wanted is None:
            yield
            return
        before = torch.get_num_threads()
        torch.set_num_threads(wanted)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.device_opt is not None:
            self._sync_hyperparameters(self.device_opt)
            with self._resident(self.on_device):
                self.device_opt.step()
        if self.host_opt is not None:
            early = self._finish_early()
            self._sync_hyperparameters(self.host_opt)
            start = time.perf_counter()
            with self._host_threads():
                if self.swap is None:
                    self._step_cpu(early)
                else:
                    self._step_nvme()
            self.host_step_seconds += time.perf_counter() - start
            for i in self.offloaded:
                self._versions[i] = self.shards[i]._version
        self._publish_states()
        return loss

    def _resident(self, shards: list[int], in_backward: bool = False) -> contextlib.AbstractContextManager[None]:
        if self.residency is None:
            return contextlib.nullcontext()
        return self.residency(shards, in_backward=True) if in_backward else self.residency(shards)

    def _stale(self, piece: _Piece) -> bool:
        return self.shards[piece.shard]._version != self._versions[piece.shard]

    def _step_cpu(self, early: set[int]) -> None:
        """Step every piece not stepped early from the backward graph; copy every separate master back to its shard."""
        assert self.host_opt is not None
        copies = []
        for piece in self.pieces:
            shard = self.shards[piece.shard]
            if piece.inplace:
                self._rebind(piece)
                piece.master.grad = None if piece.shard in early or shard.grad is None else shard.grad.detach()
                continue
            if piece.shard in early:  # stepped on the host during backward: only the copy back is left
                piece.master.grad = None
                copies.append(piece)
                continue
            if self._stale(piece):
                with self._resident([piece.shard]):
                    piece.master.copy_(shard.detach())
            copied = self._copied.get(piece.shard)
            if shard.grad is None:
                piece.master.grad = None
            elif copied is not None and copied[0] is shard.grad and copied[1] == shard.grad._version:
                piece.master.grad = self._host_grads[piece.shard]  # copied during backward and unchanged since
            else:
                host_grad = self._host_grads[piece.shard]
                host_grad.copy_(shard.grad.detach(), non_blocking=host_grad.is_pinned())
                piece.master.grad = host_grad
                self.gradient_copies["at_step"] += 1
            copies.append(piece)
        self._copied.clear()
        if copies and torch.cuda.is_available():
            torch.cuda.synchronize()
        self.host_opt.step()  # pieces whose master has no gradient (stepped early, or unused) are skipped
        for piece in copies:
            with self._resident([piece.shard]):
                self.shards[piece.shard].copy_(piece.master, non_blocking=piece.master.is_pinned())
            piece.master.grad = None
        for piece in self.pieces:
            piece.master.grad = None
        if copies and torch.cuda.is_available():
            torch.cuda.synchronize()

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
        so the reads overlap its forward and backward). A no-op without NVMe, or when they are already in flight."""
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

    def _rebind(self, piece: _Piece) -> None:
        """An in-place master follows its shard if the shard's storage was replaced (its states move with it)."""
        shard = self.shards[piece.shard]
        if piece.master.data_ptr() == shard.data_ptr() and piece.master.shape == shard.shape:
            return
        assert self.host_opt is not None
        alias = nn.Parameter(shard.detach())
        state = self.host_opt.state.pop(piece.master, None)
        if state is not None:
            self.host_opt.state[alias] = state
        for group in self.host_opt.param_groups:
            group["params"] = [alias if p is piece.master else p for p in group["params"]]
        self._host_group_params = [[alias if p is piece.master else p for p in params] for params in self._host_group_params]
        piece.master = alias

    # -- the early host step (cpu): started from the backward graph --------------------------------
    @torch.no_grad()
    def hand_off(self, i: int, grad: torch.Tensor) -> None:
        """Called by ``dscompile::offload_gradient`` in the backward graph once shard ``i``'s gradient is final.

        When the engine's gate allows (a batch-ending backward whose gradients nothing global changes before the
        step: no clipping, no loss scaling), the gradient is added to an accumulated ``.grad`` exactly as
        AccumulateGrad does, copied to the host (referenced where it is already a host fp32 tensor), and the
        shard's host step is submitted to the worker thread; backward continues meanwhile. Else nothing happens
        and the shard is stepped at ``step()`` as without the graph hook."""
        if self.early_gate is None or self.host_opt is None or not self.early_gate():
            return
        if self.swap is not None:
            self._hand_off_nvme(i, grad)
            return
        piece = self._piece_of.get(i)
        if piece is None or grad.shape != self.shards[i].shape:
            return  # not one of this optimizer's host-stepped shards: stepped at step()
        if i in self._early:
            raise DSCompileError(
                f"offload_optimizer: shard {i}'s gradient was handed to the host step twice before step(); call engine.step() after each batch's backward"
            )
        shard = self.shards[i]
        if not self._early:  # the first of this backward: the hyper-parameters the step would use
            self._sync_hyperparameters(self.host_opt)
        if grad.dtype != shard.dtype:
            grad = grad.to(shard.dtype)  # what autograd does to a gradient of another dtype than its leaf
        if shard.grad is not None:  # earlier micro-steps' gradient: AccumulateGrad adds this one to it
            grad = shard.grad + grad
        event = None
        if piece.inplace:
            self._rebind(piece)
            # an alias, not the graph's tensor: AccumulateGrad then takes that tensor as .grad instead of cloning it
            # (it clones a gradient referenced elsewhere); nothing writes it before step() has waited for the worker
            host = grad.detach()
        else:
            if self._stale(piece):
                with self._resident([i]):
                    piece.master.copy_(shard.detach())
                self._versions[i] = shard._version
            host = self._host_grads[i]  # the device->host copy (the path an accelerator takes, also when the host is the device)
            host.copy_(grad, non_blocking=host.is_pinned())
            if host.is_pinned() and torch.cuda.is_available():
                event = torch.cuda.Event()  # the worker steps once the copy has landed
                event.record()
            self.gradient_copies["during_backward"] += 1
        threads = self.settings.host_threads or max(1, (os.cpu_count() or 1) - torch.get_num_threads())
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dscompile-host-step")
        self._early[i] = self._worker.submit(self._early_step, piece, host, event, threads)
        self.early_steps["submitted"] += 1

    def _early_step(self, piece: _Piece, grad: torch.Tensor, event: Any, threads: int) -> None:
        """On the worker thread: step one piece's master (the shard itself when in place) with ``grad``."""
        assert self.host_opt is not None
        if event is not None:
            event.synchronize()
        with self._early_lock:
            self._early_started.add(piece.shard)
        start = time.perf_counter()
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)  # this thread's own pool: the backward keeps its threads
        groups = self.host_opt.param_groups
        saved = [g["params"] for g in groups]
        piece.master.grad = grad
        try:
            for g, group in enumerate(groups):
                group["params"] = [piece.master] if g == piece.group else []
            self.host_opt.step()
        finally:
            for group, params in zip(groups, saved, strict=True):
                group["params"] = params
            piece.master.grad = None
        self.early_step_seconds += time.perf_counter() - start

    def end_backward(self) -> None:
        """After a backward: count the submitted steps that started (and finished) before it returned."""
        if self.swap is not None:
            if self._early_grads or self._order_now or self._held or self._writes:
                self._end_early_nvme()
            return
        if not self._early:
            return
        with self._early_lock:
            started = len(self._early_started)
        self.early_steps["started_in_backward"] += started
        self.early_steps["finished_in_backward"] += sum(f.done() for f in self._early.values())

    def _wait_early(self) -> None:
        """Wait for the steps submitted during backward, re-raising a failure (they stay recorded until ``step()``)."""
        for future in list(self._early.values()):
            future.result()

    def _finish_early(self) -> set[int]:
        """Wait for the steps submitted during backward (re-raising a failure); the shard indices they stepped."""
        done = set(self._early)
        futures = list(self._early.values())
        self._early.clear()
        with self._early_lock:
            self._early_started.clear()
        for future in futures:
            future.result()
        return done

    def close(self) -> None:
        """Wait for submitted steps and stop the worker thread."""
        for future in self._early.values():
            with contextlib.suppress(Exception):
                future.result()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        _SINKS.pop(getattr(self, "sink", -1), None)

    def _step_nvme(self) -> None:
        """Tile by tile: read ahead, step, write behind, with at most ``buffer_count`` tile buffers alive. Tiles already
        stepped from this batch's backward (``_hand_off_nvme``) are skipped; the tiles read ahead go first."""
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

    # -- the early NVMe step: tiles stepped from the backward graph ---------------------------------
    @torch.no_grad()
    def _hand_off_nvme(self, i: int, grad: torch.Tensor) -> None:
        """Shard ``i``'s final gradient (``hand_off``): every tile whose shards all have theirs now is stepped here,
        on the main thread, in the backward: its read was started ahead (in the order the first early backward
        stepped the tiles), its write is left in flight, so the disk works while backward computes. The gate is
        ``hand_off``'s; what the step at ``step()`` would do, bit for bit (each element is stepped once, by the same
        fused kernel over the same tile cuts, with the same accumulated gradient)."""
        tiles = self._tiles_of.get(i)
        shard = self.shards[i]
        if tiles is None or grad.shape != shard.shape:
            return
        if i in self._early_grads:
            raise DSCompileError(
                f"offload_optimizer: shard {i}'s gradient was handed to the host step twice before step(); call engine.step() after each batch's backward"
            )
        assert self.host_opt is not None and self.swap is not None
        if not self._early_grads and not self._early_tiles:  # the first of this backward
            self._sync_hyperparameters(self.host_opt)
            self._retire_writes()
            self._waiting = {t: {p.shard for p in tile.pieces} for t, tile in enumerate(self.tiles)}
            self._order_now = []
        if grad.dtype != shard.dtype:
            grad = grad.to(shard.dtype)  # what autograd does to a gradient of another dtype than its leaf
        if shard.grad is not None:  # earlier micro-steps' gradient: AccumulateGrad adds this one to it
            grad = shard.grad + grad
        self._early_grads[i] = grad.detach()
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

    def _end_early_nvme(self) -> None:
        """After a backward that stepped tiles: shards still resident are written back, the writes finish behind, and
        the first such backward fixes the order the tiles are read ahead in."""
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

    def _step_tile(self, tile: _Tile, buf: torch.Tensor, grads: dict[int, torch.Tensor] | None = None) -> None:
        """Step ``tile``'s pieces from ``buf`` (its states, and masters where the files hold them) with each shard's
        ``.grad``, or with ``grads[shard]`` (the early step: handed off before AccumulateGrad set ``.grad``)."""
        assert self.host_opt is not None
        for j, piece in enumerate(tile.pieces):
            shard = self.shards[piece.shard]
            own = shard.detach().reshape(-1)[piece.start : piece.stop]
            if self.masters_in_files:
                master = self._segment(buf, tile, 0, j, torch.float32)
                if self._stale(piece):
                    master.copy_(own)
            else:
                master = own  # the shard is its own fp32 master: stepped in place
            piece.master.data = master
            state = self.host_opt.state[piece.master]
            if piece.initialized:
                for k, name, dtype in self._state_segments(piece):
                    state[name] = self._segment(buf, tile, k, j, dtype)
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
                    self._segment(buf, tile, k, j, dtype).copy_(state[name])  # states created at this first step
                piece.initialized = True
            if piece.master.grad is not None and self.masters_in_files:
                self.shards[piece.shard].reshape(-1)[piece.start : piece.stop].copy_(piece.master)
            self._unbind(piece)  # no view of the tile buffer or of a shard made resident for this tile outlives it

    def _unbind(self, piece: _Piece) -> None:
        """Drop the views into a tile buffer: between steps only scalar states stay in memory."""
        assert self.host_opt is not None
        piece.master.data = torch.empty(0, dtype=torch.float32)
        piece.master.grad = None
        state = self.host_opt.state.get(piece.master)
        if state:
            for name, _ in self.slots[piece.group]:
                state.pop(name, None)

    # -- checkpoints -----------------------------------------------------------------------------
    def _nvme_states(self) -> dict[int, dict[str, Any]]:
        """Every offloaded shard's states read back from its tiles (whole tensors in memory, for a checkpoint)."""
        assert self.swap is not None and self.host_opt is not None
        self._retire_writes()
        parts: dict[int, dict[str, list[torch.Tensor]]] = {}
        scalars: dict[int, dict[str, Any]] = {}
        complete: dict[int, bool] = {}
        for tile in self.tiles:
            if not any(p.initialized for p in tile.pieces):
                for p in tile.pieces:
                    complete[p.shard] = False
                continue
            buf = aligned_buffer(tile.nbytes)
            self.swap.wait(self.swap.read(tile.name, buf))
            for j, piece in enumerate(tile.pieces):
                complete[piece.shard] = complete.get(piece.shard, True) and piece.initialized
                if not piece.initialized:
                    continue
                for k, name, dtype in self._state_segments(piece):
                    parts.setdefault(piece.shard, {}).setdefault(name, []).append(self._segment(buf, tile, k, j, dtype).clone())
                state = self.host_opt.state.get(piece.master, {})
                scalars.setdefault(piece.shard, {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()})
        out: dict[int, dict[str, Any]] = {}
        for i, ok in complete.items():
            if ok and i in parts:
                shape = self.shards[i].shape
                out[i] = {**scalars.get(i, {}), **{name: torch.cat(chunks).view(shape) for name, chunks in parts[i].items()}}
        return out

    def _shard_states(self) -> dict[int, dict[str, Any]]:
        states: dict[int, dict[str, Any]] = {}
        if self.device_opt is not None:
            for i in self.on_device:
                entry = self.device_opt.state.get(self.shards[i])
                if entry:
                    states[i] = dict(entry)
        if self.swap is not None:
            states.update(self._nvme_states())
        elif self.host_opt is not None:
            for piece in self.pieces:
                entry = self.host_opt.state.get(piece.master)
                if entry:
                    states[piece.shard] = dict(entry)
        return states

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The same layout as the un-offloaded sharded optimizer's ``state_dict`` (states read back from NVMe)."""
        self._wait_early()  # read between backward and step(): the states of the shards stepped early, not half-written
        index = {id(p): i for i, p in enumerate(self.shards)}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(p)] for p in g["params"]]} for g in self.param_groups]
        return {"state": self._shard_states(), "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        self._finish_early()  # a load replaces what steps started during backward would write
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
            len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, self.param_groups, strict=False)
        ):
            raise ValueError("loaded optimizer state_dict has groups of other sizes than this optimizer's")
        for group, saved in zip(self.param_groups, saved_groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        states = {int(k): v for k, v in state_dict["state"].items()}
        if self.device_opt is not None:
            for i in self.on_device:
                shard = self.shards[i]
                self.device_opt.state.pop(shard, None)
                if i in states:
                    self.device_opt.state[shard] = {
                        k: v.to(shard.device).clone() if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in states[i].items()
                    }
        if self.host_opt is None:
            self._publish_states()
            return
        if self.swap is None:
            for piece in self.pieces:
                entry = self.host_opt.state[piece.master]
                entry.clear()
                entry.update({k: v.to("cpu").clone() if isinstance(v, torch.Tensor) else v for k, v in states.get(piece.shard, {}).items()})
                if not piece.inplace:
                    piece.master.copy_(self.shards[piece.shard].detach())
        else:
            self._load_nvme(states)
        for i in self.offloaded:
            self._versions[i] = self.shards[i]._version
        self._publish_states()

    def _load_nvme(self, states: dict[int, dict[str, Any]]) -> None:
        assert self.swap is not None and self.host_opt is not None
        self._drop_prefetched()
        self._retire_writes()
        for tile in self.tiles:
            buf = aligned_buffer(tile.nbytes)
            buf.zero_()
            for j, piece in enumerate(tile.pieces):
                shard = self.shards[piece.shard]
                if self.masters_in_files:
                    self._segment(buf, tile, 0, j, torch.float32).copy_(shard.detach().reshape(-1)[piece.start : piece.stop])
                entry = states.get(piece.shard)
                state = self.host_opt.state[piece.master]
                state.clear()
                piece.initialized = bool(entry)
                if not entry:
                    continue
                slots = dict(self.slots[piece.group])
                for k, name, dtype in self._state_segments(piece):
                    self._segment(buf, tile, k, j, dtype).copy_(entry[name].reshape(-1)[piece.start : piece.stop])
                state.update({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in entry.items() if k not in slots})
            self.swap.wait(self.swap.write(tile.name, buf))

    # -- what tools read -------------------------------------------------------------------------
    def counters(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "device": self.settings.device,
            "offloaded_elements": self.offloaded_elements,
            "device_elements": sum(self.shards[i].numel() for i in self.on_device),
            "host_step_seconds": self.host_step_seconds,
            "gradient_copies": dict(self.gradient_copies),
            "early_host_steps": dict(self.early_steps),
            "early_host_step_seconds": self.early_step_seconds,
        }
        if self.swap is not None:
            out.update(
                tiles=len(self.tiles),
                prefetched_tiles=self.prefetched_tiles,
                early_tiles=self.early_tiles,
                masters_in_files=self.masters_in_files,
                bytes_read=self.swap.bytes_read,
                bytes_written=self.swap.bytes_written,
                io_wait_seconds=self.swap.wait_seconds,
                direct_io=self.swap.direct,
                swap_dir=str(self.swap.root),
            )
        return out

    def swap_file_bytes(self) -> int:
        """Bytes of this rank's tile files on disk (0 without NVMe), once the writes behind the last step have landed
        (``offload_param`` may keep its shard files in the same directory: those are not counted)."""
        if self.swap is None:
            return 0
        self._retire_writes()
        tiles = {tile.name for tile in self.tiles}
        return sum(size for name, size in self.swap.file_bytes().items() if name in tiles)

    def expected_swap_bytes(self) -> int:
        """What the swap files hold once every state exists: masters plus each element-wise state, segments padded to 4 KiB."""
        return sum(t.nbytes for t in self.tiles)


_SINKS: weakref.WeakValueDictionary[int, OffloadedOptimizer] = weakref.WeakValueDictionary()
"""Live cpu-offloaded optimizers by key: where ``dscompile::offload_gradient`` hands gradients."""
_SINK_KEYS = iter(range(1, 1 << 62))


def gradient_sink_of(tensor: Any) -> tuple[int, int, bool] | None:
    """(optimizer key, shard index, stepped in place) of a host-stepped shard of a live offloaded optimizer; None otherwise."""
    if not isinstance(tensor, torch.Tensor):
        return None
    for key, opt in list(_SINKS.items()):
        i = opt._sink_index.get(id(tensor))
        if i is not None and opt.shards[i] is tensor:
            return key, i, opt.steps_in_place(i)
    return None


@torch.library.custom_op("dscompile::offload_gradient", mutates_args=())
def offload_gradient(grad: torch.Tensor, after: list[torch.Tensor], shard: int) -> None:
    """Shard ``shard``'s final gradient of this backward, handed to the offloaded optimizer whose engine runs this
    backward (``hand_off``; every other one's gate is closed).

    The optimizer is found when the graph runs, not named in it: Dynamo may reuse a compiled graph for another
    engine over a model of the same structure (the same shard order). ``after``: values whose computation last
    reads the shard in this graph; they are inputs only so that every lowering runs this op after them (the early
    step may update an in-place shard)."""
    for opt in list(_SINKS.values()):
        if opt.early_gate is not None and opt.early_gate():
            opt.hand_off(shard, grad)
            return


@offload_gradient.register_fake
def _offload_gradient_fake(grad: torch.Tensor, after: list[torch.Tensor], shard: int) -> None:
    return None


torch.fx.node.has_side_effect(torch.ops.dscompile.offload_gradient.default)  # kept by DCE and by Inductor
OFFLOAD_GRADIENT = torch.ops.dscompile.offload_gradient.default


def state_bytes_per_element(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of element-wise optimizer state per fp32 parameter element (8 for Adam), from one probe step."""
    group = optimizer.param_groups[0] if optimizer.param_groups else dict(optimizer.defaults)
    return sum(torch.empty((), dtype=dtype).element_size() for _, dtype in _state_slots(type(optimizer), group, torch.float32))


def host_threads_from_fraction(fraction: float | None) -> int | None:
    """``cpuadam_cores_perc`` as a thread count for the host step (None: leave torch's setting)."""
    if fraction is None:
        return None
    return max(1, int(round(fraction * (os.cpu_count() or 1))))


__all__ = ["ALIGN", "OFFLOAD_GRADIENT", "OffloadSettings", "OffloadedOptimizer", "gradient_sink_of", "host_threads_from_fraction", "state_bytes_per_element"]
