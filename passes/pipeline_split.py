"""Pipeline stage split: the ``pipeline`` config section, stage partitioning and the graph cut.

The captured (Dynamo, torch-level) graph is cut into contiguous pieces of its topological order:

- ``partition_method``: DeepSpeed's ``uniform`` (same number of layers per stage),
  ``parameters`` (balance trainable parameters), ``type:REGEX`` (balance layers whose class
  name matches), or dscompile's ``cost``: balance the cost model's FLOPs and memory per stage,
  with the bytes crossing each cut added to both neighbouring stages, minimising the most
  expensive stage exactly by dynamic programming over every node boundary of the graph.
  Layer methods cut only between layers (top-level children, ``ModuleList`` items expanded).
- ``split_points: ["blocks.4", ...]`` cut in front of the first node of each named module;
  ``dscompile.pipeline_split()`` calls in ``forward`` cut where they stand.

``split_program`` then cuts the graph with ``torch.fx.passes.split_module`` into one
GraphModule per stage and records, for every stage, where each input comes from (a user input
or an output of an earlier stage) so the runtime knows which activations travel forward and
which gradients travel back.

The ``pipeline_split`` pass (pre-autograd) is the one place the split is decided and made. It
annotates ``node.meta["dscompile"]["stage"]`` (a dump shows one colour per stage); with ``cut``
it also cuts the graph into a ``StagedProgram`` and leaves it in ``ctx.analysis["pipeline_program"]``:
the pipeline engine captures the model through the frontend (``dscompile.frontend.capture``) with
this pass in its pipeline and runs the stages it finds there, as ``torch.distributed.pipelining``
hands its IR to its schedules. Cutting needs the module whose parameters the stages will own and
the call's arguments, which the capture puts in ``ctx.analysis["captured_module"]`` and
``["captured_args"]``.
"""

from __future__ import annotations

import copy
import logging
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.fx

from dscompile.config import log_no_effect, log_no_effect_keys, parse_dataclass, register_section
from dscompile.cost import evaluate, nbytes, node_cost
from dscompile.errors import DSCompileConfigError, DSCompileNotSupportedError, DSCompilePipelineError
from dscompile.graph import ds_meta, is_collective, node_value
from dscompile.pipeline import PassContext, register_pass
from dscompile.runtime.pipeline_markers import is_marker

log = logging.getLogger("dscompile.passes.pipeline_split")

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
_COMPUTE_OPS = ("call_function", "call_method", "call_module")


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------
@dataclass
class PipelineParallelConfig:
    """DeepSpeed's ``pipeline`` section, plus dscompile's own keys below ``split_points``.

    ``stages`` is the pipeline-parallel degree (ranks per pipeline); with ``interleaved_1f1b``
    each rank holds ``virtual_stages`` model chunks. ``micro_batches`` defaults to
    ``gradient_accumulation_steps``. ``compile`` compiles every stage with the dscompile backend.

    DeepSpeed's own keys are accepted with DeepSpeed's meaning: ``"stages": "auto"`` (its default)
    takes the stage count from a ``dscompile.pipe.PipelineModule``, and for any other model the
    section then asks for no pipeline (DeepSpeed ignores it too); ``partition`` and
    ``seed_layers`` are read by DeepSpeed's ``PipelineModule``, not from the config, so they change
    nothing; ``pipe_partitioned`` / ``grad_partitioned`` split activations over a tensor-parallel
    group, which dscompile does not build, so there is nothing for them to split (as in DeepSpeed
    without model parallelism); ``use_reentrant`` picks DeepSpeed's recomputation API (the
    gradients are the same).
    """

    stages: int = 1
    partition_method: str = "cost"
    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"
    micro_batches: int | None = None
    activation_checkpoint_interval: int = 0
    split_points: list[str] = field(default_factory=list)
    virtual_stages: int | None = None
    compile: bool = True
    cost_memory_weight: float = 0.1
    cost_flops_per_byte: float = 1.0
    partition: str = "best"
    seed_layers: bool = False
    pipe_partitioned: bool = True
    grad_partitioned: bool = True
    use_reentrant: bool | None = None

    def validate(self, path: str) -> None:
        where = path or "pipeline"
        if self.stages < 1:
            raise DSCompileConfigError(f"{where}.stages", f"must be >= 1, got {self.stages}")
        if self.micro_batches is not None and self.micro_batches < 1:
            raise DSCompileConfigError(f"{where}.micro_batches", f"must be >= 1, got {self.micro_batches}")
        if self.activation_checkpoint_interval < 0:
            raise DSCompileConfigError(f"{where}.activation_checkpoint_interval", "must be >= 0 (0 turns it off)")
        method = self.partition_method
        if method.lower().startswith("type:"):
            try:
                re.compile(method[5:], re.IGNORECASE)
            except re.error as exc:
                raise DSCompileConfigError(f"{where}.partition_method", f"bad regular expression in {method!r}: {exc}") from None
        elif method not in ("parameters", "uniform", "cost"):
            raise DSCompileConfigError(
                f"{where}.partition_method", f"{method!r} is not a partition method", "use parameters, uniform, type:REGEX or cost"
            )
        if self.virtual_stages is None:
            self.virtual_stages = 2 if self.schedule == "interleaved_1f1b" else 1
        if self.virtual_stages < 1:
            raise DSCompileConfigError(f"{where}.virtual_stages", f"must be >= 1, got {self.virtual_stages}")
        if self.virtual_stages > 1 and self.schedule != "interleaved_1f1b":
            raise DSCompileConfigError(f"{where}.virtual_stages", f"only interleaved_1f1b uses virtual stages, schedule is {self.schedule!r}")
        if self.split_points and len(self.split_points) != self.num_model_stages - 1:
            raise DSCompileConfigError(
                f"{where}.split_points",
                f"{len(self.split_points)} split points make {len(self.split_points) + 1} stages, "
                f"but stages * virtual_stages = {self.num_model_stages}",
                f"give {self.num_model_stages - 1} split points",
            )
        if self.cost_memory_weight < 0 or self.cost_flops_per_byte < 0:
            raise DSCompileConfigError(f"{where}.cost_memory_weight", "cost weights must be >= 0")

    @property
    def num_model_stages(self) -> int:
        """How many pieces the graph is cut into: ranks per pipeline times chunks per rank."""
        return self.stages * (self.virtual_stages or 1)


