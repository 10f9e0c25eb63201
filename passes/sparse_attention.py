"""Find attention in the Dynamo graph and replace it with dscompile's block-sparse attention op.

Two shapes of attention are recognised on the pre-autograd (torch-level) graph:

- ``F.scaled_dot_product_attention(q, k, v, attn_mask=..., dropout_p=..., is_causal=..., scale=...)``;
- the explicit form ``softmax((q @ kᵀ) * c [+ bias | .masked_fill(m, -inf)]) [-> dropout] @ v``,
  in any of the spellings Dynamo leaves (``operator.matmul``/``torch.matmul``/``.matmul``,
  ``mul``/``truediv`` by a constant, ``F.softmax``/``torch.softmax``/``.softmax``, dtype casts
  around the softmax, ``F.dropout``).

The explicit form comes in too many spellings for fixed FX patterns, so the matcher anchors
on each softmax and walks its producer and consumer chains, normalising each spelling; a
chain it cannot prove equivalent is left unchanged and logged. Each match becomes one
``dscompile::block_sparse_attention`` node whose layout (from the config's sparsity mode) is
named by its config. Causal masks become the op's ``causal`` flag, so blocks above the
diagonal are never visited: ``is_causal=True``, and boolean masks the graph itself builds as
the lower triangle of ones (``torch.ones(s, s).tril()``, sliced from the start, unsqueezed or
cast; ``~`` of it, or ``triu(ones, 1)``, as a masked_fill's drop-mask; ``where(tril, 0, -inf)``
as an additive one). A mask that arrives as a graph input (a buffer, an argument) cannot be
proven causal from the graph, so it stays a bias, like every other mask (boolean keep/drop or
additive, e.g. key padding); the bias combines with the layout. ``mode=dense`` leaves
attention as it is (dense attention is what the graph already computes), which keeps a
dense-mode compile bit-identical to eager.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import numbers
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.symbolic_shapes import statically_known_true

from dscompile.config import register_section
from dscompile.errors import DSCompileError
from dscompile.graph import ds_meta, node_value, set_fake_value
from dscompile.pipeline import PassContext, PassInvocation, invocation, register_config_rule, register_pass
from dscompile.sparsity import SparseAttentionConfig, layout_from_spec, parse_sparse_attention

log = logging.getLogger("dscompile.passes.sparse_attention")

# the ATen op too: a graph captured by torch.export (tensor and sequence parallelism) and compiled again calls it
_SDPA = {
    F.scaled_dot_product_attention,
    getattr(torch._C._nn, "scaled_dot_product_attention", None),
    torch.ops.aten.scaled_dot_product_attention.default,
} - {None}
_MATMUL_FNS = {operator.matmul, torch.matmul}
_SOFTMAX_FNS = {F.softmax, torch.softmax, torch.nn.functional.softmax}
_DROPOUT_FNS = {F.dropout, torch.dropout}
_MUL_FNS = {operator.mul, torch.mul}
_DIV_FNS = {operator.truediv, torch.div, torch.true_divide}
_ADD_FNS = {operator.add, torch.add}
_CAST_METHODS = {"to", "type_as", "float", "half", "bfloat16", "type", "contiguous"}
_MASK_FILL_LIMIT = -1e4  # masked_fill values at or below this act as -inf after the softmax


# ----------------------------------------------------------------------------- node spelling helpers


def _is(node: Any, fns: set[Any], method: str | None = None) -> bool:
    if not isinstance(node, torch.fx.Node):
        return False
    if node.op == "call_function" and node.target in fns:
        return True
    return method is not None and node.op == "call_method" and node.target == method


def _arg(node: torch.fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Argument ``index`` (positional, counting self for methods) or keyword ``name``."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _ndim(node: Any) -> int | None:
    value = node_value(node) if isinstance(node, torch.fx.Node) else None
    return value.dim() if isinstance(value, torch.Tensor) else None


def _is_last_dim(dim: Any, ndim: int | None) -> bool:
    return isinstance(dim, int) and ndim is not None and dim % ndim == ndim - 1


def _transposed_source(node: Any) -> torch.fx.Node | None:
    """``k`` when ``node`` is k with its last two dims swapped (transpose or permute), else None."""
    if not isinstance(node, torch.fx.Node):
        return None
    ndim = _ndim(node)
    if ndim is None or ndim < 2:
        return None
    if _is(node, {torch.transpose}, "transpose"):
        dims = {_arg(node, 1, "dim0") % ndim, _arg(node, 2, "dim1") % ndim}
        return node.args[0] if dims == {ndim - 2, ndim - 1} else None
    if _is(node, {torch.permute}, "permute"):
        perm = node.args[1:] if node.op == "call_method" else node.args[1]
        if len(perm) == 1 and isinstance(perm[0], (list, tuple)):
            perm = perm[0]
        expected = list(range(ndim - 2)) + [ndim - 1, ndim - 2]
        return node.args[0] if [p % ndim for p in perm] == expected else None
    return None


def _constant(value: Any) -> float | None:
    return float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else None


def _scale_factor(node: torch.fx.Node) -> tuple[torch.fx.Node, float] | None:
    """``(x, c)`` when ``node`` computes ``x * c`` with a Python constant ``c``."""
    if _is(node, _MUL_FNS, "mul"):
        a, b = node.args[0], node.args[1] if len(node.args) > 1 else None
        if isinstance(a, torch.fx.Node) and _constant(b) is not None:
            return a, _constant(b)
        if isinstance(b, torch.fx.Node) and _constant(a) is not None:
            return b, _constant(a)
    if _is(node, _DIV_FNS, "div") and len(node.args) == 2 and not node.kwargs:
        a, c = node.args
        if isinstance(a, torch.fx.Node) and _constant(c) not in (None, 0.0):
            return a, 1.0 / _constant(c)
    return None


@dataclass
class _Mask:
    """One mask applied to the scores: ``add`` (additive tensor) or ``keep``/``drop`` (boolean)."""

    kind: str
    tensor: torch.fx.Node


def _mask_of(node: torch.fx.Node) -> tuple[torch.fx.Node, _Mask] | None:
    """``(scores, mask)`` when ``node`` masks ``scores``; None otherwise."""
    if _is(node, _ADD_FNS, "add") and len(node.args) == 2 and not node.kwargs:
        a, b = node.args
        if isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node):
            # the scores are the operand with the full 4-D shape of the matmul result
            for scores, bias in ((a, b), (b, a)):
                if _producer_is_score_chain(scores):
                    return scores, _Mask("add", bias)
    if _is(node, {torch.masked_fill}, "masked_fill"):
        scores, mask, value = node.args[0], _arg(node, 1, "mask"), _arg(node, 2, "value")
        fill = _constant(value)
        if isinstance(mask, torch.fx.Node) and fill is not None and fill <= _MASK_FILL_LIMIT:
            return scores, _Mask("drop", mask)
    return None


def _producer_is_score_chain(node: torch.fx.Node) -> bool:
    cur: Any = node
    while isinstance(cur, torch.fx.Node):
        if _is(cur, _MATMUL_FNS, "matmul"):
            return True
        step = _scale_factor(cur)
        if step is not None:
            cur = step[0]
            continue
        masked = _mask_of(cur)
        if masked is not None:
            cur = masked[0]
            continue
        return False
    return False


# ----------------------------------------------------------------------------- matches


@dataclass
class AttentionMatch:
    """One attention site, in the op's terms."""

    q: torch.fx.Node
    k: torch.fx.Node
    v: torch.fx.Node
    output: torch.fx.Node  # the node whose uses the op's output replaces
    scale: float | None  # None: 1/sqrt(head dim)
    causal: bool
    dropout_p: float
    masks: list[_Mask] = field(default_factory=list)
    nodes: list[torch.fx.Node] = field(default_factory=list)  # the matched nodes, erased afterwards
    kind: str = "sdpa"


