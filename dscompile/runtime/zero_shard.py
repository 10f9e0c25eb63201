"""Sharded parameters for ZeRO: flat, padded per-parameter shards and the module that uses them.

Every parameter is flattened and padded to a multiple of the world size, so rank ``r`` owns
elements ``[r*L, (r+1)*L)`` (``L = ceil(numel / N)``). The optimizer always steps these shards
(ZeRO-1: partitioned optimizer states). ``ZeroModule`` runs the wrapped model with
``torch.func.functional_call`` on tensors produced by the ops of ``zero_ops``: gathered shards
(ZeRO-3) or the kept full copy whose gradient is reduce-scattered into the shard (ZeRO-2 and
persistent ZeRO-3 parameters). ZeRO-1 keeps the model as it is and reduce-scatters the full
gradients at the accumulation boundary (``ZeroPartition.reduce_gradients``).

``shard_model(model, stage=3)`` is the torch-native entry: compile the result and give a plain
``torch.optim`` optimizer its ``parameters()`` (the shards).
"""

from __future__ import annotations

import collections
import contextlib
import enum
import functools
import itertools
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dscompile.errors import DSCompileConfigError, DSCompileError
from dscompile.runtime import zero_ops
from dscompile.runtime.devices import collective_device
from dscompile.runtime.zero_leaf import leaf_of_parameters
from dscompile.runtime.zero_ops import GLOO_BROADCASTS_ABOVE, broadcast_gather_async, moves_like_gloo
from dscompile.runtime.zero_recompute import bind_recompute_to_forward_tensors

log = logging.getLogger("dscompile.zero")

OUT_OF_GRAPH_BUCKET_CAP = 64 << 20
"""Largest flat buffer (bytes) the eager gather/reduce of ZeRO-1/2 builds at once, and the most such buffers'
bytes in flight at once."""

CPU_ALONE_ABOVE = 1 << 16
"""Elements above which a collective on CPU tensors is not bucketed (its copies would cost more than its latency):
the graph passes' rule (``passes/zero_bucketing.py``) and the out-of-graph collectives' alike."""


@dataclass
class ParamLayout:
    """Where one (deduplicated) parameter lives: its full shape and its shard."""

    name: str
    shape: tuple[int, ...]
    numel: int
    shard_numel: int
    persistent: bool
    aliases: list[str] = field(default_factory=list)
    leaf: str = ""  # the ZeRO-3 leaf module it belongs to (``runtime/zero_leaf.py``): gathered with that module's others

    @property
    def padded_numel(self) -> int:
        return self.shard_numel

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "numel": self.numel,
            "shard_numel": self.shard_numel,
            "persistent": self.persistent,
            "aliases": list(self.aliases),
            "leaf": self.leaf,
        }


class _InFlight:
    """Asynchronous collectives outside the graphs, finished in issue order: each one's copy-out runs while the
    later ones are still moving, and the flat buffers in flight stay under ``OUT_OF_GRAPH_BUCKET_CAP`` bytes."""

    def __init__(self) -> None:
        self._queue: collections.deque[tuple[Any, int, Callable[[], None] | None, tuple[torch.Tensor, ...]]] = collections.deque()
        self._bytes = 0

    def add(self, work: Any, nbytes: int = 0, then: Callable[[], None] | None = None, keep: tuple[torch.Tensor, ...] = ()) -> None:
        """``keep``: tensors the collective reads, held here until it has finished (a freed input could be reused under it)."""
        self._queue.append((work, nbytes, then, keep))
        self._bytes += nbytes
        while self._bytes > OUT_OF_GRAPH_BUCKET_CAP and len(self._queue) > 1:
            self._finish_oldest()

    def drain(self) -> None:
        while self._queue:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        work, nbytes, then, _ = self._queue.popleft()
        work.wait()
        self._bytes -= nbytes
        if then is not None:
            then()