_TP_GROUP = "it splits over a tensor-parallel group that the pipeline engine does not build: nothing to split, as in DeepSpeed without one"
_NO_EFFECT = {
    "pipe_partitioned": _TP_GROUP,
    "grad_partitioned": _TP_GROUP,
    "use_reentrant": "it picks DeepSpeed's recomputation API; the gradients are the same",
}
_PIPELINE_MODULE_KEYS = {
    "partition": "pipeline.partition_method (or dscompile.pipe.PipelineModule(partition_method=...)) chooses the cut",
    "seed_layers": "dscompile.pipe.PipelineModule(seed_layers=...) seeds the layers",
}


def _parse_section(value: Any, path: str) -> PipelineParallelConfig | None:
    """None for DeepSpeed's ``"stages": "auto"``: the stage count comes from a PipelineModule."""
    log_no_effect_keys(path, value, _NO_EFFECT)
    if isinstance(value, Mapping):
        for key in ("partition", "seed_layers"):
            if key in value:
                log_no_effect(
                    f"{path}.{key}", f"DeepSpeed reads it from PipelineModule(...) arguments, never from the config; here {_PIPELINE_MODULE_KEYS[key]}"
                )
    if isinstance(value, dict) and value.get("stages") == "auto":
        parse_dataclass(PipelineParallelConfig, {k: v for k, v in value.items() if k != "stages"}, path)  # check the other keys
        return None
    return parse_dataclass(PipelineParallelConfig, value, path)


register_section("pipeline_parallel", _parse_section, "pipeline parallelism")


# ---------------------------------------------------------------------------------------------
# Graph facts the partitioner needs
# ---------------------------------------------------------------------------------------------
_PATH_PREFIXES = re.compile(r"^(L\['self'\]\.|L\['self'\]|self\.)")


