"""The ``fuse`` pass: partition a graph into regions the Triton backend generates as one kernel.

Regions are found by ``CapabilityBasedPartitioner`` with an operator support that asks the
codegen (``unsupported_reason``); each proposed partition is then refined so it is one
kernel's worth of work: split at collectives (compute never moves across a wait), split into
connected pieces, stripped of views that only alias an outside tensor, and checked by planning
its kernel. Fused regions become ``call_module`` nodes; every node records its region in
``meta["dscompile"]["region"]`` or why it was left out in ``["fusion_skip_reason"]``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner, Partition
from torch.fx.passes.operator_support import OperatorSupport

from dscompile.backends.assignment import REGION_PREFIX, region_report  # noqa: F401  (tests import it from here)
from dscompile.backends.triton.generate import generate_kernel
from dscompile.backends.triton.specs import CodegenUnsupported, TensorSpec, output_spec_for
from dscompile.backends.triton.support import is_compute, is_view, unsupported_reason
from dscompile.graph import ds_meta, is_collective
from dscompile.pipeline import PassContext, invocation, register_config_rule, register_pass

log = logging.getLogger("dscompile.passes.fuse")


class TritonOperatorSupport(OperatorSupport):
    """Nodes the Triton codegen can generate; the rest get a recorded reason."""

    def is_node_supported(self, submodules: Any, node: torch.fx.Node) -> bool:
        if node.op != "call_function":
            return False
        reason = unsupported_reason(node)
        if reason is not None:
            ds_meta(node)["fusion_skip_reason"] = reason
            return False
        ds_meta(node).pop("fusion_skip_reason", None)
        return True


def _phases(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, int]:
    """Number of collectives (and waits) before each node: a region never spans one."""
    phase, count = {}, 0
    for node in gm.graph.nodes:
        if is_collective(node):
            count += 1
        phase[node] = count
    return phase


def _view_root(node: torch.fx.Node) -> torch.fx.Node:
    while is_view(node) and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def _drop_aliasing_views(nodes: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """Remove views of outside tensors whose result (or a view of it) leaves the region.

    Materialising such a view would turn an alias into a copy; the view stays an aten call and
    the region reads it as a (strided) input instead.
    """
    changed = True
    while changed:
        changed = False
        for node in list(nodes):
            if node not in nodes or not is_view(node) or _view_root(node) in nodes:
                continue
            family, stack = {node}, [node]
            while stack:
                for user in stack.pop().users:
                    if user in nodes and is_view(user) and user not in family:
                        family.add(user)
                        stack.append(user)
            if any(u not in nodes for f in family for u in f.users):
                for f in family:
                    ds_meta(f)["fusion_skip_reason"] = "view of an outside tensor leaves the region: kept as an alias"
                nodes -= family
                changed = True
    return nodes


def _components(nodes: set[torch.fx.Node]) -> list[set[torch.fx.Node]]:
    import networkx as nx

    g = nx.Graph()
    g.add_nodes_from(nodes)
    for n in nodes:
        for a in n.all_input_nodes:
            if a in nodes:
                g.add_edge(a, n)
    return [set(c) for c in nx.connected_components(g)]


def _region_io(nodes: Sequence[torch.fx.Node]) -> tuple[list[torch.fx.Node], list[torch.fx.Node]]:
    members = set(nodes)
    inputs: list[torch.fx.Node] = []
    outputs: list[torch.fx.Node] = []
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in members and a not in inputs:
                inputs.append(a)
        if any(u not in members for u in n.users):
            outputs.append(n)
    return inputs, outputs


def plan(nodes: Sequence[torch.fx.Node]) -> str | None:
    """None when the codegen can emit ``nodes`` (topologically ordered) as one kernel, else why."""
    inputs, outputs = _region_io(nodes)
    if not outputs:
        return "region has no outputs"
    try:
        generate_kernel(
            inputs,
            nodes,
            outputs,
            [TensorSpec.of(a.meta["val"]) for a in inputs],
            [output_spec_for(o.meta["val"]) for o in outputs],
        )
    except CodegenUnsupported as exc:
        return str(exc)
    except Exception as exc:  # a planner bug must not break compilation: log and fall back
        log.warning("planning a region failed unexpectedly: %r", exc)
        return f"planner error: {exc!r}"
    return None


def _split_plannable(nodes: list[torch.fx.Node]) -> list[list[torch.fx.Node]]:
    """Greedy intervals of the topological order that plan (intervals of a convex set stay convex)."""
    if plan(nodes) is None:
        return [nodes]
    chunks: list[list[torch.fx.Node]] = []
    current: list[torch.fx.Node] = []
    for node in nodes:
        if plan(current + [node]) is None:
            current.append(node)
            continue
        if current:
            chunks.append(current)
        if plan([node]) is None:
            current = [node]
        else:
            reason = plan([node])
            ds_meta(node)["fusion_skip_reason"] = f"codegen: {reason}"
            current = []
    if current:
        chunks.append(current)
    return chunks


def propose_regions(gm: torch.fx.GraphModule) -> list[list[torch.fx.Node]]:
    """The refined partitions of ``gm``, each a topologically ordered node list."""
    support = TritonOperatorSupport()
    partitioner = CapabilityBasedPartitioner(gm, support, allows_single_node_partition=True)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    phase = _phases(gm)
    regions: list[list[torch.fx.Node]] = []
    for part in partitioner.propose_partitions():
        nodes = _drop_aliasing_views(set(part.nodes))
        by_phase: dict[int, set[torch.fx.Node]] = {}
        for n in nodes:
            by_phase.setdefault(phase[n], set()).add(n)
        for group in by_phase.values():
            for comp in _components(group):
                ordered = sorted(comp, key=order.__getitem__)
                for chunk in _split_plannable(ordered):
                    if not any(is_compute(n) for n in chunk):
                        for n in chunk:
                            ds_meta(n).setdefault("fusion_skip_reason", "region without arithmetic: views stay free aten calls")
                        continue
                    regions.append(chunk)
    regions.sort(key=lambda r: order[r[0]])
    return regions


def fuse_regions(gm: torch.fx.GraphModule, prefix: str = REGION_PREFIX) -> list[str]:
    """Turn every plannable region into a ``call_module`` submodule; returns the submodule names."""
    regions = propose_regions(gm)
    if not regions:
        return []
    existing = sum(1 for name, _ in gm.named_children() if name.startswith(prefix))
    start = existing
    names = [f"{prefix}{start + i}" for i in range(len(regions))]
    for name, nodes in zip(names, regions, strict=False):
        for n in nodes:
            meta = ds_meta(n)
            meta["region"] = name
            meta.pop("fusion_skip_reason", None)
    partitions = [Partition(id=i, nodes=nodes) for i, nodes in enumerate(regions)]
    partitioner = CapabilityBasedPartitioner(gm, TritonOperatorSupport())
    fused = partitioner.fuse_partitions(partitions, prefix=f"{prefix}tmp_")
    # Rename the submodules to stable, numbered names and mark the new nodes.
    for node in fused.graph.nodes:
        if node.op == "call_module" and str(node.target).startswith(f"{prefix}tmp_"):
            index = int(str(node.target)[len(f"{prefix}tmp_") :])
            new_name = names[index]
            sub = getattr(fused, node.target)
            delattr(fused, node.target)
            fused.add_submodule(new_name, sub)
            node.target = new_name
            node._rename(new_name)
            meta = node.meta.setdefault("dscompile", {})
            meta = dict(meta)
            meta.pop("fusion_skip_reason", None)
            meta["region"] = new_name
            meta["region_nodes"] = [n.name for n in sub.graph.nodes if n.op == "call_function"]
            node.meta["dscompile"] = meta
            _ensure_values(sub)
    for node in fused.graph.nodes:
        if node.op == "call_function" and node.target is __import__("operator").getitem:
            src = node.args[0]
            if src.op == "call_module" and str(src.target).startswith(prefix) and "val" not in node.meta:
                node.meta["val"] = src.meta["val"][node.args[1]]
    fused.recompile()
    if fused is not gm:
        gm.graph = fused.graph
    log.debug("fused %d regions: %s", len(names), names)
    return names


def _ensure_values(sub: torch.fx.GraphModule) -> None:
    for n in sub.graph.nodes:
        if n.op in ("placeholder", "call_function") and "val" not in n.meta:
            raise CodegenUnsupported(f"region node {n.name} lost its meta['val']")


@register_pass("fuse", graphs=("forward", "backward"))
def fuse(gm: torch.fx.GraphModule, ctx: PassContext, options: None) -> torch.fx.GraphModule:
    """Group pointwise ops, trailing-dim reductions and free views into Triton kernel regions.

    Before the triton lowering on a GPU, matmuls with a bias/activation/residual epilogue first
    become single Triton template calls (kernels/matmul_epilogue.py).
    """
    lowering = ctx.analysis.get("lowering")
    if lowering not in (None, "triton", "eager"):
        # Inductor partitions and fuses on its own and cannot take region submodules.
        log.info("%s: regions are for the triton lowering; with lower(%s) the graph is left unchanged", ctx.graph_name, lowering)
        return gm
    if lowering == "triton":
        from dscompile.passes.matmul_epilogue_fold import fold_matmul_epilogues

        folded = fold_matmul_epilogues(gm)
        if folded:
            log.debug("%s: %d matmul epilogues folded into the Triton template", ctx.graph_name, folded)
    names = fuse_regions(gm)
    ctx.analysis.setdefault("fusion_regions", {})[ctx.graph_name] = names
    if getattr(ctx.config, "dump", None):
        from pathlib import Path

        target = Path(ctx.config.dump) / ctx.graph_name
        target.mkdir(parents=True, exist_ok=True)
        (target / "regions.txt").write_text(region_report(gm))
    return gm


def triton_lowering_selected(config: Any) -> bool:
    """Only ``lower: triton`` forms regions: the default lowering is Inductor on every device, which fuses on its own."""
    return getattr(config, "lower", None) == "triton"


@register_config_rule(90, "fusion")
def _fusion_rule(config: Any) -> list:
    return [invocation("fuse")] if triton_lowering_selected(config) else []