class NoMatch(Exception):
    """Why an attention-like subgraph was left unchanged."""


def _match_sdpa(node: torch.fx.Node) -> AttentionMatch:
    q, k, v = node.args[:3]
    attn_mask = _arg(node, 3, "attn_mask")
    dropout_p = _arg(node, 4, "dropout_p", 0.0)
    is_causal = _arg(node, 5, "is_causal", False)
    scale = _arg(node, 6, "scale")
    if _arg(node, 7, "enable_gqa", False):
        raise NoMatch("enable_gqa=True (keys/values with fewer heads) is not supported")
    if not isinstance(dropout_p, numbers.Real) or not isinstance(is_causal, bool):
        raise NoMatch("dropout_p / is_causal are not constants")
    if scale is not None and _constant(scale) is None:
        raise NoMatch("scale is not a constant")
    masks = []
    if attn_mask is not None:
        value = node_value(attn_mask)
        if not isinstance(value, torch.Tensor):
            raise NoMatch("attn_mask is not a tensor")
        masks.append(_Mask("keep" if value.dtype == torch.bool else "add", attn_mask))
    return AttentionMatch(q, k, v, node, _constant(scale), is_causal, float(dropout_p), masks, [node], "sdpa")


def _single_user(node: torch.fx.Node) -> torch.fx.Node:
    users = list(node.users)
    if len(users) != 1:
        raise NoMatch(f"intermediate '{node.name}' has {len(users)} users (attention weights used elsewhere?)")
    return users[0]