def module_path(node: torch.fx.Node, strip: str = "") -> str:
    """The dotted name of the innermost module a node was traced in ('' at the root)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    raw = list(stack.values())[-1][0]
    text = _PATH_PREFIXES.sub("", str(raw))
    text = text.replace("_modules['", "").replace("']", "").replace("._modules", "")
    if strip and (text == strip.rstrip(".") or text.startswith(strip)):
        text = text[len(strip) :]
    return text


def _module_types(node: torch.fx.Node, strip: str = "") -> dict[str, str]:
    found: dict[str, str] = {}
    for path, cls in (node.meta.get("nn_module_stack") or {}).values():
        text = _PATH_PREFIXES.sub("", str(path)).replace("_modules['", "").replace("']", "").replace("._modules", "")
        if strip and text.startswith(strip):
            text = text[len(strip) :]
        found[text] = getattr(cls, "__name__", str(cls))
    return found


def layer_of(path: str) -> str:
    """The 'layer' a module path belongs to: its first component, plus the index of a list item."""
    if not path:
        return ""
    parts = path.split(".")
    if len(parts) > 1 and parts[1].isdigit():
        return f"{parts[0]}.{parts[1]}"
    return parts[0]


def _value_bytes(node: torch.fx.Node) -> int:
    value = node_value(node)
    if isinstance(value, torch.Tensor):
        return int(evaluate(nbytes(value)))
    return 0


def _is_plain_tensor(node: torch.fx.Node) -> bool:
    return isinstance(node_value(node), torch.Tensor)


def _starts_collective(node: torch.fx.Node) -> bool:
    """A functional collective (tensor parallelism's all-reduces): its result is only usable after its
    ``wait_tensor``, on the same rank."""
    return is_collective(node) and node.target is not torch.ops._c10d_functional.wait_tensor.default


@dataclass
class GraphFacts:
    """Per compute node (in order): FLOPs, memory, layer; per boundary: bytes crossing, validity."""

    nodes: list[torch.fx.Node]
    flops: torch.Tensor  # float64, one per node (torch, not numpy: numpy is no dependency of dscompile)
    memory: torch.Tensor
    layers: list[str]
    layer_types: dict[str, str]
    param_count: torch.Tensor
    cut_bytes: torch.Tensor  # cut_bytes[i]: bytes of values crossing the boundary in front of node i
    cut_valid: torch.Tensor  # bool
    markers: list[int]  # boundaries where a pipeline_split() marker stood


def graph_facts(gm: torch.fx.GraphModule, param_nodes: set[torch.fx.Node], strip: str = "") -> GraphFacts:
    """Measure the graph once; every partition method reads these arrays."""
    nodes: list[torch.fx.Node] = []
    markers: list[int] = []
    for node in gm.graph.nodes:
        if is_marker(node):
            markers.append(len(nodes))
        elif node.op in _COMPUTE_OPS:
            nodes.append(node)
    index = {node: i for i, node in enumerate(nodes)}
    n = len(nodes)
    flops = torch.zeros(n, dtype=torch.float64)
    memory = torch.zeros(n, dtype=torch.float64)
    params = torch.zeros(n, dtype=torch.float64)
    layers: list[str] = []
    layer_types: dict[str, str] = {}
    seen_params: set[torch.fx.Node] = set()
    previous = ""
    for i, node in enumerate(nodes):
        flops[i] = float(evaluate(node_cost(node).flops))
        memory[i] = _value_bytes(node)  # activations kept for backward (an upper estimate)
        for arg in node.all_input_nodes:
            if arg in param_nodes and arg not in seen_params:
                seen_params.add(arg)
                value = node_value(arg)
                # parameter, gradient and two optimizer states per element
                memory[i] += 4 * _value_bytes(arg)
                if isinstance(value, torch.Tensor):
                    params[i] += value.numel()
        layer = layer_of(module_path(node, strip)) or previous  # root-level ops join the layer before them
        layers.append(layer)
        previous = layer
        for path, cls in _module_types(node, strip).items():
            if path == layer:
                layer_types[layer] = cls
    if layers and not layers[0]:
        first = next((name for name in layers if name), "")
        layers = [name or first for name in layers]
    # bytes crossing each boundary: values made before it and used after it
    diff = torch.zeros(n + 2, dtype=torch.float64)
    valid = torch.ones(n + 1, dtype=torch.bool)
    for node in gm.graph.nodes:
        if node.op not in _COMPUTE_OPS or node not in index:
            continue
        users = [index[u] for u in node.users if u in index]
        if not users:
            continue
        start, last = index[node] + 1, max(users)
        if last < start:
            continue
        diff[start] += _value_bytes(node)
        diff[last + 1] -= _value_bytes(node)
        if not _is_plain_tensor(node) or _starts_collective(node):
            # tuples, sizes and None cannot travel between ranks; a collective must be waited where it started
            valid[start : last + 1] = False
    cut_bytes = torch.cumsum(diff, 0)[: n + 1]
    valid[0] = valid[n] = True
    return GraphFacts(nodes, flops, memory, layers, layer_types, params, cut_bytes, valid, markers)


# ---------------------------------------------------------------------------------------------
# The min-max partition (exact dynamic programming)
# ---------------------------------------------------------------------------------------------
_DP_BLOCK = 256  # run ends handled together: a (units + 1) x 256 float64 matrix per step


def min_max_partition(unit_costs: Sequence[float], cut_costs: Sequence[float], stages: int) -> list[int]:
    """Cut ``units`` into ``stages`` non-empty contiguous runs minimising the largest run cost.

    A run ``[i, j)`` costs ``sum(unit_costs[i:j]) + cut_costs[i] + cut_costs[j]``; the ends
    ``cut_costs[0]`` and ``cut_costs[n]`` are ignored and ``inf`` marks a forbidden cut.
    Returns the ``stages + 1`` boundaries ``[0, c1, ..., n]``. Exact: dp[s][j] is the best
    largest cost of ``s`` runs covering the first ``j`` units; ties prefer smaller total cost.
    """
    costs = torch.as_tensor(unit_costs, dtype=torch.float64).reshape(-1)
    n = len(costs)
    if stages < 1 or stages > n:
        raise ValueError(f"cannot cut {n} units into {stages} non-empty stages")
    cuts = torch.as_tensor(cut_costs, dtype=torch.float64).reshape(-1).clone()
    cuts[0] = cuts[n] = 0.0
    prefix = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(costs, 0)])
    inf = float("inf")
    best = torch.full((stages + 1, n + 1), inf, dtype=torch.float64)
    total = torch.full((stages + 1, n + 1), inf, dtype=torch.float64)
    choice = torch.zeros((stages + 1, n + 1), dtype=torch.long)
    best[0, 0] = 0.0
    total[0, 0] = 0.0
    starts = torch.arange(n + 1)
    for s in range(1, stages + 1):
        # every run end j at once (in column blocks to bound memory): rows are run starts i < j
        for lo in range(s, n + 1, _DP_BLOCK):
            ends = torch.arange(lo, min(lo + _DP_BLOCK, n + 1))
            run = prefix[ends][None, :] - prefix[:, None] + cuts[:, None] + cuts[ends][None, :]
            allowed = (starts[:, None] >= s - 1) & (starts[:, None] < ends[None, :])
            worst = torch.where(allowed, torch.maximum(best[s - 1][:, None], run), inf)
            tot = torch.where(allowed, total[s - 1][:, None] + run, inf)
            lowest = worst.min(dim=0).values
            # among (near-)optimal starts pick the one with the smallest total cost (first on ties)
            near = worst <= lowest * (1 + 1e-12) + 1e-300
            k = torch.where(near, tot, inf).argmin(dim=0)
            reachable = torch.isfinite(lowest)
            cols = ends[reachable]
            best[s, cols] = worst[k, ends - lo][reachable]
            total[s, cols] = tot[k, ends - lo][reachable]
            choice[s, cols] = k[reachable]
    if not torch.isfinite(best[stages, n]):
        raise ValueError(f"no valid way to cut the graph into {stages} stages (every boundary is forbidden)")
    bounds = [n]
    j = n
    for s in range(stages, 0, -1):
        j = int(choice[s, j])
        bounds.append(j)
    return bounds[::-1]


@dataclass
class PartitionPlan:
    """Where the graph is cut, and what each stage costs (FLOPs, memory) and sends."""

    method: str
    bounds: list[int]  # node-index boundaries, len = stages + 1
    stage_flops: list[float]
    stage_memory: list[float]
    stage_params: list[int]
    cut_bytes: list[int]  # bytes crossing each inner boundary
    objective: list[float]  # the cost-model objective of every stage

    @property
    def stages(self) -> int:
        return len(self.bounds) - 1

    def stage_of(self, index: int) -> int:
        for s in range(self.stages):
            if self.bounds[s] <= index < self.bounds[s + 1]:
                return s
        raise IndexError(index)


def _objective(facts: GraphFacts, memory_weight: float, flops_per_byte: float) -> tuple[torch.Tensor, torch.Tensor]:
    total_flops = max(float(facts.flops.sum()), 1.0)
    total_memory = max(float(facts.memory.sum()), 1.0)
    units = facts.flops / total_flops + memory_weight * facts.memory / total_memory
    cuts = torch.where(facts.cut_valid, flops_per_byte * facts.cut_bytes / total_flops, float("inf"))
    return units, cuts


def _layer_units(facts: GraphFacts) -> list[tuple[int, int, str]]:
    """Maximal runs of consecutive nodes of one layer: (start, end, layer)."""
    runs: list[tuple[int, int, str]] = []
    start = 0
    for i in range(1, len(facts.nodes) + 1):
        if i == len(facts.nodes) or facts.layers[i] != facts.layers[start]:
            runs.append((start, i, facts.layers[start]))
            start = i
    # merge runs whose front boundary cannot be cut into the run before them
    merged: list[tuple[int, int, str]] = []
    for run in runs:
        if merged and not facts.cut_valid[run[0]]:
            merged[-1] = (merged[-1][0], run[1], merged[-1][2])
        else:
            merged.append(run)
    return merged


def _split_point_bounds(facts: GraphFacts, split_points: Sequence[str], strip: str) -> list[int]:
    bounds = [0]
    for name in split_points:
        found = None
        for i, node in enumerate(facts.nodes):
            path = module_path(node, strip)
            if (path == name or path.startswith(name + ".")) and i > bounds[-1]:
                found = i
                break
        if found is None:
            raise DSCompileConfigError(
                "pipeline.split_points", f"no node after the previous split point runs inside module {name!r}", "name modules in forward order, e.g. 'blocks.2'"
            )
        if not facts.cut_valid[found]:
            raise DSCompileConfigError("pipeline.split_points", f"cannot cut in front of {name!r}: a non-tensor value crosses there")
        bounds.append(found)
    return bounds + [len(facts.nodes)]


def plan_partition(
    facts: GraphFacts,
    stages: int,
    method: str = "cost",
    *,
    split_points: Sequence[str] = (),
    memory_weight: float = 0.1,
    flops_per_byte: float = 1.0,
    strip: str = "",
) -> PartitionPlan:
    """Choose the cut: markers, then split points, then the partition method."""
    n = len(facts.nodes)
    units, cuts = _objective(facts, memory_weight, flops_per_byte)
    if facts.markers:
        bounds = sorted(set([0, *facts.markers, n]))
        method = "markers"
    elif split_points:
        bounds = _split_point_bounds(facts, split_points, strip)
        method = "split_points"
    elif method == "cost":
        bounds = min_max_partition(units, cuts, stages)
    else:
        runs = _layer_units(facts)
        if len(runs) < stages:
            raise DSCompileConfigError(
                "pipeline.stages",
                f"the model has {len(runs)} layers, too few for {stages} stages with partition_method {method!r}",
                "use partition_method 'cost' (cuts inside layers) or fewer stages",
            )
        if method == "uniform":
            weights = torch.ones(len(runs), dtype=torch.float64)
        elif method == "parameters":
            weights = torch.tensor([float(facts.param_count[a:b].sum()) for a, b, _ in runs], dtype=torch.float64)
        else:
            pattern = re.compile(method[5:], re.IGNORECASE)
            weights = torch.tensor([1.0 if pattern.search(facts.layer_types.get(layer, "")) else 0.0 for _, _, layer in runs], dtype=torch.float64)
            if not weights.any():
                classes = sorted(set(facts.layer_types.values()))
                raise DSCompileConfigError("pipeline.partition_method", f"no layer class matches {method[5:]!r}; layer classes: {classes}")
        # ties between equal-weight splits are broken by the cost model (a tiny second term)
        tie = torch.tensor([float(units[a:b].sum()) for a, b, _ in runs], dtype=torch.float64) * 1e-6
        layer_bounds = min_max_partition(weights + tie, torch.zeros(len(runs) + 1, dtype=torch.float64), stages)
        bounds = [runs[k][0] if k < len(runs) else n for k in layer_bounds]
    if len(bounds) - 1 != stages:
        raise DSCompileConfigError("pipeline.stages", f"the model's split markers / split points make {len(bounds) - 1} stages, config asks for {stages}")
    flops = [float(facts.flops[a:b].sum()) for a, b in zip(bounds, bounds[1:])]
    memory = [float(facts.memory[a:b].sum()) for a, b in zip(bounds, bounds[1:])]
    params = [int(facts.param_count[a:b].sum()) for a, b in zip(bounds, bounds[1:])]
    crossing = [int(facts.cut_bytes[b]) for b in bounds[1:-1]]
    cuts0 = torch.where(torch.isfinite(cuts), cuts, 0.0)
    objective = [float(units[a:b].sum() + (cuts0[a] if a else 0.0) + (cuts0[b] if b < n else 0.0)) for a, b in zip(bounds, bounds[1:])]
    return PartitionPlan(method, list(bounds), flops, memory, params, crossing, objective)


# ---------------------------------------------------------------------------------------------
# Cutting the graph into stage GraphModules
# ---------------------------------------------------------------------------------------------
@dataclass
class InputRef:
    """Where one stage input comes from: user input ``index`` or output ``index`` of stage ``stage``."""

    kind: Literal["input", "stage"]
    index: int
    stage: int = -1


@dataclass
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


@dataclass
class StageSpec:
    index: int
    module: torch.fx.GraphModule
    inputs: list[InputRef]
    input_specs: list[TensorSpec | None]
    output_specs: list[TensorSpec | None]
    consumers: dict[int, list[int]] = field(default_factory=dict)  # output index -> consumer stages
    param_names: list[str] = field(default_factory=list)


@dataclass
class StagedProgram:
    """The whole model as stages; ``loss`` is (stage, output index) of the model's result."""

    stages: list[StageSpec]
    loss: tuple[int, int]
    plan: PartitionPlan
    split_gm: torch.fx.GraphModule
    facts: GraphFacts | None = None  # the measurements the plan was made from (for ``describe``)

    def describe(self) -> str:
        """The plan's table and the tensors crossing each cut (``describe_plan``)."""
        if self.facts is None:
            raise ValueError("this StagedProgram carries no GraphFacts to describe its plan with")
        return describe_plan(self, self.plan, self.facts)


def _spec(value: Any) -> TensorSpec | None:
    if not isinstance(value, torch.Tensor):
        return None
    return TensorSpec(tuple(int(d) for d in value.shape), value.dtype, bool(value.requires_grad))


def _copy_constants_per_stage(gm: torch.fx.GraphModule, stage_of: dict[torch.fx.Node, int], param_nodes: set[torch.fx.Node]) -> None:
    """Recompute input-independent, gradient-free values (rotary tables...) in each stage using
    them, instead of sending them between ranks."""
    constant: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node not in param_nodes:
            constant.add(node)
        elif node.op in _COMPUTE_OPS and node in stage_of and node.all_input_nodes and all(a in constant for a in node.all_input_nodes):
            value = node_value(node)
            if isinstance(value, torch.Tensor) and not value.requires_grad:
                constant.add(node)
    copies: dict[tuple[torch.fx.Node, int], torch.fx.Node] = {}

    def copy_for(node: torch.fx.Node, stage: int, before: torch.fx.Node) -> torch.fx.Node:
        if node.op == "get_attr" or stage_of.get(node) == stage:
            return node
        key = (node, stage)
        if key not in copies:
            args = torch.fx.node.map_arg(node.args, lambda a: copy_for(a, stage, before))
            kwargs = torch.fx.node.map_arg(node.kwargs, lambda a: copy_for(a, stage, before))
            with gm.graph.inserting_before(before):
                new = gm.graph.create_node(node.op, node.target, args, kwargs, name=f"{node.name}_s{stage}")
            new.meta = dict(node.meta)
            stage_of[new] = stage
            copies[key] = new
        return copies[key]

    for node in list(gm.graph.nodes):
        if node.op not in _COMPUTE_OPS or node not in stage_of:
            continue
        stage = stage_of[node]
        for arg in node.all_input_nodes:
            if arg in constant and arg.op != "get_attr" and stage_of.get(arg) != stage:
                node.replace_input_with(arg, copy_for(arg, stage, node))
    gm.graph.eliminate_dead_code()


def _set_nested(module: torch.nn.Module, qualname: str, value: torch.Tensor) -> None:
    *path, leaf = qualname.split(".")
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, torch.nn.Module())
        module = getattr(module, part)
    if isinstance(value, torch.nn.Parameter):
        module.register_parameter(leaf, value)
    else:
        module.register_buffer(leaf, value)


