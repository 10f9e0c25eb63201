"""Generate the kernel for one region: check every node, run the emitter, name the kernel by its structure.

``region_key`` hashes ops, wiring, constants and every tensor's shape/stride/dtype, so the kernel cache
(``kernel_cache.py``) compiles a region once however many graphs contain it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from dscompile.backends.triton.emitter import RegionEmitter, next_pow2
from dscompile.backends.triton.specs import CodegenUnsupported, KernelSource, TensorSpec
from dscompile.backends.triton.support import unsupported_reason


def region_key(
    inputs: Sequence[torch.fx.Node],
    nodes: Sequence[torch.fx.Node],
    outputs: Sequence[torch.fx.Node],
    input_specs: Sequence[TensorSpec],
    output_specs: Sequence[TensorSpec],
) -> str:
    """A structural hash: ops and their wiring, constants, and every tensor's shape/stride/dtype."""
    local: dict[torch.fx.Node, str] = {n: f"i{i}" for i, n in enumerate(inputs)}
    parts = []
    for k, node in enumerate(nodes):
        local[node] = f"n{k}"

        def norm(a: Any) -> Any:
            return local.get(a, "?") if isinstance(a, torch.fx.Node) else a

        args = torch.fx.node.map_aggregate(node.args, norm)
        kwargs = torch.fx.node.map_aggregate(dict(node.kwargs), norm)
        val = node.meta["val"]
        parts.append(f"{node.target}|{args!r}|{sorted(kwargs.items(), key=lambda kv: kv[0])!r}|{tuple(val.shape)}|{val.dtype}")
    parts.append("out:" + ",".join(local[o] for o in outputs))
    parts.append("in:" + repr(list(input_specs)) + "out:" + repr(list(output_specs)))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def generate_kernel(
    inputs: Sequence[torch.fx.Node],
    nodes: Sequence[torch.fx.Node],
    outputs: Sequence[torch.fx.Node],
    input_specs: Sequence[TensorSpec],
    output_specs: Sequence[TensorSpec],
    output_is_tuple: bool = True,
) -> KernelSource:
    """Plan and print the kernel for one region; raises CodegenUnsupported with a reason."""
    for node in nodes:
        reason = unsupported_reason(node)
        if reason:
            raise CodegenUnsupported(reason)
    emitter = RegionEmitter(inputs, nodes, outputs, input_specs, output_specs)
    emitter.run()
    key = region_key(inputs, nodes, outputs, input_specs, output_specs)
    name = f"ds_{emitter.kind}_{key[:12]}"
    specs = (*input_specs, *output_specs)
    extent = max([1] + [sum((d - 1) * abs(s) for d, s in zip(sp.shape, sp.stride, strict=False)) + 1 for sp in specs])
    int64 = extent >= 2**31 - 1 or emitter.xnumel * max(emitter.rnumel, 1) >= 2**31 - 1
    source = emitter.source(name, int64)
    return KernelSource(
        name=name,
        source=source,
        kind=emitter.kind,
        xnumel=emitter.xnumel,
        rnumel=emitter.rnumel,
        rblock=next_pow2(emitter.rnumel) if emitter.kind == "reduction" else 1,
        input_specs=tuple(input_specs),
        output_specs=tuple(output_specs),
        output_is_tuple=output_is_tuple,
        key=key,
        index_int64=int64,
    )


def region_parts(gm: torch.fx.GraphModule) -> tuple[list[torch.fx.Node], list[torch.fx.Node], list[torch.fx.Node], bool]:
    """(placeholders, compute nodes, output nodes, output_is_tuple) of a region submodule."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    result = out_node.args[0]
    is_tuple = isinstance(result, (list, tuple))
    outputs = list(result) if is_tuple else [result]
    for o in outputs:
        if not isinstance(o, torch.fx.Node) or o in placeholders:
            raise CodegenUnsupported("region output is not computed in the region")
    return placeholders, nodes, outputs, is_tuple