def _match_explicit(softmax: torch.fx.Node) -> AttentionMatch:
    ndim = _ndim(softmax)
    dim = _arg(softmax, 1, "dim")
    if not _is_last_dim(dim, ndim):
        raise NoMatch(f"softmax over dim {dim}, not the last one")
    nodes = [softmax]
    # upward: masks and constant scales, down to q @ kᵀ
    masks: list[_Mask] = []
    scale = 1.0
    seen_scale = False  # walking upward, a scale seen before a mask was applied after it
    cur = softmax.args[0]
    while True:
        if not isinstance(cur, torch.fx.Node):
            raise NoMatch("softmax input is not a graph value")
        if _is(cur, _MATMUL_FNS, "matmul"):
            break
        masked = _mask_of(cur)
        step = _scale_factor(cur) if masked is None else None
        if masked is None and step is None:
            raise NoMatch(f"'{cur.name}' ({cur.target}) between the scores and the softmax is not a scale or mask")
        if len(cur.users) != 1:
            raise NoMatch(f"intermediate '{cur.name}' has {len(cur.users)} users")
        nodes.append(cur)
        if masked is not None:
            if seen_scale and masked[1].kind == "add":
                raise NoMatch("an additive mask is scaled afterwards")
            masks.append(masked[1])
            cur = masked[0]
        else:
            if step[1] <= 0:
                raise NoMatch("non-positive score scale")
            scale *= step[1]
            seen_scale = True
            cur = step[0]
    matmul = cur
    if len(matmul.users) != 1:
        raise NoMatch("the scores q @ kᵀ are used elsewhere")
    nodes.append(matmul)
    q, kt = matmul.args[0], matmul.args[1]
    k = _transposed_source(kt)
    if k is None:
        raise NoMatch("the second operand of q @ kᵀ is not a transpose of the last two dims")
    if len(kt.users) == 1:
        nodes.append(kt)
    # downward: casts and dropout, up to probs @ v
    dropout_p = 0.0
    cur = softmax
    while True:
        user = _single_user(cur)
        if _is(user, _MATMUL_FNS, "matmul"):
            if user.args[0] is not cur:
                raise NoMatch("the attention weights are the right operand of the final matmul")
            break
        if _is(user, _DROPOUT_FNS, "dropout"):
            p, training = _arg(user, 1, "p", 0.5), _arg(user, 2, "training", True)
            if not isinstance(p, numbers.Real) or not isinstance(training, bool):
                raise NoMatch("dropout p / training are not constants")
            if training and p > 0:
                if dropout_p > 0:
                    raise NoMatch("two dropouts on the attention weights")
                dropout_p = float(p)
        elif not (user.op == "call_method" and user.target in _CAST_METHODS):
            raise NoMatch(f"'{user.name}' ({user.target}) after the softmax is not a cast, dropout or the final matmul")
        nodes.append(user)
        cur = user
    final = user
    nodes.append(final)
    return AttentionMatch(q, k, final.args[1], final, scale, False, dropout_p, masks[::-1], nodes[::-1], "explicit")


