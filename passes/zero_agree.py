"""Check, before each run of a compiled ZeRO graph, that every rank issues the same collectives.

ZeRO-2/3 gathers and reduce-scatters sit inside the compiled graphs, each where the model uses
the parameter. When ranks compile different graphs (a branch taken on some ranks only, so a
parameter unused there), the collectives pair with the wrong partners: a hang, a gloo abort, or
silently misaligned gradients. This pass fingerprints the graph's schedule: the forward graph's
collectives in issue order, each named by the parameters it carries, and from the joint graph the
order in which backward first reads each gathered parameter and reduce-scatters each gradient.
It wraps the lowered forward graph so that each run starts with
``zero_shard.agree_on_schedule`` (one all-gather of the 64-bit fingerprint); on a mismatch every
rank raises ``ZeroScheduleDivergence`` before any payload moves, and the engine switches to
up-front collectives (``ZeroModule.collectives_up_front``). Runs last among the ZeRO passes.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any

import torch.fx
from torch.utils._pytree import tree_leaves

from dscompile.graph import ds_meta
from dscompile.passes.zero import is_zero_start, joint_backward
from dscompile.pipeline import PassContext, register_pass
from dscompile.runtime import zero_ops
from dscompile.runtime.zero_shard import agree_on_schedule

log = logging.getLogger("dscompile.passes.zero_agree")

_ZERO_OPS = (zero_ops.GATHER, zero_ops.USE)


def _param_name(node: torch.fx.Node) -> str:
    return str(ds_meta(node).get("param", node.name)) if node.op == "placeholder" else node.name


def joint_schedule(gm: torch.fx.GraphModule) -> tuple[list[str], str | None]:
    """Backward events of a joint graph: first backward read of each gathered parameter, each gradient reduce-scatter."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    backward = joint_backward(graph)
    gathered = {n: _param_name(n.args[0]) for n in graph.nodes if n.op == "call_function" and n.target is zero_ops.GATHER}
    owners = _gradient_owners(graph, placeholders)
    group = next((str(n.args[-1]) for n in graph.nodes if n.op == "call_function" and n.target in (*_ZERO_OPS, zero_ops.REDUCE_SCATTER)), None)
    events: list[str] = []
    read: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op != "call_function" or node not in backward:
            continue
        if node.target is zero_ops.REDUCE_SCATTER:
            events.append(f"reduce_scatter:{owners.get(node, node.args[1])}")
            continue
        for source in node.all_input_nodes:
            if source in gathered and source not in read:
                read.add(source)
                events.append(f"gather:{gathered[source]}")
    return events, group


def _gradient_owners(graph: torch.fx.Graph, placeholders: list[torch.fx.Node]) -> dict[torch.fx.Node, str]:
    """Which parameter each reduce-scatter's result is the gradient of (the joint graph returns one per primal)."""
    primals = [n for n in placeholders if n.name.startswith("primals")]
    output = next(n for n in graph.nodes if n.op == "output")
    flat = tree_leaves(output.args[0])  # forward outputs, then one gradient (or None) per primal
    grads = flat[len(flat) - len(primals) :] if len(flat) >= len(primals) else []
    owners: dict[torch.fx.Node, str] = {}
    for primal, grad in zip(primals, grads, strict=False):
        node = grad
        while isinstance(node, torch.fx.Node) and node.target is not zero_ops.REDUCE_SCATTER and len(node.all_input_nodes) == 1:
            node = node.all_input_nodes[0]  # through views and casts
        if isinstance(node, torch.fx.Node) and node.target is zero_ops.REDUCE_SCATTER:
            owners[node] = _param_name(primal)
    return owners


def forward_schedule(gm: torch.fx.GraphModule) -> tuple[list[str], str | None]:
    """The forward graph's ZeRO collectives in issue order, each named by the parameters it carries."""
    events, group = [], None
    for node in gm.graph.nodes:
        if not is_zero_start(node):
            continue
        info = ds_meta(node)["zero"]
        group = info["group"]
        members = sorted({_param_name(n) for n in _placeholder_inputs(node)})
        events.append(f"{info['kind']}:{info['elements']}:{','.join(members)}")
    return events, group


def _placeholder_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    found, stack, seen = [], list(node.all_input_nodes), set()
    while stack:
        item = stack.pop()
        if item in seen:
            continue
        seen.add(item)
        if item.op == "placeholder":
            found.append(item)
        else:
            stack.extend(item.all_input_nodes)
    return found


def fingerprint(events: list[str]) -> int:
    digest = hashlib.blake2b("\n".join(events).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


@register_pass("zero_agree", graphs=("joint", "forward"), requires=("zero",))
def zero_agree(gm: torch.fx.GraphModule, ctx: PassContext, options: None) -> torch.fx.GraphModule:
    """Make each run of this ZeRO graph first agree with the other ranks on its collective schedule."""
    if ctx.graph_kind == "joint":
        ctx.analysis["zero_agree_backward"] = joint_schedule(gm)
        return gm
    forward, group = forward_schedule(gm)
    backward, joint_group = ([], None) if ctx.is_inference else ctx.analysis.get("zero_agree_backward", ([], None))
    group = group or joint_group
    if group is None or ctx.world_size <= 1 or not (forward or backward):
        # No ZeRO collective in this graph: the model part under up-front collectives, or a ZeRO-2 inference
        # graph, which a single rank may run on its own (evaluation on rank 0): no agreement to ask for.
        return gm
    events = ["forward", *forward, "backward", *backward]
    value = fingerprint(events)
    summary = f"{len(forward)} forward and {len(backward)} backward ZeRO collective events, fingerprint {value}"
    ctx.analysis.setdefault("zero_agree", {})[ctx.graph_name] = {"fingerprint": value, "events": events}
    wraps = ctx.analysis.setdefault("wrap_lowered", {})
    wraps[ctx.graph_name] = _agreeing(value, summary, group, wraps.get(ctx.graph_name))
    log.debug("%s: schedule fingerprint %d over %d events", ctx.graph_name, value, len(events))
    return gm


def _agreeing(value: int, summary: str, group: str, inner_wrap: Callable[..., Any] | None) -> Callable[..., Any]:
    """A ``wrap_lowered`` hook: agree on the schedule, then run the lowered graph (through any earlier wrap)."""

    def wrapper(gm: torch.fx.GraphModule, lowered: Callable[..., Any]) -> Callable[..., Any]:
        inner = inner_wrap(gm, lowered) if inner_wrap is not None else lowered
        boxed = getattr(inner, "_boxed_call", False)

        def run(args: list[Any]) -> Any:
            agree_on_schedule(value, summary, group)
            return inner(args) if boxed else inner(*args)

        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    return wrapper
