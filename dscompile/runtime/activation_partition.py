"""Shard saved activations across a group of ranks that hold identical copies, and gather them back.

DeepSpeed's ``partition_activations`` splits each checkpointed activation across the
model-parallel group, whose ranks compute the same activations, and all-gathers it before
backward uses it. This is the same transformation on the partitioned forward/backward graphs:

- forward: every saved activation (a contiguous tensor the forward hands to backward) is
  flattened, padded to a multiple of the group size ``N`` and only this rank's ``1/N`` slice is
  returned (as a copy, so the full tensor is freed after its last forward use);
- backward: just before the first use of that activation, the slices are gathered back with
  ``_c10d_functional.all_gather_into_tensor`` + ``wait_tensor`` and reshaped to the original.

The group is named by ``activation_checkpointing.partition_group_size``: consecutive ranks in
groups of that size (Megatron/DeepSpeed lay tensor-parallel groups out that way). The ranks of a
group must compute identical activations (replicated model and inputs); sharding activations
that differ would give wrong gradients, so the key is explicit, and with ``verify`` (the config's
``debug``) the forward also gathers every shard back and fails loudly when the group's copies differ.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from dscompile.graph import ds_meta, node_value, set_fake_value

log = logging.getLogger("dscompile.passes.checkpoint")
aten = torch.ops.aten
c10d = torch.ops._c10d_functional


@dataclass(frozen=True)
class PartitionGroup:
    """This rank's activation-partition group: its c10d name, size and this rank's index in it."""

    name: str
    size: int
    index: int
    ranks: tuple[int, ...]


_GROUPS: dict[tuple[int, int], PartitionGroup] = {}


def partition_group(group_size: int) -> PartitionGroup:
    """The group of ``group_size`` consecutive ranks this rank belongs to (created once, collectively).

    Every rank must call this for the same sizes in the same order (they do: every rank compiles
    the same graphs); ``group_size`` equal to the world size reuses the default group.
    """
    import torch.distributed as dist

    from dscompile.runtime.zero_ops import group_name_of

    world, rank = dist.get_world_size(), dist.get_rank()
    if group_size <= 0 or world % group_size:
        raise ValueError(f"partition group size {group_size} does not divide the world size {world}")
    key = (world, group_size)
    if key not in _GROUPS:
        if group_size == world:
            group = dist.group.WORLD
        else:
            group, _all = dist.new_subgroups(group_size)
        start = rank - rank % group_size
        _GROUPS[key] = PartitionGroup(group_name_of(group), group_size, rank % group_size, tuple(range(start, start + group_size)))
    return _GROUPS[key]


@dataclass
class PartitionResult:
    """What ``partition_saved_activations`` did: per-rank bytes before and after, and what it left whole."""

    group_size: int
    sharded: dict[str, str] = field(default_factory=dict)  # saved value -> its shard's node name in forward
    full_bytes: int = 0  # bytes of the sharded activations, whole
    shard_bytes: int = 0  # bytes this rank keeps of them
    kept_whole: dict[str, str] = field(default_factory=dict)  # saved value -> why it was not sharded

    def summary(self) -> dict[str, Any]:
        return {"group_size": self.group_size, "sharded": len(self.sharded), "full_bytes": self.full_bytes,
                "shard_bytes": self.shard_bytes, "kept_whole": self.kept_whole}


def _why_not(value: Any) -> str | None:
    if not isinstance(value, torch.Tensor):
        return "not a tensor"
    if not all(isinstance(v, int) for v in (value.numel(), *value.stride())):
        return "symbolic size"
    if value.numel() == 0:
        return "empty"
    if dense_order(value) is None:
        return "not dense (a strided view with gaps or overlaps)"
    return None


def dense_order(value: torch.Tensor) -> list[int] | None:
    """A permutation ``perm`` with ``value.permute(perm)`` contiguous (identity for contiguous tensors),
    or None. Transposed activations are common; storing them in memory order and permuting back
    after the gather gives backward a tensor with the very strides it was traced with."""
    sizes, strides = list(value.shape), list(value.stride())
    if value.is_contiguous():
        return list(range(len(sizes)))
    perm = sorted(range(len(sizes)), key=lambda d: (-strides[d], -sizes[d], d))
    expected = 1
    for d in reversed(perm):
        if sizes[d] != 1 and strides[d] != expected:
            return None
        expected *= sizes[d]
    return perm


def partition_saved_activations(
    fw: torch.fx.GraphModule,
    bw: torch.fx.GraphModule,
    num_fwd_outputs: int,
    candidates: Sequence[str],
    group: PartitionGroup,
    *,
    verify: bool = False,
) -> PartitionResult:
    """Rewrite ``fw``/``bw`` so that each saved value named in ``candidates`` crosses as a 1/N shard.

    ``verify`` adds to the forward, per sharded value, a gather of the shards and a check that they
    reassemble this rank's own copy (a debugging aid: one extra all-gather per activation)."""
    output = next(n for n in reversed(fw.graph.nodes) if n.op == "output")
    outputs = list(output.args[0])
    bw_placeholders = {n.name: n for n in bw.graph.nodes if n.op == "placeholder"}
    wanted = set(candidates)
    result = PartitionResult(group.size)
    n_ranks = group.size
    for index in range(num_fwd_outputs, len(outputs)):
        node = outputs[index]
        if not isinstance(node, torch.fx.Node) or node.name not in wanted or node.name not in bw_placeholders:
            continue
        value = node_value(node)
        reason = _why_not(value)
        if reason is not None:
            result.kept_whole[node.name] = reason
            continue
        numel = int(value.numel())
        length = -(-numel // n_ranks)
        is_bool = value.dtype == torch.bool
        perm = dense_order(value)
        assert perm is not None
        identity = perm == sorted(perm)
        graph = fw.graph
        with graph.inserting_before(output):
            ordered = node if identity else _new(graph, aten.permute.default, (node, perm))
            flat = _new(graph, aten.view.default, (ordered, [-1]))
            if is_bool:  # gloo and NCCL gather bytes, not bools
                flat = _new(graph, aten.view.dtype, (flat, torch.uint8))
            if numel != n_ranks * length:
                flat = _new(graph, aten.constant_pad_nd.default, (flat, [0, n_ranks * length - numel]))
            piece = _new(graph, aten.slice.Tensor, (flat, 0, group.index * length, (group.index + 1) * length))
            shard = _new(graph, aten.clone.default, (piece,))  # a copy: the full tensor must not stay alive
            if verify:
                _insert_check(graph, node, flat, shard, group, n_ranks)
        ds_meta(shard)["activation_partition"] = {"of": node.name, "group": group.name, "size": n_ranks, "numel": numel}
        outputs[index] = shard
        placeholder = bw_placeholders[node.name]
        placeholder.meta["val"] = node_value(shard)
        users = list(placeholder.users)
        if users:
            order = {n: i for i, n in enumerate(bw.graph.nodes)}
            first_use = min(users, key=order.__getitem__)
            bgraph = bw.graph
            with bgraph.inserting_before(first_use):
                gathered = _new(bgraph, c10d.all_gather_into_tensor.default, (placeholder, n_ranks, group.name))
                waited = _new(bgraph, c10d.wait_tensor.default, (gathered,))
                full = waited
                if numel != n_ranks * length:
                    full = _new(bgraph, aten.slice.Tensor, (full, 0, 0, numel))
                if is_bool:
                    full = _new(bgraph, aten.view.dtype, (full, torch.bool))
                restored = _new(bgraph, aten.view.default, (full, [value.shape[d] for d in perm]))
                if not identity:
                    inverse = sorted(range(len(perm)), key=perm.__getitem__)
                    restored = _new(bgraph, aten.permute.default, (restored, inverse))
            ds_meta(gathered)["activation_partition"] = {"of": node.name, "group": group.name, "size": n_ranks, "numel": numel}
            placeholder.replace_all_uses_with(restored)
            gathered.args = (placeholder, *gathered.args[1:])  # the gather itself still reads the shard
        result.sharded[node.name] = shard.name
        result.full_bytes += numel * value.element_size()
        result.shard_bytes += length * value.element_size()
    output.args = (tuple(outputs),)
    for module in (fw, bw):
        module.graph.lint()
        module.recompile()
    return result


def _insert_check(graph: torch.fx.Graph, node: torch.fx.Node, flat: torch.fx.Node, shard: torch.fx.Node,
                  group: PartitionGroup, n_ranks: int) -> None:
    """Forward-side check that every rank of the group holds the same ``node``: gather the shards and
    compare with this rank's flat copy (floats within 1e-5 relative, others exactly)."""
    gathered = _new(graph, c10d.all_gather_into_tensor.default, (shard, n_ranks, group.name))
    waited = _new(graph, c10d.wait_tensor.default, (gathered,))
    if node_value(flat).is_floating_point():
        same = _new(graph, aten.isclose.default, (waited, flat, 1e-5, 1e-6))
    else:
        same = _new(graph, aten.eq.Tensor, (waited, flat))
    every = _new(graph, aten.all.default, (same,))
    message = (f"partition_activations: the ranks {list(group.ranks)} hold different values of saved activation "
               f"'{node.name}', so they are not replicas; fix partition_group_size (or the inputs) or drop partition_activations")
    _new(graph, aten._assert_async.msg, (every, message))


def _new(graph: torch.fx.Graph, target: Any, args: tuple[Any, ...]) -> torch.fx.Node:
    node = graph.call_function(target, args)
    set_fake_value(node)
    return node


__all__ = ["PartitionGroup", "PartitionResult", "partition_group", "partition_saved_activations"]
