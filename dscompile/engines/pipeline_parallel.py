"""``PipelineEngine``: DeepSpeed's pipeline engine API over stages cut from the captured graph.

    engine = PipelineEngine(model, config, optimizer)      # config has a "pipeline" section
    loss = engine.train_batch(data_iter)                   # micro_batches x next(data_iter)
    engine.eval_batch(data_iter)

``model(*micro_batch)`` must return the loss (or pass ``loss_fn``: ``loss_fn(model(*batch[:-1]),
batch[-1])``). On the first batch (or at construction with ``example_batch=``) the model is
captured whole through the frontend (``dscompile.frontend.capture``) with the ``pipeline_split`` pass
in its pipeline, which partitions the graph and cuts the stages (``passes/pipeline_split/``); the
engine receives them as data (a ``StagedProgram``), as ``torch.distributed.pipelining``'s schedules
receive its IR. Each rank keeps only its stages (their parameters; the others are freed), compiles them with the
dscompile backend and runs its schedule. Ranks are laid out as DeepSpeed's pipeline topology lays them
out (``dscompile.planner.ParallelLayout``: ``rank = stage * data_parallel_size + data_parallel_rank``
without tensor parallelism, whose ranks are innermost); gradients are averaged over the data-parallel group and summed over the ranks that
share a tied parameter. With ``zero_optimization.stage`` 1 the optimizer states of each stage are
partitioned across its data-parallel replicas (each steps its share, then broadcasts it), as
DeepSpeed's ZeRO-1 does across pipelines; stages 2 and 3 are refused, as in DeepSpeed.
``dscompile.initialize`` returns this engine for a config with a ``pipeline`` section. Every
rank consumes ``micro_batches`` items of its ``data_iter`` per
``train_batch`` (ranks that read no inputs may pass None once the engine is built).

The optimizer step is the training core's (``dscompile.runtime.training_core``), so every engine
extension works here as in ``DSCompileEngine``: fp16 loss scaling (the loss gradient that seeds
backward on the last stage carries the scale; an overflow on any stage skips the step on every
rank), ``communication_data_type``, ``wall_clock_breakdown`` (forward, backward and p2p-wait time
summed from the schedule's timeline, and the step) and ``memory_breakdown`` (after the schedule and
after the step), ``communication_stats()`` (p2p, replica and tied reductions). Gradient reduction
across tied stages and replicas, and ZeRO-1 across pipelines, are its gradient strategy
(``runtime/pipeline_gradients.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
import types
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
from torch import nn

from dscompile.config import DSConfig, load_config
from dscompile.errors import DSCompileConfigError
from dscompile.frontend import capture
from dscompile.graph import fill_capture_values
from dscompile.pipeline import PassContext, PassInvocation, PassManager, invocation
from dscompile.planner import PlannedConfig, plan_parallel
from dscompile.runtime.checkpoint_io import CheckpointError, CheckpointReader, CheckpointWriter, read_latest, resolve_checkpoint_dir
from dscompile.runtime.comm_stats import collecting
from dscompile.runtime.devices import accelerator_devices, capture_rng, collective_device, forked_rng, restore_rng
from dscompile.runtime.engine_core import world_info, wrapped_module_attribute
from dscompile.runtime.pipeline_executor import Timeline, run_actions, run_forward_only
from dscompile.runtime.pipeline_gradients import PipelineGradients
from dscompile.runtime.pipeline_p2p import P2P
from dscompile.runtime.pipeline_schedules import build_schedule
from dscompile.runtime.process_groups import ProcessGroups, build_process_groups
from dscompile.runtime.sixteen_bit import upcast_low_precision
from dscompile.runtime.tensor_parallel import broadcast_in_tp_group, gather_slices, slicing_metadata
from dscompile.runtime.tensor_parallel_checkpoint import cut_to_rank, join_tp_ranks, specs_of
from dscompile.runtime.training_core import TrainingCore, params_or_error, write_16bit_state
from dscompile.runtime.zero_checkpoint import FullState, _load_full_optimizer, optimizer_param_names
from dscompile.runtime.zero_shard import collective_failures_explained

log = logging.getLogger("dscompile.pipeline_engine")


_MP_RANK = re.compile(r"^pipe_stage_\d+_mp_rank_(\d+)_model_states\.pt$")


def refuse_sequence_parallel(tc: Any) -> None:
    """Megatron's sequence parallelism (``tensor_parallel.sequence_parallel``) inside pipeline stages is not built."""
    if tc is not None and tc.enabled and tc.sequence_parallel:
        raise DSCompileConfigError(
            "tensor_parallel.sequence_parallel",
            "sequence parallelism with pipeline stages is not built (the stages would pass sequence chunks between them)",
            "set tensor_parallel.sequence_parallel to false, or remove the pipeline section",
        )


