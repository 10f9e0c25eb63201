"""What sequence parallelism runs outside its pass: the collectives the split graph calls.

Each is an autograd function over functional collectives (``torch.ops._c10d_functional``), so Dynamo
and AOTAutograd trace them into the graphs as a collective and its ``wait_tensor``, forward and backward:

- ``heads_to_sequence`` / ``sequence_to_heads``: Ulysses' all-to-alls. Before attention each rank
  trades its sequence chunk of all heads for the whole sequence of its share of heads; after
  attention the reverse. Each one's backward is the other. Both are ``all_to_all`` over the
  [B, H, S, D] layout; ``DistributedAttention`` (DeepSpeed's module for models that shard the
  sequence themselves) calls it over the layout its caller uses.
- ``gather_sequence``: all-gather along the sequence (the whole sequence, replicated, for an op that
  needs it: a loss that shifts its labels, a cumulative sum). Its backward reduce-scatters (sums) the
  gradient: the ops after the gather run on every rank of the group, and gradients are averaged over
  all ranks, so the sum is what makes every rank's chunk gradient the single-process one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dscompile.errors import DSCompileNotSupportedError
from dscompile.runtime.tensor_parallel import gather_in_group, sum_in_group


def _all_to_all(x: torch.Tensor, group_name: str, world: int) -> torch.Tensor:
    """Chunk ``i`` of dim 0 goes to rank ``i``; chunk ``i`` of the result came from rank ``i``."""
    c10d = torch.ops._c10d_functional
    sizes = [x.shape[0] // world] * world
    return c10d.wait_tensor(c10d.all_to_all_single(x.contiguous(), sizes, sizes, group_name))


def _scatter_gather(x: torch.Tensor, scatter_dim: int, gather_dim: int, group_name: str, world: int) -> torch.Tensor:
    """Chunk ``i`` of ``scatter_dim`` goes to rank ``i``; what each rank sent is concatenated along
    ``gather_dim`` in rank order (``scatter_dim`` shrinks ``world`` times, ``gather_dim`` grows as much)."""
    scatter_dim, gather_dim = scatter_dim % x.dim(), gather_dim % x.dim()
    shape = list(x.shape)
    parts = x.unflatten(scatter_dim, (world, shape[scatter_dim] // world)).movedim(scatter_dim, 0)
    got = _all_to_all(parts, group_name, world)  # [N (source rank), ...x's dims, scatter_dim cut to its chunk]
    return got.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


class _AllToAll(torch.autograd.Function):
    """The all-to-all forward; backward the inverse one (scatter and gather dims swapped)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scatter_dim: int, gather_dim: int, group_name: str, world: int) -> torch.Tensor:
        ctx.dims, ctx.group_name, ctx.world = (scatter_dim, gather_dim), group_name, world
        return _scatter_gather(x, scatter_dim, gather_dim, group_name, world)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        scatter_dim, gather_dim = ctx.dims
        return _scatter_gather(grad, gather_dim, scatter_dim, ctx.group_name, ctx.world), None, None, None, None


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group_name: str, world: int) -> torch.Tensor:
    """Differentiable all-to-all over functional collectives: ``scatter_dim`` split over the group's ranks,
    ``gather_dim`` concatenated from them. ``DistributedAttention`` moves heads and sequence with it in
    whatever layout the model keeps them."""
    return _AllToAll.apply(x, scatter_dim, gather_dim, group_name, world)


def heads_to_sequence(x: torch.Tensor, group_name: str, world: int) -> torch.Tensor:
    """Ulysses' all-to-all before attention: [B, H, S/N, D] -> [B, H/N, S, D]."""
    return all_to_all(x, 1, 2, group_name, world)


def sequence_to_heads(x: torch.Tensor, group_name: str, world: int) -> torch.Tensor:
    """Ulysses' all-to-all after attention: [B, H/N, S, D] -> [B, H, S/N, D]."""
    return all_to_all(x, 2, 1, group_name, world)


def _reduce_scatter(x: torch.Tensor, dim: int, group_name: str, world: int) -> torch.Tensor:
    c10d = torch.ops._c10d_functional
    moved = x.movedim(dim, 0).contiguous()
    got = c10d.wait_tensor(c10d.reduce_scatter_tensor(moved, "sum", world, group_name))
    return got.movedim(0, dim)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group_name: str, world: int) -> torch.Tensor:
        ctx.dim, ctx.group_name, ctx.world = dim, group_name, world
        return gather_in_group(x, dim, group_name, world)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        return _reduce_scatter(grad, ctx.dim, ctx.group_name, ctx.world), None, None, None


