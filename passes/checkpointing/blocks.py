"""Checkpoint segments for policy ``full``: the model's repeated blocks (``<...>.<index>`` module paths),
grouped into ``number_checkpoints`` runs, or runs of about equal FLOPs for a model without repeated blocks."""

from __future__ import annotations

import re

import torch
import torch.fx

from dscompile.passes.checkpointing.joint import JointInfo

_BLOCK_PATH = re.compile(r"^(.*?\.\d+)(?:\.|$)")


def block_of(node: torch.fx.Node) -> str | None:
    """The repeated block (``<...>.<index>`` module path) a node was traced in, if any.

    A node traced in backward carries the module stack of the forward op it differentiates as
    ``fwd_nn_module_stack``: a tangent-free one (the ``pow(x, 2)`` of an RMSNorm backward, the
    ``sigmoid`` of a SiLU backward) is a forward value to the cut, and belongs to that block. Read
    without it, such a node sat outside every block, so ``full`` had to compute it in forward and
    save it, and the block-internal values it reads became segment boundaries (saved too)."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return None
    for path, _type in stack.values():
        match = _BLOCK_PATH.match(str(path))
        if match:
            return match.group(1)
    return None


def _made_by_a_pass(node: torch.fx.Node) -> bool:
    """A node no tracer made (an Inductor joint-graph pattern's replacement): it has no module stack
    and no partitioner tag, where every traced node has one or the other."""
    return not any(key in node.meta for key in ("nn_module_stack", "fwd_nn_module_stack", "partitioner_tag"))


def segments(info: JointInfo, number_checkpoints: int = 0) -> dict[torch.fx.Node, int]:
    """Checkpoint segment of each forward node (-1: outside every segment, saved as usual).

    Segments are the model's repeated blocks, grouped into ``number_checkpoints`` runs when
    given; a model without repeated blocks is one segment, or ``number_checkpoints`` runs of
    roughly equal FLOPs.
    """
    blocks: list[str] = []
    block_index: dict[torch.fx.Node, int] = {}
    for node in info.forward:
        name = block_of(node)
        if name is None:
            if _made_by_a_pass(node):  # no trace of its own: it belongs where its inputs are
                inherited = [block_index[a] for a in node.all_input_nodes if a in block_index]
                if inherited:
                    block_index[node] = max(inherited)
            continue
        if name not in blocks:
            blocks.append(name)
        block_index[node] = blocks.index(name)
    if blocks:
        groups = number_checkpoints if 0 < number_checkpoints < len(blocks) else len(blocks)
        return {n: (block_index[n] * groups) // len(blocks) if n in block_index else -1 for n in info.forward}
    groups = max(1, number_checkpoints)
    total = sum(info.flops[n] for n in info.forward) or 1
    result, running = {}, 0
    for node in info.forward:
        result[node] = min(groups - 1, (running * groups) // total)
        running += info.flops[node]
    return result