def find_attention(gm: torch.fx.GraphModule) -> tuple[list[AttentionMatch], list[tuple[torch.fx.Node, str]]]:
    """Every attention site of the graph, and the attention sites that could not be matched (and why).

    Sites are SDPA calls and softmaxes that sit between two matmuls (scores from a product, weights
    into a product); other softmaxes (a classifier's probabilities) are not attention and not reported."""
    matches, skipped = [], []
    for node in gm.graph.nodes:
        try:
            if _is(node, _SDPA):
                matches.append(_fold_causal(_check_shapes(_match_sdpa(node))))
            elif _is(node, _SOFTMAX_FNS, "softmax"):
                matches.append(_fold_causal(_check_shapes(_match_explicit(node))))
        except NoMatch as why:
            if _is(node, _SDPA) or _between_products(node):
                skipped.append((node, str(why)))
            else:
                log.debug("'%s' is a softmax outside attention (%s)", node.name, why)
    return matches, skipped


_PRODUCT_FNS = _MATMUL_FNS | {torch.bmm, torch.einsum}
_PRODUCT_METHODS = ("matmul", "bmm")


def _is_product(node: torch.fx.Node) -> bool:
    return _is(node, _PRODUCT_FNS) or (node.op == "call_method" and node.target in _PRODUCT_METHODS)


def _between_products(softmax: torch.fx.Node, hops: int = 6) -> bool:
    """Whether a product feeds ``softmax`` and its result feeds a product, each within ``hops`` nodes."""

    def reaches(start: torch.fx.Node, step: Any) -> bool:
        frontier, seen = [start], {start}
        for _ in range(hops):
            frontier = [n for node in frontier for n in step(node) if n not in seen]
            seen.update(frontier)
            if any(_is_product(n) for n in frontier):
                return True
        return False

    return reaches(softmax, lambda n: n.all_input_nodes) and reaches(softmax, lambda n: list(n.users))


class SparseAttentionLeftDenseError(DSCompileError):
    """``sparse_attention.strict``: an attention site the pass cannot make sparse."""


def _site(node: torch.fx.Node) -> str:
    """Where ``node`` comes from in the user's code: its module path and source line, when known."""
    parts = [f"'{node.name}'"]
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = str(list(stack.values())[-1][0])
        parts.append(f"in {path}")
    trace = node.meta.get("stack_trace")
    if trace:
        frames = [line.strip() for line in str(trace).strip().splitlines() if line.strip().startswith("File ")]
        if frames:
            parts.append(f"({frames[-1]})")
    return " ".join(parts)


def _same(a: Any, b: Any) -> bool:
    """Sizes provably equal, without adding a guard on a symbolic size."""
    return statically_known_true(a == b)