def gather_sequence(x: torch.Tensor, dim: int, group_name: str, world: int, outer: int = 1) -> torch.Tensor:
    """Every rank's chunk of dim ``dim``, concatenated in rank order; the gradient is reduce-scattered.

    ``outer > 1``: dim ``dim`` is ``outer`` sequences' chunks flattened together (``[B * S/N, ...]``, a
    view the model made); each sequence is gathered, and the result has the same flattened layout.
    """
    if outer == 1:
        return _GatherSequence.apply(x, dim, group_name, world)
    shape = list(x.shape)
    split = x.reshape(*shape[:dim], outer, shape[dim] // outer, *shape[dim + 1 :])
    whole = _GatherSequence.apply(split, dim + 1, group_name, world)
    return whole.reshape(*shape[:dim], outer * world * (shape[dim] // outer), *shape[dim + 1 :])


def sequence_chunk(x: torch.Tensor, dim: int, rank: int, world: int, pad_value: float = 0) -> torch.Tensor:
    """This rank's chunk of dim ``dim``, the sequence padded with ``pad_value`` at its end to a multiple of ``world``."""
    length = x.shape[dim]
    chunk = -(-length // world)
    if chunk * world != length:
        x = torch.nn.functional.pad(x, [0, 0] * (x.dim() - 1 - dim) + [0, chunk * world - length], value=pad_value)
    return x.narrow(dim, rank * chunk, chunk)


def gather_whole_sequence(x: torch.Tensor, dim: int, group_name: str, world: int, outer: int, length: int) -> torch.Tensor:
    """``gather_sequence``, then the padding cut off: the sequence as the single-process model has it."""
    whole = gather_sequence(x, dim, group_name, world, outer)
    padded = whole.shape[dim] // outer
    if padded == length:
        return whole
    shape = list(whole.shape)
    split = whole.reshape(*shape[:dim], outer, padded, *shape[dim + 1 :]).narrow(dim + 1, 0, length)
    return split.reshape(*shape[:dim], outer * length, *shape[dim + 1 :])


def pad_attention_mask(mask: torch.Tensor, padded: int) -> torch.Tensor:
    """An attention mask ``[..., S or 1, S]`` grown to ``padded`` tokens: padded keys masked out, padded
    queries (cut off after the gather) free to attend, so no row is all masked (that would make NaNs)."""
    keys = padded - mask.shape[-1]
    blocked, free = (False, True) if mask.dtype == torch.bool else (float("-inf"), 0.0)
    mask = torch.nn.functional.pad(mask, [0, keys], value=blocked)
    if mask.shape[-2] != 1:
        mask = torch.nn.functional.pad(mask, [0, 0, 0, padded - mask.shape[-2]], value=free)
    return mask


def chunk_targets(target: torch.Tensor, outer: int, rank: int, world: int, ignore_index: int) -> torch.Tensor:
    """This rank's chunk of flattened per-token targets ``[outer * S]``, padding (if any) ignored by the loss."""
    return sequence_chunk(target.reshape(outer, -1), 1, rank, world, pad_value=ignore_index).reshape(-1)


class _SumOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group_name: str) -> torch.Tensor:
        ctx.group_name = group_name
        return sum_in_group(x, group_name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return sum_in_group(grad, ctx.group_name), None


def cross_entropy_over_chunks(logits: torch.Tensor, target: torch.Tensor, outer: int, reduction: int, ignore_index: int,
                              label_smoothing: float, group_name: str, rank: int, world: int) -> torch.Tensor:  # fmt: skip
    """The cross-entropy of the whole sequence from this rank's chunk of logits ``[outer * S/N, V]``: each
    rank sums its tokens' losses, the sums are added over the group (a scalar all-reduce, not gathered
    logits), and a mean divides by the non-ignored targets of the whole sequence (as torch's mean does).
    The sum's gradient is all-reduced too, which keeps every chunk's gradient on the scale the rest of the
    graph has (the group's ranks' gradients are averaged afterwards, as for every parameter)."""
    mine = chunk_targets(target, outer, rank, world, ignore_index)
    local = torch.ops.aten.cross_entropy_loss(logits, mine, None, 2, ignore_index, label_smoothing)  # 2: sum
    total = _SumOverGroup.apply(local, group_name)
    if reduction == 2:
        return total
    return total / (target != ignore_index).sum()


# ---------------------------------------------------------------------------------------------
# DeepSpeed's DistributedAttention: Ulysses for models that take their chunk of the sequence themselves
# ---------------------------------------------------------------------------------------------
_HEADS = 2  # DeepSpeed's batch_dim_idx form keeps the heads at dim 2: [B, S, H, D] or [S, B, H, D]


def _rotate_half(t: torch.Tensor) -> torch.Tensor:
    first, second = t.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _apply_rotary(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of the first ``cos.shape[-1]`` features of ``t`` (halves rotated, as DeepSpeed's
    layer does); the rest pass through."""
    width = cos.shape[-1]
    rotated = t[..., :width] * cos + _rotate_half(t[..., :width]) * sin
    return rotated if width == t.shape[-1] else torch.cat((rotated, t[..., width:]), dim=-1)


def _is_dim(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class DistributedAttention(torch.nn.Module):
    """DeepSpeed's ``deepspeed.sequence.layer.DistributedAttention``: each rank of ``sequence_process_group``
    holds its chunk of the sequence with all heads; an all-to-all gives it the whole sequence of a share
    of the heads, ``local_attention`` runs on that, and the inverse all-to-all returns the chunk.

    The all-to-alls are functional collectives inside an autograd function (backward: the inverse
    all-to-all), so ``torch.compile`` traces them into the graphs. Scripts that wrap their attention
    this way train under ``dscompile.initialize`` with ``sequence_parallel_size`` left at 1: every rank
    feeds its own chunk, and the engine's average of gradients over all ranks is DeepSpeed's
    sequence-data-parallel average. dscompile's own Ulysses (``sequence_parallel_size`` > 1) shards an
    unmodified model instead; the two together are refused.

    ``sp_stream`` (DeepSpeed's side CUDA stream overlapping the all-to-alls) and heads the group does not
    divide (DeepSpeed splits them unevenly) are refused.
    """

    def __init__(self, local_attention: torch.nn.Module, sequence_process_group: Any = None, scatter_idx: int = 2,
                 gather_idx: int = 0, sp_stream: Any = None) -> None:  # fmt: skip
        super().__init__()
        if sp_stream is not None:
            raise DSCompileNotSupportedError(
                "sp_stream", "DistributedAttention's side stream overlapping the all-to-alls",
                "pass sp_stream=None; under torch.compile the all-to-alls are graph collectives the scheduler places",
            )  # fmt: skip
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx, self.gather_idx = scatter_idx, gather_idx
        self.sp_stream = None
        self.sp_overlap_comm = False
        self.overlap_handles = None
        if dist.is_available() and dist.is_initialized():
            group = sequence_process_group if sequence_process_group is not None else dist.group.WORLD
            self._group_name, self._world = group.group_name, dist.get_world_size(group)
        else:  # one process: the all-to-alls are the identity
            self._group_name, self._world = "", 1

    def layer_sync(self, layer: Any) -> None:
        """DeepSpeed's wait on the overlap stream; there is none here."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """Either of DeepSpeed's call forms: ``(query, key, value, batch_dim_idx, rotary_pos_emb=None, *args,
        **kwargs)`` (current: ``batch_dim_idx`` 0 for [B, S, H, D], 1 for [S, B, H, D]; the heads are
        scattered and the sequence gathered at the dim it implies, the constructor's ``gather_idx``
        unused as in DeepSpeed) or ``(query, key, value, *args, **kwargs)`` (before ``batch_dim_idx``: the
        constructor's ``scatter_idx`` and ``gather_idx``). ``args`` and ``kwargs`` go to the local attention."""
        rotary = None
        if (args and _is_dim(args[0])) or "batch_dim_idx" in kwargs:
            batch_dim = args[0] if args and _is_dim(args[0]) else kwargs.pop("batch_dim_idx")
            args = args[1:] if args and _is_dim(args[0]) else args
            if args and "rotary_pos_emb" not in kwargs:
                rotary, args = args[0], args[1:]
            else:
                rotary = kwargs.pop("rotary_pos_emb", None)
            scatter, gather = self._dims(batch_dim, query)
        else:
            scatter, gather = self.scatter_idx, self.gather_idx
        q, k, v = (self._exchange(x, scatter, gather, name) for x, name in ((query, "query"), (key, "key"), (value, "value")))
        if rotary is not None:
            cos, sin = (r.permute(1, 0, 2, 3) for r in rotary)
            q, k = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)
        context = self.local_attn(q, k, v, *args, **kwargs)
        return self._exchange(context, gather, scatter, "the local attention's output")

    def _dims(self, batch_dim: int, query: torch.Tensor) -> tuple[int, int]:
        """DeepSpeed's layout for ``batch_dim_idx``: (scatter, gather) dims of the first all-to-all."""
        if batch_dim not in (0, 1) or query.dim() != 4:
            raise ValueError(f"DistributedAttention: batch_dim_idx must be 0 ([B, S, H, D]) or 1 ([S, B, H, D]) with 4-d inputs, "
                             f"got {batch_dim} and a {query.dim()}-d query")  # fmt: skip
        sequence = 1 - batch_dim
        return (_HEADS, sequence) if self.scatter_idx >= 2 else (sequence, _HEADS)

    def _exchange(self, x: torch.Tensor, scatter: int, gather: int, name: str) -> torch.Tensor:
        if self._world == 1:
            return x
        size = x.shape[scatter]
        if size % self._world:
            what = "heads" if scatter % x.dim() == _HEADS else f"entries along dim {scatter % x.dim()}"
            raise DSCompileNotSupportedError(
                "sequence_process_group",
                f"DistributedAttention splitting {name}'s {size} {what} over a sequence group of {self._world} ranks "
                "(Ulysses gives each rank an equal share; DeepSpeed spreads heads the group does not divide unevenly)",
                f"use a sequence group whose size divides {size}",
            )  # fmt: skip
        return all_to_all(x, scatter, gather, self._group_name, self._world)