def shard_numel(numel: int, world: int) -> int:
    return -(-numel // world) if numel else 0


def shard_of(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's slice of the flat, zero-padded tensor (a fresh tensor)."""
    length = shard_numel(full.numel(), world)
    flat = F.pad(full.detach().reshape(-1), (0, length * world - full.numel()))
    return flat[rank * length : (rank + 1) * length].clone()


def _copy_columns_into(param: torch.Tensor, columns: torch.Tensor, numel: int) -> None:
    """Copy a gathered parameter, laid out ``[world, shard]`` (row r: rank r's shard, the last padded), into
    ``param`` without first making the columns contiguous: one strided copy for the whole rows and one
    for the padded tail, so the refresh after each step moves each element once, not three times."""
    if not param.is_contiguous():
        param.copy_(columns.reshape(-1)[:numel].view(param.shape))
        return
    flat = param.view(-1)
    length = columns.shape[1]
    whole = numel // length if length else 0
    if whole:
        flat[: whole * length].view(whole, length).copy_(columns[:whole])
    rest = numel - whole * length
    if rest:
        flat[whole * length :].copy_(columns[whole, :rest])


def is_sharded(param: torch.Tensor) -> bool:
    """True for a parameter whose shard is recorded on it (built under ``zero.Init``, or partitioned)."""
    return hasattr(param, "ds_tensor")


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The parameter's full shape, also when only its shard exists."""
    return tuple(param.ds_shape) if is_sharded(param) else tuple(param.shape)


def attach_shard(param: torch.Tensor, shard: torch.Tensor, shape: tuple[int, ...], group: dist.ProcessGroup | None) -> None:
    """Record ``param``'s shard under DeepSpeed's attribute names (``ds_tensor``, ``ds_shape``,
    ``ds_numel``), so ``zero.GatheredParameters`` and scripts that read them find it."""
    param.ds_tensor = shard
    param.ds_shape = torch.Size(shape)
    param.ds_numel = int(torch.Size(shape).numel())
    param.ds_process_group = group


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's ``ds_status`` of a ZeRO-3 parameter. ``AVAILABLE``: ``param.data`` holds the full value
    (a persistent parameter, or inside ``GatheredParameters``); ``NOT_AVAILABLE``: only the shard
    ``ds_tensor`` exists. ``INFLIGHT`` is never set here: the gathers of the step run inside the compiled
    graphs on copies, and the parameter itself stays ``NOT_AVAILABLE`` throughout."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


_ZERO3_IDS = itertools.count()
ZERO3_ATTRIBUTES = ("ds_id", "ds_status", "ds_persist", "ds_active_sub_modules")
"""What ZeRO-3 parameters carry besides the shard's attributes: scripts test ``hasattr(p, "ds_id")`` to tell
a ZeRO-3 parameter, so parameters of the other stages do not carry them (as under DeepSpeed)."""


def mark_zero3(param: torch.Tensor, persistent: bool) -> None:
    """Give a sharded ZeRO-3 parameter DeepSpeed's ``ds_id`` (unique in the process, kept once given),
    ``ds_persist``, ``ds_active_sub_modules`` (always empty: no module hooks fetch parameters here) and its
    ``ds_status``."""
    if not hasattr(param, "ds_id"):
        param.ds_id = next(_ZERO3_IDS)
        param.ds_active_sub_modules = set()
    param.ds_persist = persistent
    refresh_status(param)


def refresh_status(param: torch.Tensor) -> None:
    """Set ``ds_status`` from what ``param.data`` holds now (a ZeRO-3 parameter; others are left alone)."""
    if hasattr(param, "ds_id"):
        whole = param.data.numel() == param.ds_numel and (param.ds_numel > 0 or param.ds_persist)
        param.ds_status = ZeroParamStatus.AVAILABLE if whole else ZeroParamStatus.NOT_AVAILABLE


def forget_zero3(param: torch.Tensor) -> None:
    """Drop the ZeRO-3 attributes (a parameter kept whole by the stage that trains it)."""
    for name in ZERO3_ATTRIBUTES:
        if hasattr(param, name):
            delattr(param, name)


def gather_sharded(param: torch.Tensor) -> torch.Tensor:
    """The full value of a sharded parameter, gathered from every rank's shard (a collective)."""
    group = param.ds_process_group
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    shard = param.ds_tensor.detach()
    flat = shard.clone() if world == 1 else shard.new_empty(shard.numel() * world)
    if world > 1:
        dist.all_gather_into_tensor(flat, shard.contiguous(), group=group)
    return flat[: param.ds_numel].view(param.ds_shape).to(param.dtype)


def initial_shard(param: torch.Tensor, rank: int, world: int, group: dist.ProcessGroup | None) -> nn.Parameter:
    """The shard ``ZeroPartition`` starts from: the one cut at construction (adopted, same storage)
    when only that shard exists (built under ``zero.Init``), else a new cut of the full value."""
    if not is_sharded(param) or param.numel() == param.ds_numel:  # a full value exists: it is authoritative
        return nn.Parameter(shard_of(param, rank, world))
    expected = shard_numel(param.ds_numel, world)
    if param.ds_tensor.numel() != expected or zero_ops.group_name_of(param.ds_process_group) != zero_ops.group_name_of(group):
        raise DSCompileConfigError(
            "zero.Init(data_parallel_group)",
            f"the model was sharded over another group than ZeRO's ({param.ds_tensor.numel()} elements per shard, {expected} expected)",
            "build it under zero.Init with the default (world) group",
        )
    shard = param.ds_tensor
    return shard if isinstance(shard, nn.Parameter) else nn.Parameter(shard.detach())


def _world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    *path, leaf = name.split(".")
    return functools.reduce(getattr, path, module), leaf


def plan_byte_buckets(nbytes: list[int], dtypes: list[Any], bucket_bytes: int) -> list[list[int]]:
    """Consecutive positions grouped into buckets of at most ``bucket_bytes`` (one alone may exceed it) and one dtype:
    the out-of-graph collectives' buckets (also what ``runtime/onebit/predict.py`` plans without a process group)."""
    buckets: list[list[int]] = []
    bucket: list[int] = []
    size = 0
    for j, (n, dtype) in enumerate(zip(nbytes, dtypes, strict=True)):
        if bucket and (size + n > bucket_bytes or dtype != dtypes[bucket[0]]):
            buckets.append(bucket)
            bucket, size = [], 0
        bucket.append(j)
        size += n
    if bucket:
        buckets.append(bucket)
    return buckets


class ZeroPartition:
    """The shards of a module's parameters and the out-of-graph collectives around them.

    ``stage`` 1 and 2 keep every parameter's full copy; stage 3 frees the full copy of every
    parameter with more than ``persistence_threshold`` elements, and keeps the small ones only
    while their total stays within ``model_persistence_threshold`` elements (in parameter order, as
    DeepSpeed's ``stage3_model_persistence_threshold``). ``allgather_partitions=False`` refreshes
    the full copies after a step with one broadcast per rank instead of an all-gather.
    Without a process group the partition is world size 1 (the ZeRO ops then communicate nothing).
    """

    def __init__(
        self,
        module: nn.Module,
        stage: int,
        group: dist.ProcessGroup | None = None,
        persistence_threshold: int = 0,
        bucket_bytes: int = 500_000_000,
        check_consistency: bool = True,
        model_persistence_threshold: int | None = None,
        allgather_partitions: bool = True,
        ignore_unused_parameters: bool = True,
    ) -> None:
        if stage not in (1, 2, 3):
            raise DSCompileConfigError("zero_optimization.stage", f"must be 0, 1, 2 or 3, got {stage}")
        self.module = module
        self.stage = stage
        self.group = group
        self.ignore_unused_parameters = ignore_unused_parameters  # DeepSpeed's switch: False makes a gradient-less parameter an error
        self.rank, self.world = _world(group)
        self.allgather_partitions = allgather_partitions
        # "" (no process group, world size 1): the ZeRO ops run locally
        self.group_name = zero_ops.group_name_of(group) if dist.is_available() and dist.is_initialized() else ""
        # Out-of-graph buckets are transient flat copies: cap them so ZeRO-1/2 never hold a second
        # full copy of the model while refreshing parameters or reducing gradients.
        self.bucket_bytes = max(1, min(int(bucket_bytes), OUT_OF_GRAPH_BUCKET_CAP))
        # dtype of ZeRO-1's gradient reduce-scatter (``communication_data_type``); None: the gradients' own.
        self.comm_dtype: torch.dtype | None = None
        self.predivisor = 1.0  # DeepSpeed's prescale_gradients / gradient_predivide_factor (DSConfig.gradient_predivisor)
        # out-of-graph collectives that read or wrote the parameter or gradient itself, with no flat copy (tests, benchmarks)
        self.copy_free_collectives = 0
        # offload_param (``runtime/offload/params.py``): makes offloaded shards' values resident for code that reads
        # or writes them outside the graphs (full state, checkpoints); None: shards are always resident.
        self.residency: Callable[[], contextlib.AbstractContextManager[None]] | None = None
        aliases: dict[int, list[str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        leaves = leaf_of_parameters(module) if stage == 3 else {}
        if not named:
            raise DSCompileError("ZeRO: the model has no trainable parameters to partition")
        if check_consistency and self.world > 1:
            check_same_parameters(named, group)
        self.layouts: list[ParamLayout] = []
        self.full_params: list[nn.Parameter] = []
        shards = []
        kept = 0  # elements of small ZeRO-3 parameters kept whole so far
        for name, p in named:
            shape = full_shape(p)
            numel = int(torch.Size(shape).numel())
            persistent = stage < 3
            if not persistent and numel <= persistence_threshold:
                budget = model_persistence_threshold if model_persistence_threshold is not None else float("inf")
                persistent = kept + numel <= budget
                kept += numel if persistent else 0
            leaf_name, leaf_module = leaves.get(name, ("", None))
            layout = ParamLayout(name, shape, numel, shard_numel(numel, self.world), persistent, aliases[id(p)], leaf_name if not persistent else "")
            if leaf_module is not None:
                p.ds_z3_leaf_module = leaf_module  # type: ignore[attr-defined]  # DeepSpeed's attribute (z3_leaf_parameter)
            self.layouts.append(layout)
            self.full_params.append(p)
            shards.append(initial_shard(p, self.rank, self.world, group))  # adopts zero.Init's shard
        self.shards: list[nn.Parameter] = shards
        with torch.no_grad():
            for layout, p, shard in zip(self.layouts, self.full_params, shards):
                if stage >= 2:
                    p.requires_grad_(False)  # gradients flow to the shard, never to the full copy
                if layout.persistent and p.numel() != layout.numel:
                    p.data = gather_sharded(p)  # built under zero.Init, but this stage keeps a full copy
                elif not layout.persistent:
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                attach_shard(p, shard, layout.shape, group)
                p._ds_resident = self.resident  # zero.GatheredParameters reads offloaded shards through it
                if stage == 3:
                    mark_zero3(p, layout.persistent)
                else:
                    forget_zero3(p)
            partitioned = {id(p) for p in self.full_params}
            for p in module.parameters():  # frozen parameters built under zero.Init are not partitioned: gather them
                if id(p) not in partitioned and is_sharded(p) and p.numel() != p.ds_numel:
                    p.data = gather_sharded(p)
                    refresh_status(p)

    def resident(self) -> contextlib.AbstractContextManager[None]:
        """Every shard holds its value inside (offloaded ones are read back, and written back on exit)."""
        return self.residency() if self.residency is not None else contextlib.nullcontext()

    # -- names ---------------------------------------------------------------------------------
    def named_shards(self) -> Iterator[tuple[str, nn.Parameter]]:
        for layout, shard in zip(self.layouts, self.shards):
            yield layout.name, shard

    def shard_for(self, param: torch.Tensor) -> nn.Parameter:
        for p, shard in zip(self.full_params, self.shards):
            if p is param:
                return shard
        raise DSCompileError("ZeRO: the optimizer holds a tensor that is not a parameter of the model; build it over model.parameters()")

    # -- collectives outside the graphs --------------------------------------------------------
    def _buckets(self, indices: Iterable[int]) -> Iterator[list[int]]:
        """Byte-capped buckets in parameter order; on CPU a parameter over ``CPU_ALONE_ABOVE`` elements goes alone."""
        run: list[int] = []
        for i in indices:
            if self.shards[i].device.type == "cpu" and self.layouts[i].shard_numel * self.world > CPU_ALONE_ABOVE:
                yield from self._planned(run)
                run = []
                yield [i]
            else:
                run.append(i)
        yield from self._planned(run)

    def _planned(self, indices: list[int]) -> Iterator[list[int]]:
        sizes = [self.layouts[i].shard_numel * self.world * self.shards[i].element_size() for i in indices]
        for bucket in plan_byte_buckets(sizes, [self.shards[i].dtype for i in indices], self.bucket_bytes):
            yield [indices[j] for j in bucket]

    def _unpadded(self, i: int, full: torch.Tensor, dtype: torch.dtype) -> bool:
        """Whether parameter ``i``'s collective can read or write ``full`` itself: no padding, one flat layout, same dtype."""
        return self.layouts[i].numel == self.layouts[i].shard_numel * self.world and full.is_contiguous() and full.dtype == dtype

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """ZeRO-1 at the accumulation boundary: average the full gradients into the shards' grads.

        The ranks first agree (one small all-reduce) on which parameters have a gradient on any
        rank; those are reduce-scattered everywhere, zeros standing in where a rank has none (a
        branch it did not take), so the buckets line up. A parameter no rank used keeps no gradient.
        """
        counts = self.gradient_counts([p.grad is not None for p in self.full_params])
        self.check_unused(counts)
        have = [i for i, count in enumerate(counts) if count > 0]
        in_flight = _InFlight()
        for bucket in self._buckets(have):
            if self.world > 1 and len(bucket) == 1 and self.comm_dtype is None and self.predivisor == 1.0:
                i = bucket[0]
                grad = self.full_params[i].grad
                if grad is not None and self._unpadded(i, grad, self.shards[i].dtype):
                    # alone and unpadded: reduce-scattered straight from the gradient, no flat copy in or out
                    work, nbytes, out = self._reduce_scatter_async(grad.view(-1))
                    in_flight.add(work, nbytes, lambda i=i, out=out: self._accumulate_shard_grad(i, out()), keep=(grad,))
                    self.copy_free_collectives += 1
                    continue
            rows = []
            for i in bucket:
                grad = self.full_params[i].grad
                g = grad.reshape(-1) if grad is not None else self.full_params[i].new_zeros(self.layouts[i].numel)
                rows.append(F.pad(g, (0, self.layouts[i].shard_numel * self.world - g.numel())).view(self.world, -1))
            flat = torch.cat(rows, dim=1).reshape(-1) if len(rows) > 1 else rows[0].reshape(-1)
            grad_dtype = flat.dtype
            if self.comm_dtype is not None and self.world > 1:
                flat = flat.to(self.comm_dtype)
            if self.world > 1:
                flat = flat.contiguous()
                if self.predivisor != 1.0:
                    flat = flat.div(self.predivisor)  # a copy: rows may view the parameters' gradients
                work, nbytes, out = self._reduce_scatter_async(flat)
                in_flight.add(work, flat.nbytes + nbytes, lambda bucket=bucket, out=out, dt=grad_dtype: self._split_reduced(bucket, out(), dt), keep=(flat,))
            else:
                self._split_reduced(bucket, flat.clone(), None)
        in_flight.drain()
        for p in self.full_params:
            p.grad = None

    def _reduce_scatter_async(self, flat: torch.Tensor) -> tuple[Any, int, Callable[[], torch.Tensor]]:
        """Start summing ``flat`` (1-D, ``world`` equal chunks, chunk r for rank r) over the ranks; returns the work,
        the bytes of the buffer it holds, and what gives this rank's summed chunk once the work has finished.

        On gloo the chunks are exchanged with one all-to-all and summed here: gloo's reduce-scatter all-reduces the
        whole tensor (a clone of it), twice the bytes (measured: 8M fp32 elements on 2 ranks, 43 ms against 16 ms).
        Two ranks' sums are the same additions either way; with more ranks the order of the additions may differ."""
        length = flat.numel() // self.world
        if moves_like_gloo(self.group, flat.device.type):
            received = torch.empty_like(flat)
            work = dist.all_to_all_single(received, flat, group=self.group, async_op=True)
            return work, received.nbytes, lambda: received.view(self.world, length).sum(0)
        out = flat.new_empty(length)
        return dist.reduce_scatter_tensor(out, flat, group=self.group, async_op=True), 0, lambda: out

    def _split_reduced(self, bucket: list[int], out: torch.Tensor, grad_dtype: torch.dtype | None) -> None:
        """A reduced bucket's pieces (averaged over the ranks when it was communicated) into the shards' grads."""
        if grad_dtype is not None:
            out = out.to(grad_dtype).div_(self.world if self.predivisor == 1.0 else self.world / self.predivisor)
        offset = 0
        for i in bucket:
            length = self.layouts[i].shard_numel
            piece = out[offset : offset + length]
            self._accumulate_shard_grad(i, piece.clone() if len(bucket) > 1 else piece, divide=False)
            offset += length

    def _accumulate_shard_grad(self, i: int, piece: torch.Tensor, divide: bool = True) -> None:
        if divide:
            piece.div_(self.world)
        shard = self.shards[i]
        shard.grad = piece if shard.grad is None else shard.grad.add_(piece)

    def gradient_counts(self, present: list[bool]) -> list[int]:
        """How many ranks have each parameter's gradient (an all-reduce of this rank's flags)."""
        device = collective_device(self.group, like=self.shards[0] if self.shards else None)
        flags = torch.tensor(present, dtype=torch.int32, device=device)  # counts, not gradients: never in the communication dtype
        if self.world > 1:
            dist.all_reduce(flags, group=self.group)
        return [int(c) for c in flags.tolist()]

    def check_unused(self, counts: list[int] | None = None) -> None:
        """``ignore_unused_parameters: false``: fail when a parameter got no gradient (on some rank).

        Without ``counts`` (ZeRO-2/3 at the step) it reads the shards: their gradients come from
        graphs every rank runs alike, so every rank sees the same and raises together.
        """
        if self.ignore_unused_parameters:
            return
        if counts is None:
            counts = [self.world if s.grad is not None else 0 for s in self.shards]
        check_unused_parameters([layout.name for layout in self.layouts], counts, self.world, None, strict=True)

    @torch.no_grad()
    def gather_full_params(self) -> None:
        """After the optimizer step: refresh every persistent full copy from the updated shards."""
        todo = [i for i, layout in enumerate(self.layouts) if layout.persistent]
        in_flight = _InFlight()
        for bucket in self._buckets(todo):
            if self.allgather_partitions and self.world > 1 and len(bucket) == 1:
                i = bucket[0]
                full = self.full_params[i].data
                if self._unpadded(i, full, self.shards[i].dtype):
                    # alone and unpadded: gathered straight into the full copy, no flat copy in or out
                    shard = self.shards[i].detach().reshape(-1)
                    in_flight.add(self._all_gather_async(full.view(-1), shard), keep=(shard, full))
                    self.copy_free_collectives += 1
                    continue
            flat = torch.cat([self.shards[i].detach().reshape(-1) for i in bucket]) if len(bucket) > 1 else self.shards[bucket[0]].detach().reshape(-1)
            if self.allgather_partitions and self.world > 1:
                out = flat.new_empty(flat.numel() * self.world)
                flat = flat.contiguous()
                work = self._all_gather_async(out, flat)
                in_flight.add(work, out.nbytes, functools.partial(self._copy_gathered, bucket, out), keep=(flat,))
            else:
                self._copy_gathered(bucket, self._all_gather(flat) if self.allgather_partitions else self._broadcast_gather(flat))
        in_flight.drain()

    def _copy_gathered(self, bucket: list[int], out: torch.Tensor) -> None:
        out = out.view(self.world, -1)
        offset = 0
        for i in bucket:
            layout = self.layouts[i]
            _copy_columns_into(self.full_params[i].data, out[:, offset : offset + layout.shard_numel], layout.numel)
            offset += layout.shard_numel

    def _all_gather(self, flat: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return flat.clone()
        out = flat.new_empty(flat.numel() * self.world)
        self._all_gather_async(out, flat.contiguous()).wait()
        return out

    def _all_gather_async(self, out: torch.Tensor, flat: torch.Tensor) -> Any:
        """Start gathering every rank's ``flat`` into ``out`` (1-D, rank r's at ``[r*len, (r+1)*len)``); returns what to wait on.

        On gloo a gather over ``GLOO_BROADCASTS_ABOVE`` elements runs as one broadcast per rank, each rank's piece
        from its owner (the values are the same; gloo's all-gather is the slower way to move these bytes)."""
        if out.numel() > GLOO_BROADCASTS_ABOVE and moves_like_gloo(self.group, out.device.type):
            return broadcast_gather_async(out, flat, self.group if self.group is not None else dist.group.WORLD)
        return dist.all_gather_into_tensor(out, flat, group=self.group, async_op=True)

    def _broadcast_gather(self, flat: torch.Tensor) -> torch.Tensor:
        """The all-gather as one broadcast per rank (DeepSpeed's ``allgather_partitions: false``)."""
        if self.world == 1:
            return flat.clone()
        out = flat.new_empty(flat.numel() * self.world)
        for r, piece in enumerate(out.view(self.world, -1)):
            if r == self.rank:
                piece.copy_(flat)
            src = dist.get_global_rank(self.group, r) if self.group is not None else r
            dist.broadcast(piece, src=src, group=self.group)
        return out

    @torch.no_grad()
    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter's full value (gathered from the shards), under its first name."""
        result: dict[str, torch.Tensor] = {}
        with self.resident():
            for layout, shard in zip(self.layouts, self.shards):
                full = self._all_gather(shard.detach().reshape(-1))[: layout.numel]
                result[layout.name] = full.view(layout.shape).clone()
        return result

    @torch.no_grad()
    def load_full_state(self, state: dict[str, torch.Tensor]) -> None:
        """Set shards (and persistent full copies) from full parameter values."""
        with self.resident():
            for layout, shard, p in zip(self.layouts, self.shards, self.full_params):
                value = _lookup(state, layout)
                if tuple(value.shape) != layout.shape:
                    raise DSCompileError(f"ZeRO: parameter {layout.name} has shape {tuple(value.shape)} in the state, {layout.shape} in the model")
                shard.copy_(shard_of(value.to(shard.dtype), self.rank, self.world))
                if layout.persistent:
                    p.data.copy_(value.to(p.dtype))

    def zero_grad(self) -> None:
        for shard in self.shards:
            shard.grad = None
        for p in self.full_params:
            p.grad = None

    def grad_norm_squared(self) -> torch.Tensor:
        """Sum of squares of this rank's shard gradients, summed over ranks (the global norm²)."""
        grads = [s.grad.detach().float() for s in self.shards if s.grad is not None]
        device = collective_device(self.group, like=self.shards[0])
        local = torch.stack([g.pow(2).sum() for g in grads]).sum() if grads else torch.zeros((), device=device)
        if self.world > 1:
            dist.all_reduce(local, group=self.group)
        return local


def check_unused_parameters(names: list[str], counts: list[int], world: int, zero_section: Any, strict: bool = False) -> None:
    """DeepSpeed's ``zero_optimization.ignore_unused_parameters: false``: a trainable parameter without a
    gradient is an error. ``counts[i]`` ranks had parameter ``i``'s gradient (agreed, so every rank raises)."""
    if not strict and (zero_section is None or zero_section.ignore_unused_parameters):
        return
    unused = [(name, world - count) for name, count in zip(names, counts, strict=True) if count < world]
    if unused:
        listed = ", ".join(f"{name} (on {missing} of {world} ranks)" for name, missing in unused[:8])
        raise DSCompileError(
            f"parameters got no gradient: {listed}{' ...' if len(unused) > 8 else ''}. zero_optimization.ignore_unused_parameters "
            "is false, which makes this an error; set it to true (the default) to train on (zeros where a rank did not use a "
            "parameter, no step for a parameter no rank used), or use every parameter in forward"
        )


def _lookup(state: dict[str, torch.Tensor], layout: ParamLayout) -> torch.Tensor:
    for name in [layout.name, *layout.aliases]:
        if name in state:
            return state[name]
    raise DSCompileError(f"ZeRO: the state has no entry for parameter {layout.name}")


def check_same_parameters(named: list[tuple[str, torch.Tensor]], group: dist.ProcessGroup | None) -> None:
    """Fail at start when ranks hold different parameter values (a seed or loading bug)."""
    with torch.no_grad():
        prints = []
        for _, p in named:
            flat = p.detach().reshape(-1).double().to(collective_device(group, like=p))
            weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device).remainder_(7).add_(1)
            count = torch.tensor(float(flat.numel()), dtype=torch.float64, device=flat.device)
            prints.append(torch.stack([flat.sum(), (flat * weights).sum(), count]))
        mine = torch.stack(prints)
        world = dist.get_world_size(group)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine, group=group)
    for rank, theirs in enumerate(gathered[1:], start=1):
        if not torch.equal(theirs, gathered[0]):
            row = int((theirs != gathered[0]).any(dim=1).nonzero()[0])
            raise DSCompileError(
                f"ZeRO: parameter '{named[row][0]}' differs between rank 0 and rank {rank}; every rank must start "
                "from the same weights (seed the model identically, or load the same checkpoint on every rank)"
            )


_PEER_FAILURE_MARKERS = ("connection closed by peer", "connection reset by peer", "broken pipe", "timed out", "timeout", "nccl error")


@contextlib.contextmanager
def explain_collective_failure(rank: int, what: str) -> Iterator[None]:
    """Re-raise a failed collective as what it almost always means: a peer died, stalled or diverged.

    ``what`` names the operation (``"ZeRO forward"``, ``"engine.step()"``). The collective itself
    fails on its own (a closed connection at once, a stalled peer at the process group's
    ``timeout``); this only names the likely cause and where to look.
    """
    try:
        yield
    except RuntimeError as exc:
        if isinstance(exc, DSCompileError) or not (
            isinstance(exc, dist.DistError) or any(marker in str(exc).lower() for marker in _PEER_FAILURE_MARKERS)
        ):
            raise
        raise DSCompileError(
            f"{what} on rank {rank}: a collective failed, so another rank died, stalled past the process group "
            f"timeout (init_process_group(timeout=...)), or issued different collectives; the first error in the other "
            f"ranks' logs is the cause. {type(exc).__name__}: {exc}"
        ) from exc


def collective_failures_explained(what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Method decorator for engines (``world_size`` and ``rank`` or ``global_rank``): ``explain_collective_failure`` around the call."""

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            if getattr(self, "world_size", 1) <= 1:
                return fn(self, *args, **kwargs)
            with explain_collective_failure(getattr(self, "rank", getattr(self, "global_rank", 0)), what):
                return fn(self, *args, **kwargs)

        return run

    return decorator


class ZeroScheduleDivergence(DSCompileError):
    """Ranks are about to run compiled ZeRO graphs whose collectives differ (parameters used on some ranks only)."""


def agree_on_schedule(fingerprint: int, summary: str, group_name: str) -> None:
    """Before a compiled ZeRO graph runs: check every rank is about to issue the same collectives.

    The gathers and reduce-scatters of ZeRO-2/3 sit inside the compiled graphs, where the model
    uses each parameter. A branch taken on some ranks only (a parameter unused there) gives those
    ranks other graphs: their collectives would pair with the wrong ones (a hang, a crash, or
    silently misaligned gradients). One all-gather of a 64-bit fingerprint of the schedule per
    graph run (the ``zero_agree`` pass) catches it before any payload moves, on every rank at once.
    """
    pg = zero_ops.resolve_group(group_name)
    world = dist.get_world_size(pg)
    if world == 1:
        return
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(pg) == "nccl" else torch.device("cpu")
    mine = torch.tensor([fingerprint], dtype=torch.int64, device=device)
    every = torch.empty(world, dtype=torch.int64, device=device)
    dist.all_gather_single(every, mine, group=pg)
    values = every.tolist()
    if len(set(values)) > 1:
        differing = [r for r, v in enumerate(values) if v != values[0]]
        raise ZeroScheduleDivergence(
            f"ZeRO: ranks {differing} compiled other collectives than rank 0 for this step (this rank, {dist.get_rank(pg)}: {summary}). "
            "The model uses different parameters (or the same in another order) on different ranks, e.g. a branch "
            "taken on some ranks only, so the gathers/reduce-scatters inside the compiled graphs cannot pair up."
        )


def run_agreeing(compiled: Callable[..., Any], zero_module: ZeroModule | None, args: tuple, kwargs: dict) -> Any:
    """Call the compiled ZeRO model; if the ranks' schedules diverge, switch to up-front collectives once.

    Every rank sees the same fingerprints, so every rank switches at the same call.
    """
    if zero_module is not None:
        bind_recompute_to_forward_tensors(zero_module.module)  # checkpointed layers recompute on ZeRO's tensors
    try:
        return compiled(*args, **kwargs)
    except ZeroScheduleDivergence as exc:
        if zero_module is None or zero_module.collectives_up_front:
            raise
        if not zero_module.partition.ignore_unused_parameters:
            raise ZeroScheduleDivergence(
                f"{exc} zero_optimization.ignore_unused_parameters is false, which makes a parameter without a gradient on "
                "some rank an error; set it to true (the default) to train on with zero gradients there"
            ) from exc
        log.warning(
            "%s Falling back to issuing every parameter's collectives up front, in one graph the same on every rank "
            "(correct, but ZeRO-3 keeps all parameters gathered through the step and nothing overlaps).",
            exc,
        )
        zero_module.collectives_up_front = True
        return compiled(*args, **kwargs)


class ZeroModule(nn.Module):
    """Runs ``module`` on parameters built from shards by the ZeRO ops (stages 2 and 3).

    ``collectives_up_front`` (set by ``run_agreeing`` when ranks diverge) puts a graph break between
    the ZeRO ops and the model: the first graph then gathers every parameter, and its backward
    reduce-scatters every gradient (zeros where a rank did not use the parameter), identically on
    every rank, whatever each rank's model graphs do.
    """

    def __init__(self, module: nn.Module, partition: ZeroPartition) -> None:
        super().__init__()
        if partition.stage < 2:
            raise DSCompileError("ZeroModule wraps ZeRO stage 2 or 3; stage 1 keeps the model unwrapped")
        self.module = module
        self.zero_shards = nn.ParameterList(partition.shards)
        object.__setattr__(self, "partition", partition)
        self._plan = [(layout.name, layout.persistent, list(layout.shape), layout.numel, layout.leaf) for layout in partition.layouts]
        self._group = partition.group_name
        self.collectives_up_front = False
        # ZeRO-3 parameter offload (``passes/offload.py``): shard index -> parameter store id; those shards
        # are read through ``zero_param_load`` (the host or NVMe copy) right before their gather.
        self.offloaded_shards: dict[int, int] = {}

    def wrapping(self, module: nn.Module) -> ZeroModule:
        """The same ZeRO ops, over the same shards, around another graph of the model's parameters (a model
        captured again: eval mode, another batch shape)."""
        other = ZeroModule(module, self.partition)
        other.collectives_up_front = self.collectives_up_front
        other.offloaded_shards = self.offloaded_shards
        return other

    @contextlib.contextmanager
    def whole_parameters(self) -> Iterator[None]:
        """While the model is captured again: every parameter ZeRO-3 keeps only as shards holds its whole value
        (gathered over the group), released after."""
        partition = self.partition
        sharded = [(p, layout) for layout, p in zip(partition.layouts, partition.full_params) if not layout.persistent]
        if not sharded:
            yield
            return
        values = partition.full_state()
        try:
            for p, layout in sharded:
                p.data = values[layout.name]
                refresh_status(p)
            yield
        finally:
            for p, _ in sharded:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                refresh_status(p)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        tensors: dict[str, torch.Tensor] = {}
        for i, ((name, persistent, shape, numel, leaf), shard) in enumerate(zip(self._plan, self.zero_shards)):
            if persistent:
                owner, leaf = _owner(self.module, name)
                tensors[name] = torch.ops.dscompile.zero_use(shard, getattr(owner, leaf), self._group)
            else:
                store = self.offloaded_shards.get(i)
                source = shard if store is None else torch.ops.dscompile.zero_param_load(shard, store, i)
                tensors[name] = torch.ops.dscompile.zero_gather(source, shape, numel, self._group, leaf)
        if self.collectives_up_front:
            torch._dynamo.graph_break()
        return torch.func.functional_call(self.module, tensors, args, kwargs)


def shard_model(
    model: nn.Module,
    stage: int = 3,
    group: dist.ProcessGroup | None = None,
    persistence_threshold: int = 0,
) -> nn.Module:
    """Torch-native ZeRO-2/3: returns a module whose ``parameters()`` are this rank's shards.

    Compile it with ``torch.compile(m, backend="dscompile", options={"zero_optimization":
    {"stage": stage}})`` and step a plain optimizer over ``m.parameters()``; for stage 2 call
    ``m.partition.gather_full_params()`` after each optimizer step.
    """
    partition = ZeroPartition(model, stage, group, persistence_threshold)
    return ZeroModule(model, partition)


def state_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of distinct storages among ``tensors`` (views of one storage count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


def model_state_tensors(partition: ZeroPartition, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """The model-state tensors a rank holds: parameters (full copies and shards), grads, optimizer states."""
    tensors: list[torch.Tensor] = []
    for p in partition.full_params:
        tensors.append(p.data)
        tensors.append(p.grad)
    for s in partition.shards:
        tensors.append(s.data)
        tensors.append(s.grad)
    if optimizer is not None:
        for state in optimizer.state.values():
            tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return tensors
