"""What a partition really saves and recomputes, measured on the forward and backward graphs it produced,
and the reference a memory budget is a fraction of (AOTAutograd's default min-cut partition of a copy)."""

from __future__ import annotations

import contextlib
import copy
import operator
from typing import Any

import torch
import torch.fx

from dscompile.cost import _shape_hints, evaluate, is_matmul_class, nbytes, node_cost, roofline_for
from dscompile.graph import node_value, set_fake_value, tensor_values
from dscompile.passes.checkpointing.joint import _graph_device, is_alias, recompute_seconds, storage_base


def no_checkpointing_saved_bytes(gm: torch.fx.GraphModule, example_inputs: Any, num_fwd_outputs: int) -> int:
    """What the forward saves for backward without activation checkpointing: AOTAutograd's min-cut
    partition (dscompile's default, which already recomputes cheap pointwise ops) of a copy of the
    joint graph, measured as ``measure_partition`` measures every partition. Earlier passes' pins
    stay (ZeRO-3's gathers are released without checkpointing too); torch's own
    ``activation_memory_budget`` is held at 1 for it. ``memory_budget`` is a fraction of this, the
    scale torch's ``activation_memory_budget`` uses."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    joint = copy_graph_module(gm)
    with torch._functorch.config.patch(activation_memory_budget=1.0), _fake_mode_of(example_inputs):
        fw, bw = min_cut_rematerialization_partition(joint, example_inputs, num_fwd_outputs=num_fwd_outputs)
    for module in (fw, bw):
        _fill_missing_values(module)
    return measure_partition(fw, bw, num_fwd_outputs)["saved_bytes"]


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A deep copy of ``gm``'s graph and node metadata that shares its real tensors (constants,
    buffers, parameters, real values in ``meta``) instead of copying them.

    The joint graph reaches the partitioner while its fake mode is active; deep-copying a real tensor
    there makes a meta tensor and then fails to attach the real CPU storage to it. Hugging Face
    models that build a ``DynamicCache`` (``use_cache=True``, the default) leave such constants
    (``_tensor_constant0`` = ``torch.tensor([])``) on the joint module. Copies made here are only
    re-tagged and partitioned, never written through their tensors, so sharing them is safe."""
    from torch._subclasses.fake_tensor import FakeTensor

    shared: dict[int, Any] = {}
    for module in gm.modules():
        for value in (*module._parameters.values(), *module._buffers.values(), *vars(module).values()):
            if isinstance(value, torch.Tensor):
                shared[id(value)] = value
    for node in gm.graph.nodes:
        for value in node.meta.values():
            for t in tensor_values(value):
                if not isinstance(t, FakeTensor):
                    shared[id(t)] = t
    return copy.deepcopy(gm, shared)


def _fake_mode_of(values: Any) -> Any:
    """The fake mode of ``values`` to enter, unless it is already active (or there is none)."""
    from torch._guards import detect_fake_mode
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    mode = detect_fake_mode(list(values) if values is not None else [])
    if mode is None or mode in _get_current_dispatch_mode_stack():
        return contextlib.nullcontext()
    return mode


