"""Megatron's sequence parallelism inside tensor parallelism (``tensor_parallel.sequence_parallel``).

Runs on the graph ``passes/tensor_parallel/`` split (``parallelize`` calls ``find_sequence`` and
``shard_sequence``): between the blocks the residual stream holds each rank's chunk of the sequence, each
block's all-reduce becomes a reduce-scatter along the sequence and an all-gather goes before the next block's
column-parallel linears, so the norms, residual adds and dropouts between the blocks run on a chunk.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from dscompile.errors import DSCompileConfigError
from dscompile.passes.tensor_parallel.graph_facts import POINTWISE, SECTION, VIEWS, node_shape, view_groups
from dscompile.runtime.tensor_parallel import sp_gather, sp_reduce_scatter, sp_scatter, tp_copy, tp_reduce

log = logging.getLogger("dscompile.passes.tensor_parallel")
aten = torch.ops.aten

SP_KEY = f"{SECTION}.sequence_parallel"


@dataclass(frozen=True)
class SequenceLayout:
    """The token ids' ``[batch, sequence]`` sizes, read from the graph (the integer input an embedding reads)."""

    batch: int
    length: int
    tp: int

    @property
    def local(self) -> int:
        """Tokens of each rank's chunk (a length TP does not divide is padded to a multiple of it)."""
        return -(-self.length // self.tp)


def find_sequence(gm: fx.GraphModule, tp: int) -> SequenceLayout:
    """The batch and sequence length of the token ids: the 2-D integer input that an embedding reads (through views)."""
    found: set[tuple[int, ...]] = set()
    for node in gm.graph.nodes:
        if node.target is not aten.embedding.default:
            continue
        ids = node.args[1]
        while isinstance(ids, fx.Node) and ids.op == "call_function" and (ids.target in VIEWS or ids.target is aten.clone.default):
            ids = ids.args[0]
        shape = node_shape(ids)
        if isinstance(ids, fx.Node) and ids.op == "placeholder" and shape is not None and len(shape) == 2:
            found.add(shape)
    if len(found) != 1:
        raise DSCompileConfigError(
            SP_KEY,
            "the token ids' sequence length is not found in the graph "
            + ("(no embedding reads a [batch, sequence] integer input)" if not found else f"(embeddings read inputs of shapes {sorted(found)})"),
            "set tensor_parallel.sequence_parallel to false for this model",
        )
    batch, length = found.pop()
    if length % tp:
        log.info("tensor_parallel: sequence_parallel pads %d tokens to %d between blocks", length, -(-length // tp) * tp)
    return SequenceLayout(batch, length, tp)


def _sequence_through_view(src: tuple[int, ...], dst: tuple[int, ...], dim: int, batch: int, seq: SequenceLayout) -> tuple[int, int] | None:
    """Where the sequence chunk of ``src`` (``dim``; ``batch`` > 0: ``[batch * sequence]`` flattened) lands in a view
    to ``dst``, or None when the view mixes it with other dims (a reader that then reads it gathered)."""
    for gi, gj in view_groups(src, dst):
        if dim not in gi:
            continue
        gi = [k for k in gi if k < len(src)]
        gj = [k for k in gj if k < len(dst)]
        if gi == [dim] and len(gj) == 1:
            return gj[0], batch
        if not batch and gi[-1] == dim and len(gj) == 1 and math.prod(src[k] for k in gi[:-1]) == seq.batch:
            return gj[0], seq.batch  # [B, S] merged into tokens
        if batch and gi == [dim] and len(gj) == 2 and (dst[gj[0]], dst[gj[1]]) == (seq.batch, seq.length):
            return gj[1], 0  # tokens split into [B, S]
        return None
    return None


_PER_TOKEN_REDUCTIONS = {aten.mean.dim, aten.sum.dim_IntList}
_NORMS = {aten.layer_norm.default: (2, 3), aten.rms_norm.default: (2,)}  # the norm -> its weight/bias argument positions


class _SequenceSharding:
    """Walks the split graph once, in order, keeping which values hold only this rank's sequence chunk."""

    def __init__(self, gm: fx.GraphModule, seq: SequenceLayout, group: Any, tp: int, rank: int) -> None:
        self.gm, self.graph, self.seq = gm, gm.graph, seq
        self.group, self.tp, self.rank = group, tp, rank
        self.sharded: dict[fx.Node, tuple[int, int]] = {}  # node -> (its sequence dim, batch if that dim is [batch * sequence])
        self.gathered: dict[fx.Node, fx.Node] = {}
        self.scattered: dict[tuple[fx.Node, int, int], fx.Node] = {}
        self.summed: dict[fx.Node, fx.Node] = {}
        self.counts = {"reduce_scatters": 0, "all_gathers_before_blocks": 0, "all_gathers_for_readers": 0, "scatters": 0, "gradient_sums": 0}
        self.readers: list[str] = []  # the ops that read a gathered sequence (the LM head, the loss, outputs)
        self.summed_names: list[str] = []  # the whole values read on chunks whose gradients are summed over the group
        self.kept_whole: list[str] = []  # block all-reduces left as they were (an output not laid out [batch, sequence, ...])

    def _insert(self, before: fx.Node, fn: Any, args: tuple, val_of: fx.Node, tag: str) -> fx.Node:
        with self.graph.inserting_before(before):
            new = self.graph.call_function(fn, args)
        new.meta["val"] = val_of.meta.get("val")  # the full (unsplit) value, as every value's meta here
        new.meta.setdefault("dscompile", {})["shard"] = tag
        return new

    def run(self) -> dict[str, Any]:
        for node in list(self.graph.nodes):
            if node.op == "call_function" and node.target is tp_reduce and node.meta.get("dscompile", {}).get("shard") == "tp_reduce":
                self._reduce_scatter(node)
            elif node.op == "call_function" and node.target is tp_copy and node.args[0] in self.sharded:
                self._gather_before_block(node)
            elif any(a in self.sharded for a in node.all_input_nodes):
                if not self._on_chunk(node):
                    self._read_gathered(node)
        if not self.counts["reduce_scatters"]:
            raise DSCompileConfigError(SP_KEY, "no split block's output could be scattered along the sequence", f"set {SP_KEY} to false")
        self.graph.lint()
        self.gm.recompile()
        padded = self.seq.local * self.tp
        layout = {"batch": self.seq.batch, "seq_len": self.seq.length, "padded_to": padded}
        return {**layout, **self.counts, "gathered_for": self.readers, "gradients_summed": self.summed_names, "all_reduces_kept": self.kept_whole}

    def _reduce_scatter(self, node: fx.Node) -> None:
        partial = node.args[0]
        shape = node_shape(partial)
        assert shape is not None
        prefix = shape[:-1]
        b, s = self.seq.batch, self.seq.length
        if prefix == (b, s):
            dim, batch = len(shape) - 2, 0
        elif prefix == (b * s,):
            dim, batch = 0, b
        elif prefix == (s, b):
            dim, batch = 0, 0
        else:  # not token by token: this block keeps its all-reduce, its output whole
            log.warning("tensor_parallel: sequence_parallel leaves %s whole: its shape %s has no [batch, sequence] prefix (%d, %d)", node.name, shape, b, s)
            self.kept_whole.append(node.name)
            return
        scattered = self._insert(node, sp_reduce_scatter, (partial, dim, batch, self.seq.length, self.group, self.tp), node, "sp_reduce_scatter")
        node.replace_all_uses_with(scattered)
        self.graph.erase_node(node)
        self.sharded[scattered] = (dim, batch)
        self.counts["reduce_scatters"] += 1

    def _gather_before_block(self, node: fx.Node) -> None:
        x = node.args[0]
        dim, batch = self.sharded[x]
        gathered = self._insert(node, sp_gather, (x, dim, batch, self.seq.length, self.group, self.tp, self.rank, True), x, "sp_all_gather")
        node.replace_all_uses_with(gathered)
        self.graph.erase_node(node)
        self.counts["all_gathers_before_blocks"] += 1

    def _read_gathered(self, node: fx.Node) -> None:
        """A reader not known to work on a chunk reads the whole sequence (backward: its chunk of the gradient)."""
        for x in [a for a in node.all_input_nodes if a in self.sharded]:
            if x not in self.gathered:
                dim, batch = self.sharded[x]
                with self.graph.inserting_after(x):
                    g = self.graph.call_function(sp_gather, (x, dim, batch, self.seq.length, self.group, self.tp, self.rank, False))
                g.meta["val"] = x.meta.get("val")
                g.meta.setdefault("dscompile", {})["shard"] = "sp_all_gather"
                self.gathered[x] = g
                self.counts["all_gathers_for_readers"] += 1
            node.replace_input_with(x, self.gathered[x])
        self.readers.append(node.name)

    def _scatter(self, node: fx.Node, whole: fx.Node, dim: int, batch: int) -> None:
        key = (whole, dim, batch)
        if key not in self.scattered:
            self.scattered[key] = self._insert(node, sp_scatter, (whole, dim, batch, self.seq.length, self.group, self.tp, self.rank), whole, "sp_scatter")
            self.counts["scatters"] += 1
        node.replace_input_with(whole, self.scattered[key])

    def _sum_gradient(self, node: fx.Node, whole: fx.Node) -> None:
        """A whole value broadcast over the chunk (a norm's weight, a bias added after the reduce-scatter): each rank
        computes its tokens' part of its gradient, summed over the group (identity forward, all-reduce backward)."""
        val = whole.meta.get("val")
        if not isinstance(val, torch.Tensor) or not val.is_floating_point():
            return
        if whole not in self.summed:
            self.summed[whole] = self._insert(node, tp_copy, (whole, self.group), whole, "sp_gradient_sum")
            self.counts["gradient_sums"] += 1
            self.summed_names.append(str(whole.target) if whole.op == "get_attr" else whole.name)
        node.replace_input_with(whole, self.summed[whole])

    def _on_chunk(self, node: fx.Node) -> bool:
        """Rewrite ``node`` to run on this rank's chunk when it works token by token; False when it may not."""
        if node.op != "call_function":
            return False
        out_shape = node_shape(node)
        target = node.target
        ins = [a for a in node.all_input_nodes if a in self.sharded]
        if out_shape is None:
            return False
        if target in VIEWS:
            dim, batch = self.sharded[node.args[0]]  # type: ignore[index]
            placed = _sequence_through_view(node_shape(node.args[0]), out_shape, dim, batch, self.seq)  # type: ignore[arg-type]
            sizes = node.args[1]
            if placed is None or not isinstance(sizes, (list, tuple)) or not isinstance(sizes[placed[0]], int):
                return False
            sizes = list(sizes)
            if sizes[placed[0]] != -1:  # S -> this rank's chunk, B * S -> B chunks
                sizes[placed[0]] = sizes[placed[0]] // self.seq.length * self.seq.local
            node.args = (node.args[0], sizes, *node.args[2:])
            self.sharded[node] = placed
            return True
        if target in _NORMS or target in _PER_TOKEN_REDUCTIONS:
            if len(ins) != 1 or node.args[0] is not ins[0]:
                return False
            dim, batch = self.sharded[ins[0]]
            n = len(node_shape(ins[0]))  # type: ignore[arg-type]
            if target in _NORMS:
                if len(node.args[1]) > n - 1 - dim:  # type: ignore[arg-type]  # normalized over the sequence too
                    return False
                for pos in _NORMS[target]:
                    w = node.args[pos] if len(node.args) > pos else None
                    if isinstance(w, fx.Node):
                        self._sum_gradient(node, w)
                self.sharded[node] = (dim, batch)
                return True
            dims = node.args[1] if len(node.args) > 1 else None
            if not isinstance(dims, (list, tuple)) or not dims:
                return False
            dims = [k % n for k in dims]
            if dim in dims:
                return False
            keep = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim", False))
            self.sharded[node] = (dim if keep else dim - sum(1 for k in dims if k < dim), batch)
            return True
        if target not in POINTWISE:
            return False
        n = len(out_shape)
        placed = {(self.sharded[a][0] + n - len(node_shape(a)), self.sharded[a][1]) for a in ins}  # type: ignore[arg-type]
        if len(placed) != 1:
            return False
        ((dim, batch),) = placed
        cut, summed = [], []
        for a in [a for a in node.all_input_nodes if a not in self.sharded]:
            sa = node_shape(a)
            if sa is None:
                continue
            k = dim - (n - len(sa))
            if k >= 0 and sa[k] != 1:
                if sa[k] != out_shape[dim]:
                    return False
                cut.append((a, k))  # whole along the sequence: this rank's chunk of it
            else:
                summed.append(a)
        for a, k in cut:
            self._scatter(node, a, k, batch)
        for a in summed:
            self._sum_gradient(node, a)
        self.sharded[node] = (dim, batch)
        return True


def shard_sequence(gm: fx.GraphModule, seq: SequenceLayout, group: Any, tp: int, rank: int) -> dict[str, Any]:
    """Megatron's sequence parallelism on the split graph: between blocks the residual stream holds this rank's
    sequence chunk.

    Each block's all-reduce after its row-parallel linear becomes a reduce-scatter along the sequence (backward:
    all-gather); the ops after it that work token by token (residual adds, norms, dropouts, casts, views that keep
    the sequence) run on the chunk; the ``tp_copy`` before a block's column-parallel linears becomes an all-gather
    along the sequence (backward: reduce-scatter). A whole value meeting a chunk along the sequence (the embedding
    output entering the first residual add) is cut to the chunk (backward: all-gather); one broadcast over it (a
    norm's weight, the row-parallel bias) is read through ``tp_copy``, so its per-rank partial gradients are summed
    over the group. Any other reader (the LM head, the loss, an output, an op not known to work token by token)
    reads the all-gathered sequence (backward: its chunk of the gradient)."""
    return _SequenceSharding(gm, seq, group, tp, rank).run()
