"""FLOP, byte and memory model of an FX graph, symbolic in dynamic sizes (sympy).

FLOP formulas come from ``torch.utils.flop_counter`` (matmul, convolution, attention, ...);
pointwise and reduction ops count one FLOP per output (resp. input) element. Peak live bytes
follow the graph's order: a value is allocated by its node and freed after its last user.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
import torch.fx
from torch.utils.flop_counter import flop_registry

from dscompile.graph import is_collective, node_value, op_name, tensor_values

Size = int | sympy.Expr

_ATTENTION_CPU = {
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_attention_math",
    "aten.scaled_dot_product_attention",
}
_ATTENTION_CPU_BACKWARD = {"aten._scaled_dot_product_flash_attention_for_cpu_backward"}
_FREE_OPS = {
    "aten.view",
    "aten._unsafe_view",
    "aten.reshape",
    "aten.expand",
    "aten.permute",
    "aten.t",
    "aten.transpose",
    "aten.unsqueeze",
    "aten.squeeze",
    "aten.alias",
    "aten.slice",
    "aten.select",
    "aten.as_strided",
    "aten.detach",
    "aten.split",
    "aten.unbind",
    "operator.getitem",
    "_c10d_functional.wait_tensor",
}


def to_sympy(value: Any) -> Size:
    """An int stays an int; a SymInt becomes its sympy expression over the graph's size symbols."""
    if isinstance(value, torch.SymInt):
        node = value.node
        return node.expr if hasattr(node, "expr") else sympy.sympify(str(value))
    return int(value)


def numel(t: torch.Tensor) -> Size:
    return _product(to_sympy(d) for d in t.shape)


def nbytes(t: torch.Tensor) -> Size:
    return numel(t) * t.element_size()


def _product(items: Any) -> Size:
    result: Size = 1
    for item in items:
        result = result * item
    return result


def evaluate(value: Size, hints: dict[sympy.Symbol, int] | None = None) -> int:
    """A concrete number for a possibly symbolic size, using the shape environment's hints."""
    if isinstance(value, int):
        return value
    if hints:
        value = value.subs(hints)
    try:
        return int(value)
    except TypeError:
        return int(value.subs({s: 1 for s in value.free_symbols}))


def _shape_hints(gm: torch.fx.GraphModule) -> dict[sympy.Symbol, int]:
    for node in gm.graph.nodes:
        for t in tensor_values(node_value(node)):
            fake_mode = getattr(t, "fake_mode", None)
            shape_env = getattr(fake_mode, "shape_env", None)
            if shape_env is not None:
                values = getattr(shape_env, "backed_var_to_val", None)
                return dict(values if values is not None else shape_env.var_to_val)
    return {}


@dataclass
class NodeCost:
    """Cost of one node: FLOPs, bytes read and written, and whether it moves data across ranks."""

    flops: Size = 0
    bytes_read: Size = 0
    bytes_written: Size = 0
    is_collective: bool = False


def node_cost(node: torch.fx.Node) -> NodeCost:
    """Estimate one node's FLOPs and memory traffic from its fake values."""
    if node.op != "call_function":
        return NodeCost()
    name = op_name(node)
    out_tensors = tensor_values(node_value(node))
    in_tensors = [t for arg in node.all_input_nodes for t in tensor_values(node_value(arg))]
    written = sum((nbytes(t) for t in out_tensors), 0)
    read = sum((nbytes(t) for t in in_tensors), 0)
    if name in _FREE_OPS:
        return NodeCost(is_collective=is_collective(node))
    flops = _flops(node, name, in_tensors, out_tensors)
    return NodeCost(flops=flops, bytes_read=read, bytes_written=written, is_collective=is_collective(node))