def _check_shapes(m: AttentionMatch) -> AttentionMatch:
    """Self-attention shapes. Batch and sequence length may be symbolic (Dynamo makes them so at the
    second distinct length): the op then builds the layout at run time from the real length. The
    head count and head size must be fixed: the layout has one pattern per head."""
    values = [node_value(n) for n in (m.q, m.k, m.v)]
    if not all(isinstance(v, torch.Tensor) for v in values):
        raise NoMatch("q, k, v have no recorded values")
    q, k, v = values
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise NoMatch(f"q/k/v are {q.dim()}-D; the op needs [batch, heads, seq, head_dim]")
    if not isinstance(q.shape[1], int) or not isinstance(q.shape[3], int):
        raise NoMatch(f"the head count or head size is symbolic ({q.shape[1]}, {q.shape[3]}); the layout needs a fixed head count")
    if not all(_same(q.shape[i], t.shape[i]) for t in (k, v) for i in range(3)) or not _same(q.shape[3], k.shape[3]):
        raise NoMatch(f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} are not self-attention shapes")
    scores = (q.shape[0], q.shape[1], q.shape[2], q.shape[2])
    for mask in m.masks:
        value = node_value(mask.tensor)
        if not isinstance(value, torch.Tensor):
            raise NoMatch("a mask has no recorded value")
        if mask.kind == "add" and value.requires_grad:
            raise NoMatch("the additive mask is trainable (the op has no bias gradient)")
        if value.dim() > 4 or not all(_same(d, 1) or _same(d, want) for d, want in zip(reversed(value.shape), reversed(scores))):
            raise NoMatch(f"mask of shape {list(value.shape)} does not broadcast to the scores {list(scores)}")
    return m


# ----------------------------------------------------------------------------- causal masks

_TRIL_FNS, _TRIU_FNS = {torch.tril}, {torch.triu}
_ONES_FNS = {torch.ones, torch.ones_like}
_NOT_FNS = {operator.invert, torch.logical_not, torch.bitwise_not}
_SHAPE_METHODS = {"unsqueeze", "view", "reshape", "expand", "bool", "to", "contiguous"}


def _full_slice(index: Any) -> bool:
    """``:``, ``:n``, ``0:n`` (step 1), ``None`` or ``...``: indexing that keeps a prefix square's origin."""
    if index is None or index is Ellipsis:
        return True
    return isinstance(index, slice) and index.start in (None, 0) and index.step in (None, 1)


def _same_last2(a: Any, b: Any) -> bool:
    va, vb = (node_value(n) if isinstance(n, torch.fx.Node) else None for n in (a, b))
    ok = isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.dim() >= 2 and vb.dim() >= 2
    return ok and _same(va.shape[-2], vb.shape[-2]) and _same(va.shape[-1], vb.shape[-1])


def _strip_views(node: Any) -> Any:
    """Look through prefix slices, unsqueezes, views and casts that keep ``[i, j]`` at ``[..., i, j]``."""
    while isinstance(node, torch.fx.Node):
        if _is(node, {operator.getitem}) and isinstance(node.args[1], tuple) and all(map(_full_slice, node.args[1])):
            node = node.args[0]
        elif (_is(node, {torch.unsqueeze}, "unsqueeze") or (node.op == "call_method" and node.target in _SHAPE_METHODS)) and _same_last2(
            node, node.args[0]
        ):
            node = node.args[0]
        else:
            return node
    return node


def _ones(node: Any) -> bool:
    if _is(node, _ONES_FNS, "new_ones"):
        return True
    if _is(node, {torch.full}, "new_full"):
        fill = _arg(node, 2 if node.op == "call_method" else 1, "fill_value")
        return fill is True or (_constant(fill) == 1.0)
    return False


def _triangle(node: Any, fns: set[Any], method: str, diagonal: int) -> bool:
    """``node`` is ``tril``/``triu`` (per ``fns``) of ones with the given diagonal."""
    node = _strip_views(node)
    if not _is(node, fns, method):
        return False
    return _arg(node, 1, "diagonal", 0) == diagonal and _ones(_strip_views(node.args[0]))


def _square_mask(mask: torch.fx.Node, seq: int | torch.SymInt) -> bool:
    value = node_value(mask)
    return isinstance(value, torch.Tensor) and value.dim() >= 2 and _same(value.shape[-2], seq) and _same(value.shape[-1], seq)