def _own_attributes(split_gm: torch.fx.GraphModule) -> None:
    """split_module passes tensor attributes into stages as inputs; make each stage own the
    parameters and buffers it reads instead (same tensor objects), so a stage's
    ``parameters()`` are exactly what its rank trains."""
    for call in [n for n in split_gm.graph.nodes if n.op == "call_module"]:
        sub = getattr(split_gm, str(call.target))
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        keep = []
        for arg, ph in zip(call.args, placeholders):
            if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
                value = getattr_path(split_gm, str(arg.target))
                _set_nested(sub, str(arg.target), value)
                with sub.graph.inserting_after(placeholders[-1]):
                    attr = sub.graph.get_attr(str(arg.target))
                attr.meta = dict(ph.meta)
                ph.replace_all_uses_with(attr)
                sub.graph.erase_node(ph)
            else:
                keep.append(arg)
        call.args = tuple(keep)
        sub.recompile()
    split_gm.graph.eliminate_dead_code()
    split_gm.recompile()


def getattr_path(module: torch.nn.Module, qualname: str) -> Any:
    for part in qualname.split("."):
        module = getattr(module, part)
    return module


def _mark_gradients(specs: list[StageSpec]) -> None:
    """Which stage inputs and outputs carry a gradient: floating values that depend on a
    trainable parameter, followed through each stage graph in order (fake propagation does not
    keep ``requires_grad``)."""
    out_flags: dict[int, list[bool]] = {}
    for spec in specs:
        flags_in = [ref.kind == "stage" and out_flags[ref.stage][ref.index] for ref in spec.inputs]
        flow: dict[torch.fx.Node, bool] = {}
        placeholders = iter(flags_in)
        result: list[bool] = []
        for node in spec.module.graph.nodes:
            if node.op == "placeholder":
                flow[node] = next(placeholders)
            elif node.op == "get_attr":
                value = getattr_path(spec.module, str(node.target))
                flow[node] = isinstance(value, torch.Tensor) and value.requires_grad
            elif node.op == "output":
                outs = node.args[0]
                outs = outs if isinstance(outs, (tuple, list)) else (outs,)
                result = [isinstance(o, torch.fx.Node) and flow.get(o, False) for o in outs]
            else:
                value = node_value(node)
                floating = not isinstance(value, torch.Tensor) or value.dtype.is_floating_point or value.dtype.is_complex
                flow[node] = floating and any(flow.get(a, False) for a in node.all_input_nodes)
        for tspec, flag in zip(spec.input_specs, flags_in):
            if tspec is not None:
                tspec.requires_grad = flag
        for tspec, flag in zip(spec.output_specs, result):
            if tspec is not None:
                tspec.requires_grad = flag and tspec.dtype.is_floating_point
        out_flags[spec.index] = [bool(t is not None and t.requires_grad) for t in spec.output_specs]


