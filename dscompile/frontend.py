"""The ``dscompile`` torch.compile backend: capture, AOTAutograd, the pass pipeline, lowering.

``torch.compile(model, backend="dscompile", options=CONFIG)`` calls ``dscompile_backend`` once per
Dynamo graph. Each graph goes through: ``pre_autograd`` passes on the Dynamo graph, AOTAutograd
(``joint`` passes inside the partition function, then the partitioner), ``forward`` and
``backward`` passes, and finally the lowering chosen by the pipeline's ``lower(...)`` item.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx

from dscompile.config import DSConfig, load_config
from dscompile.graph import fill_capture_values, fill_rng_wrapper_values, runtime_inputs, unlift_runtime_inputs
from dscompile.pipeline import (
    PassContext,
    PassInvocation,
    PassManager,
    PassRecord,
    get_pass,
    invocation,
    pipeline_from_config,
    pipeline_lowering,
)
from dscompile.planner import PlannedConfig, compiling_under
from dscompile.runtime.comm_stats import count_graph_runs, graph_collectives

log = logging.getLogger("dscompile.frontend")

_GRAPH_COUNTER = itertools.count()

ProgressFn = Callable[[str, str], None]
_PROGRESS_LISTENERS: list[ProgressFn] = []


@contextlib.contextmanager
def compile_progress(listener: ProgressFn) -> Iterator[None]:
    """Call ``listener(graph_name, phase)`` as each compile phase starts (the demo's progress line).

    Phases: ``passes on the <kind> graph``, ``AOTAutograd: tracing forward and backward``,
    ``partitioning``, ``lowering <kind> with <lowering>``, ``done <kind>``.
    """
    _PROGRESS_LISTENERS.append(listener)
    try:
        yield
    finally:
        _PROGRESS_LISTENERS.remove(listener)


def _progress(graph_name: str, phase: str) -> None:
    for listener in list(_PROGRESS_LISTENERS):
        listener(graph_name, phase)


AUTO_LOWERING_REASON = (
    "auto: Inductor on every device. Its code is plain torch.compile's, so the default is no slower than torch.compile by "
    "construction; dscompile's Triton codegen (lower: triton) measured 2.3x slower than Inductor on an H200. The kernels "
    "passes put in the graph (dscompile::* ops: block-sparse attention, cache attention, rotary, ...) run inside it as "
    "the custom ops they are."
)


def resolve_lowering(name: str | None) -> str:
    """``auto`` (or nothing) means Inductor, on a GPU as on a CPU (``AUTO_LOWERING_REASON`` says why)."""
    if name in (None, "auto"):
        return "inductor"
    return name


def lowering_reason(requested: str | None, resolved: str) -> str:
    """Why this compile lowers with ``resolved``: what the dump's ``lowering.txt`` states."""
    return AUTO_LOWERING_REASON if requested in (None, "auto") else f"lower: {resolved}, as configured"


class GraphCompiler:
    """Compiles one Dynamo graph; holds the state its joint/forward/backward graphs share."""

    def __init__(
        self, config: DSConfig, invocations: Sequence[PassInvocation], dumper: Any = None, mode: str | None = None, name: str | None = None
    ) -> None:
        from dscompile.backends import get_lowering

        self.config = config
        self.invocations = list(invocations)
        requested = pipeline_lowering(invocations)
        self.lowering_name = resolve_lowering(requested)
        self.lowering_reason = lowering_reason(requested, self.lowering_name)
        self.lowering = get_lowering(self.lowering_name)
        check_mode(mode, self.lowering_name)
        self.decompositions = self.lowering.decompositions()
        self.manager = PassManager(self.invocations, debug=config.debug, dumper=dumper)
        self.dumper = dumper
        # With a dump, names follow the directory (graph_0, graph_1, ... per dump), else the process.
        self.graph_name = name or (dumper.next_graph_name() if dumper is not None else f"graph_{next(_GRAPH_COUNTER)}")
        # Shared by the passes of every graph of this compile; "lowering" tells them the final backend.
        self.analysis: dict[str, Any] = {"lowering": self.lowering_name, "mode": mode}
        self.param_names: dict[int, str] = {}
        self.rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)

    def context(self, kind: str, example_inputs: Sequence[Any], **extra: Any) -> PassContext:
        return PassContext(
            config=self.config,
            graph_kind=kind,
            graph_name=f"{self.graph_name}.{kind}" if kind != "pre_autograd" else f"{self.graph_name}.dynamo",
            example_inputs=example_inputs,
            rank=self.rank,
            world_size=self.world_size,
            param_names=self.param_names if kind in ("joint", "forward", "pre_autograd") else {},
            analysis=self.analysis,
            **extra,
        )

    def run_dynamo_passes(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[torch.fx.GraphModule, PassContext]:
        """The ``pre_autograd`` passes on Dynamo's graph (its parameters named first); the graph and their context."""
        self.param_names = _parameter_names(gm, example_inputs)
        _annotate_parameters(gm, self.param_names)
        fill_capture_values(gm)  # Dynamo's value-less in-place calls (requires_grad_ under no_grad)
        _progress(self.graph_name, "passes on the Dynamo graph")
        ctx = self.context("pre_autograd", example_inputs)
        return self.manager.run(gm, ctx), ctx

    def compile(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        gm, _ = self.run_dynamo_passes(gm, example_inputs)
        inputs, resolvers = _with_runtime_inputs(gm, example_inputs, self.param_names)
        from torch._functorch.aot_autograd import aot_module_simplified

        _progress(self.graph_name, "AOTAutograd: tracing forward and backward")

        compiled = aot_module_simplified(
            gm,
            inputs,
            fw_compiler=functools.partial(self._compile_graph, "forward", False),
            bw_compiler=functools.partial(self._compile_graph, "backward", False),
            inference_compiler=functools.partial(self._compile_graph, "forward", True),
            partition_fn=self._partition,
            decompositions=self.decompositions,
            keep_inference_input_mutations=True,
        )
        if not resolvers:
            return compiled
        unlift_runtime_inputs(gm)  # Dynamo passes its graph's placeholders: give it back its own
        return _feeding(compiled, resolvers)

    def _partition(self, joint: torch.fx.GraphModule, joint_inputs: Sequence[Any], *, num_fwd_outputs: int, **kwargs: Any) -> Any:
        from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

        ctx = self.context("joint", joint_inputs, num_fwd_outputs=num_fwd_outputs)
        _annotate_parameters(joint, self.param_names)
        fill_capture_values(joint)  # AOTAutograd traces calls that return nothing (a stage marker) without a value
        _progress(self.graph_name, "passes on the joint graph")
        joint = self.manager.run(joint, ctx)
        if self.lowering.prepare_joint is not None:
            _progress(self.graph_name, f"{self.lowering_name}: joint-graph passes")
            joint = self.lowering.prepare_joint(joint, joint_inputs)
        _progress(self.graph_name, "partitioning")
        partition = min_cut_rematerialization_partition if self.config.partitioner == "min_cut" else default_partition
        # A joint pass may choose its own partitioner (same signature as AOTAutograd's).
        partition = self.analysis.get("partition_fn", partition)
        forward, backward = partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
        for graph in (forward, backward):  # the partitioner's RNG wrappers come without fake values
            if fill_rng_wrapper_values(graph):
                graph.recompile()
        return forward, backward

    def _compile_graph(self, kind: str, inference: bool, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        ctx = self.context(kind, example_inputs, is_inference=inference)
        if inference:
            ctx.graph_name = f"{self.graph_name}.inference"
        if kind == "forward":
            _annotate_parameters(gm, self.param_names)
        fill_capture_values(gm)  # calls that return nothing (a stage marker) come without a value, as in the joint graph
        label = "inference" if inference else kind
        if inference and self.lowering.prepare_joint is not None:
            gm = self.lowering.prepare_joint(gm, example_inputs)  # no joint graph: the forward stands in for it
        _progress(self.graph_name, f"passes on the {label} graph")
        gm = self.manager.run(gm, ctx)
        gm = self._run_required_passes(gm, ctx)
        from dscompile.backends.decompose import decompose_leftovers

        start, before = time.perf_counter(), len(gm.graph.nodes)
        decompose_leftovers(gm, self.decompositions)  # ops passes inserted after AOTAutograd's decomposition
        _progress(self.graph_name, f"lowering the {label} graph with {self.lowering_name}")
        record = PassRecord(ctx.graph_name, f"lower({self.lowering_name})", time.perf_counter() - start, before, len(gm.graph.nodes))
        record_assignment(gm, self.lowering_name, self.lowering_reason, ctx, self.dumper, record)
        compiled = self.lowering.compile(gm, example_inputs, ctx)
        _progress(self.graph_name, f"done: {label} graph")
        # A pass may wrap the lowered graph (``zero_profile`` times the first steps op by op).
        wrap = self.analysis.get("wrap_lowered", {}).pop(ctx.graph_name, None)
        compiled = wrap(gm, compiled) if wrap is not None else compiled
        collectives = graph_collectives(gm)
        # Each run of a graph with collectives adds them to the running engine's communication_stats().
        return count_graph_runs(compiled, collectives) if collectives else compiled


    def _run_required_passes(self, gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
        """The passes the lowering compiles the output of (the triton lowering: ``fuse``'s regions) that this graph's
        pipeline left out, with their default options."""
        ran = {inv.name for inv in self.manager.applicable(ctx.graph_kind)}
        for name in self.lowering.required_passes:
            info = get_pass(name)
            if name in ran or info.fn is None or ctx.graph_kind not in info.graphs:
                continue
            log.info("%s: lower(%s) needs the %s pass; running it with its defaults", ctx.graph_name, self.lowering_name, name)
            result = info.fn(gm, ctx, info.options() if info.options is not None else None)
            gm = result if result is not None else gm
            gm.recompile()
        return gm


def record_assignment(gm: torch.fx.GraphModule, lowering: str, reason: str, ctx: PassContext, dumper: Any, record: PassRecord | None = None) -> None:
    """Write what runs each node into its metadata (``lowered_by``), into ``ctx.analysis["lowering_choice"]`` and,
    with a dump, into a last step ``<graph>/<NN>_lower/`` (its ``nodes.txt`` and ``lowering.txt``)."""
    from dscompile.backends.assignment import assign_nodes, assignment_report

    counts = assign_nodes(gm, lowering)
    ctx.analysis.setdefault("lowering_choice", {})[ctx.graph_name] = {"lowering": lowering, "reason": reason, "nodes": dict(counts)}
    if dumper is not None:  # one more dump step, after the passes: the graph as the lowering gets it
        directory = dumper.dump(gm, ctx, "lower", step=dumper.next_step(ctx.graph_name), record=record)
        (directory / "lowering.txt").write_text(assignment_report(gm, lowering, reason))


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def check_mode(mode: str | None, lowering: str) -> None:
    """``torch.compile(mode=...)`` selects Inductor's option sets: honoured by the inductor lowering, refused by the others."""
    if mode is None or mode == "default":
        return
    from dscompile.errors import DSCompileConfigError, suggest

    if mode not in COMPILE_MODES:
        raise DSCompileConfigError("mode", f"{mode!r} is not a torch.compile mode", suggest(mode, COMPILE_MODES) or f"use one of {COMPILE_MODES}")
    if lowering != "inductor":
        raise DSCompileConfigError(
            "mode",
            f"mode={mode!r} selects Inductor options, but this compile lowers with {lowering!r}",
            'drop mode= or lower with Inductor ("lower": "inductor")',
        )


def _parameter_names(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> dict[int, str]:
    """Map input positions that hold parameters to readable names (Dynamo lifts them as inputs)."""
    names: dict[int, str] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for index, (node, value) in enumerate(zip(placeholders, example_inputs)):
        if isinstance(value, torch.nn.Parameter):
            names[index] = _readable_param_name(node)
    return names


def _with_runtime_inputs(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], param_names: dict[int, str]
) -> tuple[list[Any], list[Callable[[Sequence[Any]], torch.Tensor]]]:
    """The inputs AOTAutograd compiles for once passes lifted state (``lift_tensor``), and the resolvers
    that fetch that state from each call's own inputs; lifted parameters (learned mask scores) are
    named as parameters."""
    lifted = runtime_inputs(gm)
    for k, (node, tensor, _) in enumerate(lifted):
        if isinstance(tensor, torch.nn.Parameter):
            param_names[len(example_inputs) + k] = node.name
    return [*example_inputs, *(tensor for _, tensor, _ in lifted)], [resolve for _, _, resolve in lifted]


def _feeding(compiled: Callable[..., Any], resolvers: list[Callable[[Sequence[Any]], torch.Tensor]]) -> Callable[..., Any]:
    """``compiled`` called with the lifted state of this call's inputs appended."""

    @functools.wraps(compiled)
    def run(*args: Any) -> Any:
        return compiled(*args, *(resolve(args) for resolve in resolvers))

    return run


def _annotate_parameters(gm: torch.fx.GraphModule, param_names: dict[int, str]) -> None:
    """Mark parameter placeholders with ``meta["dscompile"]["param"]`` (their position is stable).

    Dynamo's graph and AOTAutograd's joint and forward graphs all take the parameters as the same
    leading inputs, so one index map serves the three.
    """
    from dscompile.graph import ds_meta

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for index, name in param_names.items():
        if index < len(placeholders):
            ds_meta(placeholders[index])["param"] = name


def _readable_param_name(node: torch.fx.Node) -> str:
    source = node.meta.get("grapharg")
    name = getattr(getattr(source, "source", None), "name", None)
    text = name() if callable(name) else (name or node.target)
    text = str(text)
    for prefix in ("L['self'].", "L_self_"):
        text = text.replace(prefix, "")
    text = text.replace("_modules['", "").replace("_parameters['", "").replace("']", "").replace("._modules", "")
    return text.replace("modules_", "").replace("_parameters_", ".")


def capture(
    module: torch.nn.Module,
    args: Sequence[Any],
    config: Any,
    invocations: Sequence[PassInvocation],
    *,
    name: str | None = None,
) -> tuple[torch.fx.GraphModule, PassContext]:
    """Capture ``module(*args)`` as one Dynamo graph (static shapes) and run ``invocations``' ``pre_autograd``
    passes on it, as the backend does, but stop there: no AOTAutograd, no lowering. For an entry that runs what
    the passes made of the whole model (the pipeline engine runs the stage graphs ``pipeline_split(cut=true)``
    leaves in ``ctx.analysis``); the graph and the passes' context come back.

    The passes find ``module`` and ``args`` in ``ctx.analysis["captured_module"]`` and ``["captured_args"]``.
    The model runs once (the captured graph, on ``args``), as a compiled model's first call does; the passes run
    after that, so a pass's exception reaches the caller as itself. ``name`` names the graph in the dump
    (``<name>.dynamo/``).
    """
    config = load_config(config)
    invocations = list(invocations)
    if pipeline_lowering(invocations) is None:  # what the passes are told the graphs will be lowered with
        invocations.append(invocation("lower", config.lower or "auto"))
    dumper = None
    if config.dump:
        from dscompile.dump import Dumper

        dumper = Dumper(config.dump)
    compiler = GraphCompiler(config, invocations, dumper, name=name)
    compiler.analysis.update(captured_module=module, captured_args=tuple(args))
    captured: dict[str, Any] = {}

    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        captured["gm"], captured["inputs"] = gm, list(example_inputs)
        return gm.forward

    log.info("%s: capture with pipeline %s", compiler.graph_name, ",".join(inv.spec() for inv in invocations))
    torch.compile(module, backend=backend, fullgraph=True, dynamic=False)(*args)
    if "gm" not in captured:
        raise RuntimeError(f"Dynamo captured no graph of {type(module).__name__} (its forward ran without being traced)")
    # The passes run once Dynamo is done, outside its compile (whose global state they must not see): measured, the
    # stage graphs the pipeline pass cuts inside a backend call compile to different rounding than those cut after it.
    gm, ctx = compiler.run_dynamo_passes(captured["gm"], captured["inputs"])
    return gm, ctx


def dscompile_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    options: Any = None,
    mode: str | None = None,
    **unexpected: Any,
) -> Callable[..., Any]:
    """The torch.compile backend registered as ``"dscompile"``.

    ``options`` is a DeepSpeed-style config dict, ``{"config": "ds_config.json"}``, a DSConfig, or
    ``{"pipeline": "pass(opt=1),...,lower(eager)"}``; an engine gives a ``planner.PlannedConfig`` (its config and
    its plan, which the config rules then read). ``mode`` is torch.compile's: with the inductor
    lowering its option set (``torch._inductor.list_mode_options``: CUDA graphs for
    ``"reduce-overhead"``, autotuning for ``"max-autotune"``) applies to every graph's Inductor
    compile; the other lowerings refuse a mode other than ``"default"``.
    """
    if unexpected:
        from dscompile.errors import DSCompileConfigError

        raise DSCompileConfigError(next(iter(unexpected)), "is not an argument of the dscompile backend", "pass settings inside options={...}")
    plan = None
    if isinstance(options, PlannedConfig):  # an engine's: the passes read its plan
        options, plan = options.config, options.plan
    config = load_config(options)
    tp = config.sections.get("tensor_parallel")
    engine_only = {
        "tensor_parallel": (tp is not None and getattr(tp, "enabled", False), "splits the model's parameters, which only an engine can own"),
        "sequence_parallel_size": (
            int(config.sections.get("sequence_parallel_size") or 1) > 1,
            "splits every batch's sequence across ranks, which only an engine can feed",
        ),
    }
    for key, (on, why) in engine_only.items():
        if on:
            from dscompile.errors import DSCompileConfigError

            raise DSCompileConfigError(key, why, "use dscompile.initialize(model=..., config=...)")
    with compiling_under(plan):
        invocations = pipeline_from_config(config)
    dumper = None
    if config.dump:
        from dscompile.dump import Dumper

        dumper = Dumper(config.dump)
    compiler = GraphCompiler(config, invocations, dumper, mode)
    log.info("%s: pipeline %s", compiler.graph_name, ",".join(inv.spec() for inv in invocations))
    return compiler.compile(gm, example_inputs)
