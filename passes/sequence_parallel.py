"""Ulysses sequence parallelism found from the graph: each rank of a group runs its chunk of the sequence.

DeepSpeed-Ulysses asks the model to take its chunk of the sequence (its position ids too) and wraps the
attention module in ``DistributedAttention``. Here the model is captured whole (``torch.export``,
non-strict, at the first batch, as tensor parallelism captures it) and the pass rewrites the ATen graph:

- the token embeddings' outputs (``aten.embedding`` over an index of the attention's sequence length)
  are cut to this rank's chunk of the sequence; a length the group size does not divide is padded at
  its end (DeepSpeed #7384 is silently wrong there);
- the chunk is followed through the graph: ops that work token by token keep it (views, pointwise ops,
  linears, norms, reductions over other dimensions, softmax over another dimension, slices and
  concatenations along others), and their sizes along the sequence are rewritten to the chunk's; a
  whole-sequence tensor met by a chunk (position embeddings, rotary tables, a mask added to scores) is
  cut to the same chunk there;
- each ``scaled_dot_product_attention`` whose query, key and value are chunks gets Ulysses'
  all-to-all before it (all heads of a chunk -> a share of the heads over the whole sequence) and the
  reverse after it; GQA's key/value heads travel as they are when the group divides them, else they are
  repeated to the query heads first; a mask is cut to the rank's heads and padded with the sequence;
- a token cross-entropy over flattened logits (how Hugging Face and most training loops compute the LM
  loss, its labels shifted beforehand) is computed on the chunk's tokens: partial sums added over the
  group by one scalar all-reduce, a mean divided by the non-ignored targets of the whole sequence, so
  the logits (the largest activation of a language model) are never gathered;
- any other op that needs the whole sequence (a loss that slices the logits to shift them, attention
  scores of the explicit softmax form, a cumulative sum) gets the whole sequence gathered before it
  (``gather_sequence``: all-gather forward, reduce-scatter backward) and runs on every rank; so does
  the graph's output. The explicit form of attention thus runs with its keys and values gathered.

Every rank of a group then computes the same loss on the same batch, and the gradients are right when
averaged over all ranks (the data-parallel average over the whole world: the group's ranks hold the same
parameters, as DeepSpeed's "sequence data parallel" group does), so ZeRO 1-3 shard over the whole world.
The engine's part: groups of ``sequence_parallel_size`` consecutive ranks, every batch broadcast inside
its group, batch sizes counted per group.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import operator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from dscompile.errors import DSCompileConfigError
from dscompile.passes.tensor_parallel import TensorParallelModule, capture, refuse_layouts_per_head
from dscompile.planner import PlannedConfig
from dscompile.runtime.engine_core import EngineExtension, register_engine_extension
from dscompile.runtime.process_groups import ProcessGroups, build_process_groups
from dscompile.runtime.sequence_parallel import (
    DistributedAttention,
    cross_entropy_over_chunks,
    gather_whole_sequence,
    heads_to_sequence,
    pad_attention_mask,
    sequence_chunk,
    sequence_to_heads,
)
from dscompile.runtime.training_core import TrainingCore

log = logging.getLogger("dscompile.passes.sequence_parallel")
aten = torch.ops.aten
KEY = "sequence_parallel_size"


def sequence_parallel_size(config: Any) -> int:
    """DeepSpeed's top-level ``sequence_parallel_size`` (1: off)."""
    sections = getattr(config, "sections", {})
    return int(sections.get(KEY) or 1)


@dataclass
class SequenceParallelPlan:
    """The pass's decisions, for users and tests (``engine.extension("sequence_parallel").plan``) and the dump
    (``DUMP/sequence_parallel_plan_<tokens>.json``, one per captured length)."""

    sp_size: int
    seq_len: int
    chunk: int
    seeds: list[str] = field(default_factory=list)  # the nodes cut into chunks
    ulysses: list[str] = field(default_factory=list)  # attentions run with Ulysses' all-to-alls
    gathered: list[dict[str, str]] = field(default_factory=list)  # where the whole sequence was gathered, and why
    chunked_losses: list[str] = field(default_factory=list)  # cross-entropies computed on the chunks (logits never gathered)

    @property
    def padded(self) -> bool:
        return self.chunk * self.sp_size != self.seq_len