def split_program(
    gm: torch.fx.GraphModule,
    root: torch.nn.Module,
    facts: GraphFacts,
    plan: PartitionPlan,
    param_nodes: set[torch.fx.Node],
    example_inputs: Sequence[Any],
) -> StagedProgram:
    """Cut ``gm`` (parameters as ``get_attr`` of ``root``) into the plan's stage GraphModules."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    from torch.fx.passes.split_module import split_module

    stage_of = {node: plan.stage_of(i) for i, node in enumerate(facts.nodes)}
    for node in list(gm.graph.nodes):
        if is_marker(node):
            gm.graph.erase_node(node)
    for node, stage in stage_of.items():
        ds_meta(node)["stage"] = stage
    _copy_constants_per_stage(gm, stage_of, param_nodes)
    gm.recompile()
    split_gm = split_module(gm, root, lambda node: stage_of[node], keep_original_order=True, tuple_return=True)
    _own_attributes(split_gm)

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_inputs = [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
    with fake_mode:
        FakeTensorProp(split_gm, fake_mode).propagate(*fake_inputs)

    placeholders = [n for n in split_gm.graph.nodes if n.op == "placeholder"]
    producer: dict[torch.fx.Node, tuple[int, int]] = {}
    specs: list[StageSpec] = []
    stage_number: dict[torch.fx.Node, int] = {}
    for node in split_gm.graph.nodes:
        if node.op == "call_module":
            index = int(str(node.target).rsplit("_", 1)[1])
            stage_number[node] = index
            refs: list[InputRef] = []
            in_specs: list[TensorSpec | None] = []
            for arg in node.args:
                if not isinstance(arg, torch.fx.Node):
                    raise RuntimeError(f"stage {index}: unexpected constant argument {arg!r} from split_module")
                if arg.op == "placeholder":
                    refs.append(InputRef("input", placeholders.index(arg)))
                else:
                    src_stage, out_index = producer[arg]
                    refs.append(InputRef("stage", out_index, src_stage))
                in_specs.append(_spec(node_value(arg)))
            module = getattr(split_gm, str(node.target))
            outputs = node_value(node)
            out_specs = [_spec(v) for v in (outputs if isinstance(outputs, (tuple, list)) else (outputs,))]
            names = [name for name, _ in module.named_parameters()]
            specs.append(StageSpec(index, module, refs, in_specs, out_specs, param_names=names))
        elif node.op == "call_function" and node.args and node.args[0] in stage_number:
            producer[node] = (stage_number[node.args[0]], int(node.args[1]))
    specs.sort(key=lambda s: s.index)
    _mark_gradients(specs)
    for spec in specs:
        for ref in spec.inputs:
            if ref.kind == "stage":
                specs[ref.stage].consumers.setdefault(ref.index, []).append(spec.index)
                if ref.stage >= spec.index:
                    raise RuntimeError(f"stage {spec.index} reads from later stage {ref.stage}")
    out_node = next(n for n in split_gm.graph.nodes if n.op == "output")
    result = out_node.args[0]
    result = result[0] if isinstance(result, (tuple, list)) else result
    if not isinstance(result, torch.fx.Node) or result not in producer:
        raise DSCompileConfigError("pipeline", "the model's result is not computed by a stage", "the model must return its loss")
    loss = producer[result]
    if loss[0] != len(specs) - 1:
        raise DSCompileConfigError("pipeline", f"the loss is computed in stage {loss[0]}, not the last stage", "the loss must be the model's last computation")
    return StagedProgram(specs, loss, plan, split_gm)


def describe_plan(program: StagedProgram | None, plan: PartitionPlan, facts: GraphFacts) -> str:
    """Readable table: each stage's nodes, FLOPs, memory, parameters, and the tensors at each cut."""
    lines = [f"pipeline partition: method={plan.method}, stages={plan.stages}"]
    mean = sum(plan.stage_flops) / max(plan.stages, 1)
    for s in range(plan.stages):
        a, b = plan.bounds[s], plan.bounds[s + 1]
        first, last = facts.nodes[a].name, facts.nodes[b - 1].name
        lines.append(
            f"  stage {s}: nodes {a}..{b - 1} ({first} .. {last}), flops {plan.stage_flops[s]:.4g}"
            f" ({plan.stage_flops[s] / mean if mean else 0:.2f}x mean), memory {plan.stage_memory[s]:.4g} B,"
            f" params {plan.stage_params[s]}, objective {plan.objective[s]:.4f}"
        )
    if program is not None:
        for spec in program.stages:
            for ref, tspec in zip(spec.inputs, spec.input_specs):
                if ref.kind == "stage" and tspec is not None:
                    grad = "activation + gradient back" if tspec.requires_grad else "activation only"
                    lines.append(f"  cut: stage {ref.stage} output {ref.index} -> stage {spec.index}: {tspec.dtype} {list(tspec.shape)} ({grad})")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# The pass: decide the split (annotating the graph), and with ``cut`` make the stage graphs
