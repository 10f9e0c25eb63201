"""Move the activations a forward graph saves for backward to host memory, and back.

Used by ``activation_checkpointing.cpu_checkpointing``: after partitioning, every saved
activation (not a graph input, not a symbolic size) on an accelerator gets a copy to CPU just
before the forward returns, and the backward copies it back to its device right before its
first use, so device memory holds it only during forward and from that use on.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.fx

from dscompile.graph import ds_meta, node_value, set_fake_value

log = logging.getLogger("dscompile.passes.checkpoint")
aten = torch.ops.aten


def saved_outputs(fw: torch.fx.GraphModule, num_fwd_outputs: int) -> list[torch.fx.Node]:
    """The forward graph's outputs beyond the user outputs: what it hands to backward."""
    output = next(n for n in reversed(fw.graph.nodes) if n.op == "output")
    values = output.args[0]
    return [v for v in values[num_fwd_outputs:] if isinstance(v, torch.fx.Node)]


def offload_saved_activations(
    fw: torch.fx.GraphModule,
    bw: torch.fx.GraphModule,
    num_fwd_outputs: int,
    candidates: Sequence[str],
    *,
    include_cpu: bool = False,
) -> list[str]:
    """Rewrite ``fw``/``bw`` so that the saved values named in ``candidates`` travel via the host.

    ``include_cpu`` also routes CPU tensors through a host copy (a real copy on CPU); it exists
    so the graph rewrite itself can be tested on machines without an accelerator. Returns the
    names of the values moved.
    """
    output = next(n for n in reversed(fw.graph.nodes) if n.op == "output")
    outputs = list(output.args[0])
    bw_placeholders = {n.name: n for n in bw.graph.nodes if n.op == "placeholder"}
    wanted = set(candidates)
    moved: list[str] = []
    for index in range(num_fwd_outputs, len(outputs)):
        node = outputs[index]
        if not isinstance(node, torch.fx.Node) or node.name not in wanted:
            continue
        value = node_value(node)
        if not isinstance(value, torch.Tensor) or node.name not in bw_placeholders:
            continue
        device = value.device
        if device.type == "cpu" and not include_cpu:
            continue
        with fw.graph.inserting_before(output):
            host = fw.graph.call_function(aten._to_copy.default, (node,), {"device": torch.device("cpu")})
        set_fake_value(host)
        ds_meta(host)["offload"] = "to_host"
        outputs[index] = host
        placeholder = bw_placeholders[node.name]
        users = list(placeholder.users)
        if users:
            first_use = min(users, key=_position(bw.graph))
            with bw.graph.inserting_before(first_use):
                back = bw.graph.call_function(aten._to_copy.default, (placeholder,), {"device": device})
            placeholder.replace_all_uses_with(back)
            back.args = (placeholder,)  # the copy itself still reads the host value
        host_value = node_value(host)
        placeholder.meta["val"] = host_value
        if users:
            set_fake_value(back)
            ds_meta(back)["offload"] = "to_device"
        moved.append(node.name)
    output.args = (tuple(outputs),)
    fw.graph.lint()
    bw.graph.lint()
    fw.recompile()
    bw.recompile()
    return moved


def _position(graph: torch.fx.Graph):  # noqa: ANN202 - a key function
    order = {n: i for i, n in enumerate(graph.nodes)}
    return lambda n: order[n]
