"""Cutting the graph into stage GraphModules (``split_program``) and what the runtime needs to run them.

Each ``StageSpec`` records where its inputs come from (a user input or an earlier stage's output) and which values carry
a gradient, so the schedules know which activations travel forward and which gradients travel back.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.fx

from dscompile.errors import DSCompileConfigError, DSCompileNotSupportedError
from dscompile.graph import ds_meta, node_value
from dscompile.passes.pipeline_split.facts import _COMPUTE_OPS, GraphFacts
from dscompile.passes.pipeline_split.partition import PartitionPlan
from dscompile.runtime.pipeline_markers import is_marker


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