# ---------------------------------------------------------------------------------------------
MODULE_KEY = "captured_module"  # ctx.analysis: the nn.Module the graph was captured from
ARGS_KEY = "captured_args"  # ctx.analysis: the arguments it was called with (the example batch)
PROGRAM_KEY = "pipeline_program"  # ctx.analysis: the StagedProgram the pass cut
PLAN_KEY = "pipeline_plan"  # ctx.analysis: the PartitionPlan


def attribute_graph(
    gm: torch.fx.GraphModule, root: torch.nn.Module, example_inputs: Sequence[Any], args: Sequence[Any]
) -> tuple[torch.fx.GraphModule, set[torch.fx.Node]]:
    """A copy of ``gm`` whose placeholders holding ``root``'s parameters and buffers are ``get_attr`` of ``root``
    (what ``split_program`` cuts: each stage then owns the tensors it reads), and its trainable-parameter nodes.

    ``example_inputs`` are the values of ``gm``'s placeholders (a backend's example inputs: the real tensors);
    the others must be ``args`` in order (the batch positions the runtime feeds). ``get_attr`` nodes already
    in ``gm`` (a graph that holds its tensors) stay, resolved in ``root``. ``gm`` itself is left as it was.
    """
    graph = copy.deepcopy(gm.graph)
    for node in graph.nodes:  # node metadata is copied shallowly: give the copy its own dscompile dict
        if isinstance(node.meta.get("dscompile"), dict):
            node.meta["dscompile"] = dict(node.meta["dscompile"])
    names: dict[int, str] = {}
    for name, p in root.named_parameters():
        names.setdefault(id(p), name)
    for name, b in root.named_buffers():
        names.setdefault(id(b), name)
    arg_ids = {id(a): i for i, a in enumerate(args)}
    param_nodes: set[torch.fx.Node] = set()
    user_inputs: list[int] = []
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    first_compute = next(n for n in graph.nodes if n.op != "placeholder")
    for node, value in zip(placeholders, example_inputs):
        if id(value) in names:
            with graph.inserting_before(first_compute), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the graph's module does not hold the model's attributes yet
                attr = graph.get_attr(names[id(value)])
            attr.meta = dict(node.meta)
            node.replace_all_uses_with(attr)
            graph.erase_node(node)
            if isinstance(value, torch.nn.Parameter) and value.requires_grad:
                param_nodes.add(attr)
        elif id(value) in arg_ids:
            user_inputs.append(arg_ids[id(value)])
        else:
            raise DSCompileNotSupportedError(
                "pipeline", f"capturing a model whose graph reads a tensor that is neither an input nor a parameter/buffer ({node.name})"
            )
    if user_inputs != sorted(user_inputs) or len(user_inputs) != len(args):
        raise DSCompileNotSupportedError("pipeline", "models that do not read every batch tensor in order (pass only the tensors forward uses)")
    for node in graph.nodes:
        if node.op == "get_attr" and node not in param_nodes:
            value = getattr_path(root, str(node.target))
            if isinstance(value, torch.nn.Parameter) and value.requires_grad:
                param_nodes.add(node)
    return torch.fx.GraphModule(root, graph), param_nodes


