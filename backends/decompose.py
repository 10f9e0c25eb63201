"""Re-apply a lowering's decomposition table to ops that passes inserted after AOTAutograd traced.

AOTAutograd decomposes the graph with the lowering's table once, at trace time. Passes on the
forward and backward graphs run later and may insert ops that table would have decomposed (a
gradient cast as ``aten._to_copy``, an offload copy). A lowering that relies on the table, as
Inductor does (it has no lowering of its own for ``aten._to_copy``), then fails on them. So before
lowering, each such node is traced through the table on its fake values and replaced by the
resulting ops, which carry fake values like every other node.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx
from torch.fx.node import map_arg

log = logging.getLogger("dscompile.backends.decompose")


def _fake_mode(gm: torch.fx.GraphModule) -> Any:
    from torch._guards import detect_fake_mode

    return detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"])


def decompose_leftovers(gm: torch.fx.GraphModule, table: dict | None) -> int:
    """Decompose every ``call_function`` node whose op is in ``table``; returns how many were replaced.

    A decomposition that declines (returns ``NotImplemented``, as Inductor's do for shapes they
    leave to a fallback kernel) keeps its node.
    """
    if not table:
        return 0
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in table and "val" in n.meta]
    if not nodes:
        return 0
    fake_mode = _fake_mode(gm)
    if fake_mode is None:
        log.info("graph without fake values: %d op(s) left undecomposed", len(nodes))
        return 0
    replaced = 0
    for node in nodes:
        replaced += _decompose_node(gm, node, table, fake_mode)
    if replaced:
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return replaced


def _decompose_node(gm: torch.fx.GraphModule, node: torch.fx.Node, table: dict, fake_mode: Any) -> int:
    from torch.fx.experimental.proxy_tensor import make_fx

    inputs = list(node.all_input_nodes)
    position = {n: i for i, n in enumerate(inputs)}

    def call(*values: Any) -> Any:
        # make_fx applies the table at dispatch; a decomposition returning NotImplemented keeps the op
        return node.target(*map_arg(node.args, lambda n: values[position[n]]), **map_arg(node.kwargs, lambda n: values[position[n]]))

    with fake_mode:
        traced = make_fx(call, decomposition_table=table, tracing_mode="real")(*[n.meta["val"] for n in inputs])
    output = next(n for n in traced.graph.nodes if n.op == "output")
    if (
        not isinstance(output.args[0], torch.fx.Node)
        or any(n.op == "call_function" and n.target is node.target for n in traced.graph.nodes)
        or any(n.op == "get_attr" for n in traced.graph.nodes)
    ):
        log.info("%s: %s left as is (declined, or a result/constant this rewrite does not inline)", node.name, node.target)
        return 0
    env: dict[torch.fx.Node, Any] = {}
    placeholders = iter(inputs)
    with gm.graph.inserting_before(node):
        for sub in traced.graph.nodes:
            if sub.op == "placeholder":
                env[sub] = next(placeholders)
            elif sub.op == "call_function":
                new = gm.graph.node_copy(sub, lambda n: env[n])
                for key in ("stack_trace", "nn_module_stack"):
                    if key in node.meta:
                        new.meta.setdefault(key, node.meta[key])
                if "dscompile" in node.meta:
                    new.meta.setdefault("dscompile", dict(node.meta["dscompile"]))
                env[sub] = new
    result = env[output.args[0]]
    node.replace_all_uses_with(result)
    gm.graph.erase_node(node)
    log.debug("%s decomposed into %s", node.target, result.target)
    return 1
