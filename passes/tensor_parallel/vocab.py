"""The vocabulary-parallel LM head (``vocab_parallel_lm_head``): find it, and rewrite it.

An LM head whose logits a mean cross-entropy reads is split by vocabulary rows: the loss becomes a parallel
cross-entropy (no gathered logits), a tied embedding a vocabulary-parallel lookup, and any other reader of the
logits reads them gathered. Kept apart from the blocks: a different pattern, opted into separately.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from dscompile.passes.tensor_parallel.blocks import Linear, as_linear
from dscompile.passes.tensor_parallel.graph_facts import VIEWS, attr_value, node_shape
from dscompile.passes.tensor_parallel.propagate import Unsplittable
from dscompile.runtime.tensor_parallel import (
    SliceSpec,
    gather_vocabulary,
    padded_units,
    tp_copy,
    units_of_rank,
    vocab_parallel_cross_entropy,
    vocab_parallel_embedding,
)

log = logging.getLogger("dscompile.passes.tensor_parallel")  # the pass's one logger, whichever module logs
aten = torch.ops.aten


@dataclass
class VocabHead:
    """``cross_entropy_loss(view(linear(h, W)), targets)``, and the embeddings that read ``W`` (tied weights)."""

    linear: Linear
    views: list[fx.Node]
    loss: fx.Node
    embeddings: list[fx.Node]
    vocab: int
    ignore_index: int
    chain: list[fx.Node]  # the linear, then the views and casts to the loss (any other user of them reads gathered logits)


def _arg(node: fx.Node, position: int, name: str, default: Any) -> Any:
    return node.args[position] if len(node.args) > position else node.kwargs.get(name, default)


def _casts_only(node: fx.Node) -> bool:
    """A dtype conversion and nothing else (the parallel cross-entropy computes in fp32 whatever the logits' dtype)."""
    if node.target is aten.to.dtype:
        return True
    return node.target is aten._to_copy.default and set(node.kwargs) <= {"dtype"}


_PER_LOGIT = {aten.div.Tensor, aten.mul.Tensor, aten.div.Scalar, aten.mul.Scalar, aten.tanh.default, aten.add.Scalar, aten.sub.Scalar}


def _per_logit(node: fx.Node) -> bool:
    """An op on each logit alone with constants (Gemma2's ``tanh(logits / cap) * cap``): it runs on a vocabulary slice as is."""
    return node.target in _PER_LOGIT and not any(isinstance(a, fx.Node) for a in [*node.args[1:], *node.kwargs.values()])


def find_vocab_heads(gm: fx.GraphModule) -> tuple[list[VocabHead], list[dict[str, Any]]]:
    """Every mean cross-entropy computed straight from a linear's logits (the LM head), and those left whole (why)."""
    heads: list[VocabHead] = []
    whole: list[dict[str, Any]] = []
    for loss in gm.graph.nodes:
        if loss.target is not aten.cross_entropy_loss.default:
            continue
        try:
            if _arg(loss, 2, "weight", None) is not None or _arg(loss, 3, "reduction", 1) != 1 or _arg(loss, 5, "label_smoothing", 0.0):
                raise Unsplittable("only the mean cross-entropy without class weights or label smoothing is split by vocabulary")
            logits = loss.args[0]
            if len(node_shape(logits) or ()) != 2:
                raise Unsplittable("the loss does not read [tokens, vocabulary] logits")
            views, x, chain = [], logits, []
            while x.target in VIEWS or _casts_only(x) or _per_logit(x):  # views, Hugging Face's logits.float(), Gemma2's soft-capping
                if x.target in VIEWS:
                    views.append(x)
                chain.insert(0, x)
                x = x.args[0]
            chain.insert(0, x)
            head = as_linear(x)
            if head is None or head.transposed or head.bias is not None:
                raise Unsplittable("the loss does not read the logits of a linear without bias")
            if any(h.linear.node is x for h in heads):
                raise Unsplittable(f"the LM head {x.name} also feeds another loss")
            vocab = node_shape(x)[-1]  # type: ignore[index]
            if any((node_shape(v) or (0,))[-1] != vocab for v in views):
                raise Unsplittable("a view between the LM head and the loss moves the vocabulary dimension")
            param = attr_value(gm, str(x.args[1].target))  # type: ignore[union-attr]
            readers = [n for n in gm.graph.nodes if n.op == "get_attr" and attr_value(gm, str(n.target)) is param]  # tied: any name
            embeddings = [u for r in readers for u in r.users if u is not x]
            for u in embeddings:
                if u.target is not aten.embedding.default or len(u.args) > 3 or u.kwargs:  # a padding_idx (Gemma's) is kept
                    raise Unsplittable(f"the LM head's weight is also read by {u.name} ({u.target}), not a plain embedding")
            heads.append(VocabHead(head, views, loss, embeddings, vocab, int(_arg(loss, 4, "ignore_index", -100)), chain))
        except Unsplittable as exc:
            whole.append({"loss": loss.name, "reason": str(exc)})
            log.warning("tensor_parallel: the LM head of %s stays replicated: %s", loss.name, exc)
    return heads, whole


def rewrite_vocab_heads(gm: fx.GraphModule, heads: list[VocabHead], group: Any, tp: int, rank: int, names: dict[str, str]) -> dict[str, SliceSpec]:
    """Split each head's weight by vocabulary rows: its logits stay local, the loss becomes the parallel
    cross-entropy, a tied embedding a vocabulary-parallel lookup. A vocabulary TP does not divide is padded
    with zero rows that the loss leaves out of its softmax."""
    graph = gm.graph
    slices: dict[str, SliceSpec] = {}
    held = [padded_units(h.vocab, tp) for h in heads]
    for head, local in zip(heads, held):
        first, count = units_of_rank(head.vocab, rank, tp)
        x = head.linear.input
        with graph.inserting_before(head.linear.node):
            copied = graph.call_function(tp_copy, (x, group))
        copied.meta["val"] = x.meta.get("val")
        head.linear.node.replace_input_with(x, copied)
        for node, onward in zip(head.chain, [*head.chain[1:], head.loss]):
            others = [u for u in node.users if u is not onward]
            if others:  # the logits are also returned (Hugging Face's output) or read elsewhere: those read them whole
                with graph.inserting_after(node):
                    whole = graph.call_function(gather_vocabulary, (node, group, tp, rank, head.vocab))
                whole.meta["val"] = node.meta.get("val")
                for user in others:
                    user.replace_input_with(node, whole)
        for view in head.views:
            sizes = list(view.args[1])  # type: ignore[arg-type]
            if sizes[-1] != -1:
                sizes[-1] = local
                view.args = (view.args[0], sizes, *view.args[2:])
        with graph.inserting_after(head.loss):
            parallel = graph.call_function(vocab_parallel_cross_entropy, (head.loss.args[0], head.loss.args[1], group, first, count, head.ignore_index))
        parallel.meta["val"] = head.loss.meta.get("val")
        head.loss.replace_all_uses_with(parallel)
        graph.erase_node(head.loss)
        for embedding in head.embeddings:
            with graph.inserting_after(embedding):
                padding = embedding.args[2] if len(embedding.args) > 2 else -1
                lookup = graph.call_function(vocab_parallel_embedding, (embedding.args[0], embedding.args[1], group, first, count, padding))
            lookup.meta["val"] = embedding.meta.get("val")
            embedding.replace_all_uses_with(lookup)
            graph.erase_node(embedding)
        weight = str(head.linear.node.args[1].target)  # type: ignore[union-attr]
        slices[names.get(weight, weight)] = SliceSpec(dim=0, units=head.vocab if head.vocab % tp else 0)
    graph.lint()
    gm.recompile()
    return slices
