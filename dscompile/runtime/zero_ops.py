"""The three ZeRO operators a sharded model's forward calls, as PyTorch custom ops.

They are opaque single nodes in the captured graphs, so the ``zero`` pass can find each
parameter's gather and each gradient's reduce-scatter and replace them with functional
collectives (``_c10d_functional.*`` + ``wait_tensor``) that later passes bucket and move.
Run eagerly (or when no pass rewrote them) they do the same communication with blocking
``torch.distributed`` calls, so a sharded model is correct with or without the passes.

- ``zero_gather(shard, shape, numel, group, leaf="")``: the full parameter from every rank's flat,
  padded shard (ZeRO-3). Backward: ``zero_reduce_scatter`` of its gradient. ``leaf`` names the ZeRO-3
  leaf module the parameter belongs to (``runtime/zero_leaf.py``): the passes gather a leaf's
  parameters together; it changes no value.
- ``zero_use(shard, full, group)``: a parameter whose full copy stays on every rank (ZeRO-2,
  and small ZeRO-3 parameters kept persistent); the value is ``full``, but the gradient
  flows to ``shard`` through a reduce-scatter.
- ``zero_reduce_scatter(grad, shard_numel, group)``: flatten, pad, reduce-scatter (sum) and
  divide by the world size: the averaged gradient of this rank's shard.

The group ``""`` means no process group: world size 1, where the shard is the whole (flat)
parameter, so the ops copy instead of communicating (ZeRO in one process without
``init_process_group``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dscompile.runtime.devices import backend_serving


def resolve_group(group_name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def group_name_of(group: dist.ProcessGroup | None) -> str:
    group = group if group is not None else dist.group.WORLD
    return group.group_name


@torch.library.custom_op("dscompile::zero_gather", mutates_args=())
def zero_gather(shard: torch.Tensor, shape: list[int], numel: int, group: str, leaf: str = "") -> torch.Tensor:
    if not group:
        return shard[:numel].view(shape).clone()
    pg = resolve_group(group)
    world = dist.get_world_size(pg)
    out = shard.new_empty(shard.numel() * world)
    dist.all_gather_into_tensor(out, shard.contiguous(), group=pg)
    return out[:numel].view(shape)


@zero_gather.register_fake
def _zero_gather_fake(shard: torch.Tensor, shape: list[int], numel: int, group: str, leaf: str = "") -> torch.Tensor:
    return shard.new_empty(shape)


@torch.library.custom_op("dscompile::zero_reduce_scatter", mutates_args=())
def zero_reduce_scatter(grad: torch.Tensor, shard_numel: int, group: str) -> torch.Tensor:
    if not group:
        out = grad.new_zeros(shard_numel)
        out[: grad.numel()].copy_(grad.reshape(-1))
        return out
    pg = resolve_group(group)
    world = dist.get_world_size(pg)
    flat = grad.reshape(-1)
    padded = F.pad(flat, (0, shard_numel * world - flat.numel())).contiguous()
    out = grad.new_empty(shard_numel)
    dist.reduce_scatter_tensor(out, padded, group=pg)
    return out.div_(world)


@zero_reduce_scatter.register_fake
def _zero_reduce_scatter_fake(grad: torch.Tensor, shard_numel: int, group: str) -> torch.Tensor:
    return grad.new_empty(shard_numel)


@torch.library.custom_op("dscompile::zero_use", mutates_args=())
def zero_use(shard: torch.Tensor, full: torch.Tensor, group: str) -> torch.Tensor:
    return full.clone()


@zero_use.register_fake
def _zero_use_fake(shard: torch.Tensor, full: torch.Tensor, group: str) -> torch.Tensor:
    return torch.empty_like(full)


def _gather_setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: torch.Tensor) -> None:
    ctx.shard_numel = inputs[0].numel()
    ctx.group = inputs[3]


def _gather_backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:
    return zero_reduce_scatter(grad, ctx.shard_numel, ctx.group), None, None, None, None


def _use_setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: torch.Tensor) -> None:
    ctx.shard_numel = inputs[0].numel()
    ctx.group = inputs[2]


def _use_backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:
    return zero_reduce_scatter(grad, ctx.shard_numel, ctx.group), None, None


zero_gather.register_autograd(_gather_backward, setup_context=_gather_setup)
zero_use.register_autograd(_use_backward, setup_context=_use_setup)

GLOO_BROADCASTS_ABOVE = 1 << 18
"""Elements of an all-gather's output above which, on gloo, it runs as one broadcast per rank: gloo's all-gather
costs two to three times as much for the same bytes (measured on this project's CPU machine, 2 ranks: 8M fp32
elements 32.5 ms against 15.3 ms, 256Ki 0.97 against 0.45 ms; 4 ranks: 8M 60.7 against 23.4 ms; 64Ki elements
favour the all-gather, 0.29 against 0.43 ms)."""


def moves_like_gloo(group: dist.ProcessGroup | None, device_type: str) -> bool:
    """Whether ZeRO moves ``device_type`` tensors of ``group`` the gloo way: reduce-scatter as an all-to-all and a
    local sum, big all-gathers as one broadcast per rank. Only where gloo carries those tensors: NCCL (and any
    other backend) runs its own reduce-scatter and all-gather, which are the fast ones there. Decided per
    device type, so a ``"cpu:gloo,cuda:nccl"`` group moves CPU tensors the gloo way and CUDA tensors NCCL's way."""
    return backend_serving(group, device_type) == "gloo"


