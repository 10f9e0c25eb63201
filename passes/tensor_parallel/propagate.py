"""Sharding propagation: follow a column-parallel linear's sliced feature dimension through the ops of a block.

``Propagator`` visits a block's nodes in order and says, per node, which dimension holds the slice, or raises
``Unsplittable`` with the reason; it notes the shapes to divide by TP, where KV heads become query heads (GQA/MQA)
and the slices of a fused projection's features. It reads shapes only and changes nothing.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from dscompile.passes.tensor_parallel.graph_facts import POINTWISE, REDUCTIONS, VIEWS, node_shape, view_groups

aten = torch.ops.aten


_NARROWABLE = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor}  # ops whose whole operand may be cut to the slice


class Unsplittable(Exception):
    """This block cannot run on a slice (the message says why)."""


def _is_empty(node: Any) -> bool:
    """A 1-D tensor of no elements: ``cat`` skips it (Hugging Face's cache starts as ``torch.tensor([])``)."""
    return node_shape(node) == (0,)


def _view_dim(src: tuple[int, ...], dst: tuple[int, ...], dim: int, heads_of_one: bool = False) -> tuple[int, bool]:
    """The dim of ``dst`` that a view of ``src`` sliced on ``dim`` is sliced on (the outermost of its group), and
    whether a size-one dim before it could have been the sliced one instead.

    Shapes cannot tell ``[.., F] -> [.., 1, F]`` as one head of ``F`` features (MQA's keys) from a size-one
    dim put before ``F`` (a decode step's sequence); the features are the default, ``heads_of_one`` picks the
    size-one dim. A sliced dim of size one (that one head) stays a size-one dim, or the outermost of a merge."""
    for gi, gj in view_groups(src, dst):
        if dim in gi:
            real_src = [d for d in gi if d < len(src) and (src[d] != 1 or d == dim)]
            if real_src[0] != dim:
                raise Unsplittable(f"a view merges the sliced dimension {dim} of {src} under an outer one")
            real_dst = [d for d in gj if d < len(dst) and dst[d] != 1]
            ones = [d for d in gj if d < len(dst) and dst[d] == 1 and (not real_dst or d < real_dst[0])]
            if ones and (src[dim] == 1 or heads_of_one or not real_dst):
                return ones[-1], False
            return real_dst[0], bool(ones)
    raise Unsplittable(f"cannot follow dimension {dim} through a view {src} -> {dst}")


class Propagator:
    """Follows the sliced dimension from the column outputs through a block, noting the shape rewrites.

    It also notes where KV heads become query heads (GQA/MQA's ``repeat_interleave``, Hugging Face's
    ``repeat_kv`` expand + reshape, SDPA's ``enable_gqa``): the sliced values upstream of those are the
    block's KV side, which ``_replicated_kv`` may hold one head of per rank."""

    def __init__(self, tp: int, heads_of_one: bool = False) -> None:
        self.tp = tp
        self.heads_of_one = heads_of_one  # read ``[.., F] -> [.., 1, F]`` views as one head (see ``_view_dim``)
        self.ambiguous = False  # a view could have been read that way
        self.sharded: dict[fx.Node, int] = {}
        self.blocks: dict[fx.Node, int] = {}
        self.rewrites: dict[fx.Node, tuple[int, int]] = {}
        self.origin: dict[fx.Node, fx.Node] = {}  # sliced node -> the column it comes from (while its last dim is the column's)
        self.states: dict[str, int] = {}  # buffers written in place with sliced values (inference's KV cache) -> sliced dim
        self.writers: dict[str, fx.Node] = {}  # such a buffer -> the node writing it
        self.conversions: dict[fx.Node, list[fx.Node]] = {}  # op turning KV heads into query heads -> its KV-side inputs
        self.repeats: dict[fx.Node, tuple[int, int]] = {}  # node -> (its repeat count's place: -1 the argument, else a size's; the count)
        self.sections: dict[fx.Node, dict[fx.Node, tuple[int, int]]] = {}  # column -> its slices along the features -> [start, end)
        # (op, whole input, its dim): a whole tensor as long as the unsliced dimension (T5's relative position bias per head,
        # added to the scores or passed as SDPA's mask), which the rewrite cuts to this rank's part
        self.narrowed: list[tuple[fx.Node, fx.Node, int]] = []

    def seed(self, column: fx.Node) -> None:
        shape = node_shape(column)
        if shape is None:
            raise Unsplittable(f"{column.name} has no shape")
        self.sharded[column] = len(shape) - 1
        self.blocks[column] = 1
        self.origin[column] = column

    def visit(self, node: fx.Node) -> None:
        ins = [a for a in node.all_input_nodes if a in self.sharded]
        if not ins:
            return
        target = node.target
        src = ins[0]
        d = self.sharded[src]
        in_shape, out_shape = node_shape(src), node_shape(node)
        if target in VIEWS:
            assert in_shape is not None and out_shape is not None
            out, ambiguous = _view_dim(in_shape, out_shape, d, self.heads_of_one)
            self.ambiguous |= ambiguous
            if out == len(out_shape) - 1 and in_shape[d] == out_shape[-1] and d == len(in_shape) - 1 and src in self.origin:
                self.origin[node] = self.origin[src]  # the column's features stay the last dim (Conv1D's 2-D -> 3-D view)
            else:
                self._check_whole(src)
            self._note_repeat_kv(node, src, d, out, in_shape, out_shape)
            self._note_shape(node, out, out_shape)
            self.sharded[node] = out
        elif target is aten.transpose.int:
            a, b = (x % len(in_shape) for x in node.args[1:3])  # type: ignore[operator]
            self.sharded[node] = b if d == a else a if d == b else d
            self._inherit(node, src)
        elif target is aten.permute.default:
            self.sharded[node] = list(x % len(in_shape) for x in node.args[1]).index(d)  # type: ignore[union-attr]
            self._inherit(node, src)
        elif target is aten.unsqueeze.default:
            k = node.args[1] % len(out_shape)  # type: ignore[operator]
            self.sharded[node] = d + 1 if k <= d else d
        elif target is aten.repeat_interleave.self_int:  # GQA: each rank's KV heads repeated for its query heads
            dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
            if dim is None:
                raise Unsplittable("repeat_interleave over the flattened tensor")
            size = node.kwargs.get("output_size")
            if dim % len(in_shape) == d:  # type: ignore[operator]
                if size is not None:
                    self.rewrites[node] = (-3, int(size))
                if isinstance(node.args[1], int):
                    self.conversions[node] = [src]
                    self.repeats[node] = (-1, node.args[1])
            self.sharded[node] = d
        elif target is aten.expand.default:
            out = d + len(out_shape) - len(in_shape)
            self._note_shape(node, out, out_shape)
            self.sharded[node] = out
        elif target in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default):
            dim = node.args[2] % len(in_shape) if len(node.args) > 2 else 0  # type: ignore[operator]
            parts = [node_shape(u) for u in node.users]
            if dim == d:
                if src not in self.origin or self.blocks[self.origin[src]] != 1 or len({p for p in parts}) != 1:
                    raise Unsplittable("the sliced dimension is split unevenly or twice")
                self.blocks[self.origin[src]] = sum(1 for _ in node.users) if target is not aten.split_with_sizes.default else len(node.args[1])  # type: ignore[arg-type]
                self._split_arg(node, in_shape[d])
            self.sharded[node] = d
        elif target is operator.getitem:
            self.sharded[node] = d
        elif target is aten.index_copy_.default:  # a KV-cache write: the cache buffer holds this rank's heads only
            cache, dim, source = node.args[0], node.args[1] % len(out_shape), node.args[3]  # type: ignore[operator]
            if source is not src or not isinstance(cache, fx.Node) or cache.op != "get_attr" or dim == d:
                raise Unsplittable(f"{node.name} writes sliced values into something other than a buffer's unsliced dimension")
            self.states[str(cache.target)] = d
            self.writers[str(cache.target)] = node
            self.sharded[node] = d
        elif target is aten.cat.default:
            parts = [a for a in node.args[0] if not _is_empty(a)]  # type: ignore[union-attr]  # an empty cache: cat skips it
            if any(a not in self.sharded for a in parts):
                raise Unsplittable("cat of a sliced and a whole tensor")
            if len({self.sharded[a] for a in parts}) != 1:
                raise Unsplittable(f"{node.name} joins tensors sliced along different dimensions")
            dim = (node.args[1] if len(node.args) > 1 else 0) % len(out_shape)  # type: ignore[operator]
            if dim == self.sharded[parts[0]]:
                raise Unsplittable(f"{target} along the sliced dimension")
            self.sharded[node] = self.sharded[parts[0]]
        elif target is aten.slice.Tensor and (node.args[1] if len(node.args) > 1 else 0) % len(in_shape) == d:  # type: ignore[operator]
            self._note_section(node, src, d, in_shape)
            self.sharded[node] = d
        elif target in (aten.slice.Tensor, aten._softmax.default, aten.softmax.int, aten._log_softmax.default):
            dim = node.args[1] if len(node.args) > 1 else 0
            dim = dim % len(out_shape)  # type: ignore[operator]
            if dim == d:
                raise Unsplittable(f"{target} along the sliced dimension")
            self.sharded[node] = d
        elif target is aten.select.int:  # Bloom's q/k/v picked from each head's fused [3, head_dim]
            dim = node.args[1] % len(in_shape)  # type: ignore[operator]
            if dim == d:
                raise Unsplittable(f"{target} along the sliced dimension")
            self.sharded[node] = d if dim > d else d - 1
        elif target is aten.stack.default:  # GPT-J's interleaved rotary: stack([-x2, x1], dim=-1)
            parts = node.args[0]
            if any(a not in self.sharded for a in parts) or len({self.sharded[a] for a in parts}) != 1:  # type: ignore[union-attr]
                raise Unsplittable("stack of tensors not all sliced alike")
            dim = (node.args[1] if len(node.args) > 1 else 0) % len(out_shape)  # type: ignore[operator]
            self.sharded[node] = d + 1 if dim <= d else d
        elif target is aten.flatten.using_ints:  # the rotary pairs merged back (GPT-J, Cohere)
            start = (node.args[1] if len(node.args) > 1 else 0) % len(in_shape)  # type: ignore[operator]
            end = (node.args[2] if len(node.args) > 2 else -1) % len(in_shape)  # type: ignore[operator]
            if start < d <= end:
                raise Unsplittable("a flatten merges the sliced dimension under an outer one")
            self.sharded[node] = d if d <= start else d - (end - start)
        elif target in REDUCTIONS:
            dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
            if not dims:
                raise Unsplittable(f"{node.name} ({target}) reduces every dimension")
            dims = [x % len(in_shape) for x in ([dims] if isinstance(dims, int) else dims)]  # type: ignore[union-attr]
            if d in dims:
                raise Unsplittable(f"{target} along the sliced dimension")
            keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
            self.sharded[node] = d if keepdim else d - sum(1 for x in dims if x < d)
        elif target in POINTWISE:
            outs = set()
            for a in node.all_input_nodes:
                sa = node_shape(a)
                if a in self.sharded:
                    outs.add(self.sharded[a] + len(out_shape) - len(sa))  # type: ignore[arg-type]
            if len(outs) != 1:
                raise Unsplittable(f"{node.name} mixes tensors sliced along different dimensions")
            (out,) = outs
            for a in node.all_input_nodes:
                sa = node_shape(a)
                if a not in self.sharded and sa is not None:
                    k = out - (len(out_shape) - len(sa))
                    if k >= 0 and sa[k] == out_shape[out] and sa[k] != 1 and node.target in _NARROWABLE:
                        self.narrowed.append((node, a, k))
                    elif k >= 0 and sa[k] != 1:
                        raise Unsplittable(f"{node.name} combines a sliced tensor with a whole one ({a.name}) along the sliced dimension")
            self.sharded[node] = out
        elif target in (aten.matmul.default, aten.bmm.default):
            a, b = node.args[0], node.args[1]
            sa, sb = node_shape(a), node_shape(b)
            out = None
            for x, sx in ((a, sa), (b, sb)):
                if x in self.sharded:
                    k = self.sharded[x]
                    if k >= len(sx) - 2:  # type: ignore[arg-type]
                        raise Unsplittable(f"{node.name} contracts or produces along the sliced dimension")
                    o = k + len(out_shape) - len(sx)  # type: ignore[arg-type]
                    if out is not None and o != out:
                        raise Unsplittable(f"{node.name} mixes sliced dimensions")
                    out = o
            for x, sx in ((a, sa), (b, sb)):
                if x not in self.sharded and sx is not None:
                    k = out - (len(out_shape) - len(sx))  # type: ignore[operator]
                    if k >= 0 and sx[k] != 1:
                        raise Unsplittable(f"{node.name} multiplies by a whole tensor along the sliced dimension")
            self.sharded[node] = out  # type: ignore[assignment]
        elif target is aten.scaled_dot_product_attention.default:
            q, k, v = node.args[:3]
            if any(self.sharded.get(x) != 1 for x in (q, k, v)):  # type: ignore[call-overload]
                raise Unsplittable("attention whose query, key and value are not all sliced by heads")
            if node.kwargs.get("enable_gqa"):  # query heads attend to their KV head inside the op
                self.conversions[node] = [k, v]  # type: ignore[list-item]
            mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
            sm = node_shape(mask)
            if sm is not None and len(sm) == 4 and sm[1] != 1:
                if isinstance(mask, fx.Node) and mask in self.sharded or sm[1] != node_shape(q)[1]:  # type: ignore[index]
                    raise Unsplittable("an attention mask per head, sliced otherwise than the heads")
                self.narrowed.append((node, mask, 1))  # type: ignore[arg-type]
            self.sharded[node] = 1
        else:
            raise Unsplittable(f"{node.name} ({target}) is not known to keep a slice of heads/hidden units whole")

    def _inherit(self, node: fx.Node, src: fx.Node) -> None:
        pass

    def _note_section(self, node: fx.Node, src: fx.Node, d: int, in_shape: tuple[int, ...]) -> None:
        """A fused projection cut into parts by slices of its features (Phi-3's ``qkv[..., :q]``, ``qkv[..., q:q+kv]``, ...):
        each part is split on its own, so the parts may differ in size (GQA's q against k and v)."""
        column = self.origin.get(src)
        if column is None or self.blocks[column] != 1:
            raise Unsplittable("a slice along the sliced dimension of something other than a projection's features")
        if any(u.target is not aten.slice.Tensor or (u.args[1] if len(u.args) > 1 else 0) % len(in_shape) != d for u in src.users):  # type: ignore[operator]
            raise Unsplittable(f"{src.name} is read both whole and by slices of its features")
        step = node.args[4] if len(node.args) > 4 else 1
        if step != 1:
            raise Unsplittable("a strided slice along the sliced dimension")
        size = in_shape[d]
        start, end = (node.args[2] if len(node.args) > 2 else 0), (node.args[3] if len(node.args) > 3 else size)
        if not isinstance(start, int) or not isinstance(end, int):
            raise Unsplittable(f"{node.name} slices the features at symbolic bounds")
        start, end = (min(max(b + size if b < 0 else b, 0), size) for b in (start, end))
        self.sections.setdefault(column, {})[node] = (start, end)

    def _note_repeat_kv(self, node: fx.Node, src: fx.Node, d: int, out: int, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> None:
        """Hugging Face's ``repeat_kv``: ``expand`` a size-one dim after the KV heads to ``n_rep``, then a view merging
        both into the query heads."""
        if src.target is not aten.expand.default or d + 1 >= len(in_shape) or in_shape[d + 1] == 1:
            return
        before = node_shape(src.args[0])
        if before is None or len(before) != len(in_shape) or before[d + 1] != 1 or out_shape[out] != in_shape[d] * in_shape[d + 1]:
            return
        self.conversions[node] = [src]
        self.repeats[src] = (d + 1, in_shape[d + 1])

    def _check_whole(self, src: fx.Node) -> None:
        if src in self.origin and self.blocks[self.origin[src]] != 1:
            raise Unsplittable("a fused projection is viewed before it is split into its parts")

    def _note_shape(self, node: fx.Node, out: int, out_shape: tuple[int, ...]) -> None:
        sizes = node.args[1]
        if isinstance(sizes, (list, tuple)) and out < len(sizes):
            entry = sizes[out]
            if isinstance(entry, int) and entry != -1:
                self.rewrites[node] = (out, out_shape[out])
            elif not isinstance(entry, int):
                raise Unsplittable(f"{node.name} has a symbolic size on the sliced dimension")

    def _split_arg(self, node: fx.Node, size: int) -> None:
        if node.target is aten.split.Tensor:
            self.rewrites[node] = (-1, int(node.args[1]))  # type: ignore[arg-type]
        elif node.target is aten.split_with_sizes.default:
            self.rewrites[node] = (-2, 0)