@dataclass
class PipelineSplitOptions:
    stages: int = field(default=2, metadata={"help": "how many pieces: ranks per pipeline times chunks per rank"})
    method: str = field(default="cost", metadata={"help": "cost | parameters | uniform | type:REGEX (pipeline.partition_method)"})
    split_points: tuple[str, ...] = field(default=(), metadata={"help": "cut in front of these modules, in forward order"})
    memory_weight: float = field(default=0.1, metadata={"help": "pipeline.cost_memory_weight"})
    flops_per_byte: float = field(default=1.0, metadata={"help": "pipeline.cost_flops_per_byte"})
    strip: str = field(default="", metadata={"help": "module-path prefix split points and layers leave out (the engine's loss wrapper)"})
    cut: bool = field(default=False, metadata={"help": "also cut the stage graphs into ctx.analysis['pipeline_program'] (the pipeline engine)"})


@register_pass("pipeline_split", graphs=["pre_autograd"], options=PipelineSplitOptions)
def pipeline_split_pass(gm: torch.fx.GraphModule, ctx: PassContext, options: PipelineSplitOptions) -> None:
    """Annotate each node with its pipeline stage (``meta['dscompile']['stage']``); with ``cut``, cut the stage
    graphs into ``ctx.analysis['pipeline_program']`` for the pipeline engine (``gm`` itself is not rewritten)."""
    if options.cut:
        _cut(gm, ctx, options)
        return None
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    param_nodes = {placeholders[i] for i in ctx.param_names if i < len(placeholders)}
    facts = graph_facts(gm, param_nodes, options.strip)
    if len(facts.nodes) < options.stages:
        log.info("graph %s has %d nodes, fewer than %d stages: left unannotated", ctx.graph_name, len(facts.nodes), options.stages)
        return None
    try:
        plan = _plan(facts, options)
    except (ValueError, DSCompileConfigError) as exc:
        log.info("graph %s not annotated: %s", ctx.graph_name, exc)
        return None
    for i, node in enumerate(facts.nodes):
        ds_meta(node)["stage"] = plan.stage_of(i)
    ctx.analysis[PLAN_KEY] = plan
    log.info("%s", describe_plan(None, plan, facts))
    return None