def check_pipeline_world(world_size: int, stages: int, tp_size: int = 1) -> None:
    """Ranks form ``world_size / (stages * tp_size)`` pipelines of ``stages`` TP groups: the division must be exact."""
    if world_size % (stages * tp_size):
        per_pipeline = f"{stages} pipeline stages" + (f" × tensor-parallel size {tp_size}" if tp_size > 1 else "")
        raise DSCompileConfigError(
            "pipeline.stages",
            f"world size {world_size} is not divisible by {per_pipeline}",
            f"launch a multiple of {stages * tp_size} processes or change pipeline.stages" + (" or tensor_parallel.autotp_size" if tp_size > 1 else ""),
        )


class _WithLoss(nn.Module):
    """``loss_fn(model(*inputs), labels)`` as one module, so the loss is part of the graph."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *batch: Any) -> torch.Tensor:
        return self.loss_fn(self.model(*batch[:-1]), batch[-1])


def capture_graph(module: nn.Module, example_args: Sequence[Any]) -> tuple[torch.fx.GraphModule, set[torch.fx.Node]]:
    """The whole forward as one graph whose parameters and buffers are ``get_attr`` of ``module``, and its trainable
    parameter nodes: the frontend's capture (``dscompile.frontend.capture``, no pass) in the form the pipeline pass
    cuts (``attribute_graph``). For inspecting the partitioner by hand; the engine runs the pass instead."""
    from dscompile.passes.pipeline_split import attribute_graph

    gm, ctx = capture(module, tuple(example_args), {}, [])
    return attribute_graph(gm, module, ctx.example_inputs, tuple(example_args))


def _writable(inputs: list[Any], every_tensor: bool) -> list[Any]:
    """Copies the stage may modify in place: of the received activations that require grad (leaf
    tensors, which autograd forbids modifying in place; a copy is not a leaf and its gradient
    still reaches the leaf), and with ``every_tensor`` of all tensors (a recomputed stage must
    start again from unmodified inputs). DeepSpeed's engine copies received activations too."""
    return [t.clone() if isinstance(t, torch.Tensor) and (every_tensor or t.requires_grad) else t for t in inputs]