def is_causal_mask(mask: _Mask, seq: int | torch.SymInt) -> bool:
    """Whether ``mask`` is provably the causal mask of ``seq`` x ``seq`` scores, from how the graph builds it."""
    node = mask.tensor
    if not _square_mask(node, seq):
        return False
    value = node_value(node)
    if mask.kind == "keep":
        return value.dtype == torch.bool and _triangle(node, _TRIL_FNS, "tril", 0)
    if mask.kind == "drop":
        inner = _strip_views(node)
        if _is(inner, _NOT_FNS, "logical_not") or _is(inner, _NOT_FNS, "__invert__"):
            return _triangle(inner.args[0], _TRIL_FNS, "tril", 0)
        return _triangle(node, _TRIU_FNS, "triu", 1)
    if mask.kind == "add":  # where(tril(ones), 0, -inf)
        inner = _strip_views(node)
        if not _is(inner, {torch.where}) or len(inner.args) != 3:
            return False
        keep, zero, fill = inner.args
        low = _constant(fill)
        return _constant(zero) == 0.0 and low is not None and low <= _MASK_FILL_LIMIT and _triangle(keep, _TRIL_FNS, "tril", 0)
    return False


def _fold_causal(m: AttentionMatch) -> AttentionMatch:
    """Turn recognisably causal masks into ``causal=True`` so the op skips blocks above the diagonal."""
    seq = node_value(m.q).shape[2]
    causal = [mask for mask in m.masks if is_causal_mask(mask, seq)]
    if causal:
        log.info("attention at '%s': mask '%s' is the causal triangle; using causal=True", m.output.name, causal[0].tensor.name)
        m.masks = [mask for mask in m.masks if mask not in causal]
        m.causal = True
    return m


# ----------------------------------------------------------------------------- rewrite


def _call(gm: torch.fx.GraphModule, target: Any, args: tuple[Any, ...], kwargs: dict | None = None) -> torch.fx.Node:
    node = gm.graph.call_function(target, args, kwargs or {})
    # The graph's own fake mode: under Dynamo the tracing context may hold a different one.
    set_fake_value(node, _graph_fake_mode(gm))
    return node


def _graph_fake_mode(gm: torch.fx.GraphModule) -> Any:
    for node in gm.graph.nodes:
        value = node_value(node) if node.op == "placeholder" else None
        if isinstance(value, FakeTensor):
            return value.fake_mode
    return None


def _combined_bias(gm: torch.fx.GraphModule, masks: Sequence[_Mask]) -> torch.fx.Node | None:
    """One bias for the op: a keep-mask or an additive tensor (several masks are summed as additive)."""
    keep_masks: list[torch.fx.Node] = []
    for mask in masks:
        if mask.kind == "drop":
            src = mask.tensor
            inverted = src.args[0] if _is(src, {operator.invert, torch.logical_not, torch.bitwise_not}, "logical_not") else None
            keep_masks.append(inverted if inverted is not None else _call(gm, torch.logical_not, (src,)))
        elif mask.kind == "keep":
            keep_masks.append(mask.tensor)
    additive = [m.tensor for m in masks if m.kind == "add"]
    if not additive and len(keep_masks) == 1:
        return keep_masks[0]
    if not keep_masks and len(additive) == 1:
        return additive[0]
    terms = additive + [_call(gm, torch.where, (m, 0.0, float("-inf"))) for m in keep_masks]
    total = terms[0] if terms else None
    for term in terms[1:]:
        total = _call(gm, operator.add, (total, term))
    return total