def _plan(facts: GraphFacts, options: PipelineSplitOptions) -> PartitionPlan:
    return plan_partition(
        facts,
        options.stages,
        options.method,
        split_points=options.split_points,
        memory_weight=options.memory_weight,
        flops_per_byte=options.flops_per_byte,
        strip=options.strip,
    )


def _cut(gm: torch.fx.GraphModule, ctx: PassContext, options: PipelineSplitOptions) -> None:
    """Plan on a copy of ``gm`` whose parameters are ``get_attr`` of the captured module, cut that copy into the
    StagedProgram, and annotate ``gm``'s nodes with the same stages. Errors are the user's (a split point that
    matches nothing, too few layers): raised, not logged, since the engine cannot run without its stages."""
    root = ctx.analysis.get(MODULE_KEY)
    args = ctx.analysis.get(ARGS_KEY)
    if root is None or args is None:
        raise DSCompilePipelineError(
            "pipeline_split(cut=true) cuts the stage graphs for the pipeline engine and needs the captured module and its "
            f"arguments in ctx.analysis[{MODULE_KEY!r}] and [{ARGS_KEY!r}] (dscompile.frontend.capture puts them there); "
            "inside torch.compile use pipeline_split without cut, which annotates the stages"
        )
    target, param_nodes = attribute_graph(gm, root, ctx.example_inputs, args)
    facts = graph_facts(target, param_nodes, options.strip)
    plan = _plan(facts, options)
    by_name = {node.name: node for node in gm.graph.nodes}
    for i, node in enumerate(facts.nodes):
        if node.name in by_name:
            ds_meta(by_name[node.name])["stage"] = plan.stage_of(i)
    program = split_program(target, root, facts, plan, param_nodes, args)
    program.facts = facts
    ctx.analysis[PLAN_KEY] = plan
    ctx.analysis[PROGRAM_KEY] = program
    log.info("%s", program.describe())
