"""What sequence parallelism runs outside its pass: the collectives the split graph calls.

Each is an autograd function over functional collectives (``torch.ops._c10d_functional``), so Dynamo
and AOTAutograd trace them into the graphs as a collective and its ``wait_tensor``, forward and backward:

- ``heads_to_sequence`` / ``sequence_to_heads``: Ulysses' all-to-alls. Before attention each rank
  trades its sequence chunk of all heads for the whole sequence of its share of heads; after
  attention the reverse. Each one's backward is the other.
- ``gather_sequence``: all-gather along the sequence (the whole sequence, replicated, for an op that
  needs it: a loss that shifts its labels, a cumulative sum). Its backward reduce-scatters (sums) the
  gradient: the ops after the gather run on every rank of the group, and gradients are averaged over
  all ranks, so the sum is what makes every rank's chunk gradient the single-process one.
"""

from __future__ import annotations

from typing import Any

import torch

from dscompile.runtime.tensor_parallel import sum_in_group


def _all_to_all(x: torch.Tensor, group_name: str, world: int) -> torch.Tensor:
    """Chunk ``i`` of dim 0 goes to rank ``i``; chunk ``i`` of the result came from rank ``i``."""
    c10d = torch.ops._c10d_functional
    sizes = [x.shape[0] // world] * world
    return c10d.wait_tensor(c10d.all_to_all_single(x.contiguous(), sizes, sizes, group_name))


def _heads_to_sequence(x: torch.Tensor, group_name: str, world: int) -> torch.Tensor:
    """[B, H, S/N, D] (all heads, this rank's chunk) -> [B, H/N, S, D] (this rank's heads, every chunk)."""
    b, h, s, d = x.shape
    parts = x.reshape(b, world, h // world, s, d).permute(1, 0, 2, 3, 4)
    got = _all_to_all(parts, group_name, world)  # [N (chunk), B, H/N, S/N, D]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // world, world * s, d)


def _sequence_to_heads(x: torch.Tensor, group_name: str, world: int) -> torch.Tensor:
    """[B, H/N, S, D] -> [B, H, S/N, D]: the inverse of ``_heads_to_sequence``."""
    b, h, s, d = x.shape
    parts = x.reshape(b, h, world, s // world, d).permute(2, 0, 1, 3, 4)
    got = _all_to_all(parts, group_name, world)  # [N (head group), B, H/N, S/N, D]
    return got.permute(1, 0, 2, 3, 4).reshape(b, world * h, s // world, d)


class _UlyssesAllToAll(torch.autograd.Function):
    """One of the two all-to-alls forward; the other one backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group_name: str, world: int, to_sequence: bool) -> torch.Tensor:
        ctx.group_name, ctx.world, ctx.to_sequence = group_name, world, to_sequence
        return (_heads_to_sequence if to_sequence else _sequence_to_heads)(x, group_name, world)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return (_sequence_to_heads if ctx.to_sequence else _heads_to_sequence)(grad, ctx.group_name, ctx.world), None, None, None


def heads_to_sequence(x: torch.Tensor, group_name: str, world: int) -> torch.Tensor:
    """Ulysses' all-to-all before attention: [B, H, S/N, D] -> [B, H/N, S, D]."""
    return _UlyssesAllToAll.apply(x, group_name, world, True)


def sequence_to_heads(x: torch.Tensor, group_name: str, world: int) -> torch.Tensor:
    """Ulysses' all-to-all after attention: [B, H/N, S, D] -> [B, H, S/N, D]."""
    return _UlyssesAllToAll.apply(x, group_name, world, False)


def _gather(x: torch.Tensor, dim: int, group_name: str, world: int) -> torch.Tensor:
    c10d = torch.ops._c10d_functional
    moved = x.movedim(dim, 0).contiguous()
    got = c10d.wait_tensor(c10d.all_gather_into_tensor(moved, world, group_name))
    return got.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group_name: str, world: int) -> torch.Tensor:
    c10d = torch.ops._c10d_functional
    moved = x.movedim(dim, 0).contiguous()
    got = c10d.wait_tensor(c10d.reduce_scatter_tensor(moved, "sum", world, group_name))
    return got.movedim(0, dim)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group_name: str, world: int) -> torch.Tensor:
        ctx.dim, ctx.group_name, ctx.world = dim, group_name, world
        return _gather(x, dim, group_name, world)

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