class _NeedsWhole(Exception):
    """The op needs the whole sequence of its chunked inputs."""


_EXTRA_POINTWISE = {
    aten.dropout.default, aten.native_dropout.default, aten.clone.default, aten.contiguous.default,
    aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.type_as.default,
    aten.alias.default, aten.detach.default, aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.where.self,
}  # fmt: skip
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_REDUCTIONS = {
    aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default, aten.var.correction, aten.std.correction,
    aten.var_mean.correction, aten.logsumexp.default, aten.linalg_vector_norm.default,
}  # fmt: skip
_SOFTMAX = {aten._softmax.default, aten.softmax.int, aten._log_softmax.default, aten.log_softmax.int}
_NORMS = {aten.layer_norm.default, aten.rms_norm.default}
_MATMULS = {aten.matmul.default, aten.bmm.default, aten.mm.default}


def _is_pointwise(target: Any) -> bool:
    return target in _EXTRA_POINTWISE or (isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags)


def _shape(node: Any) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(int(s) for s in val.shape) if isinstance(val, torch.Tensor) else None


def _seq_dim_after_view(src: tuple[int, ...], dim: int, outer: int, dst: tuple[int, ...], seq: int) -> tuple[int, int]:
    """Where the sequence is after viewing ``src`` (sequence at ``dim``, ``outer`` sequences flattened
    into that dim) as ``dst``: the dim whose stride is the sequence's and whose size holds it whole."""
    inner = 1
    for s in src[dim + 1 :]:
        inner *= s
    suffix = 1
    for j in range(len(dst) - 1, -1, -1):
        if suffix == inner and dst[j] % seq == 0 and dst[j] >= seq:
            return j, dst[j] // seq
        suffix *= dst[j]
        if suffix > inner:
            break
    raise _NeedsWhole(f"a view {src} -> {dst} splits or merges the sequence with inner dimensions")