def _rewrite(gm: torch.fx.GraphModule, m: AttentionMatch, options: SparseAttentionConfig) -> torch.fx.Node:
    q_val = node_value(m.q)
    _, heads, seq, head_dim = q_val.shape
    # The op makes (and caches, per length) the layout from this spec at run time: the graph stays
    # free of tensor constants, and a symbolic length gets the layout of each real length.
    spec = layout_spec(options)
    layout = None
    if isinstance(seq, int):
        layout = layout_from_spec(spec, heads, seq)  # checks the config fits this length now, not at the first step
        if seq % options.block:
            log.info(
                "attention at '%s': sequence length %d is not a multiple of block %d; the op pads it to %d",
                m.output.name, seq, options.block, layout.shape[-1] * options.block,
            )  # fmt: skip
    graph = gm.graph
    with graph.inserting_before(m.output):
        bias = _combined_bias(gm, m.masks)
        seed = None
        if m.dropout_p > 0:
            seed = _call(gm, torch.randint, (0, 2**31 - 1, ()), {"device": q_val.device, "dtype": torch.int64})
        scale = m.scale if m.scale is not None else 1.0 / math.sqrt(head_dim)
        op = _call(
            gm,
            torch.ops.dscompile.block_sparse_attention.default,
            (m.q, m.k, m.v, None, bias, seed, options.block, scale, m.causal, m.dropout_p, options.kernel, spec),
        )
        out = _call(gm, operator.getitem, (op, 0))
        want = node_value(m.output).dtype
        if out.meta["val"].dtype != want:
            out = _call(gm, torch.Tensor.to, (out, want))
    density = None  # a symbolic length: one layout per real length, built at run time
    if layout is not None:
        visited = layout.bool() & torch.ones(layout.shape[-2:], dtype=torch.bool).tril() if m.causal else layout.bool()
        density = float(visited.float().mean())
    ds_meta(op)["sparse_attention"] = {"mode": options.mode, "block": options.block, "matched": m.kind, "causal": m.causal,
                                       "density": density, "dynamic_length": layout is None}  # fmt: skip
    for node in (op, out):
        if m.output.meta.get("stack_trace"):
            node.meta["stack_trace"] = m.output.meta["stack_trace"]
    m.output.replace_all_uses_with(out)
    order = {node: i for i, node in enumerate(graph.nodes)}
    for node in sorted(set(m.nodes), key=order.__getitem__, reverse=True):  # consumers before producers
        if not node.users:
            graph.erase_node(node)
    return op


def layout_spec(options: SparseAttentionConfig) -> str:
    """The JSON of the keys that shape the layout (the op builds layouts from it)."""
    return json.dumps({k: v for k, v in dataclasses.asdict(options).items() if k not in _NOT_LAYOUT and v is not None}, sort_keys=True)


_NOT_LAYOUT = ("kernel", "strict")


@register_pass("sparse_attention", graphs=("pre_autograd",), options=SparseAttentionConfig)
def sparse_attention_pass(gm: torch.fx.GraphModule, ctx: PassContext, options: SparseAttentionConfig) -> torch.fx.GraphModule:
    """Replace every recognised attention with dscompile::block_sparse_attention under the configured layout."""
    options.validate("sparse_attention")
    matches, skipped = find_attention(gm)
    found = ctx.analysis.setdefault("sparse_attention", {"replaced": 0, "dense": 0, "skipped": 0})
    found["skipped"] += len(skipped)
    if options.mode != "dense":
        for node, why in skipped:
            message = f"{ctx.graph_name}: attention at {_site(node)} stays dense: {why}"
            if options.strict:
                raise SparseAttentionLeftDenseError(
                    f"{message} (sparse_attention.strict is set; rewrite that attention in a form listed in "
                    "passes/sparse_attention.py, or set sparse_attention.strict to false to run it dense with a warning)"
                )
            log.warning(message)
    if options.mode == "dense":
        for m in matches:
            ds_meta(m.output)["sparse_attention"] = {"mode": "dense", "matched": m.kind}
        found["dense"] += len(matches)
        log.info("%s: mode 'dense': %d attention site(s) left as dense attention", ctx.graph_name, len(matches))
        return gm
    for m in matches:
        _rewrite(gm, m, options)
    found["replaced"] += len(matches)
    log.info("%s: replaced %d attention site(s) with block-sparse attention (%s)", ctx.graph_name, len(matches), options.mode)
    return gm


register_section("sparse_attention", parse_sparse_attention, "sparse attention")


@register_config_rule(10, "sparse_attention")
def _sparse_attention_rule(config: Any) -> list[PassInvocation]:
    section = config.sections.get("sparse_attention")
    if section is None:
        return []
    return [invocation("sparse_attention", **dataclasses.asdict(section))]
