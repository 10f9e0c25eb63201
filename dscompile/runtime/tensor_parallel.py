"""What tensor parallelism runs outside the pass: its collectives, the partitioned module, its gradients.

- ``tp_copy`` / ``tp_reduce``: Megatron's *f* and *g* as autograd functions over functional collectives
  (``torch.ops._c10d_functional``), so Dynamo and AOTAutograd trace them into the graphs as
  ``_c10d_functional.all_reduce`` + ``wait_tensor``: ``tp_copy`` (before the column-parallel linears of a
  block) is the identity forward and an all-reduce of the input's gradient backward; ``tp_reduce`` (after
  the row-parallel linear) all-reduces the partial outputs forward and passes the gradient through backward.
- Megatron's sequence parallelism (``tensor_parallel.sequence_parallel``): ``sp_reduce_scatter`` (a row-parallel
  output summed and scattered along the sequence; backward all-gather), ``sp_gather`` (a sequence chunk
  all-gathered; backward a reduce-scatter before column-parallel linears, whose input gradients are partial per
  rank, or this rank's chunk of the gradient for any other reader, which runs alike on every rank) and
  ``sp_scatter`` (a whole value cut to this rank's chunk; backward all-gather). A ``batch`` > 0 names a
  dimension that is ``[batch * sequence]`` flattened (Conv1D's 2-D tokens), chunked along the sequence within it.
- ``TensorParallelGradients``: data parallelism over the DP group only (TP peers hold different slices),
  gradient clipping by the global norm (sliced parameters' squares summed over the TP group), and
  ``full_parameters`` gathered back to the unpartitioned layout.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dscompile.runtime.process_groups import ProcessGroups


def sum_in_group(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum over a process group (by name) as one functional collective and its wait (graph nodes once traced)."""
    c10d = torch.ops._c10d_functional
    return c10d.wait_tensor(c10d.all_reduce(x.contiguous(), "sum", group_name))


def gather_in_group(x: torch.Tensor, dim: int, group_name: str, world: int) -> torch.Tensor:
    """All-gather along ``dim`` over a process group (by name), ranks in order: one functional collective and its wait."""
    c10d = torch.ops._c10d_functional
    moved = x.movedim(dim, 0).contiguous()
    got = c10d.wait_tensor(c10d.all_gather_into_tensor(moved, world, group_name))
    return got.movedim(0, dim)


class _CopyToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return sum_in_group(grad, ctx.group), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        return sum_in_group(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def tp_copy(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Megatron's *f*: identity forward, all-reduce of the gradient backward (input of column-parallel linears)."""
    return _CopyToTensorParallel.apply(x, group)


def tp_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Megatron's *g*: all-reduce forward (partial sums of row-parallel linears), identity backward."""
    return _ReduceFromTensorParallel.apply(x, group)


def _padded_length(length: int, world: int) -> int:
    return -(-length // world) * world


def _seq_first(x: torch.Tensor, dim: int, batch: int) -> torch.Tensor:
    """``x`` with its sequence dimension first (a flattened ``[batch * sequence]`` dim unflattened first), contiguous."""
    if batch:
        x = x.unflatten(dim, (batch, -1))
        dim += 1
    return x.movedim(dim, 0).contiguous()


def _seq_back(x: torch.Tensor, dim: int, batch: int) -> torch.Tensor:
    """Undo ``_seq_first``."""
    if batch:
        return x.movedim(0, dim + 1).flatten(dim, dim + 1)
    return x.movedim(0, dim)


def _pad_to(x: torch.Tensor, length: int) -> torch.Tensor:
    """``x`` (sequence first) with zero tokens after its own up to ``length``."""
    extra = length - x.shape[0]
    return torch.cat([x, x.new_zeros((extra, *x.shape[1:]))]) if extra else x


def _sequence_sum_scatter(x: torch.Tensor, dim: int, batch: int, length: int, group: Any, world: int) -> torch.Tensor:
    c10d = torch.ops._c10d_functional
    whole = _pad_to(_seq_first(x, dim, batch), _padded_length(length, world))
    got = c10d.wait_tensor(c10d.reduce_scatter_tensor(whole, "sum", world, group))
    return _seq_back(got, dim, batch)


def _sequence_gather(x: torch.Tensor, dim: int, batch: int, length: int, group: Any, world: int) -> torch.Tensor:
    c10d = torch.ops._c10d_functional
    got = c10d.wait_tensor(c10d.all_gather_into_tensor(_seq_first(x, dim, batch), world, group))
    return _seq_back(got[:length], dim, batch)  # the padding tokens dropped


def _sequence_chunk(x: torch.Tensor, dim: int, batch: int, length: int, rank: int, world: int) -> torch.Tensor:
    whole = _pad_to(_seq_first(x, dim, batch), _padded_length(length, world))
    return _seq_back(whole.chunk(world)[rank].contiguous(), dim, batch)


class _SequenceReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, batch: int, length: int, group: Any, world: int) -> torch.Tensor:
        ctx.args = (dim, batch, length, group, world)
        return _sequence_sum_scatter(x, dim, batch, length, group, world)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _sequence_gather(grad, *ctx.args), None, None, None, None, None


class _SequenceGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, batch: int, length: int, group: Any, world: int, rank: int, partial_grad: bool) -> torch.Tensor:
        ctx.args = (dim, batch, length, group, world, rank, partial_grad)
        return _sequence_gather(x, dim, batch, length, group, world)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        dim, batch, length, group, world, rank, partial_grad = ctx.args
        if partial_grad:  # every rank holds a partial sum of the whole gradient: sum, and keep this rank's chunk
            g = _sequence_sum_scatter(grad, dim, batch, length, group, world)
        else:  # the readers ran alike on every rank: the same whole gradient everywhere, this rank's chunk is its part
            g = _sequence_chunk(grad, dim, batch, length, rank, world)
        return g, None, None, None, None, None, None, None


class _SequenceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, batch: int, length: int, group: Any, world: int, rank: int) -> torch.Tensor:
        ctx.args = (dim, batch, length, group, world)
        return _sequence_chunk(x, dim, batch, length, rank, world)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _sequence_gather(grad, *ctx.args), None, None, None, None, None, None