def measure_partition(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule, num_fwd_outputs: int) -> dict[str, Any]:
    """Saved-activation bytes (forward outputs beyond the user outputs that are not graph inputs or
    aliases of them, counted once per storage: two saved views of one tensor hold it once, a
    saved slice holds its whole base) and the recompute cost of backward nodes that also run in
    forward: all their FLOPs, the matmul-class FLOPs alone (the ones torch's FlopCounterMode
    counts), and their roofline time (``recompute_seconds``), with the forward's totals to relate them to."""
    from dscompile.runtime.activation_offload import saved_outputs

    hints = _shape_hints(fw)
    saved = saved_outputs(fw, num_fwd_outputs)
    activations, inputs, rng = [], [], []
    for node in saved:
        value = node_value(node)
        if not isinstance(value, torch.Tensor):
            continue
        if storage_base(node).op == "placeholder":
            inputs.append(node)
        elif "rng_state" in node.name or (node.target is operator.getitem and "run_and_save_rng" in str(node.args[0].target)):
            rng.append(node)
        else:
            activations.append(node)

    def total(nodes: list[torch.fx.Node]) -> int:
        held: dict[torch.fx.Node, int] = {}
        for node in nodes:
            base = storage_base(node)
            value = node_value(base) if isinstance(node_value(base), torch.Tensor) else node_value(node)
            held[base] = evaluate(nbytes(value), hints)
        return sum(held.values())

    fw_names = {n.name for n in fw.graph.nodes if n.op == "call_function"}
    bw_hints = _shape_hints(bw)
    roofline = roofline_for(_graph_device(fw.graph.nodes))
    recompute_flops = matmul_flops = 0
    recompute_time = 0.0
    recomputed = []
    for node in bw.graph.nodes:
        if node.op == "call_function" and (node.name in fw_names or str(node.target).endswith("run_with_rng_state")):
            recomputed.append(node.name)
            if not is_alias(node):
                node = _unwrap_rng(node)
                flops = evaluate(node_cost(node).flops, bw_hints)
                recompute_flops += flops
                recompute_time += recompute_seconds(node, bw_hints, roofline)
                if is_matmul_class(node):
                    matmul_flops += flops
    forward_nodes = [_unwrap_rng(n) for n in fw.graph.nodes if n.op == "call_function"]
    return {
        "saved": [n.name for n in activations],
        "saved_bytes": total(activations) + total(rng),
        "activation_bytes": total(activations),
        "rng_state_bytes": total(rng),
        "saved_input_bytes": total(inputs),
        "recompute_flops": recompute_flops,
        "recompute_matmul_flops": matmul_flops,
        "recompute_seconds": recompute_time,
        "recomputed_nodes": len(recomputed),
        "forward_flops": sum(evaluate(node_cost(n).flops, hints) for n in forward_nodes),
        "forward_matmul_flops": sum(evaluate(node_cost(n).flops, hints) for n in forward_nodes if is_matmul_class(n)),
        "forward_seconds": sum(recompute_seconds(n, hints, roofline) for n in forward_nodes),
    }


def _unwrap_rng(node: torch.fx.Node) -> torch.fx.Node:
    """The partitioner wraps replayed random ops in ``run_and_save_rng_state`` / ``run_with_rng_state``,
    which the cost model cannot see into; price them as a stand-in node of the wrapped op, built
    in a scratch graph so the real graph's use lists stay untouched."""
    name = str(node.target)
    if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
        return node
    kwargs = dict(node.kwargs)
    if "graphsafe_run_with_rng_state" in name:  # CUDA (torch >= 2.9): (op, *args, rng_state=..., **kwargs)
        op, args, value = node.args[0], node.args[1:], node_value(node)
        kwargs.pop("rng_state", None)
    elif "run_with_rng_state" in name:  # (rng_state, op, *args)
        op, args, value = node.args[1], node.args[2:], node_value(node)
    elif "run_and_save_rng_state" in name:
        value = node_value(node)
        op, args, value = node.args[0], node.args[1:], value[1] if isinstance(value, (tuple, list)) else None
    else:
        return node
    scratch = torch.fx.Graph()

    def stand_in(arg: torch.fx.Node) -> torch.fx.Node:
        placeholder = scratch.placeholder(arg.name)
        placeholder.meta["val"] = node_value(arg)
        return placeholder

    inner = scratch.call_function(op, torch.fx.node.map_arg(tuple(args), stand_in), torch.fx.node.map_arg(kwargs, stand_in))
    inner.meta["val"] = value
    return inner


def _fill_missing_values(gm: torch.fx.GraphModule) -> None:
    """The partitioner's RNG functionalisation adds nodes without ``meta["val"]``; give them one."""
    from torch._guards import detect_fake_mode

    fake_mode = detect_fake_mode([node_value(n) for n in gm.graph.nodes if n.op == "placeholder"])
    for node in gm.graph.nodes:
        if node.op == "call_function" and "val" not in node.meta:
            set_fake_value(node, fake_mode)