class AllOf(dist.Work):
    """Several asynchronous works waited for as one (a ``Work``, so ``wait_tensor`` can wait for it too).

    Each work's own ``wait`` runs, so a failed one raises here; a ``Work`` made from ``collect_all``'s future
    would not (that future completes even when one of its futures failed)."""

    def __init__(self, works: list[dist.Work]) -> None:
        super().__init__()
        self.works = works

    def wait(self, timeout: Any = None) -> bool:
        for work in self.works:
            work.wait()
        return True


def broadcast_gather_async(out: torch.Tensor, flat: torch.Tensor, pg: dist.ProcessGroup) -> AllOf:
    """Start gathering every rank's ``flat`` into ``out`` (1-D, rank r's at ``[r*len, (r+1)*len)``) with one
    broadcast per rank, each from the piece's owner. ``flat`` is copied into ``out`` here: it is not read later."""
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    pieces = out.view(world, -1)
    pieces[rank].copy_(flat)
    return AllOf([dist.broadcast(piece, src=dist.get_global_rank(pg, r), group=pg, async_op=True) for r, piece in enumerate(pieces)])


@torch.library.custom_op("dscompile::zero_broadcast_gather", mutates_args=())
def zero_broadcast_gather(flat: torch.Tensor, world: int, group: str) -> torch.Tensor:
    """``_c10d_functional.all_gather_into_tensor`` on gloo as one broadcast per rank (``GLOO_BROADCASTS_ABOVE``):
    returns at once, and ``_c10d_functional.wait_tensor`` on the result waits for every broadcast."""
    out = flat.new_empty(flat.numel() * world)
    torch._C._distributed_c10d._register_work(out, broadcast_gather_async(out, flat, resolve_group(group)))
    return out


@zero_broadcast_gather.register_fake
def _zero_broadcast_gather_fake(flat: torch.Tensor, world: int, group: str) -> torch.Tensor:
    return flat.new_empty(flat.numel() * world)


@torch.library.custom_op("dscompile::zero_sum_received", mutates_args=())
def zero_sum_received(received: torch.Tensor, sent: torch.Tensor, world: int) -> torch.Tensor:
    """Wait for an all-to-all's ``received`` chunks and sum them: this rank's reduce-scatter result.

    ``sent`` (the all-to-all's input) is not read: it is an argument so that the lowering keeps its
    buffer alive and unchanged until here. Gloo reads an all-to-all's input on its own thread after the
    call returns; Inductor keeps a collective's input alive until its ``wait_tensor`` (the wait's
    "volatile reads"), and this op stands in for that wait, so it takes the input itself."""
    done = torch.ops._c10d_functional.wait_tensor(received)
    return done.view(world, -1).sum(0)


@zero_sum_received.register_fake
def _zero_sum_received_fake(received: torch.Tensor, sent: torch.Tensor, world: int) -> torch.Tensor:
    return received.new_empty(received.shape[0] // world)


GATHER = torch.ops.dscompile.zero_gather.default
USE = torch.ops.dscompile.zero_use.default
REDUCE_SCATTER = torch.ops.dscompile.zero_reduce_scatter.default
SUM_RECEIVED = torch.ops.dscompile.zero_sum_received.default
BROADCAST_GATHER = torch.ops.dscompile.zero_broadcast_gather.default


# -- ZeRO-3 parameter offload (``zero_optimization.offload_param``) ----------------------------------
PARAM_SOURCES: dict[int, object] = {}
"""Live parameter stores (``runtime/offload/params.ParamStore``) by id: where ``zero_param_load`` reads shards."""


@torch.library.custom_op("dscompile::zero_param_load", mutates_args=())
def zero_param_load(shard: torch.Tensor, store: int, index: int) -> torch.Tensor:
    """This rank's shard ``index`` brought from the host or NVMe, just before its all-gather.

    ``shard`` is the parameter itself, whose storage is released while offloaded: only its metadata
    (shape, dtype, device) is read here. The value comes from the store (read ahead in use order).
    """
    return PARAM_SOURCES[store].load(index, shard)  # type: ignore[attr-defined]


@zero_param_load.register_fake
def _zero_param_load_fake(shard: torch.Tensor, store: int, index: int) -> torch.Tensor:
    return torch.empty_like(shard)


def _load_setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: torch.Tensor) -> None:
    pass


def _load_backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:
    return grad, None, None


zero_param_load.register_autograd(_load_backward, setup_context=_load_setup)



@torch.library.custom_op("dscompile::zero_param_load_after", mutates_args=())
def zero_param_load_after(shard: torch.Tensor, store: int, index: int, after: torch.Tensor) -> torch.Tensor:
    """``zero_param_load`` that the lowering cannot run before ``after`` exists (``after`` is not read): the
    ``zero`` pass pins a read used in place (world 1) right before its use with it, and ``zero_prefetch`` every
    read that feeds an all-gather where the gather schedule put it. Without the pin, Inductor's
    reordering for peak memory runs every read first (it takes the released ``shard`` each read consumes for
    memory freed), and every read buffer stays alive until its use."""
    return PARAM_SOURCES[store].load(index, shard)  # type: ignore[attr-defined]


@zero_param_load_after.register_fake
def _zero_param_load_after_fake(shard: torch.Tensor, store: int, index: int, after: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(shard)


PARAM_LOAD = torch.ops.dscompile.zero_param_load.default
PARAM_LOAD_AFTER = torch.ops.dscompile.zero_param_load_after.default