class GraphStageRunner:
    """Runs one stage GraphModule per micro-batch, keeping what its backward needs.

    With ``checkpoint`` the forward keeps only its inputs (and RNG state) and is recomputed in
    backward. The stage always runs on copies of its inputs where it could otherwise modify them
    in place (a stage starting with ``ReLU(inplace=True)``): see ``_writable``.
    """

    def __init__(self, fn: Callable[..., Any], checkpoint: bool = False) -> None:
        self.fn = fn
        self.checkpoint = checkpoint
        self.saved: dict[int, Any] = {}

    def forward(self, micro_batch: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        if not torch.is_grad_enabled():
            return list(self.fn(*inputs))
        if self.checkpoint:
            rng = capture_rng(accelerator_devices(inputs))  # CPU and the inputs' GPU generators
            with torch.no_grad():
                outputs = list(self.fn(*_writable(inputs, every_tensor=True)))
            self.saved[micro_batch] = (inputs, None, rng)
            return outputs
        outputs = list(self.fn(*_writable(inputs, every_tensor=False)))
        self.saved[micro_batch] = (inputs, outputs, None)
        return [o.detach() if isinstance(o, torch.Tensor) else o for o in outputs]

    def backward(self, micro_batch: int, output_grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        inputs, outputs, rng = self.saved.pop(micro_batch)
        if outputs is None:
            with forked_rng(list(rng.devices)):
                restore_rng(rng)
                outputs = list(self.fn(*_writable(inputs, every_tensor=False)))
        pairs = [(o, g) for o, g in zip(outputs, output_grads) if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return [t.grad if isinstance(t, torch.Tensor) and t.requires_grad else None for t in inputs]


class PipelineEngine(TrainingCore):
    """Pipeline-parallel (optionally x data-parallel) training of a model on this rank's stages."""

    runs_pipeline = True

    def __getattr__(self, name: str) -> Any:
        """What the engine lacks is the wrapped model's, as DeepSpeed's engine."""
        return wrapped_module_attribute(self, name)

    def __init__(
        self,
        model: nn.Module,
        config: Any,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        *,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        example_batch: Sequence[Any] | None = None,
    ) -> None:
        config = load_config(config)
        pcfg = config.sections.get("pipeline_parallel")
        if pcfg is None:
            raise DSCompileConfigError("pipeline", "PipelineEngine needs a 'pipeline' section", 'add "pipeline": {"stages": N}')
        self.pcfg = pcfg
        self.world_size, self.global_rank = world_info()
        self.num_stages = pcfg.stages
        tc = config.sections.get("tensor_parallel")  # passes/tensor_parallel/config.py's TensorParallelConfig
        self.tensor_parallel: Any = tc if tc is not None and tc.enabled else None
        self.tp_size = tc.autotp_size if self.tensor_parallel is not None else 1
        refuse_sequence_parallel(self.tensor_parallel)
        check_pipeline_world(self.world_size, self.num_stages, self.tp_size)
        # the one plan: its rank layout (TP innermost, its ranks consecutive, then data-parallel replicas, then stages)
        # and the ZeRO stage (stages 2 and 3 refused, as DeepSpeed does; stage 1 is the gradient strategy's)
        plan = plan_parallel(config, self.world_size, self.tp_size)
        self.zero_stage = plan.zero_stage
        self.layout = plan.layout
        self.stage_id, self.dp_id, self.tp_rank = self.layout.coordinates(self.global_rank)
        self.dp_size = self.layout.dp_size
        self.chunks = pcfg.virtual_stages or 1
        gas = config.gradient_accumulation_steps
        if pcfg.micro_batches is not None and gas not in (None, 1, pcfg.micro_batches):
            raise DSCompileConfigError("pipeline.micro_batches", f"{pcfg.micro_batches} contradicts gradient_accumulation_steps {gas}", "set only one of them")
        self.micro_batches = pcfg.micro_batches or gas or 1
        if pcfg.schedule == "interleaved_1f1b" and self.micro_batches % self.num_stages:
            raise DSCompileConfigError(
                "pipeline.micro_batches", f"interleaved_1f1b needs micro_batches ({self.micro_batches}) divisible by stages ({self.num_stages})"
            )
        self.module = model
        self.root: nn.Module = _WithLoss(model, loss_fn) if loss_fn is not None else model
        self._strip = "model." if loss_fn is not None else ""
        params_or_error(model, needs_training=True)
        self.init_core(config, optimizer, lr_scheduler, plan)
        self.program: Any = None
        self.facts: Any = None
        self.last_timeline: Timeline | None = None
        self.last_batch_seconds = 0.0
        self._pending_load: tuple[Any, ...] | None = None
        self.training_dataloader: Any = None
        self.data_iterator: Iterator[Any] | None = None
        if self.world_size > 1:
            with torch.no_grad():
                for t in list(model.parameters()) + list(model.buffers()):
                    dist.broadcast(t, src=0)
        # Only the TP groups of this layout serve here: its data-parallel groups span stages, so it is not the
        # engine's ``process_groups`` (which the engine core and ZeRO read for the data-parallel group).
        self.tp_groups: ProcessGroups | None = build_process_groups(self.tp_size) if self.tp_size > 1 else None
        self.tensor_parallel_plan: Any = None
        self.gradients: PipelineGradients = PipelineGradients(layout=self.layout, global_rank=self.global_rank, zero_stage=self.zero_stage)
        self.configure_extensions(self._stage_config())  # ZeRO-1 across pipelines is the strategy's, not the ZeRO extension's
        if example_batch is not None:
            self._build(example_batch)

    # -- layout --------------------------------------------------------------------------------
    def rank_of_stage(self, stage: int) -> int:
        """Global rank holding model stage ``stage`` in this rank's pipeline (at this rank's TP rank)."""
        return self.layout.rank_of(stage % self.num_stages, self.dp_id, self.tp_rank)

    @property
    def local_stages(self) -> list[int]:
        return [s for s in range(self.num_stages * self.chunks) if s % self.num_stages == self.stage_id]

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    # -- DeepSpeed's pipeline-mode API ---------------------------------------------------------
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step (DeepSpeed's name for them)."""
        return self.micro_batches

    def data_parallel_world_size(self) -> int:
        return self.dp_size

    def set_dataloader(self, loader: Any) -> None:
        """Draw ``train_batch()``'s micro-batches from ``loader`` (``initialize(training_data=...)`` sets one)."""
        self.training_dataloader = loader
        self.data_iterator = iter(loader) if loader is not None else None

    def set_dataiterator(self, iterator: Iterator[Any] | None) -> None:
        """Draw ``train_batch()``'s micro-batches from ``iterator`` from now on (as DeepSpeed's engine does)."""
        self.training_dataloader = None
        self.data_iterator = iterator

    def release_compiled(self) -> None:
        """``destroy()``: drop the stage graphs and their runners."""
        self.runners = {}
        self.program = None
        self.data_iterator = None

    def _only_train_batch(self, name: str) -> RuntimeError:
        return RuntimeError(
            f"PipelineEngine.{name}(): in pipeline mode one call runs forward, backward and the step of every "
            "micro-batch; use engine.train_batch(data_iter) (or eval_batch) instead, as with DeepSpeed's PipelineEngine"
        )

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise self._only_train_batch("__call__")

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise self._only_train_batch("forward")

    def backward(self, *args: Any, **kwargs: Any) -> None:
        raise self._only_train_batch("backward")

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise self._only_train_batch("step")

    # -- building the stages -------------------------------------------------------------------
    def _build(self, example: Sequence[Any]) -> None:
        """Capture the model through the frontend with the ``pipeline_split`` pass in the pipeline; the pass decides and
        cuts the stages, and this engine runs the ``StagedProgram`` it leaves in the pass context."""
        example = tuple(example)
        cfg = self.pcfg
        split = invocation(
            "pipeline_split",
            stages=self.num_stages * self.chunks,
            method=cfg.partition_method,
            split_points=list(cfg.split_points),
            memory_weight=cfg.cost_memory_weight,
            flops_per_byte=cfg.cost_flops_per_byte,
            strip=self._strip,
            cut=True,
        )
        config = self.config if self.global_rank == 0 else dataclasses.replace(self.config, dump=None)  # rank 0 dumps
        if self.tp_groups is not None:
            analysis = self._split_tensor_parallel(example, config, split)
        else:
            _, ctx = capture(self.root, example, config, [split], name="pipeline")
            analysis = ctx.analysis
        self.program = analysis["pipeline_program"]
        self.facts = self.program.facts
        if config.dump:
            self._dump()
        owners: dict[int, set[int]] = {}
        by_id: dict[int, nn.Parameter] = {}
        for spec in self.program.stages:
            for p in spec.module.parameters():
                owners.setdefault(id(p), set()).add(spec.index % self.num_stages)
                by_id[id(p)] = p
        mine = {pid for pid, ranks in owners.items() if self.stage_id in ranks}
        self._params = [p for pid, p in by_id.items() if pid in mine and p.requires_grad]
        self._owned_ids = mine
        names = {}
        for name, p in self.root.named_parameters():
            names.setdefault(id(p), name[len(self._strip) :] if name.startswith(self._strip) else name)
        self._opt_params = self.gradients.bind(self._params, names, owners, by_id)
        with torch.no_grad():
            for p in self.root.parameters():
                if id(p) not in mine:
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)  # another rank's stage
        checkpoint = self.pcfg.activation_checkpoint_interval > 0
        self.runners = {}
        options = PlannedConfig(self._stage_config(), self.plan)  # the stages compile under the engine's plan as it is now
        for s in self.local_stages:
            module = self.program.stages[s].module
            fn = torch.compile(module, backend="dscompile", options=options, dynamic=False) if self.pcfg.compile else module
            self.runners[s] = GraphStageRunner(fn, checkpoint)
        self._filter_optimizer()
        log.info("rank %d: stages %s, %d parameters", self.global_rank, self.local_stages, sum(p.numel() for p in self._params))
        if self._pending_load is not None:
            args, self._pending_load = self._pending_load, None
            self.load_checkpoint(*args)

    def _split_tensor_parallel(self, example: tuple[Any, ...], config: DSConfig, split: PassInvocation) -> dict[str, Any]:
        """The whole model captured and split by the tensor-parallel pass (its parameters sliced in place), then the
        ``pipeline_split`` pass run on that graph: each stage runs its slice of every block on its TP group. The
        tensor-parallel split still captures with ``torch.export`` itself, outside the frontend (issue 34)."""
        from dscompile.passes.tensor_parallel import parallelize

        assert self.tp_groups is not None and self.tensor_parallel is not None
        broadcast_in_tp_group(example, self.tp_groups)
        gm, plan = parallelize(self.root, example, {}, self.tp_groups, self.tensor_parallel)
        self.tensor_parallel_plan = plan
        self.gradients.tp_sliced = {id(self.root.get_parameter(name)) for name in plan.slices}
        self.gradients.tp_replicas = {id(self.root.get_parameter(name)): spec.replicas for name, spec in plan.slices.items() if spec.replicas > 1}
        # the exported graph holds the model's (sliced) parameters and its own buffers and constants: the stages own them from it
        ctx = PassContext(
            config=config,
            graph_kind="pre_autograd",
            graph_name="pipeline.export",
            example_inputs=example,
            rank=self.global_rank,
            world_size=self.world_size,
            analysis={"captured_module": gm, "captured_args": example},
        )
        dumper = None
        if config.dump:
            from dscompile.dump import Dumper

            dumper = Dumper(config.dump)
        fill_capture_values(gm)  # export's input-guard call (_guards_fn) and any stage marker: calls that return None
        PassManager([split], debug=config.debug, dumper=dumper).run(gm, ctx)
        return ctx.analysis

    def _stage_config(self) -> DSConfig:
        """The config the stage graphs compile with (under the engine's plan): ZeRO-1 is the engine's job here, not a
        graph pass (the plan's schedule is stage 1 or 0: no ZeRO pass either), and tensor parallelism has already split
        the graph the stages are cut from."""
        from dscompile.passes.tensor_parallel import split_graph_sections

        sections = split_graph_sections({k: v for k, v in self.config.sections.items() if k != "zero_optimization"})
        return dataclasses.replace(self.config, sections=sections)

    @property
    def zero1_sharded(self) -> bool:
        """True when ZeRO-1 partitions this stage's optimizer states across data-parallel replicas."""
        return self.gradients.zero1_sharded

    def _filter_optimizer(self) -> None:
        if self.optimizer is None and self.config.optimizer is not None:
            from dscompile.runtime.optimizers import build_optimizer

            self.optimizer = build_optimizer(self.config.optimizer, self._opt_params)
            if self.lr_scheduler is None and self.config.scheduler is not None:
                from dscompile.runtime.schedulers import build_scheduler

                self.lr_scheduler = build_scheduler(self.config.scheduler, self.optimizer)
            return
        if self.optimizer is None:
            return
        if self.optimizer.state:
            raise DSCompileConfigError("optimizer", "already holds state; the pipeline engine must partition it before the first step")
        mine = {id(p) for p in self._opt_params}
        for group in self.optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in mine]  # in place: the caller's object stays valid

    def _dump(self) -> None:
        """Next to the pass's own dump of the captured graph (``pipeline.dynamo/``, stages annotated): the plan's table
        and each stage graph it cut."""
        root = Path(self.config.dump)
        root.mkdir(parents=True, exist_ok=True)
        (root / "pipeline_stages.txt").write_text(self.program.describe())
        for spec in self.program.stages:
            (root / f"pipeline_stage_{spec.index}.py").write_text(spec.module.print_readable(print_output=False))

    # -- training ------------------------------------------------------------------------------
    def _fetch(self, data_iter: Iterator[Any] | None) -> list[Sequence[Any]] | None:
        """``micro_batches`` items of ``data_iter``, or of the iterator set before (DeepSpeed's rule:
        a given iterator is kept for later calls); 16-bit inputs upcast (``runtime/sixteen_bit.py``)."""
        if self.destroyed:
            raise RuntimeError("this engine was destroyed (engine.destroy()); build a new one to train again")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        if self.data_iterator is None:
            return None
        batches = []
        for _ in range(self.micro_batches):
            item = next(self.data_iterator)
            batch = tuple(item) if isinstance(item, (tuple, list)) else (item,)
            batches.append(upcast_low_precision(batch) if self.compute_dtype is not None else batch)
        if self.tp_groups is not None:
            for batch in batches:
                broadcast_in_tp_group(batch, self.tp_groups)
        return batches

    def prepare(self, example_batch: Sequence[Any]) -> None:
        """Capture, partition and compile now from one micro-batch (otherwise the first
        ``train_batch`` does it); a no-op once built. Call it before ``load_checkpoint`` to restore
        the step count before the first batch is drawn."""
        if self.program is None:
            self._build(tuple(example_batch) if isinstance(example_batch, (tuple, list)) else (example_batch,))

    def _ensure_built(self, batches: list[Sequence[Any]] | None) -> None:
        if self.program is None:
            if batches is None:
                raise RuntimeError("PipelineEngine: the first train_batch/eval_batch needs a data_iter on every rank (or pass example_batch=)")
            self._build(batches[0])

    @collective_failures_explained("PipelineEngine.train_batch()")
    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """One optimizer step over ``micro_batches`` micro-batches; the mean loss (same on every rank)."""
        batches = self._fetch(data_iter)
        self._ensure_built(batches)
        if self.optimizer is None:
            raise RuntimeError("PipelineEngine.train_batch: no optimizer; pass optimizer= or set 'optimizer' in the config")
        if self.world_size > 1:
            dist.barrier()
        begin = time.perf_counter()
        self.tput_timer.start()
        actions = [a for a in build_schedule(self.pcfg.schedule, self.stage_id, self.num_stages, self.micro_batches, self.chunks)]
        p2p = P2P(self.global_rank, self._comm_device())
        self._hook("before_forward")
        # The last stage seeds backward with d(loss / micro_batches)/d(loss), times the loss scale (fp16).
        seed = self.loss_gradient_seed(1.0 / self.micro_batches)
        with self.memory.phase("schedule"), collecting(self.comm_stats):
            losses, timeline = run_actions(actions, self.program.stages, self.runners, p2p, self.rank_of_stage, batches, self.program.loss, seed)
        self._hook("after_forward")
        self._hook("after_backward")
        self.last_timeline = timeline
        self.micro_steps += self.micro_batches
        for kind, phase in (("F", "forward"), ("B", "backward")):
            self.timers.add(phase, sum(e.end - e.start for e in timeline.entries if e.action.kind == kind))
        self.timers.add("p2p_wait", sum(e.start - e.wait_start for e in timeline.entries))
        with self.phase("step"):
            self.optimizer_step()
        loss = self._mean_loss(losses)
        self.last_batch_seconds = time.perf_counter() - begin
        self.end_optimizer_step(speak=self.dp_id == 0)
        self.tput_timer.stop(global_step=True, report_speed=self.global_rank == 0)
        return loss

    @collective_failures_explained("PipelineEngine.eval_batch()")
    def eval_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """Forward only over ``micro_batches`` micro-batches; the mean loss (same on every rank)."""
        batches = self._fetch(data_iter)
        self._ensure_built(batches)
        p2p = P2P(self.global_rank, self._comm_device())
        self._hook("before_forward")
        with collecting(self.comm_stats):
            losses = run_forward_only(
                self.program.stages, self.local_stages, self.runners, p2p, self.rank_of_stage, batches, self.program.loss, self.micro_batches
            )
        self._hook("after_forward")
        return self._mean_loss(losses)

    def _comm_device(self) -> torch.device:
        """Where this rank's activations, gradients and reductions travel: its parameters' device if the backend serves it."""
        return collective_device(like=self._params[0] if self._params else None)

    def _mean_loss(self, losses: dict[int, torch.Tensor]) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64, device=self._comm_device())
        if losses:
            total = torch.stack([losses[i].double() for i in sorted(losses)]).mean()
        if self.world_size > 1:
            dist.all_reduce(total)  # only the last stage of each pipeline contributes (once per TP rank)
            total /= self.dp_size * self.tp_size
        return total.float()

    # -- state ---------------------------------------------------------------------------------
    def stage_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's parameters by the model's own names (detached copies). With tensor parallelism the
        slices are gathered from the TP group (a collective on it): full tensors, as without it."""
        slices = self.tensor_parallel_plan.slices if self.tensor_parallel_plan is not None else {}
        out: dict[str, torch.Tensor] = {}
        for name, p in self.root.named_parameters():
            if id(p) in self._owned_ids:
                value = p.detach().clone()
                if name in slices:
                    assert self.tp_groups is not None
                    value = slices[name].assemble(gather_slices(value, self.tp_groups))
                out[name[len(self._strip) :] if name.startswith(self._strip) else name] = value
        return out

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        """One consolidated file on rank 0, DeepSpeed's layout: ``torch.save`` of the model's full
        ``state_dict`` (its own names, tied names included) in the training precision.

        Every stage's parameters and buffers are gathered from the ranks of data-parallel replica 0
        (each rank holds only its stages). A collective on every rank; returns True.
        """
        if self.program is None:
            raise RuntimeError("save_16bit_model before the first train_batch: nothing is partitioned yet")
        slices = self.tensor_parallel_plan.slices if self.tensor_parallel_plan is not None else {}
        names: dict[int, list[str]] = {}
        by_id: dict[int, torch.Tensor] = {}
        for name, t in [*self.root.named_parameters(remove_duplicate=False), *self.root.named_buffers(remove_duplicate=False)]:
            names.setdefault(id(t), []).append(name[len(self._strip) :] if name.startswith(self._strip) else name)
            by_id[id(t)] = t
        owned = set(self._owned_ids)
        for s in self.local_stages:
            owned.update(id(b) for b in self.program.stages[s].module.buffers())
        mine: dict[str, torch.Tensor] = {}
        if self.dp_id == 0:
            root_names = {id(t): name for name, t in self.root.named_parameters(remove_duplicate=False) if name in slices}
            for pid in sorted(owned & by_id.keys(), key=lambda i: names[i][0]):  # one order on every TP rank: gathers pair up
                value = by_id[pid].detach()
                if pid in root_names:  # a tensor-parallel slice: the whole tensor from the TP group's slices
                    assert self.tp_groups is not None
                    value = slices[root_names[pid]].assemble(gather_slices(value, self.tp_groups))
                for name in names[pid]:
                    mine[name] = value.to("cpu", copy=True)  # pickled for the gather: host copies
        pieces: list[Any] = [mine]
        if self.world_size > 1:
            pieces = [None] * self.world_size if self.global_rank == 0 else []
            dist.gather_object(mine, pieces if self.global_rank == 0 else None, dst=0)
        if self.global_rank == 0:
            state = {k: v.detach().to("cpu", copy=True) for k, v in self.module.state_dict().items()}
            for piece in pieces:
                state.update(piece)
            write_16bit_state(state, self.compute_dtype, save_dir, save_filename)
        if self.world_size > 1:
            dist.barrier()
        return True

    def idle_fraction(self) -> float:
        return self.last_timeline.idle_fraction() if self.last_timeline else 0.0

    def save_checkpoint(self, save_dir: str | os.PathLike, tag: str | None = None, client_state: dict | None = None) -> Path:
        """Per stage ``pipe_stage_NN_model_states.pt`` (by parameter name) and per pipeline rank
        ``pipe_rank_NN_states.pt`` (optimizer, scheduler, counters); data-parallel rank 0 writes. With tensor
        parallelism each TP rank writes its slices' set, named ``..._mp_rank_TT_...`` as DeepSpeed names them."""
        if self.program is None:
            raise RuntimeError("save_checkpoint before the first train_batch: nothing is partitioned yet")
        tag = tag or f"global_step{self.global_steps}"
        self.validate_checkpoint_tag(str(tag))
        # Every rank writes into a staging directory; committed (manifest, rename, 'latest' last) only when all succeeded.
        with CheckpointWriter(save_dir, str(tag)) as ckpt:
            if self.dp_id == 0:
                for s in self.local_stages:
                    spec = self.program.stages[s]
                    state = {name: t.detach() for name, t in spec.module.state_dict().items()}
                    ckpt.save(state, self._stage_file(s))
                ckpt.save(
                    {
                        "optimizer": self.optimizer.state_dict() if self.optimizer is not None and not self.zero1_sharded else None,
                        "zero1_replicas": self.dp_size if self.zero1_sharded else 0,
                        "bounds": self.program.plan.bounds,
                        "tp_size": self.tp_size,
                        # what loading at another TP size needs: the optimizer's positions by name, the slicing
                        "optimizer_param_names": optimizer_param_names(self._named_view()) if not self.zero1_sharded else None,
                        "tensor_parallel": slicing_metadata(self.tp_groups, self.tensor_parallel_plan.slices) if self.tp_groups is not None else None,
                        **self.core_state_dict(client_state),  # scheduler, counters, extensions (loss scaler)
                    },
                    self._rank_file(),
                )
            if self.zero1_sharded and self.optimizer is not None:  # each replica's shard of the optimizer states
                ckpt.save(self.optimizer.state_dict(), self._zero1_optim_file())
        return ckpt.directory

    def _mp(self) -> str:
        """The TP rank's part of a file name (none without tensor parallelism: the layout before it)."""
        return f"_mp_rank_{self.tp_rank:02d}" if self.tp_size > 1 else ""

    def _stage_file(self, stage: int) -> str:
        return f"pipe_stage_{stage:02d}{self._mp()}_model_states.pt"

    def _rank_file(self) -> str:
        return f"pipe_rank_{self.stage_id:02d}{self._mp()}_states.pt"

    def _zero1_optim_file(self) -> str:
        return f"pipe_rank_{self.stage_id:02d}{self._mp()}_dp_{self.dp_id:02d}_optim_states.pt"

    def _load_optimizer(self, reader: CheckpointReader, state: dict) -> None:
        """The optimizer states as saved: whole per stage, or (ZeRO-1) this replica's shard."""
        directory = reader.directory
        if self.zero1_sharded and state.get("zero1_replicas") == self.dp_size and reader.has(self._zero1_optim_file()):
            self.optimizer.load_state_dict(reader.load(self._zero1_optim_file()))
        elif not self.zero1_sharded and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        else:
            saved = state.get("zero1_replicas", 0)
            log.warning(
                "checkpoint %s has no optimizer states for this layout (ZeRO-1 shards saved over %d replicas, %d now): loaded the weights only",
                directory,
                saved,
                self.dp_size if self.zero1_sharded else 0,
            )

    def _named_view(self) -> Any:
        """This engine as the checkpoint helpers see one: its optimizer, no ZeRO, parameters by the stage files' names."""
        return types.SimpleNamespace(optimizer=self.optimizer, zero=None, module=self.root)

    def _saved_tp_rank(self, reader: CheckpointReader, saved_tp: int, tp_rank: int) -> tuple[FullState, dict | None]:
        """Everything TP rank ``tp_rank`` of a ``saved_tp`` checkpoint saved, over all its stages: its tensors by name
        (every stage file's), the optimizer states of every stage's parameters by name, and one rank file's state."""
        mp = f"_mp_rank_{tp_rank:02d}" if saved_tp > 1 else ""
        tensors: dict[str, torch.Tensor] = {}
        optimizer: dict[str, dict[str, Any]] | None = {}
        groups: list[dict[str, Any]] | None = None
        first: dict | None = None
        for name in sorted(reader.names()):
            if re.fullmatch(rf"pipe_stage_\d+{mp}_model_states\.pt", name):
                tensors.update(reader.load(name, weights_only=True))
            elif re.fullmatch(rf"pipe_rank_\d+{mp}_states\.pt", name):
                state = reader.load(name)
                first = first or state
                names, saved_opt = state.get("optimizer_param_names"), state.get("optimizer")
                if optimizer is None or names is None or saved_opt is None:
                    optimizer = None  # ZeRO-1 shards (or an older file): no optimizer states by name
                    continue
                order = [i for g in saved_opt["param_groups"] for i in g["params"]]
                by_index = dict(zip(order, names, strict=True))
                optimizer.update({by_index[i]: dict(entries) for i, entries in saved_opt["state"].items()})
                groups = groups or [{k: v for k, v in g.items() if k != "params"} for g in saved_opt["param_groups"]]  # hyper-parameters
        return FullState(source="", params=tensors, optimizer=optimizer, param_groups=groups), first

    def _load_across_tp(self, reader: CheckpointReader, saved_tp: int, load_optimizer_states: bool) -> tuple[str | None, dict | None]:
        """A checkpoint of another TP size: every saved TP rank's stages read, their slices joined by the saved
        slicing (``tensor_parallel_checkpoint.join_tp_ranks``), then cut to this rank's (``cut_to_rank``), weights
        and optimizer states by parameter name, so the stage partition may differ too."""
        directory = reader.directory
        ranks = [self._saved_tp_rank(reader, saved_tp, t) for t in range(saved_tp)]
        state = ranks[0][1]
        if state is None:
            raise CheckpointError(f"{directory} has no pipe_rank_* states file for TP rank 0")
        meta = state.get("tensor_parallel")
        if saved_tp > 1 and meta is None:
            raise CheckpointError(
                f"{directory} holds the stages of tensor-parallel size {saved_tp} without their slicing (saved by an older dscompile): "
                f"resume it at tensor_parallel.autotp_size {saved_tp}"
            )
        full = join_tp_ranks([r for r, _ in ranks], specs_of(meta) if meta else {}, f"pipeline checkpoint at TP={saved_tp}")
        live: dict[str, torch.Tensor] = {}
        for s in self.local_stages:
            live.update(self.program.stages[s].module.state_dict())
        specs = self.tensor_parallel_plan.slices if self.tensor_parallel_plan is not None else {}
        mine = cut_to_rank(dataclasses.replace(full, params={n: v for n, v in full.params.items() if n in live}), live, specs, self.tp_rank, self.tp_size)
        with torch.no_grad():
            for name, t in live.items():
                if name not in mine.params:
                    raise KeyError(f"checkpoint {directory} has no tensor {name!r} for stages {self.local_stages}")
                t.copy_(mine.params[name])
        if load_optimizer_states and self.optimizer is not None:
            if mine.optimizer is None:
                log.warning("checkpoint %s has no optimizer states by parameter name (ZeRO-1 shards): loaded the weights only", directory)
            else:
                _load_full_optimizer(self._named_view(), mine, None)
        self.load_core_state_dict(state)
        log.info("rank %d: loaded %s saved at TP=%d into TP=%d", self.global_rank, directory, saved_tp, self.tp_size)
        return str(directory), state["client_state"]

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: str | None = None, load_optimizer_states: bool = True) -> tuple[str | None, dict | None]:
        """Restore parameters by name from every stage file (so another stage count works for the
        weights); optimizer and counters only when the partition is the same. A checkpoint of another
        tensor-parallel size (TP=1 included) is joined and re-cut by name, optimizer states too (``_load_across_tp``)."""
        if self.program is None:
            self._pending_load = (load_dir, tag, load_optimizer_states)
            return None, None
        if tag is None and read_latest(load_dir) is None:
            log.warning("no 'latest' file in %s: nothing loaded (pass tag= to pick a checkpoint)", load_dir)
            return None, None
        directory = resolve_checkpoint_dir(load_dir, tag)  # says which tags exist when this one does not
        from dscompile.runtime.checkpoint_formats import checkpoint_kind, describe_checkpoint

        if checkpoint_kind(directory) != "pipeline":  # also: no manifest, an interrupted save
            raise CheckpointError(
                f"{directory} is {describe_checkpoint(directory)}, not a PipelineEngine checkpoint (no pipe_stage_*_model_states.pt); "
                "load it with an engine without a 'pipeline' section"
            )
        reader = CheckpointReader(directory)  # every file verified against the checkpoint's manifest
        saved_tp = max((int(m.group(1)) + 1 for m in map(_MP_RANK.search, reader.names()) if m), default=1)
        if saved_tp != self.tp_size:
            return self._load_across_tp(reader, saved_tp, load_optimizer_states)
        files = [name for name in reader.names() if name.startswith("pipe_stage_") and name.endswith(f"{self._mp()}_model_states.pt")]
        saved: dict[str, torch.Tensor] = {}
        for f in files:
            saved.update(reader.load(f, weights_only=True))
        with torch.no_grad():
            for s in self.local_stages:
                module = self.program.stages[s].module
                for name, t in module.state_dict().items():
                    if name not in saved:
                        raise KeyError(f"checkpoint {directory} has no tensor {name!r} for stage {s}")
                    t.copy_(saved[name])
        rank_file = self._rank_file()
        client = None
        if reader.has(rank_file):
            state = reader.load(rank_file)
            client = state["client_state"]
            if state["bounds"] == self.program.plan.bounds:
                if load_optimizer_states and self.optimizer is not None:
                    self._load_optimizer(reader, state)
                self.load_core_state_dict(state)
            else:
                log.warning("checkpoint %s was partitioned differently: loaded the weights only", directory)
        return str(directory), client