class _SequenceSharder:
    """Walks the graph once, in order, keeping for each chunked value its sequence dim (and how many
    sequences are flattened into it), and rewriting what meets a chunk."""

    def __init__(self, gm: fx.GraphModule, sp: int, rank: int, group_name: str, seq: int) -> None:
        self.gm, self.graph = gm, gm.graph
        self.sp, self.rank, self.group = sp, rank, group_name
        self.seq = seq
        self.chunk = -(-seq // sp)
        self.plan = SequenceParallelPlan(sp, seq, self.chunk)
        self.sharded: dict[fx.Node, tuple[int, int]] = {}
        self._chunks: dict[tuple[fx.Node, int], fx.Node] = {}
        self._wholes: dict[fx.Node, fx.Node] = {}

    # -- inserting --------------------------------------------------------------------------
    def _insert_after(self, node: fx.Node, fn: Any, args: tuple) -> fx.Node:
        with self.graph.inserting_after(node):
            new = self.graph.call_function(fn, args)
        new.meta["val"] = node.meta.get("val")  # shapes in meta stay the whole sequence's
        return new

    def chunk_of(self, node: fx.Node, dim: int) -> fx.Node:
        """This rank's chunk of a whole-sequence value (computed once, right after the value)."""
        key = (node, dim)
        if key not in self._chunks:
            self._chunks[key] = self._insert_after(node, sequence_chunk, (node, dim, self.rank, self.sp))
            self.sharded[self._chunks[key]] = (dim, 1)
        return self._chunks[key]

    def whole_of(self, node: fx.Node, reason: str) -> fx.Node:
        """The whole sequence of a chunked value, gathered once, right after the value."""
        if node not in self._wholes:
            dim, outer = self.sharded[node]
            self._wholes[node] = self._insert_after(node, gather_whole_sequence, (node, dim, self.group, self.sp, outer, self.seq))
            self.plan.gathered.append({"node": node.name, "reason": reason})
            log.info("sequence_parallel: the whole sequence of %s is gathered: %s", node.name, reason)
        return self._wholes[node]

    def _use_whole(self, node: fx.Node, reason: str) -> None:
        for a in list(node.all_input_nodes):
            if a in self.sharded:
                node.replace_input_with(a, self.whole_of(a, reason))

    # -- the walk ---------------------------------------------------------------------------
    def run(self, seeds: dict[fx.Node, int]) -> SequenceParallelPlan:
        for node in list(self.graph.nodes):
            if node.op == "output":
                self._use_whole(node, "a graph output")
                continue
            if node.op != "call_function" or not any(a in self.sharded for a in node.all_input_nodes):
                if node in seeds:
                    self._seed(node, seeds[node])
                continue
            try:
                self.visit(node)
            except _NeedsWhole as exc:
                self._use_whole(node, f"{node.name} ({node.target}): {exc}")
        self.graph.lint()
        self.gm.recompile()
        return self.plan

    def _seed(self, node: fx.Node, dim: int) -> None:
        users = list(node.users)
        chunk = self.chunk_of(node, dim)
        for u in users:
            u.replace_input_with(node, chunk)
        self.plan.seeds.append(node.name)

    def visit(self, node: fx.Node) -> None:
        target = node.target
        ins = [a for a in node.all_input_nodes if a in self.sharded]
        src = ins[0]
        dim, outer = self.sharded[src]
        in_shape, out_shape = _shape(src), _shape(node)
        if target is operator.getitem:
            self.sharded[node] = (dim, outer)
            return
        if target in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int):
            d = (node.args[2] if len(node.args) > 2 else node.args[1] if target is aten.unbind.int and len(node.args) > 1 else 0) % len(in_shape)  # type: ignore[operator,arg-type]
            if d == dim:
                raise _NeedsWhole("splits the sequence")
            self.sharded[node] = (dim - 1 if target is aten.unbind.int and d < dim else dim, outer)
            return
        if target in (aten.native_layer_norm.default, aten.native_dropout.default):  # tuples: (out, ...) keep the dim
            if target is aten.native_layer_norm.default and dim >= len(in_shape) - len(node.args[1]):  # type: ignore[arg-type,operator]
                raise _NeedsWhole("normalizes over the sequence")
            self.sharded[node] = (dim, outer)
            return
        if out_shape is None or in_shape is None:
            raise _NeedsWhole("no static shape")
        if target in _VIEWS:
            new, new_outer = _seq_dim_after_view(in_shape, dim, outer, out_shape, self.seq)
            self._rewrite_size(node, 1, new, new_outer)
            self.sharded[node] = (new, new_outer)
        elif target is aten.expand.default:
            new = dim + len(out_shape) - len(in_shape)
            self._rewrite_size(node, 1, new, outer)
            self.sharded[node] = (new, outer)
        elif target is aten.transpose.int:
            a, b = (x % len(in_shape) for x in node.args[1:3])  # type: ignore[operator]
            self.sharded[node] = (b if dim == a else a if dim == b else dim, outer)
        elif target is aten.repeat_interleave.self_int:  # GQA's key/value heads repeated for the query heads
            d = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
            if d is None or d % len(in_shape) == dim:  # type: ignore[operator]
                raise _NeedsWhole("repeats along the sequence")
            self.sharded[node] = (dim, outer)
        elif target is aten.t.default:
            self.sharded[node] = (len(in_shape) - 1 - dim, outer)
        elif target is aten.permute.default:
            self.sharded[node] = ([x % len(in_shape) for x in node.args[1]].index(dim), outer)  # type: ignore[union-attr]
        elif target is aten.unsqueeze.default:
            k = node.args[1] % len(out_shape)  # type: ignore[operator]
            self.sharded[node] = (dim + 1 if k <= dim else dim, outer)
        elif target in (aten.squeeze.dim, aten.squeeze.dims):
            dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
            gone = {d % len(in_shape) for d in dims if in_shape[d % len(in_shape)] == 1}  # type: ignore[operator]
            self.sharded[node] = (dim - sum(1 for d in gone if d < dim), outer)
        elif _is_pointwise(target):
            self._pointwise(node, out_shape)
        elif target in _NORMS:
            normalized = len(node.args[1])  # type: ignore[arg-type]
            if dim >= len(in_shape) - normalized or node.args[0] is not src or len(ins) != 1:
                raise _NeedsWhole("normalizes over the sequence")
            self.sharded[node] = (dim, outer)
        elif target is aten.linear.default:
            if node.args[0] is not src or len(ins) != 1 or dim == len(in_shape) - 1:
                raise _NeedsWhole("contracts the sequence")
            self.sharded[node] = (dim, outer)
        elif target is aten.addmm.default:
            if node.args[1] is not src or len(ins) != 1 or dim != 0:
                raise _NeedsWhole("contracts the sequence")
            self.sharded[node] = (0, outer)
        elif target in _MATMULS:
            self._matmul(node, out_shape)
        elif target in _REDUCTIONS:
            dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
            dims = [dims] if isinstance(dims, int) else list(dims or [])
            keep = bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
            reduced = {d % len(in_shape) for d in dims}
            if not reduced or dim in reduced or len(ins) != 1:
                raise _NeedsWhole("reduces over the sequence")
            self.sharded[node] = (dim if keep else dim - sum(1 for d in reduced if d < dim), outer)
        elif target in _SOFTMAX:
            if node.args[1] % len(in_shape) == dim:  # type: ignore[operator]
                raise _NeedsWhole("a softmax over the sequence")
            self.sharded[node] = (dim, outer)
        elif target is aten.slice.Tensor:
            d = (node.args[1] if len(node.args) > 1 else 0) % len(in_shape)  # type: ignore[operator]
            if d == dim and out_shape[d] != in_shape[d]:
                raise _NeedsWhole("slices the sequence")
            if d == dim:
                node.args = (node.args[0], d, 0, None, *node.args[4:])  # the whole chunk
            self.sharded[node] = (dim, outer)
        elif target is aten.cat.default:
            self._cat(node, out_shape)
        elif target is aten.scaled_dot_product_attention.default:
            self._attention(node)
        elif target is aten.cross_entropy_loss.default:
            self._cross_entropy(node)
        else:
            raise _NeedsWhole("not known to work token by token")

    # -- rules --------------------------------------------------------------------------------
    def _rewrite_size(self, node: fx.Node, position: int, dim: int, outer: int) -> None:
        sizes = node.args[position]
        if not isinstance(sizes, (list, tuple)) or dim >= len(sizes):
            raise _NeedsWhole("sizes not given as a list")
        entry = sizes[dim]
        if not isinstance(entry, int):
            raise _NeedsWhole("a symbolic size along the sequence")
        if entry == -1:
            return
        sizes = list(sizes)
        sizes[dim] = outer * self.chunk
        node.args = (*node.args[:position], sizes, *node.args[position + 1 :])

    def _align_whole_operands(self, node: fx.Node, out: int, out_rank: int, outer: int, skip: int = 0) -> None:
        """Cut each whole-sequence operand that broadcasts against the chunk along the sequence."""
        for a in node.all_input_nodes:
            shape = _shape(a)
            if a in self.sharded or shape is None:
                continue
            k = out - (out_rank - len(shape))
            if k < 0 or k >= len(shape) - skip or shape[k] == 1:
                continue
            if outer != 1 or shape[k] != self.seq:
                raise _NeedsWhole(f"meets {a.name} of size {shape[k]} along the sequence")
            node.replace_input_with(a, self.chunk_of(a, k))

    def _pointwise(self, node: fx.Node, out_shape: tuple[int, ...]) -> None:
        outs = set()
        for a in node.all_input_nodes:
            if a in self.sharded:
                shape = _shape(a)
                if shape is None:
                    raise _NeedsWhole("no static shape")
                d, o = self.sharded[a]
                outs.add((d + len(out_shape) - len(shape), o))
        if len(outs) != 1:
            raise _NeedsWhole("mixes chunks along different dimensions")
        ((out, outer),) = outs
        self._align_whole_operands(node, out, len(out_shape), outer)
        self.sharded[node] = (out, outer)

    def _matmul(self, node: fx.Node, out_shape: tuple[int, ...]) -> None:
        a, b = node.args[0], node.args[1]
        ra, rb, r = len(_shape(a) or ()), len(_shape(b) or ()), len(out_shape)
        placed: list[tuple[int, int]] = []
        if a in self.sharded:
            d, o = self.sharded[a]
            if d == ra - 1 or ra < 2:
                node.replace_input_with(a, self.whole_of(a, f"{node.name} contracts the sequence"))  # type: ignore[arg-type]
            else:
                placed.append((d + r - ra, o))
        if b in self.sharded:
            d, o = self.sharded[b]
            where = (r - 1, o) if d == rb - 1 else (d + r - rb, o) if d < rb - 2 else None
            if where is None or (placed and placed[0] != where):  # contracted, or keys against chunked queries
                node.replace_input_with(b, self.whole_of(b, f"{node.name} needs every key of the sequence"))  # type: ignore[arg-type]
            else:
                placed.append(where)
        if not placed:
            return
        out, outer = placed[0]
        if out < r - 2:  # a batch dim: whole operands broadcasting there are cut too
            self._align_whole_operands(node, out, r, outer, skip=2)
        self.sharded[node] = (out, outer)

    def _cat(self, node: fx.Node, out_shape: tuple[int, ...]) -> None:
        tensors = list(node.args[0])  # type: ignore[arg-type]
        d = (node.args[1] if len(node.args) > 1 else 0) % len(out_shape)  # type: ignore[operator]
        states = {self.sharded[t] for t in tensors if t in self.sharded}
        if len(states) != 1:
            raise _NeedsWhole("concatenates chunks along different dimensions")
        ((dim, outer),) = states
        if d == dim:
            raise _NeedsWhole("concatenates along the sequence")
        for t in tensors:
            if t not in self.sharded:
                shape = _shape(t)
                if shape is None or outer != 1 or shape[dim] != self.seq:
                    raise _NeedsWhole("concatenates a chunk with a whole tensor")
                node.replace_input_with(t, self.chunk_of(t, dim))
        self.sharded[node] = (dim, outer)

    def _cross_entropy(self, node: fx.Node) -> None:
        """A mean or summed token loss over flattened logits ``[B * S, V]``: computed on the chunk's tokens, the
        partial sums added over the group (the logits are never gathered)."""
        names = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")
        args = {"weight": None, "reduction": 1, "ignore_index": -100, "label_smoothing": 0.0} | dict(zip(names, node.args)) | dict(node.kwargs)
        logits, target = args["input"], args["target"]
        shape, target_shape = _shape(logits), _shape(target)
        if logits not in self.sharded or target in self.sharded or shape is None or target_shape is None:
            raise _NeedsWhole("the logits are not a chunk, or the targets are")
        dim, outer = self.sharded[logits]
        if len(shape) != 2 or dim != 0 or target_shape != (shape[0],):
            raise _NeedsWhole("the logits are not [tokens, classes] with one target per token")
        if args["weight"] is not None or args["reduction"] not in (1, 2):
            raise _NeedsWhole("class weights or per-token losses")
        node.target = cross_entropy_over_chunks
        node.args = (logits, target, outer, args["reduction"], args["ignore_index"], args["label_smoothing"], self.group, self.rank, self.sp)
        node.kwargs = {}
        self.plan.chunked_losses.append(node.name)

    def _attention(self, node: fx.Node) -> None:
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
        args = dict(zip(names, node.args)) | dict(node.kwargs)
        q, k, v = args["query"], args["key"], args["value"]
        if any(self.sharded.get(x) != (2, 1) for x in (q, k, v)) or len(_shape(q) or ()) != 4:
            raise _NeedsWhole("query, key and value are not all chunks of [batch, heads, sequence, dim]")
        heads, kv_heads = _shape(q)[1], _shape(k)[1]  # type: ignore[index]
        if heads % self.sp:
            raise _NeedsWhole(f"{heads} heads do not split over {self.sp} ranks (Ulysses moves whole heads)")
        if kv_heads != heads and kv_heads % self.sp:  # GQA with fewer KV heads than ranks: repeat them first
            for x in (k, v):
                with self.graph.inserting_before(node):
                    rep = self.graph.call_function(aten.repeat_interleave.self_int, (x, heads // kv_heads, 1))
                rep.meta["val"] = q.meta["val"].new_empty(_shape(q)[:2] + _shape(x)[2:])  # type: ignore[index,union-attr]
                node.replace_input_with(x, rep)
            args["enable_gqa"] = False
            k, v = node.args[1], node.args[2]
        moved = []
        for x in (q, k, v):
            with self.graph.inserting_before(node):
                moved.append(self.graph.call_function(heads_to_sequence, (x, self.group, self.sp)))
        mask = args.get("attn_mask")
        if isinstance(mask, fx.Node):
            if mask in self.sharded:
                mask = self.whole_of(mask, "an attention mask computed from chunks")
            shape = _shape(mask)
            if shape is not None and len(shape) >= 3 and shape[-3] == heads and heads > 1:
                share = heads // self.sp
                with self.graph.inserting_before(node):
                    mask = self.graph.call_function(aten.slice.Tensor, (mask, len(shape) - 3, self.rank * share, (self.rank + 1) * share))
            if self.plan.padded:
                with self.graph.inserting_before(node):
                    mask = self.graph.call_function(pad_attention_mask, (mask, self.chunk * self.sp))
        elif self.plan.padded and not args.get("is_causal"):  # padding at the end: a causal mask keeps it out already
            name = "_sp_key_padding_mask"
            if not hasattr(self.gm, name):
                valid = torch.zeros(1, 1, 1, self.chunk * self.sp, dtype=torch.bool)
                valid[..., : self.seq] = True
                self.gm.register_buffer(name, valid)
            with self.graph.inserting_before(node):
                mask = self.graph.get_attr(name)
        kwargs = {key: args[key] for key in ("scale", "enable_gqa") if key in args}
        node.args = (*moved, mask, args.get("dropout_p", 0.0), bool(args.get("is_causal", False)))
        node.kwargs = kwargs
        back = self._insert_after(node, sequence_to_heads, (node, self.group, self.sp))
        for user in list(node.users):
            if user is not back:
                user.replace_input_with(node, back)
        self.sharded[back] = (2, 1)
        self.plan.ulysses.append(node.name)


def _attention_length(gm: fx.GraphModule) -> int:
    """The sequence length of the graph's self-attentions (all must agree)."""
    lengths = set()
    for node in gm.graph.nodes:
        if node.target is aten.scaled_dot_product_attention.default:
            q, k = _shape(node.args[0]), _shape(node.args[1])
            if q is None or k is None or q[-2] != k[-2]:
                what = f"{node.name} is not a self-attention over one sequence (query {q}, key {k})"
                raise DSCompileConfigError(KEY, what, "sequence parallelism splits self-attention only")
            lengths.add(q[-2])
    if not lengths:  # attention of the explicit softmax form: the length of the token ids embedded
        for node in gm.graph.nodes:
            index = _shape(node.args[1]) if node.target is aten.embedding.default else None
            if index is not None and len(index) == 2:
                log.info("sequence_parallel: no scaled_dot_product_attention; the explicit form of attention runs with its keys gathered")
                return index[-1]
        what = "the graph has neither a scaled_dot_product_attention nor an embedding of [batch, sequence] token ids"
        raise DSCompileConfigError(KEY, what, "sequence parallelism splits language models")
    if len(lengths) != 1:
        raise DSCompileConfigError(KEY, f"attentions over different lengths {sorted(lengths)}", "sequence parallelism needs one sequence length per graph")
    return lengths.pop()


def _seeds(gm: fx.GraphModule, seq: int) -> dict[fx.Node, int]:
    """The embeddings of token ids (or positions) over the sequence: cut into chunks right after them."""
    seeds = {}
    for node in gm.graph.nodes:
        if node.target is aten.embedding.default:
            index = _shape(node.args[1])
            dims = [i for i, s in enumerate(index or ()) if s == seq]
            if dims:
                seeds[node] = dims[-1]
    if not seeds:
        what = "found no embedding of token ids to split along the sequence"
        raise DSCompileConfigError(KEY, what, "sequence parallelism needs a model that embeds token ids")
    return seeds


def shard_sequence(gm: fx.GraphModule, sp: int, rank: int, group_name: str) -> SequenceParallelPlan:
    """Rewrite ``gm`` (an exported ATen graph) so that this rank runs its chunk of the sequence."""
    seq = _attention_length(gm)
    plan = _SequenceSharder(gm, sp, rank, group_name, seq).run(_seeds(gm, seq))
    if not plan.ulysses:
        log.warning("sequence_parallel: no attention runs on chunks (%s); every rank computes the whole sequence", plan.gathered[:1])
    return plan


# ---------------------------------------------------------------------------------------------
# the engine's part
# ---------------------------------------------------------------------------------------------
class SequenceParallelModule(TensorParallelModule):
    """What the engine runs: at the first batch, capture and rewrite the model; then the rewritten graph.
    Every rank of a group gets the same batch (broadcast from its first rank)."""

    config_key = KEY

    dump_dir: str | None = None  # the config's dump directory: the plan is written there as JSON

    def _split(self, args: tuple, kwargs: dict) -> fx.GraphModule:
        with self._whole_parameters():
            gm = capture(self.model, args, kwargs)
        group_name = self.groups.tp_group.group_name if self.groups.tp_group is not None else ""
        plan = shard_sequence(gm, self.groups.tp_size, self.groups.tp_rank, group_name)
        self.plan = plan
        log.info(
            "sequence_parallel: %d tokens in chunks of %d over %d ranks; %d attention(s) Ulysses, %d loss(es) on chunks, %d gather(s)",
            plan.seq_len, plan.chunk, plan.sp_size, len(plan.ulysses), len(plan.chunked_losses), len(plan.gathered),
        )  # fmt: skip
        if self.dump_dir and self.groups.rank == 0:
            root = Path(self.dump_dir)
            root.mkdir(parents=True, exist_ok=True)
            (root / f"sequence_parallel_plan_{plan.seq_len}.json").write_text(json.dumps(dataclasses.asdict(plan), indent=2))
        return gm


def refuse_distributed_attention(model: nn.Module | None) -> None:
    """A model wrapping its attention in DeepSpeed's ``DistributedAttention`` already takes its chunk of the
    sequence and runs Ulysses itself; the pass would cut each chunk again."""
    found = [name for name, m in (model.named_modules() if model is not None else ()) if isinstance(m, DistributedAttention)]
    if found:
        raise DSCompileConfigError(
            KEY,
            f"the model already runs Ulysses by hand: {found[0] or 'the model'} is a DistributedAttention "
            f"({len(found)} in all), and sequence parallelism would shard its sequence a second time",
            f"either remove DistributedAttention and feed the whole sequence (dscompile then shards it from the graph), or "
            f"keep it, feed each rank its chunk and leave {KEY} at 1 (gradients are then averaged over all ranks, "
            f"as DeepSpeed's sequence-data-parallel group does)",
        )  # fmt: skip


class SequenceParallelExtension(EngineExtension):
    """Groups of consecutive ranks, the model rewritten at its first batch, data parallelism over all ranks."""

    name = "sequence_parallel"

    def __init__(self, sp: int) -> None:
        self.sp = sp
        self.module: SequenceParallelModule | None = None

    def configure(self, engine: TrainingCore) -> None:
        refuse_distributed_attention(engine.module)
        sections = engine.config.sections
        for key, clash in (
            ("tensor_parallel", sections.get("tensor_parallel") is not None and sections["tensor_parallel"].enabled),
            ("pipeline", sections.get("pipeline_parallel") is not None or engine.runs_pipeline),
            ("mpu", engine.context.process_groups is not None),
        ):
            if clash:
                raise DSCompileConfigError(KEY, f"sequence parallelism together with {key} is not built yet", f"remove {key} or {KEY}")
        refuse_layouts_per_head(sections, "sequence parallelism", f"drop {KEY}")
        self.groups: ProcessGroups = build_process_groups(self.sp, current=False)  # its "tp" groups are the sequence groups
        without = dataclasses.replace(engine.config, sections={k: v for k, v in engine.config.sections.items() if k != KEY})
        options = (lambda: PlannedConfig(without, engine.plan)) if engine.context.compiles_model else None  # the plan as it is at the compile
        engine.context.compiles_model = False  # the module compiles its rewritten graph itself
        self.engine = engine
        self.module = SequenceParallelModule(engine.module, self.groups, None, options, self._after_split)
        self.module.dump_dir = engine.config.dump or None
        engine.context.compile_target = self.module
        engine.context.after_parameters_split = []  # ZeRO partitions once the graph is captured

    def _after_split(self, split: nn.Module) -> nn.Module:
        for callback in self.engine.context.after_parameters_split or ():
            split = callback(split)
        return split

    @property
    def plan(self) -> SequenceParallelPlan | None:
        return self.module.plan if self.module is not None else None

    def counters(self) -> dict[str, Any]:
        plan = self.plan
        if plan is None:
            return {}
        return {"sp_size": plan.sp_size, "attentions_ulysses": len(plan.ulysses), "sequence_gathers": len(plan.gathered)}


@register_engine_extension(7, "sequence_parallel")
def _sequence_parallel_extension(config: Any) -> EngineExtension | None:
    sp = sequence_parallel_size(config)
    return SequenceParallelExtension(sp) if sp > 1 else None
