"""Activation checkpointing on the joint graph: choose what forward saves and what backward recomputes.

The decision is a minimum cut on the joint forward/backward graph (networkx), in the shape of
AOTAutograd's rematerialisation partitioner but with our objective: every forward value ``v``
is split into ``v_in -> v_out``; cutting that edge means *save v* (cost: its bytes), and a
``source -> v_in`` edge of capacity ``lam * seconds(v)`` is cut when backward *recomputes v*.
``seconds(v)`` is a roofline estimate of the time recomputing ``v`` takes (``recompute_seconds``):
matmul-class ops are priced by their FLOPs at matmul throughput, pointwise and reduction ops by
the bytes they move at memory bandwidth, so a cheap elementwise op is not priced like a matmul.
One cut minimises ``saved bytes + lam * recompute seconds`` exactly; sweeping ``lam`` walks the
lower convex hull of the (saved bytes, recompute time) Pareto front, a bisection on ``lam``
brackets a budget between two hull points, and a knapsack over the nodes of the feasible one
(``_refine``) fills the gap: bandwidth-bound ops all trade bytes for time at about one ratio, so
the hull alone jumps over the budget.

Bytes are counted per storage, in the plan and in the measurement alike: an alias (a view by the
op's schema, ``detach``, ``_unsafe_view``, an item of ``split``) holds its base's whole storage, two
saved aliases of one tensor hold it once, and an alias of a graph input (a transposed parameter)
holds nothing new.

Policies: ``none`` (no decisions, only measurement), ``full`` (inside each block only block
inputs may be saved), ``selective`` (outputs of compute-intensive ops may not be recomputed;
everything else is recomputed where that saves memory), ``budget`` (keep at most
``memory_budget`` x the bytes saved *without activation checkpointing*, at the least recompute
time). "Without activation checkpointing" is measured, not modelled: the pass partitions a copy
of the joint graph with AOTAutograd's default min-cut (what a compile without this pass saves; it
already recomputes some cheap pointwise ops) and measures it as it measures its own partition.
That is the scale of torch's ``activation_memory_budget`` too (1: its default cut), so the same
number asks both for the same bytes. After partitioning, the pass measures what the forward
really saves; should the partitioner keep more than the plan predicted, it cuts again for a
target lowered by the excess (``_keep_budget``), so the budget is met as measured.

Decisions reach AOTAutograd's min-cut partitioner as ``node.meta["recompute"]``
(``CheckpointPolicy.MUST_SAVE`` / ``MUST_RECOMPUTE``) on every forward node, which pins its cut
to ours; recomputed random ops are replayed from the forward's RNG state by the partitioner's
RNG functionalisation. ``ac_graph_id`` is deliberately not set: it would make the partitioner
override our tags at region boundaries. Functional collectives (and their ``wait_tensor``) are
never recomputed unless a pass marks them ``node.meta["dscompile"]["recomputable"] = True``
(ZeRO-3's parameter all-gathers should), in which case they are priced like any other node.

Tags already present when this pass runs win over its own choice: ``MUST_SAVE`` is never
recomputed, ``MUST_RECOMPUTE`` (and every view of such a value) is never saved, whatever the
policy. ZeRO-3 pins its parameter gathers that way, so under ``full`` or any budget they are
still released after forward and gathered again in backward.

The partition function this pass installs (``ctx.analysis["partition_fn"]``) runs the
partitioner, measures what the forward really hands to backward, applies
``partition_activations`` (``dscompile.runtime.activation_partition``: each rank of a
``partition_group_size`` group keeps 1/N of every saved activation, backward all-gathers it) and
``cpu_checkpointing``, and records the result in ``ctx.analysis["checkpointing"]``, in
``checkpoint_reports()`` and, with a dump directory, in ``<dump>/<graph>.joint/checkpointing.json``.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import json
import logging
import math
import operator
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from dscompile.config import parse_dataclass, register_section
from dscompile.cost import Roofline, is_matmul_class, node_seconds, roofline_for
from dscompile.errors import DSCompileConfigError, DSCompileNotSupportedError
from dscompile.graph import ds_meta, is_collective, node_value, set_fake_value, tensor_values
from dscompile.pipeline import PassContext, invocation, register_config_rule, register_pass

log = logging.getLogger("dscompile.passes.checkpoint")

Policy = Literal["none", "full", "selective", "budget"]

# ---------------------------------------------------------------------------------------------
# Config: DeepSpeed's ``activation_checkpointing`` section plus policy and memory_budget.
# ---------------------------------------------------------------------------------------------


@dataclass
class ActivationCheckpointingConfig:
    """``activation_checkpointing``: DeepSpeed's keys keep their meaning where a compiler can honour them.

    ``policy`` defaults to ``budget`` when ``memory_budget`` is given and to ``full`` otherwise
    (a DeepSpeed user who configures checkpointing checkpoints every block).
    ``number_checkpoints`` groups consecutive blocks into that many checkpointed segments
    (or, for a model without repeated blocks, cuts its forward into that many segments).
    ``partition_group_size`` (dscompile's own key) names the ranks ``partition_activations`` shards
    across: consecutive ranks in groups of that size, which must compute identical activations
    (DeepSpeed takes them from its ``mpu``'s model-parallel group).
    """

    partition_activations: bool = False
    partition_group_size: int | None = None
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False
    policy: Policy | None = None
    memory_budget: float | None = None

    def validate(self, path: str) -> None:
        if self.memory_budget is not None and not 0.0 <= self.memory_budget <= 1.0:
            raise DSCompileConfigError(f"{path}.memory_budget", f"must be between 0 and 1, got {self.memory_budget}")
        if self.policy is None:
            self.policy = "budget" if self.memory_budget is not None else "full"
        if self.policy == "budget" and self.memory_budget is None:
            raise DSCompileConfigError(f"{path}.memory_budget", "policy 'budget' needs a memory_budget", "set e.g. \"memory_budget\": 0.5")
        if self.policy != "budget" and self.memory_budget is not None:
            raise DSCompileConfigError(
                f"{path}.memory_budget", f"is only used by policy 'budget', but policy is {self.policy!r}", "drop memory_budget or set policy to 'budget'"
            )
        if self.number_checkpoints is not None and self.number_checkpoints <= 0:
            raise DSCompileConfigError(f"{path}.number_checkpoints", f"must be positive, got {self.number_checkpoints}")
        if self.partition_group_size is not None:
            if self.partition_group_size <= 0:
                raise DSCompileConfigError(f"{path}.partition_group_size", f"must be positive, got {self.partition_group_size}")
            if not self.partition_activations:
                raise DSCompileConfigError(f"{path}.partition_group_size", "is only used with partition_activations",
                                           "set \"partition_activations\": true or drop partition_group_size")
        if self.contiguous_memory_optimization:
            # DeepSpeed copies checkpoints into one preallocated buffer; not built here.
            raise DSCompileNotSupportedError(f"{path}.contiguous_memory_optimization", "contiguous checkpoint buffers")


class PartitionGroupMissingError(DSCompileConfigError):
    """``partition_activations`` on several ranks without ``partition_group_size``: sharding is only
    valid across ranks that compute identical activations (DeepSpeed's model-parallel group), and
    dscompile cannot know which ranks do (data-parallel ranks do not), so it refuses to guess."""

    def __init__(self, world_size: int, key: str = "activation_checkpointing.partition_group_size") -> None:
        super().__init__(
            key,
            f"partition_activations on {world_size} ranks needs the group of ranks that compute identical activations "
            "(DeepSpeed shards across its model-parallel group); data-parallel ranks hold different activations, "
            "so there is nothing to partition across them",
            f"set partition_group_size to the number of consecutive ranks that are replicas (a divisor of {world_size}), "
            "or set partition_activations to false (to cut activation memory use policy 'full' or a memory_budget)",
        )


def _parse_section(value: Any, path: str) -> ActivationCheckpointingConfig:
    return parse_dataclass(ActivationCheckpointingConfig, value, path)


register_section("activation_checkpointing", _parse_section, "activation checkpointing")


@register_config_rule(85, "checkpointing")  # after the clean-up: it plans on the joint graph the partitioner gets
def _checkpointing_rule(config: Any) -> list[Any]:
    section = config.sections.get("activation_checkpointing")
    if section is None:
        return []
    return [
        invocation(
            "checkpoint",
            policy=section.policy,
            budget=section.memory_budget,
            number_checkpoints=section.number_checkpoints or 0,
            cpu_offload=section.cpu_checkpointing,
            partition_activations=section.partition_activations,
            partition_group_size=section.partition_group_size or 0,
            profile=section.profile,
            synchronize_boundary=section.synchronize_checkpoint_boundary,
        )
    ]


@dataclass
class CheckpointOptions:
    policy: Literal["auto", "none", "full", "selective", "budget"] = field(
        default="auto", metadata={"help": "auto: budget when budget is given, else full"}
    )
    budget: float | None = field(default=None, metadata={"help": "fraction (0..1) of the bytes saved without checkpointing to keep"})
    number_checkpoints: int = field(default=0, metadata={"help": "segments for policy full (0: one per block)"})
    cpu_offload: bool = field(default=False, metadata={"help": "move saved activations to host memory"})
    partition_activations: bool = field(default=False, metadata={"help": "shard saved activations across ranks"})
    partition_group_size: int = field(default=0, metadata={"help": "consecutive ranks with identical activations to shard across"})
    profile: bool = field(default=False, metadata={"help": "log the decision of every graph at INFO"})
    synchronize_boundary: bool = field(default=False, metadata={"help": "DeepSpeed's synchronize_checkpoint_boundary (no effect)"})

    def resolved_policy(self) -> str:
        if self.policy == "auto":
            return "budget" if self.budget is not None else "full"
        return self.policy

    def __post_init__(self) -> None:
        if self.budget is not None and not 0.0 <= self.budget <= 1.0:
            raise ValueError(f"budget must be between 0 and 1, got {self.budget}")
        if self.policy == "budget" and self.budget is None:
            raise ValueError("policy=budget needs budget=<0..1>")
        if self.partition_group_size < 0:
            raise ValueError(f"partition_group_size must be >= 0, got {self.partition_group_size}")


def recompute_seconds(node: torch.fx.Node, hints: dict[Any, int], roofline: Roofline) -> float:
    """Estimated time to recompute ``node`` (the cost model's ``node_seconds``); views and other aliases are free."""
    if node.op != "call_function" or is_alias(node):
        return 0.0
    return node_seconds(node, hints, roofline)


def _graph_device(nodes: Iterable[torch.fx.Node]) -> torch.device:
    for node in nodes:
        for t in tensor_values(node_value(node)):
            if t.device.type != "meta":
                return t.device
    return torch.device("cpu")


# ---------------------------------------------------------------------------------------------
# The joint graph as the solver sees it.
# ---------------------------------------------------------------------------------------------

_BLOCK_PATH = re.compile(r"^(.*?\.\d+)(?:\.|$)")
_OPS = None


def _op_types() -> Any:
    global _OPS
    if _OPS is None:
        from torch._functorch.partitioners import get_default_op_list

        _OPS = get_default_op_list()
    return _OPS


def is_alias(node: torch.fx.Node) -> bool:
    """Whether ``node``'s value shares its first argument's storage: a view by the op's schema
    (``view``, ``transpose``, ``detach``, ``split``, ...), ``_unsafe_view`` (it declares no alias but
    returns one), or an item of a view op's tuple. torch's partitioner lists fewer views
    (no transpose, no detach), which would count a transposed parameter as an activation."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return False
    if node.target is operator.getitem:
        return is_alias(node.args[0])
    return bool(getattr(node.target, "is_view", False)) or node.target is torch.ops.aten._unsafe_view.default


def storage_base(node: torch.fx.Node) -> torch.fx.Node:
    """The node that allocated the storage ``node``'s value lives in (itself unless it is an alias).

    Saving any alias keeps that whole storage alive, so bytes are counted per base: a placeholder
    base costs nothing (the caller holds graph inputs and parameters anyway), and two saved views
    of one tensor cost it once."""
    while is_alias(node):
        node = node.args[0]  # an item of split(x) walks to split, then to x
    return node


def _is_tangent(node: torch.fx.Node) -> bool:
    return node.op == "placeholder" and ("tangents" in str(node.target) or "bwd_seed" in str(node.target) or "bwd_base_offset" in str(node.target))


def _must_run_in_backward(node: torch.fx.Node) -> bool:
    """As AOTAutograd's partitioner decides: a node tagged for backward runs there only when it must
    (a mutation, or an explicit tag). A tangent-free node traced in backward (the rsqrt / N of a
    decomposed layer-norm backward) is the cut's choice: saved from forward or computed in backward,
    so this pass prices and tags it like every forward value, or the partitioner would choose alone."""
    tag = node.meta.get("partitioner_tag")
    if tag == "must_be_in_backward":
        return True
    return tag == "is_backward" and isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable


def _is_random(node: torch.fx.Node) -> bool:
    target = node.target
    return node.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(target, "tags", ())


@dataclass
class JointInfo:
    """Forward/backward split of a joint graph with sizes and FLOPs at the shape hints."""

    forward: list[torch.fx.Node]  # call_function nodes computable from primals alone
    backward: set[torch.fx.Node]
    primals: list[torch.fx.Node]
    required_fw: set[torch.fx.Node]  # needed for the user outputs (recomputing them costs)
    needed_by_bw: set[torch.fx.Node]  # forward nodes some backward node depends on
    size: dict[torch.fx.Node, float]  # bytes if saved (math.inf: cannot be saved)
    flops: dict[torch.fx.Node, int]
    seconds: dict[torch.fx.Node, float]  # roofline time of recomputing the node once
    banned: dict[torch.fx.Node, str]  # never recomputed, with the reason
    rng_state_bytes: int
    # pinned by an earlier pass or the user (``meta["recompute"] = MUST_RECOMPUTE``), e.g. ZeRO-3's
    # parameter gathers: never saved. MUST_SAVE pins land in ``banned``.
    must_recompute: set[torch.fx.Node] = field(default_factory=set)


def analyse_joint(gm: torch.fx.GraphModule, num_fwd_outputs: int) -> JointInfo:
    from dscompile.cost import _shape_hints, evaluate, nbytes, node_cost

    hints = _shape_hints(gm)
    nodes = list(gm.graph.nodes)
    output = next(n for n in reversed(nodes) if n.op == "output")
    backward: set[torch.fx.Node] = set()
    for node in nodes:
        if node.op == "output":
            continue
        if _is_tangent(node) or _must_run_in_backward(node) or any(a in backward for a in node.all_input_nodes):
            backward.add(node)
    primals = [n for n in nodes if n.op == "placeholder" and n not in backward]
    forward = [n for n in nodes if n.op == "call_function" and n not in backward]
    fw_outputs = [a for a in output.args[0][:num_fwd_outputs] if isinstance(a, torch.fx.Node)]
    required_fw = _ancestors(fw_outputs, stop=backward)
    needed_by_bw: set[torch.fx.Node] = set()
    for node in backward:
        needed_by_bw |= _ancestors([a for a in node.all_input_nodes if a not in backward], stop=backward)
    roofline = roofline_for(_graph_device(forward))
    size: dict[torch.fx.Node, float] = {}
    flops: dict[torch.fx.Node, int] = {}
    seconds: dict[torch.fx.Node, float] = {}
    banned: dict[torch.fx.Node, str] = {}
    must_recompute: set[torch.fx.Node] = set()
    for node in primals + forward:
        value = node_value(node)
        if node.op == "placeholder":
            size[node] = 0.0  # inputs and parameters are alive anyway
            flops[node] = 0
            seconds[node] = 0.0
            continue
        base = storage_base(node)
        if isinstance(value, torch.Tensor):
            # saving an alias keeps its base's whole storage alive; an alias of an input costs nothing
            held = node_value(base) if base is not node else value
            size[node] = 0.0 if base.op == "placeholder" else float(evaluate(nbytes(held), hints)) if isinstance(held, torch.Tensor) else math.inf
        elif isinstance(value, (torch.SymInt, int, float, bool)):
            size[node] = 0.0
        else:
            size[node] = math.inf  # tuples: their getitems are what gets saved
        flops[node] = 0 if is_alias(node) else evaluate(node_cost(node).flops, hints)
        seconds[node] = recompute_seconds(node, hints, roofline)
        reason = _ban_reason(node)
        pinned = node.meta.get("recompute")
        if reason:
            banned[node] = reason
        elif pinned == CheckpointPolicy.MUST_SAVE:
            banned[node] = "pinned to MUST_SAVE before this pass"
        elif pinned == CheckpointPolicy.MUST_RECOMPUTE:
            must_recompute.add(node)
        elif pinned is None and _aliases_first_input(node) and node.args[0] in must_recompute:
            # saving a view (or one output of a pinned tuple op) would keep the pinned value alive: a gathered ZeRO-3 parameter
            must_recompute.add(node)
    return JointInfo(forward, backward, primals, required_fw, needed_by_bw, size, flops, seconds, banned, _rng_state_bytes(forward),
                     must_recompute)


def _aliases_first_input(node: torch.fx.Node) -> bool:
    """A view of its first input (by the op's schema), or one output of a tuple-valued node."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return False
    return node.target is operator.getitem or bool(getattr(node.target, "is_view", False))


def _ancestors(start: Iterable[torch.fx.Node], stop: set[torch.fx.Node]) -> set[torch.fx.Node]:
    seen: set[torch.fx.Node] = set()
    stack = [n for n in start if n not in stop]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(a for a in node.all_input_nodes if a not in stop and a not in seen)
    return seen


def _ban_reason(node: torch.fx.Node) -> str | None:
    target = node.target
    if is_collective(node):
        return None if ds_meta(node).get("recomputable") else "collective not marked recomputable"
    if isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
        return "mutates its input"
    if node.is_impure() and not _is_random(node):
        return "impure"
    if isinstance(target, torch._ops.HigherOrderOperator):
        return "higher-order op"
    return None


def _rng_state_bytes(forward: list[torch.fx.Node]) -> int:
    """What the partitioner saves per replayed random op: the generator state of its device."""
    for node in forward:
        if _is_random(node):
            for t in tensor_values(node_value(node)):
                return 16 if t.device.type == "cuda" else torch.get_rng_state().numel()
    return 0


def block_of(node: torch.fx.Node) -> str | None:
    """The repeated block (``<...>.<index>`` module path) a node was traced in, if any.

    A node traced in backward carries the module stack of the forward op it differentiates as
    ``fwd_nn_module_stack``: a tangent-free one (the ``pow(x, 2)`` of an RMSNorm backward, the
    ``sigmoid`` of a SiLU backward) is a forward value to the cut, and belongs to that block. Read
    without it, such a node sat outside every block, so ``full`` had to compute it in forward and
    save it, and the block-internal values it reads became segment boundaries (saved too)."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return None
    for path, _type in stack.values():
        match = _BLOCK_PATH.match(str(path))
        if match:
            return match.group(1)
    return None


def _made_by_a_pass(node: torch.fx.Node) -> bool:
    """A node no tracer made (an Inductor joint-graph pattern's replacement): it has no module stack
    and no partitioner tag, where every traced node has one or the other."""
    return not any(key in node.meta for key in ("nn_module_stack", "fwd_nn_module_stack", "partitioner_tag"))


def segments(info: JointInfo, number_checkpoints: int = 0) -> dict[torch.fx.Node, int]:
    """Checkpoint segment of each forward node (-1: outside every segment, saved as usual).

    Segments are the model's repeated blocks, grouped into ``number_checkpoints`` runs when
    given; a model without repeated blocks is one segment, or ``number_checkpoints`` runs of
    roughly equal FLOPs.
    """
    blocks: list[str] = []
    block_index: dict[torch.fx.Node, int] = {}
    for node in info.forward:
        name = block_of(node)
        if name is None:
            if _made_by_a_pass(node):  # no trace of its own: it belongs where its inputs are
                inherited = [block_index[a] for a in node.all_input_nodes if a in block_index]
                if inherited:
                    block_index[node] = max(inherited)
            continue
        if name not in blocks:
            blocks.append(name)
        block_index[node] = blocks.index(name)
    if blocks:
        groups = number_checkpoints if 0 < number_checkpoints < len(blocks) else len(blocks)
        return {n: (block_index[n] * groups) // len(blocks) if n in block_index else -1 for n in info.forward}
    groups = max(1, number_checkpoints)
    total = sum(info.flops[n] for n in info.forward) or 1
    result, running = {}, 0
    for node in info.forward:
        result[node] = min(groups - 1, (running * groups) // total)
        running += info.flops[node]
    return result


# ---------------------------------------------------------------------------------------------
# The min cut.
# ---------------------------------------------------------------------------------------------


@dataclass
class Cut:
    saved: set[torch.fx.Node]
    recomputed: set[torch.fx.Node]
    saved_bytes: float
    recompute_flops: int
    recompute_seconds: float  # roofline estimate, the quantity the cut minimises
    rng_replays: int


class CutSolver:
    """Builds the flow network once; ``solve(lam)`` prices one second of recomputation at ``lam`` bytes.

    Backward nodes are not modelled one by one: a forward value some backward node reads gets an
    infinite edge to the sink (backward must get it, saved or recomputed), which keeps the
    network to the forward half of the graph.
    """

    def __init__(self, info: JointInfo, *, may_save: Callable[[torch.fx.Node], bool] | None = None,
                 extra_banned: Iterable[torch.fx.Node] = ()) -> None:
        import networkx as nx
        from networkx.algorithms.flow import boykov_kolmogorov

        self.info = info
        # a policy's bans never override a pin to recompute (ZeRO-3 gathers stay recomputed under ``full``)
        self.banned = set(info.banned) | {n for n in extra_banned if n not in info.must_recompute}
        self.nodes = info.primals + info.forward
        graph = nx.DiGraph()
        graph.add_node("source")
        graph.add_node("sink")
        for node in self.nodes:
            node_in, node_out = f"{node.name}_in", f"{node.name}_out"
            size = info.size[node]
            if may_save is not None and node.op != "placeholder" and not may_save(node) and node not in self.banned:
                size = math.inf
            if node in info.must_recompute and node not in self.banned:
                size = math.inf
            graph.add_edge(node_in, node_out, capacity=size)
            for user in node.users:
                if user in info.backward:
                    graph.add_edge(node_out, "sink", capacity=math.inf)
                elif user.op != "output":
                    graph.add_edge(node_out, f"{user.name}_in", capacity=math.inf)
        self.graph = graph
        self.nx = nx
        self.flow_func = boykov_kolmogorov  # the fastest of networkx's max-flow routines on these graphs

    def recompute_price(self, node: torch.fx.Node, lam: float) -> float:
        """Bytes-equivalent cost of recomputing ``node`` in backward."""
        if node.op == "placeholder" or node in self.banned:
            return math.inf
        if node not in self.info.required_fw:
            return 0.0  # computed once either way: in backward instead of forward
        seconds = self.info.seconds[node]
        if node in self.info.must_recompute:
            lam = 0.0  # recomputed whatever the cut: its time is a constant, not a choice (and lam may be inf)
        price = (lam * seconds if seconds > 0 else 0.0) + 1e-3 * (1 + 1e9 * seconds)  # tie-break: recompute less
        if _is_random(node):
            price += self.info.rng_state_bytes
        return price

    def solve(self, lam: float) -> Cut:
        graph = self.graph
        for node in self.nodes:
            price = self.recompute_price(node, lam)
            if price > 0:
                graph.add_edge("source", f"{node.name}_in", capacity=price)
            elif graph.has_edge("source", f"{node.name}_in"):
                graph.remove_edge("source", f"{node.name}_in")
        _value, (reachable, _rest) = self.nx.minimum_cut(graph, "source", "sink", flow_func=self.flow_func)
        saved, recomputed = set(), set()
        for node in self.nodes:
            node_in, node_out = f"{node.name}_in", f"{node.name}_out"
            if node_in in reachable and node_out not in reachable:
                saved.add(node)
            elif node_in not in reachable and node.op != "placeholder":
                recomputed.add(node)
        # Recomputing something backward never uses is pointless (and would force its inputs).
        recomputed &= self.info.needed_by_bw
        extra = [n for n in recomputed if n in self.info.required_fw]
        held: dict[torch.fx.Node, float] = {}  # one storage held once, however many of its aliases are saved
        for node in saved:
            base = storage_base(node)
            held[base] = max(held.get(base, 0.0), self.info.size[node])
        saved_bytes = sum(held.values())
        replays = sum(1 for n in extra if _is_random(n))
        return Cut(saved, recomputed, saved_bytes + replays * self.info.rng_state_bytes,
                   sum(self.info.flops[n] for n in extra), sum(self.info.seconds[n] for n in extra), replays)


def solve_budget(info: JointInfo, budget: float, reference: float | None = None) -> tuple[Cut, Cut]:
    """The least-recompute-time cut whose saved bytes are at most ``budget`` x ``reference``.

    ``reference``: the bytes saved without activation checkpointing (``no_checkpointing_saved_bytes``);
    None: the no-recompute cut's. Returns (chosen cut, baseline cut). Bisection on ``lam`` in log
    space (saved bytes fall monotonically as ``lam``, the price of a second, falls) brackets the
    budget between two hull points; ``_refine`` then spends the slack the feasible one leaves.
    """
    solver = CutSolver(info)
    baseline = solver.solve(math.inf)
    target = budget * (baseline.saved_bytes if reference is None else reference)
    return solve_target(solver, target, baseline), baseline


def solve_target(solver: CutSolver, target: float, baseline: Cut) -> Cut:
    """The least-recompute-time cut of ``solver`` that saves at most ``target`` bytes (or the least it
    can); ``baseline`` is its no-recompute cut."""
    info = solver.info
    if baseline.saved_bytes <= target:
        return baseline
    best = solver.solve(0.0)
    if best.saved_bytes > target:
        log.warning("a memory budget of %.0f bytes is below what recomputing everything recomputable reaches (%.0f bytes); "
                    "saving that", target, best.saved_bytes)
        return best
    total_seconds = sum(info.seconds[n] for n in info.forward) or 1e-9
    scale = max(1.0, baseline.saved_bytes) / total_seconds  # lam at which recomputing everything costs the baseline
    low, high = math.log(scale * 1e-5), math.log(scale * 1e5)
    for _ in range(24):
        mid = (low + high) / 2
        cut = solver.solve(math.exp(mid))
        if cut.saved_bytes <= target:
            low = mid
            if cut.recompute_seconds <= best.recompute_seconds:
                best = cut
        else:
            high = mid
        if high - low < 0.05 or best.saved_bytes >= 0.99 * target:
            break
    return _refine(solver, math.exp(low), best, target)


def _refine(solver: CutSolver, lam: float, cut: Cut, target: float, limit: int = 16) -> Cut:
    """A knapsack step between the two hull points around the budget.

    Bandwidth-bound ops all trade bytes for time at about one ratio (a roofline op moves about
    twice what it saves), so many of them tie at one ``lam`` and the hull jumps from "recompute
    none" to "recompute all of them": which of those to recompute is a knapsack the Lagrangian
    cannot see. Price each candidate (one of the ``limit`` costliest nodes the feasible cut
    recomputes) by one solve with it forbidden to recompute,
    pick the set to forbid by an exact knapsack on those prices (assumed additive), and keep the
    result only if the real cut of that set meets the budget and recomputes less; when additivity
    fails, drop the least efficient pick and try again (three tries)."""
    info = solver.info
    candidates = sorted((n for n in cut.recomputed if info.seconds[n] > 0 and n in info.required_fw and n not in solver.banned
                         and n not in info.must_recompute),
                        key=lambda n: (-info.seconds[n], n.name))[:limit]
    best = cut
    items: list[tuple[torch.fx.Node, float, float]] = []  # (node, extra bytes, seconds saved) if forbidden alone
    for node in candidates:
        trial = _solve_banning(solver, lam, [node])
        saved_seconds = cut.recompute_seconds - trial.recompute_seconds
        if saved_seconds <= 0:
            continue
        items.append((node, trial.saved_bytes - cut.saved_bytes, saved_seconds))
        if trial.saved_bytes <= target and trial.recompute_seconds < best.recompute_seconds:
            best = trial
    chosen = _knapsack(items, target - cut.saved_bytes)
    for _ in range(3):
        if len(chosen) < 2:
            break
        trial = _solve_banning(solver, lam, [node for node, _b, _s in chosen])
        if trial.saved_bytes <= target:
            if trial.recompute_seconds < best.recompute_seconds:
                best = trial
            break
        chosen.remove(min(chosen, key=lambda item: item[2] / max(item[1], 1.0)))
    return best


def _solve_banning(solver: CutSolver, lam: float, nodes: list[torch.fx.Node]) -> Cut:
    """``solver.solve(lam)`` with ``nodes`` also forbidden to recompute."""
    added = [n for n in nodes if n not in solver.banned]
    solver.banned.update(added)
    try:
        return solver.solve(lam)
    finally:
        solver.banned.difference_update(added)


def _knapsack(items: list[tuple[Any, float, float]], room: float) -> list[tuple[Any, float, float]]:
    """The subset of ``(item, cost, value)`` with the largest total value whose total cost stays
    within ``room`` (exact: a Pareto frontier of (cost, value) over the items; items are few)."""
    frontier: list[tuple[float, float, tuple[int, ...]]] = [(0.0, 0.0, ())]
    for index, (_item, cost, value) in enumerate(items):
        grown = [(c + cost, v + value, picked + (index,)) for c, v, picked in frontier if c + cost <= room]
        merged = sorted(frontier + grown, key=lambda entry: (entry[0], -entry[1]))
        frontier = []
        for entry in merged:  # keep only states no cheaper state beats
            if not frontier or entry[1] > frontier[-1][1]:
                frontier.append(entry)
    best = max(frontier, key=lambda entry: entry[1])
    return [items[i] for i in best[2]]


@dataclass
class Plan:
    policy: str
    budget: float | None
    cut: Cut | None
    baseline: Cut | None
    notes: list[str] = field(default_factory=list)
    forward: list[torch.fx.Node] = field(default_factory=list, repr=False)
    boundary: list[str] | None = None  # policy full: the segment inputs, the only values it may save
    reference: float | None = None  # policy budget: the no-checkpointing saved bytes (None: unknown)
    target: float | None = None  # policy budget: the saved bytes it promises at most

    def summary(self) -> dict[str, Any]:
        data: dict[str, Any] = {"policy": self.policy, "memory_budget": self.budget, "notes": self.notes}
        if self.baseline is not None:
            data["baseline_saved_bytes"] = int(self.baseline.saved_bytes)
        if self.reference is not None:
            data["no_checkpointing_saved_bytes"] = int(self.reference)
        if self.target is not None:
            data["target_saved_bytes"] = int(self.target)
        if self.cut is not None:
            data["predicted_saved_bytes"] = int(self.cut.saved_bytes)
            data["predicted_recompute_flops"] = int(self.cut.recompute_flops)
            data["predicted_recompute_seconds"] = self.cut.recompute_seconds
            data["predicted_saved"] = sorted(n.name for n in self.cut.saved if n.op != "placeholder")
            data["recomputed"] = sorted(n.name for n in self.cut.recomputed)
            data["rng_replays"] = self.cut.rng_replays
        if self.boundary is not None:
            data["boundary"] = self.boundary
        return data


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


def plan_checkpointing(gm: torch.fx.GraphModule, num_fwd_outputs: int, options: CheckpointOptions, reference: float | None = None) -> Plan:
    """The plan of ``options``'s policy; ``reference`` (policy budget): the no-checkpointing saved
    bytes the budget is a fraction of (``no_checkpointing_saved_bytes``), None: the no-recompute cut's."""
    policy = options.resolved_policy()
    if policy == "none":
        return Plan(policy, None, None, None)
    info = analyse_joint(gm, num_fwd_outputs)
    if policy == "budget":
        assert options.budget is not None
        cut, baseline = solve_budget(info, options.budget, reference)
        plan = Plan(policy, options.budget, cut, baseline, forward=info.forward)
        plan.reference = reference
        plan.target = options.budget * (baseline.saved_bytes if reference is None else reference)
        return plan
    baseline = CutSolver(info).solve(math.inf)
    if policy == "selective":
        ops = _op_types()
        expensive = [n for n in info.forward if ops.is_compute_intensive(n) or "attention" in str(n.target)]
        cut = CutSolver(info, extra_banned=expensive).solve(0.0)
        return Plan(policy, None, cut, baseline, forward=info.forward)
    # full: inside a segment only the segment's inputs may be saved.
    seg = segments(info, options.number_checkpoints)
    boundary = {n for n in info.forward if seg[n] >= 0 and any(u in seg and seg[u] != seg[n] for u in n.users)}
    outside = [n for n in info.forward if seg[n] < 0]

    def may_save(node: torch.fx.Node) -> bool:
        if seg.get(node, -1) < 0 or node in boundary:
            return True
        # getitems of an op that may not be recomputed must be saved
        return node.target is operator.getitem and node.args[0] in info.banned

    cut = CutSolver(info, may_save=may_save, extra_banned=[*outside, *boundary]).solve(0.0)
    notes = [f"{len(set(v for v in seg.values() if v >= 0))} segments"]
    plan = Plan(policy, None, cut, baseline, notes, forward=info.forward)
    plan.boundary = sorted(n.name for n in boundary)
    return plan


def apply_plan(gm: torch.fx.GraphModule, plan: Plan) -> None:
    """Tag every forward node so the partitioner reproduces the plan's cut."""
    assert plan.cut is not None
    cut = plan.cut
    for node in plan.forward:
        value = node_value(node)
        if not isinstance(value, (torch.Tensor, tuple, list)):
            continue  # symbolic sizes: the partitioner handles them
        ds_meta(node).setdefault("pin", node.meta.get("recompute"))  # an earlier pass's pin, for a second plan
        if node in cut.recomputed:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            ds_meta(node)["checkpoint"] = "recompute"
        else:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            ds_meta(node)["checkpoint"] = "save" if node in cut.saved else "forward"


# ---------------------------------------------------------------------------------------------
# Measurement after partitioning.
# ---------------------------------------------------------------------------------------------

_REPORTS: collections.deque[dict[str, Any]] = collections.deque(maxlen=256)
_LOGGED_ONCE: set[str] = set()


def checkpoint_reports() -> list[dict[str, Any]]:
    """The measured report of every graph partitioned by this pass, oldest first (for tests, benchmarks, notebooks)."""
    return list(_REPORTS)


def clear_reports() -> None:
    _REPORTS.clear()


def _log_once(key: str, message: str, *args: Any) -> None:
    if key not in _LOGGED_ONCE:
        _LOGGED_ONCE.add(key)
        log.warning(message, *args)


def measure_partition(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule, num_fwd_outputs: int) -> dict[str, Any]:
    """Saved-activation bytes (forward outputs beyond the user outputs that are not graph inputs or
    aliases of them, counted once per storage: two saved views of one tensor hold it once, a
    saved slice holds its whole base) and the recompute cost of backward nodes that also run in
    forward: all their FLOPs, the matmul-class FLOPs alone (the ones torch's FlopCounterMode
    counts), and their roofline time (``recompute_seconds``), with the forward's totals to relate them to."""
    from dscompile.cost import _shape_hints, evaluate, nbytes, node_cost
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


def _make_partition_fn(ctx: PassContext, plan: Plan, options: CheckpointOptions, group_size: int = 0,
                       planned: tuple[torch.fx.Node, ...] = ()) -> Callable[..., Any]:
    """The partition function: partition the joint graph by the plan's tags and measure the result.
    ``planned`` is the joint graph's nodes when the pass planned; a later joint pass that changed it
    (common-subexpression elimination merges a decomposed backward's recomputation into forward
    values) would leave the plan describing another graph, so the plan is made again on this one."""

    def partition(joint: torch.fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, **kwargs: Any) -> Any:
        nonlocal plan
        if plan.cut is not None and tuple(joint.graph.nodes) != planned:
            log.info("%s: the joint graph changed after the checkpoint pass; planning again on the graph partitioned", ctx.graph_name)
            _restore_pins(joint)
            plan = _plan_and_tag(joint, ctx.graph_name, joint_inputs, num_fwd_outputs, options)
            plan.notes.append("planned again: a later joint pass changed the graph")
            ctx.analysis["checkpointing_plan"] = plan.summary()
        pristine = copy_graph_module(joint) if plan.target is not None else None  # untouched, should the budget need a second cut
        fw, bw, measured = _partition_and_measure(joint, joint_inputs, num_fwd_outputs, kwargs)
        if pristine is not None and measured["saved_bytes"] > plan.target:
            plan, joint, fw, bw, measured = _keep_budget(pristine, joint_inputs, num_fwd_outputs, kwargs, plan, (joint, fw, bw, measured))
            ctx.analysis["checkpointing_plan"] = plan.summary()
        report = {"graph": ctx.graph_name, **plan.summary(), **measured}
        joint_nodes = {n.name: n for n in joint.graph.nodes}
        report["saved_block"] = {name: block_of(joint_nodes[name]) if name in joint_nodes else None for name in report["saved"]}
        to_offload = report["saved"]
        if group_size > 1:
            to_offload = _partition(fw, bw, num_fwd_outputs, report, group_size, bool(getattr(ctx.config, "debug", False)))
        if options.cpu_offload:
            report["offloaded"] = _offload(fw, bw, num_fwd_outputs, to_offload)
        _record(ctx, report, options)
        return fw, bw

    return partition


def _partition_and_measure(joint: torch.fx.GraphModule, joint_inputs: Any, num_fwd_outputs: int,
                           kwargs: dict[str, Any]) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, dict[str, Any]]:
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
    for module in (fw, bw):
        _fill_missing_values(module)
    return fw, bw, measure_partition(fw, bw, num_fwd_outputs)


def _restore_pins(gm: torch.fx.GraphModule) -> None:
    """Undo ``apply_plan``'s tags, leaving the pins earlier passes had set."""
    for node in gm.graph.nodes:
        meta = node.meta.get("dscompile", {})
        if "pin" not in meta:
            continue
        pin = meta.pop("pin")
        meta.pop("checkpoint", None)
        if pin is None:
            node.meta.pop("recompute", None)
        else:
            node.meta["recompute"] = pin


def _keep_budget(pristine: torch.fx.GraphModule, joint_inputs: Any, num_fwd_outputs: int, kwargs: dict[str, Any], plan: Plan,
                 first: tuple[Any, ...], attempts: int = 2) -> tuple[Any, ...]:
    """The partitioner saved more than the plan predicted (it may keep a value the cut model did not
    expect): plan again for a target lowered by the overshoot, on a fresh copy of the joint graph,
    until the measured bytes meet the budget. Returns (plan, joint, fw, bw, measured) of the best try."""
    assert plan.target is not None
    best = (plan, *first)
    target = plan.target
    for attempt in range(attempts):
        over = best[4]["saved_bytes"] - plan.target
        if over <= 0:
            break
        target -= over
        joint = copy_graph_module(pristine)
        _restore_pins(joint)
        info = analyse_joint(joint, num_fwd_outputs)
        solver = CutSolver(info)
        baseline = solver.solve(math.inf)
        retry = Plan(plan.policy, plan.budget, solve_target(solver, max(target, 0.0), baseline), baseline,
                     [*plan.notes, f"second cut {attempt + 1}: the partitioner saved {over:.0f} bytes over the target"],
                     forward=info.forward, reference=plan.reference, target=plan.target)
        apply_plan(joint, retry)
        fw, bw, measured = _partition_and_measure(joint, joint_inputs, num_fwd_outputs, kwargs)
        log.info("checkpoint: the partition saved %.0f bytes over the budget's %.0f; cut again for %.0f: %d saved",
                 over, plan.target, target, measured["saved_bytes"])
        if measured["saved_bytes"] < best[4]["saved_bytes"]:
            best = (retry, joint, fw, bw, measured)
    if best[4]["saved_bytes"] > plan.target:
        log.warning("checkpoint: memory_budget %.2f not met: the partition saves %d bytes, the budget allows %.0f",
                    plan.budget, best[4]["saved_bytes"], plan.target)
    return best


def _partition(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule, num_fwd_outputs: int, report: dict[str, Any], group_size: int,
               verify: bool = False) -> list[str]:
    """Shard the saved activations across the partition group; the report's saved bytes become this
    rank's (``saved_bytes_unpartitioned`` keeps the whole). ``verify`` (config ``debug``) checks in
    forward that the group's copies agree. Returns the names now saved."""
    from dscompile.runtime.activation_partition import partition_group, partition_saved_activations

    result = partition_saved_activations(fw, bw, num_fwd_outputs, report["saved"], partition_group(group_size), verify=verify)
    report["partition"] = result.summary()
    report["saved_bytes_unpartitioned"] = report["saved_bytes"]
    report["saved_bytes"] -= result.full_bytes - result.shard_bytes
    report["activation_bytes"] -= result.full_bytes - result.shard_bytes
    if result.kept_whole:
        log.info("partition_activations kept %d saved values whole: %s", len(result.kept_whole), result.kept_whole)
    return [result.sharded.get(name, name) for name in report["saved"]]


def _fill_missing_values(gm: torch.fx.GraphModule) -> None:
    """The partitioner's RNG functionalisation adds nodes without ``meta["val"]``; give them one."""
    from torch._guards import detect_fake_mode

    fake_mode = detect_fake_mode([node_value(n) for n in gm.graph.nodes if n.op == "placeholder"])
    for node in gm.graph.nodes:
        if node.op == "call_function" and "val" not in node.meta:
            set_fake_value(node, fake_mode)


def _offload(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule, num_fwd_outputs: int, names: list[str]) -> list[str]:
    from dscompile.runtime.activation_offload import offload_saved_activations

    moved = offload_saved_activations(fw, bw, num_fwd_outputs, names)
    if not moved and names:
        _log_once("cpu_offload_cpu", "cpu_checkpointing: saved activations already live in host memory (CPU run); nothing to move")
    return moved


def _record(ctx: PassContext, report: dict[str, Any], options: CheckpointOptions) -> None:
    ctx.analysis.setdefault("checkpointing", {})[ctx.graph_name] = report
    _REPORTS.append(report)
    dump = getattr(ctx.config, "dump", None)
    if dump:
        directory = Path(dump) / ctx.graph_name
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "checkpointing.json").write_text(json.dumps(report, indent=2, default=str))
    level = logging.INFO if options.profile else logging.DEBUG
    log.log(level, "%s: policy %s saves %d bytes (baseline %s), recomputes %d FLOPs", ctx.graph_name, report["policy"],
            report["saved_bytes"], report.get("baseline_saved_bytes", "-"), report["recompute_flops"])


# ---------------------------------------------------------------------------------------------
# The pass.
# ---------------------------------------------------------------------------------------------


@register_pass("checkpoint", graphs=("joint",), options=CheckpointOptions)
def checkpoint(gm: torch.fx.GraphModule, ctx: PassContext, options: CheckpointOptions) -> torch.fx.GraphModule:
    """Decide per forward node whether backward gets it saved or recomputes it (policy none|full|selective|budget)."""
    if options is None:
        options = CheckpointOptions()
    group_size = _partition_group_size(options, ctx.world_size)
    if options.synchronize_boundary:
        _log_once("sync_boundary", "synchronize_checkpoint_boundary has no effect: compiled graphs have no per-block boundaries to synchronise")
    num_fwd_outputs = ctx.num_fwd_outputs
    if num_fwd_outputs is None:
        log.warning("%s: no forward-output count in the context; leaving the graph unchanged", ctx.graph_name)
        return gm
    plan = _plan_and_tag(gm, ctx.graph_name, ctx.example_inputs, num_fwd_outputs, options)
    if plan.cut is not None:
        ctx.analysis["checkpointing_plan"] = plan.summary()
    ctx.analysis["partition_fn"] = _make_partition_fn(ctx, plan, options, group_size, tuple(gm.graph.nodes))
    return gm


def _plan_and_tag(gm: torch.fx.GraphModule, graph_name: str, example_inputs: Any, num_fwd_outputs: int,
                  options: CheckpointOptions) -> Plan:
    """Plan ``options``'s policy on ``gm`` and tag its forward nodes; a graph the planner cannot
    handle is left to the default partitioner, with a warning saying why."""
    try:
        reference = None
        if options.resolved_policy() == "budget":
            reference = _reference_bytes(gm, graph_name, example_inputs, num_fwd_outputs)
        plan = plan_checkpointing(gm, num_fwd_outputs, options, reference)
    except Exception as exc:  # networkx unbounded flows, odd graphs: stay correct, say why
        if isinstance(exc, DSCompileConfigError):
            raise
        log.warning("%s: cannot plan checkpointing (%s: %s); leaving the graph to the default partitioner",
                    graph_name, type(exc).__name__, exc)
        plan = Plan("none", None, None, None, [f"planning failed: {exc}"])
    if plan.cut is not None:
        apply_plan(gm, plan)
    return plan


def _reference_bytes(gm: torch.fx.GraphModule, graph_name: str, example_inputs: Any, num_fwd_outputs: int) -> float | None:
    """The no-checkpointing saved bytes a budget is a fraction of; None (with a warning) when the
    default partition of this graph cannot be measured; the budget then counts from the
    no-recompute cut, which saves more, and the warning says the promise is weaker."""
    try:
        return float(no_checkpointing_saved_bytes(gm, example_inputs, num_fwd_outputs))
    except Exception as exc:  # an odd graph the default partitioner rejects: say so, stay safe
        log.warning("%s: cannot measure the no-checkpointing partition (%s: %s); memory_budget counts from the "
                    "no-recompute saved bytes instead", graph_name, type(exc).__name__, exc)
        return None


def _partition_group_size(options: CheckpointOptions, world_size: int) -> int:
    """The size of the group ``partition_activations`` shards across (0: no partitioning), or a clear refusal."""
    if not options.partition_activations:
        return 0
    size = options.partition_group_size
    if world_size == 1 or size == 1:
        _log_once("partition_single", "partition_activations: a partition group of one rank; there are no other copies of "
                  "the activations to shard across, so it has no effect")
        return 0
    if size == 0:
        raise PartitionGroupMissingError(world_size)
    if world_size % size:
        raise DSCompileConfigError("activation_checkpointing.partition_group_size",
                                   f"{size} does not divide the world size {world_size}", "use a divisor of the world size")
    return size


__all__ = [
    "ActivationCheckpointingConfig",
    "CheckpointOptions",
    "PartitionGroupMissingError",
    "Roofline",
    "analyse_joint",
    "checkpoint_reports",
    "clear_reports",
    "measure_partition",
    "plan_checkpointing",
    "recompute_seconds",
    "solve_budget",
]