def sp_reduce_scatter(x: torch.Tensor, dim: int, batch: int, length: int, group: Any, world: int) -> torch.Tensor:
    """Sequence parallelism's *g*: the row-parallel partial sums summed over the TP group and scattered along the
    sequence (``dim``, ``length`` tokens; ``batch`` > 0: a flattened ``[batch * sequence]`` dim), this rank keeping
    its chunk; a length the group does not divide is padded with zero tokens to a multiple of it first.
    Backward: the chunks' gradients all-gathered, the padding dropped."""
    return _SequenceReduceScatter.apply(x, dim, batch, length, group, world)


def sp_gather(x: torch.Tensor, dim: int, batch: int, length: int, group: Any, world: int, rank: int, partial_grad: bool) -> torch.Tensor:
    """The whole sequence from every rank's chunk (all-gather along ``dim``, the padding dropped). Backward: with
    ``partial_grad`` (sequence parallelism's *f*, before column-parallel linears) the partial gradients
    reduce-scattered; without, this rank's chunk of the gradient (a reader that runs alike on every rank: the LM
    head, the loss, an output)."""
    return _SequenceGather.apply(x, dim, batch, length, group, world, rank, partial_grad)


def sp_scatter(x: torch.Tensor, dim: int, batch: int, length: int, group: Any, world: int, rank: int) -> torch.Tensor:
    """A whole value (the same on every rank) cut to this rank's sequence chunk (padded as ``sp_reduce_scatter``);
    backward: the chunks' gradients all-gathered (each rank's chunk holds the gradient of its tokens only)."""
    return _SequenceScatter.apply(x, dim, batch, length, group, world, rank)


class _SumOverReplicas(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, group: Any, slot: int, slots: int) -> torch.Tensor:
        ctx.group, ctx.slot, ctx.slots = group, slot, slots
        return w.view_as(w)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        placed = grad.new_zeros((ctx.slots, *grad.shape)).select_scatter(grad, 0, ctx.slot)
        return sum_in_group(placed, ctx.group)[ctx.slot], None, None, None


def tp_sum_replicas(w: torch.Tensor, group: Any, slot: int, slots: int) -> torch.Tensor:
    """A weight held by several TP ranks (a KV head shared by their query heads; ``SliceSpec.replicas``): identity
    forward; backward, each rank's gradient put at its head's ``slot`` of ``slots`` zeros, summed over the group,
    and its slot taken back, so every rank holding the head gets the sum of their partial gradients (one
    all-reduce, a graph node once traced)."""
    return _SumOverReplicas.apply(w, group, slot, slots)