def _flops(node: torch.fx.Node, name: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> Size:
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    if packet in flop_registry:
        args = torch.fx.node.map_aggregate(node.args, lambda a: node_value(a) if isinstance(a, torch.fx.Node) else a)
        kwargs = torch.fx.node.map_aggregate(node.kwargs, lambda a: node_value(a) if isinstance(a, torch.fx.Node) else a)
        try:
            return to_sympy(flop_registry[packet](*args, **kwargs, out_val=node_value(node)))
        except Exception:  # a formula that does not accept this overload: fall back to elementwise
            pass
    if not isinstance(target, torch._ops.OpOverload) and inputs:
        counted = _count_by_replay(node)
        if counted is not None:
            return counted
    if name in _ATTENTION_CPU or name in _ATTENTION_CPU_BACKWARD:
        q, k, v = inputs[:3]
        *batch, lq, d = (to_sympy(s) for s in q.shape)
        lk, dv = to_sympy(k.shape[-2]), to_sympy(v.shape[-1])
        forward = 2 * _product(batch) * lq * lk * (d + dv)
        return forward * (2 if name in _ATTENTION_CPU_BACKWARD else 1)
    if is_collective(node):
        return 0
    if outputs and inputs and sum((numel(t) for t in inputs), 0) != 0:
        # Reductions read more than they write: count the larger side.
        largest_in = max((numel(t) for t in inputs), key=lambda v: evaluate(v))
        largest_out = max((numel(t) for t in outputs), key=lambda v: evaluate(v))
        return largest_in if evaluate(largest_in) > evaluate(largest_out) else largest_out
    return sum((numel(t) for t in outputs), 0)


def _count_by_replay(node: torch.fx.Node) -> Size | None:
    """Torch-level calls (Dynamo graphs): run the call on fake values under FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode

    value = node_value(node)
    fake_mode = next((t.fake_mode for t in tensor_values(value) if hasattr(t, "fake_mode")), None)
    if fake_mode is None or node.op != "call_function":
        return None
    args = torch.fx.node.map_aggregate(node.args, lambda a: node_value(a) if isinstance(a, torch.fx.Node) else a)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, lambda a: node_value(a) if isinstance(a, torch.fx.Node) else a)
    counter = FlopCounterMode(display=False)
    try:
        with fake_mode, counter:
            node.target(*args, **kwargs)
    except Exception:
        return None
    total = counter.get_total_flops()
    return to_sympy(total) if total else None


@dataclass
class GraphCost:
    """Totals for a graph, symbolic where sizes are; ``peak_bytes`` evaluated at the size hints."""

    flops: Size = 0
    bytes_moved: Size = 0
    collective_bytes: Size = 0
    peak_bytes: int = 0
    peak_node: str | None = None
    input_bytes: Size = 0
    per_node: dict[str, NodeCost] = field(default_factory=dict)


def graph_cost(gm: torch.fx.GraphModule) -> GraphCost:
    """FLOPs, bytes and the peak of live tensor bytes over the graph's execution order."""
    hints = _shape_hints(gm)
    cost = GraphCost()
    nodes = list(gm.graph.nodes)
    last_use: dict[torch.fx.Node, int] = {}
    for index, node in enumerate(nodes):
        for arg in node.all_input_nodes:
            last_use[arg] = index
    live = 0
    size_of: dict[torch.fx.Node, int] = {}
    frees: dict[int, list[torch.fx.Node]] = {}
    for node, index in last_use.items():
        frees.setdefault(index, []).append(node)
    for index, node in enumerate(nodes):
        nc = node_cost(node)
        cost.per_node[node.name] = nc
        cost.flops = cost.flops + nc.flops
        cost.bytes_moved = cost.bytes_moved + nc.bytes_read + nc.bytes_written
        if nc.is_collective:
            cost.collective_bytes = cost.collective_bytes + nc.bytes_written
        if node.op == "output":
            continue
        value_bytes = sum((nbytes(t) for t in tensor_values(node_value(node))), 0)
        if node.op == "placeholder":
            cost.input_bytes = cost.input_bytes + value_bytes
        # Views share their input's storage: only computing nodes allocate.
        allocated = 0 if op_name(node) in _FREE_OPS else evaluate(value_bytes, hints)
        size_of[node] = allocated
        live += allocated
        if live > cost.peak_bytes:
            cost.peak_bytes, cost.peak_node = live, node.name
        for dead in frees.get(index, []):
            if dead.op != "placeholder":  # inputs stay alive: the caller holds them
                live -= size_of.get(dead, 0)
        if node not in last_use and node.op != "placeholder":
            live -= allocated  # an unused result is freed at once
    return cost


def format_size(value: Size, unit: str = "") -> str:
    """Human-readable number (``12.3M``); symbolic sizes print as their expression."""
    if not isinstance(value, int):
        try:
            value = int(value)
        except TypeError:
            return str(sympy.simplify(value))
    for suffix, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{suffix}{unit}"
    return f"{value}{unit}"


# ---------------------------------------------------------------------------------------------
# Time: a roofline per device class (activation checkpointing prices recomputation with it).
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Roofline:
    """Throughputs of one device class. Only their ratios steer the cut (``lam`` absorbs the scale),
    so round figures do: what matters is that a pointwise op costs its bytes, not its FLOPs."""

    matmul_flops: float  # FLOP/s of matmul-class ops (mm, addmm, bmm, convolution)
    vector_flops: float  # FLOP/s of pointwise and reduction ops
    bandwidth: float  # bytes/s between memory and the cores
    attention_flops: float = 0.0  # FLOP/s of fused attention (counted over the full, unmasked score matrix); 0: matmul_flops

    def seconds(self, flops: float, moved_bytes: float, kind: str) -> float:
        """``kind``: "matmul", "attention" or "vector"."""
        rate = {"matmul": self.matmul_flops, "attention": self.attention_flops or self.matmul_flops}.get(kind, self.vector_flops)
        return max(flops / rate, moved_bytes / self.bandwidth)


ROOFLINES: dict[str, Roofline] = {
    # One x86 core, fp32, measured on the project machine: sgemm ~150 GFLOP/s, CPU flash attention
    # ~75 GFLOP/s (causal, head dim 32-64, FLOPs counted over the full score matrix as torch's
    # formula does), streaming add ~18 GB/s, GELU ~2 G elements/s. More cores scale all alike.
    "cpu": Roofline(matmul_flops=1.5e11, vector_flops=1e10, bandwidth=2e10, attention_flops=7.5e10),
    # An H100-class GPU: ~400 TFLOP/s dense matmul (TF32/BF16 tensor cores, achieved), fused
    # attention at about half that (FlashAttention-2 reaches 50-70% of GEMM throughput, and causal
    # masking skips half the counted work), ~50 TFLOP/s on the vector units, ~3 TB/s HBM
    # (datasheets: H100 SXM 3.35 TB/s, H200 4.8 TB/s).
    "cuda": Roofline(matmul_flops=4e14, vector_flops=5e13, bandwidth=3e12, attention_flops=2e14),
}


def roofline_for(device: torch.device | str | None) -> Roofline:
    """The roofline of a device type; anything that is not CPU is priced like a CUDA GPU."""
    kind = torch.device(device).type if device is not None else "cpu"
    return ROOFLINES["cpu" if kind == "cpu" else "cuda"]


def op_class(node: torch.fx.Node) -> str:
    """"attention" (any attention kernel), "matmul" (the other ops torch's FLOP counter has formulas
    for: matmuls, convolutions) or "vector" (pointwise, reductions, everything else)."""
    if node.op != "call_function":
        return "vector"
    if "attention" in str(node.target):
        return "attention"
    return "matmul" if getattr(node.target, "overloadpacket", None) in flop_registry else "vector"


def is_matmul_class(node: torch.fx.Node) -> bool:
    """Ops whose time is bound by arithmetic: matmuls, convolutions and attention."""
    return op_class(node) != "vector"


def node_seconds(node: torch.fx.Node, hints: dict[Any, int], roofline: Roofline) -> float:
    """Estimated time to run ``node`` once: ``max(flops / throughput, bytes moved / bandwidth)``, with the
    throughput of the op's class."""
    if node.op != "call_function":
        return 0.0
    cost = node_cost(node)
    flops = evaluate(cost.flops, hints)
    if flops == 0 and cost.bytes_read == 0 and cost.bytes_written == 0:
        return 0.0
    moved = evaluate(cost.bytes_read, hints) + evaluate(cost.bytes_written, hints)
    return roofline.seconds(float(flops), float(moved), op_class(node))
