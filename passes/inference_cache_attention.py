"""Attention over the static KV cache found in the captured graph and replaced by one bounded attention op.

With a static cache of ``max_out_tokens`` slots, the prefill and decode graphs of a Hugging Face
model attend over the whole cache: ``scaled_dot_product_attention(q, K, V, attn_mask=mask)`` where
``K``/``V`` are the cache tensors (graph inputs, written in place by the step; in an ATen graph the
result of that write) or their
grouped-query repeat (``cache[:, :, None].expand(b, kv, rep, s, d).reshape(b, kv * rep, s, d)``,
a full copy of the cache per layer per token), and ``mask`` is boolean with the unwritten slots
False. ``fuse_cache_attention`` (pre-autograd graph, inference only) replaces each such call by one
``dscompile::cache_attention`` op (``dscompile.runtime.inference.ops``) on the cache itself: it
reads only the prefix of the cache the mask can reach (bounded by the current length, not by
``max_out_tokens``) and groups the query heads of a KV head instead of repeating the cache. The
bound is read from the mask inside the op, so the decode graph keeps its static shapes and compiles
once. Matched from the graph's structure (shapes and op kinds), nothing per architecture.

Left alone, and logged: attention whose keys/values are not graph inputs (no cache: the plain
forward), a mask that is absent or not boolean (an additive float mask's "masked" columns are not
provably zero weight), ``is_causal``, dropout.
Nodes created carry ``meta["dscompile"]["inference_fusion"] = {"cache_attention": name}``; the count
goes to ``ctx.analysis["inference_cache_attention"][graph]``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from dscompile.graph import ds_meta, node_value, set_fake_value
from dscompile.pipeline import PassContext, register_pass
from dscompile.runtime.inference.ops import CACHE_ATTENTION

log = logging.getLogger("dscompile.passes.inference_cache_attention")

aten = torch.ops.aten
SDPA = {torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention, aten.scaled_dot_product_attention.default}
SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
SDPA_DEFAULTS: dict[str, Any] = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
# the ops a grouped-query repeat of the cache is written with (an unsqueeze as ``x[:, :, None]``, an expand, a reshape)
VIEW_FUNCS = {torch.reshape, torch.unsqueeze, aten.reshape.default, aten.view.default, aten._unsafe_view.default, aten.expand.default, aten.unsqueeze.default}
VIEW_METHODS = {"reshape", "view", "expand", "unsqueeze"}


def _value(node: Any) -> torch.Tensor | None:
    value = node_value(node) if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _eq(a: Any, b: Any) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return bool(statically_known_true(a == b))


def _same_shape(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(_eq(x, y) for x, y in zip(a, b))


def sdpa_arguments(node: torch.fx.Node) -> dict[str, Any]:
    """The arguments of an SDPA call by name, defaults filled in."""
    args = dict(SDPA_DEFAULTS)
    args.update(zip(SDPA_ARGS, node.args))
    args.update(node.kwargs)
    return args


def _view_step(node: torch.fx.Node) -> torch.fx.Node | None:
    """The input of a single-input view op (unsqueeze, expand, reshape, ``x[:, :, None]``), else None."""
    if node.op == "call_function" and node.target in VIEW_FUNCS or node.op == "call_method" and node.target in VIEW_METHODS:
        return node.args[0] if isinstance(node.args[0], torch.fx.Node) else None
    if node.op == "call_function" and node.target.__name__ == "getitem" and isinstance(node.args[1], tuple):
        index = node.args[1]
        full = slice(None, None, None)
        if all(i is None or i == full for i in index) and isinstance(node.args[0], torch.fx.Node):
            return node.args[0]
    return None


def is_cache(node: torch.fx.Node) -> bool:
    """A graph input, or an in-place write into one (an ATen graph reads the cache as ``index_copy_``'s result)."""
    if node.op == "placeholder":
        return True
    src = node.args[0] if node.args else None
    if not isinstance(src, torch.fx.Node) or src.op != "placeholder":
        return False
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.startswith("__")
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable


def cache_source(node: Any, heads: Any) -> torch.fx.Node | None:
    """The cache (a graph input ``[b, kv, s, d]``, or a write into one) that ``node`` is or repeats to ``heads`` heads; else None."""
    if not isinstance(node, torch.fx.Node):
        return None
    value = _value(node)
    if value is None or value.dim() != 4:
        return None
    if is_cache(node):
        return node
    # repeat_kv: [b, kv, s, d] -> [b, kv, 1, s, d] -> [b, kv, rep, s, d] -> [b, kv * rep, s, d], each step a view op
    chain = [node]
    while len(chain) < 4 and (step := _view_step(chain[-1])) is not None:
        chain.append(step)
    if len(chain) != 4 or not is_cache(chain[-1]):
        return None
    shapes = [tuple(_value(n).shape) if _value(n) is not None else () for n in chain]  # type: ignore[union-attr]
    out, expanded, unsqueezed, cache = shapes
    if len(cache) != 4 or len(unsqueezed) != 5 or len(expanded) != 5:
        return None
    b, kv, s, d = cache
    rep = expanded[2]
    ok = _same_shape(unsqueezed, (b, kv, 1, s, d)) and _same_shape(expanded, (b, kv, rep, s, d)) and _same_shape(out, (b, heads, s, d))
    return chain[-1] if ok and _eq(kv * rep, heads) else None


def match_cache_attention(node: torch.fx.Node) -> tuple[dict[str, Any], torch.fx.Node, torch.fx.Node] | str | None:
    """``(arguments, key cache, value cache)`` for an SDPA over the KV cache; a reason string when it is left alone."""
    if node.op != "call_function" or node.target not in SDPA:
        return None
    args = sdpa_arguments(node)
    q = _value(args["query"])
    if q is None or q.dim() != 4:
        return "query is not [batch, heads, queries, dim]"
    heads = q.shape[1]
    k, v = cache_source(args["key"], heads), cache_source(args["value"], heads)
    if k is None or v is None:
        return "keys/values are not a KV cache (graph inputs, or their grouped-query repeat)"
    mask = _value(args["attn_mask"])
    if mask is None or mask.dtype != torch.bool:
        return "no boolean attention mask to bound the cache's valid prefix"
    if args["is_causal"] or args["dropout_p"] != 0.0:
        return "is_causal or dropout"
    kv = _value(k).shape[1]  # type: ignore[union-attr]
    if not (isinstance(heads, int) and isinstance(kv, int) and heads % kv == 0):
        return f"{heads} query heads over {kv} KV heads"
    if not _eq(mask.shape[-1], _value(k).shape[2]):  # type: ignore[union-attr]
        return "the mask's last dim is not the cache length"
    return args, k, v


@register_pass("fuse_cache_attention", graphs=("pre_autograd",))
def fuse_cache_attention(gm: torch.fx.GraphModule, ctx: PassContext, options: None) -> torch.fx.GraphModule:
    """Attention over the static KV cache becomes one ``dscompile::cache_attention`` op reading its valid prefix (inference only)."""
    if torch.is_grad_enabled():
        log.info("%s: gradients are on; attention over a KV cache is fused for inference graphs only", ctx.graph_name)
        return gm
    fused = 0
    for node in list(gm.graph.nodes):
        found = match_cache_attention(node)
        if found is None:
            continue
        if isinstance(found, str):
            log.info("%s: %s left as is: %s", ctx.graph_name, node.name, found)
            continue
        args, k, v = found
        with gm.graph.inserting_before(node):
            op = gm.graph.call_function(CACHE_ATTENTION, (args["query"], k, v, args["attn_mask"], args["scale"]))
        set_fake_value(op)
        if not _same_shape(tuple(node_value(op).shape), tuple(node_value(node).shape)):
            gm.graph.erase_node(op)
            log.info("%s: %s left as is: the op's output shape differs", ctx.graph_name, node.name)
            continue
        for field in ("nn_module_stack", "stack_trace"):
            if field in node.meta:
                op.meta[field] = node.meta[field]
        ds_meta(op)["inference_fusion"] = {"cache_attention": node.name}
        node.replace_all_uses_with(op)
        gm.graph.erase_node(node)
        fused += 1
    gm.graph.lint()
    gm.recompile()
    ctx.analysis.setdefault("inference_cache_attention", {})[ctx.graph_name] = fused
    log.info("%s: %d attentions over the KV cache fused", ctx.graph_name, fused)
    return gm