def units_of_rank(units: int, rank: int, world: int) -> tuple[int, int]:
    """``(first, count)``: the units (heads, KV groups, hidden units) of ``units`` that ``rank`` holds, balanced."""
    base, extra = divmod(units, world)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def padded_units(units: int, world: int) -> int:
    """Units every rank holds, padding included: the largest share."""
    return -(-units // world)


def _all_reduce_max(x: torch.Tensor, group_name: str) -> torch.Tensor:
    c10d = torch.ops._c10d_functional
    return c10d.wait_tensor(c10d.all_reduce(x.contiguous(), "max", group_name))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of logits whose vocabulary is split over the TP group (each rank: its columns).

    Three all-reduces of ``[N]`` vectors (the row maximum, the sum of exponentials, the target's logit)
    stand in for gathering ``[N, V]`` logits; the backward is local: ``softmax - onehot`` on this rank's columns.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, group: Any, first: int, count: int, ignore_index: int) -> torch.Tensor:
        x = logits.float()
        columns = torch.arange(x.shape[-1], device=x.device)
        if count < x.shape[-1]:  # padded vocabulary rows: no part in the softmax
            x = x.masked_fill(columns >= count, float("-inf"))
        row_max = _all_reduce_max(x.detach().amax(dim=-1), group)
        shifted = x - row_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = sum_in_group(exp.sum(dim=-1), group)
        valid = targets != ignore_index
        local = targets - first
        mine = valid & (local >= 0) & (local < count)
        index = torch.where(mine, local, torch.zeros_like(local)).unsqueeze(-1)
        picked = torch.where(mine, shifted.gather(-1, index).squeeze(-1), torch.zeros_like(row_max))
        target_logit = sum_in_group(picked, group)
        losses = torch.where(valid, sum_exp.log() - target_logit, torch.zeros_like(row_max))
        n_valid = valid.sum()
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), index, mine, valid, n_valid)
        ctx.dtype = logits.dtype
        return (losses.sum() / n_valid).to(logits.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        softmax, index, mine, valid, n_valid = ctx.saved_tensors
        g = softmax.scatter_add(-1, index, -mine.to(softmax.dtype).unsqueeze(-1))
        g = g * (valid.to(softmax.dtype) * (grad.float() / n_valid)).unsqueeze(-1)
        return g.to(ctx.dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group: Any, first: int, count: int, ignore_index: int) -> torch.Tensor:
    """``F.cross_entropy(full_logits, targets, ignore_index=...)`` (mean) from this rank's vocabulary columns
    ``[first, first + count)`` (then padding): the same value on every rank of the group."""
    return _VocabParallelCrossEntropy.apply(logits, targets, group, first, count, ignore_index)


class _GatherVocabulary(torch.autograd.Function):
    """Every rank's vocabulary columns joined, padding dropped; backward: this rank's columns of the gradient
    (the ops after the gather run alike on every rank of the group, so nothing is summed)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, world: int, rank: int, vocab: int) -> torch.Tensor:
        held = ctx.held = x.shape[-1]
        ctx.first, ctx.count = units_of_rank(vocab, rank, world)
        gathered = gather_in_group(x, -1, group, world)
        return torch.cat([gathered.narrow(-1, r * held, units_of_rank(vocab, r, world)[1]) for r in range(world)], dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        mine = grad.narrow(-1, ctx.first, ctx.count)
        return torch.nn.functional.pad(mine, (0, ctx.held - ctx.count)), None, None, None, None  # zeros for the padding rows


def gather_vocabulary(logits: torch.Tensor, group: Any, world: int, rank: int, vocab: int) -> torch.Tensor:
    """The whole ``[..., vocab]`` logits from each rank's vocabulary-parallel columns (for a graph output or any
    use besides the parallel cross-entropy, which reads the local columns)."""
    return _GatherVocabulary.apply(logits, group, world, rank, vocab)


def vocab_parallel_embedding(weight: torch.Tensor, ids: torch.Tensor, group: Any, first: int, count: int, padding_idx: int = -1) -> torch.Tensor:
    """``F.embedding(ids, full_weight, padding_idx)`` from this rank's rows ``[first, first + count)``: ids outside
    them read a zero row here; the all-reduce (``tp_reduce``) adds the one rank's row that holds each id. The
    padding row (if this rank holds it) gets no gradient, as in ``F.embedding``."""
    local = ids - first
    outside = (local < 0) | (local >= count)
    local_padding = padding_idx - first if padding_idx >= 0 and first <= padding_idx < first + count else -1
    rows = torch.ops.aten.embedding.default(weight, local.masked_fill(outside, 0), local_padding)
    return tp_reduce(rows.masked_fill(outside.unsqueeze(-1), 0.0), group)


@dataclass(frozen=True)
class SliceSpec:
    """How a parameter is split across the TP group: along ``dim``, in ``blocks`` equal blocks each cut in TP pieces.

    ``blocks`` > 1 is a fused projection (GPT-2's ``c_attn``: q, k and v side by side), whose every
    block is split so that each rank holds its q, k and v heads. ``units`` > 0 is a split that TP does
    not divide (3 heads on 2 ranks): each block is ``units`` whole units (heads, KV-head groups, hidden
    units), rank ``r`` holds its balanced share and zeros after it, up to ``padded_units`` units, so
    every rank's slice has one shape; the zeros are padding, dropped when the slices are assembled.
    ``replicas`` > 1 is a slice held by that many consecutive ranks (a KV head shared by their query heads when
    there are fewer KV heads than ranks): the tensor is cut in ``world / replicas`` pieces, rank ``r`` holds
    piece ``r // replicas``, and assembling takes one copy of each.
    """

    dim: int
    blocks: int = 1
    units: int = 0
    replicas: int = 1
    sections: tuple[int, ...] = ()  # a fused projection of unequal parts (Phi-3's q, k, v under GQA): their sizes, each split

    def to_dict(self) -> dict[str, Any]:
        """As checkpoint metadata stores it (``from_dict`` reads it back, older files without the newer fields too)."""
        return {"dim": self.dim, "blocks": self.blocks, "units": self.units, "replicas": self.replicas, "sections": list(self.sections)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SliceSpec:
        return cls(d["dim"], d.get("blocks", 1), d.get("units", 0), d.get("replicas", 1), tuple(d.get("sections", ())))

    def take(self, full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
        if self.sections:
            return torch.cat([part.chunk(world, dim=self.dim)[rank] for part in full.split(list(self.sections), dim=self.dim)], dim=self.dim)
        if self.replicas > 1:
            return dataclasses.replace(self, replicas=1).take(full, rank // self.replicas, world // self.replicas)
        pieces = full.chunk(self.blocks, dim=self.dim)
        if not self.units:
            return torch.cat([piece.chunk(world, dim=self.dim)[rank] for piece in pieces], dim=self.dim)
        first, count = units_of_rank(self.units, rank, world)
        out = []
        for piece in pieces:
            unit = piece.shape[self.dim] // self.units
            mine = piece.narrow(self.dim, first * unit, count * unit)
            shape = list(piece.shape)
            shape[self.dim] = (padded_units(self.units, world) - count) * unit
            out += [mine, piece.new_zeros(shape)]
        return torch.cat(out, dim=self.dim)

    def assemble(self, slices: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's slice (rank order), padding dropped (and copies, for replicas)."""
        world = len(slices)
        if self.sections:
            local = [size // world for size in self.sections]
            per_rank = [s.split(local, dim=self.dim) for s in slices]
            return torch.cat([torch.cat([r[i] for r in per_rank], dim=self.dim) for i in range(len(local))], dim=self.dim)
        if self.replicas > 1:
            return dataclasses.replace(self, replicas=1).assemble(slices[:: self.replicas])
        per_rank = [s.chunk(self.blocks, dim=self.dim) for s in slices]
        if self.units:
            unit = per_rank[0][0].shape[self.dim] // padded_units(self.units, world)
            per_rank = [[b.narrow(self.dim, 0, units_of_rank(self.units, r, world)[1] * unit) for b in blocks] for r, blocks in enumerate(per_rank)]
        return torch.cat([torch.cat([r[b] for r in per_rank], dim=self.dim) for b in range(self.blocks)], dim=self.dim)


def broadcast_in_tp_group(values: Any, groups: ProcessGroups) -> None:
    """Every rank of a TP group computes on its first rank's batch (DeepSpeed leaves this to the data
    loader, and gets it wrong silently when the loader differs: DeepSpeed #7199)."""
    if groups.tp_size > 1:
        for v in values:
            if isinstance(v, torch.Tensor):
                dist.broadcast(v, src=groups.tp_ranks[0], group=groups.tp_group)


def gather_slices(tensor: torch.Tensor, groups: ProcessGroups) -> list[torch.Tensor]:
    """Every TP rank's slice of ``tensor`` (slices have equal shapes: the pass splits evenly)."""
    out = [torch.empty_like(tensor) for _ in range(groups.tp_size)]
    dist.all_gather(out, tensor.contiguous(), group=groups.tp_group)
    return out


def slicing_metadata(groups: ProcessGroups, specs: dict[str, SliceSpec]) -> dict[str, Any]:
    """What a reader needs to join the slices: the TP size, this rank, and each sliced tensor's ``SliceSpec``."""
    return {
        "tp_size": groups.tp_size,
        "tp_rank": groups.tp_rank,
        "slices": {n: sp.to_dict() for n, sp in specs.items()},
    }


def tp_file_name(tp_rank: int) -> str:
    return f"mp_rank_{tp_rank:02d}_model_states.pt"


def is_tensor_parallel_checkpoint(names: list[str]) -> bool:
    return tp_file_name(1) in names
