"""What runs each node of a graph handed to a lowering: the lowering's choice, written down.

Every computing node gets ``meta["dscompile"]["lowered_by"]``, one of:

- ``"dscompile op <name>"``: a ``dscompile::`` custom op a pass put in the graph (block-sparse attention, cache
  attention, rotary, ZeRO's collectives, ...). Every lowering calls it as it is, its own kernel inside, so
  dscompile's hand-written kernels run under Inductor too;
- ``"triton codegen"``: a fusion region dscompile's Triton codegen generates (``lower: triton``);
- ``"inductor"``: Inductor generates it (the default lowering);
- ``"aten"``: the op runs as its ATen kernel (``lower: eager``, and the nodes outside the regions of
  ``lower: triton``).

The frontend records the counts and the reason for the lowering in ``analysis["lowering_choice"]`` and, with a
dump, in the graph's last step ``<NN>_lower/`` (``nodes.txt`` shows ``lowered_by``; ``lowering.txt`` the reason).
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.fx

from dscompile.graph import ds_meta

REGION_PREFIX = "ds_region_"
"""Name prefix of the fusion regions' submodules (the fuse pass makes them, the triton lowering runs them)."""
_GENERATED_BY = {"inductor": "inductor", "triton": "aten", "eager": "aten"}


def node_assignment(node: torch.fx.Node, lowering: str) -> str | None:
    """What runs ``node`` under ``lowering`` (None for placeholders, outputs and attribute reads)."""
    if node.op == "call_module" and str(node.target).startswith(REGION_PREFIX):
        return "triton codegen"
    if node.op != "call_function":
        return None
    namespace, _, name = _qualified_name(node.target).partition("::")
    if namespace == "dscompile":
        return f"dscompile op {name}"
    if ds_meta(node).get("kernel") == "matmul_epilogue":
        return "dscompile op matmul_epilogue"
    return _GENERATED_BY.get(lowering, lowering)


def _qualified_name(target: object) -> str:
    """``"dscompile::rotary_embedding"`` for that op (overload or packet); ``""`` for Python functions."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return ""


def assign_nodes(gm: torch.fx.GraphModule, lowering: str) -> Counter[str]:
    """Write ``lowered_by`` into each computing node's metadata; returns the counts."""
    counts: Counter[str] = Counter()
    for node in gm.graph.nodes:
        who = node_assignment(node, lowering)
        if who is not None:
            ds_meta(node)["lowered_by"] = who
            counts[who] += 1
    return counts


def assignment_report(gm: torch.fx.GraphModule, lowering: str, reason: str) -> str:
    """The dump's ``lowering.txt``: the lowering, why, node counts by what runs them, and the dscompile ops by name."""
    counts = Counter(n.meta["dscompile"]["lowered_by"] for n in gm.graph.nodes if "lowered_by" in n.meta.get("dscompile", {}))
    lines = [f"lowering: {lowering}", f"why: {reason}", "nodes by what runs them:"]
    lines += [f"  {who}: {count}" for who, count in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    ops = [f"  {n.name}: {who}" for n in gm.graph.nodes if (who := n.meta.get("dscompile", {}).get("lowered_by", "")).startswith("dscompile op")]
    if ops:
        lines += ["dscompile ops (their own kernels):", *ops]
    return "\n".join(lines) + "\n"


def region_report(gm: torch.fx.GraphModule) -> str:
    """Readable summary of regions and skipped nodes (written to the dump)."""
    lines = []
    for node in gm.graph.nodes:
        meta = node.meta.get("dscompile", {})
        if node.op == "call_module" and "region" in meta:
            how = f"kernel {meta['kernel']}" if "kernel" in meta else meta.get("fusion_skip_reason", "not lowered yet")
            lines.append(f"region {meta['region']} [{how}]: {', '.join(meta.get('region_nodes', []))}")
    for node in gm.graph.nodes:
        reason = node.meta.get("dscompile", {}).get("fusion_skip_reason")
        if reason:
            lines.append(f"skipped {node.name}: {reason}")
    return "\n".join(lines) + "\n"
