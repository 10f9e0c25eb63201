"""``dscompile.initialize``: DeepSpeed's engine API over a dscompile-compiled model.

A DeepSpeed training script ports by changing its import: ``engine(batch)``,
``engine.backward(loss)``, ``engine.step()``, ``save_checkpoint``/``load_checkpoint``, with the
config's optimizer, scheduler, gradient accumulation and clipping.

``DSCompileEngine`` is a shell over the training core (``dscompile.runtime.training_core``): it compiles
one module and runs forward and backward; the optimizer step, gradient reduction across ranks,
overflow agreement, clipping, counters, timers and checkpoint contents are the core's, and
capabilities plug in as core extensions and gradient strategies: plain data parallelism by
default (``runtime/data_parallel.py``), ZeRO 1-3 (``runtime/zero_extension.py``), mixed precision
and loss scaling (``runtime/loss_scaler.py``), ZeRO profiling (``runtime/zero_profile.py``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from dscompile.arguments import config_source
from dscompile.autotp import merge_autotp_intent
from dscompile.config import DSConfig, load_config
from dscompile.errors import DSCompileConfigError
from dscompile.planner import ParallelLayout, PlannedConfig, plan_parallel
from dscompile.runtime.checkpoint_io import CheckpointWriter, resolve_checkpoint_dir
from dscompile.runtime.data_parallel import DataParallelGradients
from dscompile.runtime.dataloader import EpochLoader, RepeatingLoader
from dscompile.runtime.dynamo_room import make_room
from dscompile.runtime.engine_context import refuse_engine_write
from dscompile.runtime.engine_core import init_from_launcher, register_engine_extension, world_info, wrapped_module_attribute
from dscompile.runtime.engine_entry import EngineEntry
from dscompile.runtime.optimizers import build_optimizer
from dscompile.runtime.process_groups import ProcessGroups
from dscompile.runtime.schedulers import build_scheduler
from dscompile.runtime.tensor_parallel_gradients import TensorParallelGradients, TensorParallelOver
from dscompile.runtime.training_core import LATEST, MODEL_STATES, TrainingCore, _agree_any, params_or_error
from dscompile.runtime.zero_extension import shard_optimizer
from dscompile.runtime.zero_init import materialize
from dscompile.runtime.zero_shard import ZeroModule, collective_failures_explained, run_agreeing

if TYPE_CHECKING:
    from dscompile.engines.pipeline_parallel import PipelineEngine

log = logging.getLogger("dscompile.engines.training")

_ENTRIES_PER_ENGINE = 4
"""Dynamo cache entries one engine's forward may add (train and eval, a second input shape, ...)."""


def _make_room_for_one_more_engine() -> None:
    """Room in Dynamo's per-code caches for this engine's graphs (``dscompile.runtime.dynamo_room``):
    past Dynamo's limit an engine over a model of an already-compiled class would run uncompiled."""
    make_room(_ENTRIES_PER_ENGINE)


__all__ = [
    "LATEST",
    "MODEL_STATES",
    "DSCompileEngine",
    "initialize",
    "register_engine_extension",
    "shard_optimizer",
    "_agree_any",
]


class DSCompileEngine(nn.Module, TrainingCore):
    """Training engine: a compiled module, its optimizer and the training core's step around them."""

    def __init__(
        self,
        model: nn.Module,
        config: DSConfig,
        optimizer: torch.optim.Optimizer | None,
        lr_scheduler: Any = None,
        *,
        compile_model: bool = True,
        model_parallel: ProcessGroups | None = None,
    ) -> None:
        """``model_parallel``: the groups of a model the script already split (``initialize(mpu=...)``)."""
        nn.Module.__init__(self)
        if config.sections.get("pipeline_parallel") is not None:
            raise DSCompileConfigError(
                "pipeline", "DSCompileEngine does not run pipeline parallelism", "use dscompile.initialize(...), which returns a PipelineEngine for it"
            )
        params_or_error(model, needs_training=optimizer is not None)
        self.module = model
        # a script's model-parallel unit gives the TP size; otherwise the plan reads it from the config
        plan = plan_parallel(config, world_info()[0], model_parallel.tp_size) if model_parallel is not None else None
        self.init_core(config, optimizer, lr_scheduler, plan)
        self.context.compiles_model = compile_model
        self.context.compile_target = model  # extensions may wrap it (ZeRO-2/3: a ZeroModule over the shards)
        if model_parallel is not None:
            from dscompile.runtime.model_parallel_unit import prepare_model_parallel

            prepare_model_parallel(self, model_parallel)  # before the extensions: ZeRO shards over its data-parallel group
        self.configure_extensions()  # ZeRO installs its gradient strategy here
        if model_parallel is not None:
            from dscompile.runtime.model_parallel_unit import model_parallel_gradients

            self.gradients = model_parallel_gradients(self, model_parallel)
        if self.gradients is None:
            self.gradients = DataParallelGradients(model)  # the default: whole replicas, gradients averaged
        self._compiled = self._compile(self.compile_target, config)

    def _compile(self, target: nn.Module | None, config: DSConfig) -> Any:
        assert target is not None  # set by __init__ before the extensions
        if self.compiles_model:
            _make_room_for_one_more_engine()
        # the graphs' passes read the engine's plan (ZeRO schedule, checkpointing), re-plans included, not the config
        compiled = torch.compile(target, backend="dscompile", options=PlannedConfig(config, self.plan)) if self.compiles_model else target
        reference = getattr(target, "output_dtype_module", target)  # the user's model behind a wrapper that splits it
        return EngineEntry(compiled, self, self.compute_dtype, reference)  # DeepSpeed's 16-bit convention, loss.backward()

    def release_compiled(self) -> None:
        """``destroy()``: drop the compiled graphs; a later forward says the engine is gone."""
        self._compiled = _Destroyed()

    def recompile(self, config: DSConfig) -> None:
        """Compile the model again under ``config`` and the engine's current plan (an extension re-planned it, e.g. ZeRO
        profiling swapped in a new ``ZeroSchedule``)."""
        self._compiled = self._compile(self.compile_target, config)

    def __setattr__(self, name: str, value: Any) -> None:
        """nn.Module's, but the views of ``engine.context`` stay read-only for module values too (nn.Module would
        register ``engine.compile_target = module`` as a submodule the property then hides)."""
        refuse_engine_write(self, name)
        super().__setattr__(name, value)

    def __getattr__(self, name: str) -> Any:
        """nn.Module's (parameters, buffers, submodules), then the wrapped model's, as DeepSpeed's engine."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return wrapped_module_attribute(self, name)

    @property
    def zero_module(self) -> ZeroModule | None:
        """ZeRO-2/3's module over the shards (what is compiled), else None."""
        return self.compile_target if isinstance(self.compile_target, ZeroModule) else None

    # -- forward / backward / step -------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.check_states_resident("engine forward")
        self.tput_timer.start()
        self._hook("before_forward")
        with self.phase("forward"), self.gradients.failure_context(self.global_rank, "forward"):
            out = run_agreeing(self._compiled, self.zero_module, args, kwargs)  # ranks whose ZeRO graphs differ: fall back
        self._hook("after_forward")
        return out

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backpropagate ``loss``, divided by the accumulation steps as DeepSpeed does."""
        if not loss.requires_grad:
            raise RuntimeError("engine.backward(loss): loss does not require grad; call it on the training output of engine(...)")
        gas = self.gradient_accumulation_steps()
        scaled = loss / gas if scale_wrt_gas and gas > 1 else loss
        scaled = self.scale_loss(scaled)
        with self.phase("backward"), self.gradients.failure_context(self.global_rank, "backward"):
            self.in_engine_backward = True
            try:
                scaled.backward()
            finally:
                self.in_engine_backward = False
        self._hook("after_backward")
        return loss

    @collective_failures_explained("engine.step()")
    def step(self) -> None:
        """At an accumulation boundary: the training core's optimizer step (reduce, unscale, clip, step)."""
        boundary = self.is_gradient_accumulation_boundary()
        with self.phase("step"):
            self.micro_steps += 1
            if boundary:
                self.optimizer_step()
        if boundary:
            self.end_optimizer_step(speak=self.global_rank == 0)
        self.tput_timer.stop(global_step=boundary, report_speed=self.global_rank == 0)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=set_to_none)
        self.gradients.zero_grad()

    # -- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self, save_dir: str | os.PathLike, tag: str | None = None, client_state: dict | None = None, save_latest: bool = True) -> Path:
        """Write ``save_dir/tag/`` in the gradient strategy's layout (``mp_rank_00_model_states.pt``, plus ZeRO's shard files)."""
        tag = tag or f"global_step{self.global_steps}"
        self.validate_checkpoint_tag(str(tag))
        # Every rank writes into a staging directory; committed (manifest, rename, 'latest' last) only when all succeeded.
        with CheckpointWriter(save_dir, str(tag), save_latest=save_latest) as ckpt:
            self.gradients.save_checkpoint(self, ckpt, client_state)
        return ckpt.directory

    def load_checkpoint(
        self,
        load_dir: str | os.PathLike,
        tag: str | None = None,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[str | None, dict | None]:
        """Restore a checkpoint written by ``save_checkpoint``; returns ``(path, client_state)``."""
        load_dir = Path(load_dir)
        if tag is None:
            latest = load_dir / LATEST
            if not latest.is_file():
                log.warning("no 'latest' file in %s: nothing loaded (pass tag= to pick a checkpoint)", load_dir)
                return None, None
            tag = latest.read_text().strip()
        directory = resolve_checkpoint_dir(load_dir, tag)  # says which tags exist when this one does not
        from dscompile.runtime import checkpoint_formats

        kind = checkpoint_formats.checkpoint_kind(directory)
        if isinstance(self.gradients, (TensorParallelGradients, TensorParallelOver)):  # cut to this rank's slices, whatever wrote it
            client = self.gradients.load_checkpoint(self, directory, load_optimizer_states, load_lr_scheduler_states, load_module_only)
            return str(directory), client
        if getattr(self, "zero", None) is not None or kind != "dscompile-full":  # ZeRO, DeepSpeed's, TP slices joined, re-layout
            return str(directory), checkpoint_formats.load_into(self, directory, load_optimizer_states, load_lr_scheduler_states, load_module_only)
        client = self.gradients.load_checkpoint(self, directory, load_optimizer_states, load_lr_scheduler_states, load_module_only)
        return str(directory), client


class _Destroyed(nn.Module):
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("this engine was destroyed (engine.destroy()); build a new one with dscompile.initialize to train again")


def _resolve_optimizer(
    config: DSConfig, optimizer: Any, params: Iterable[Any]
) -> torch.optim.Optimizer | None:
    if optimizer is not None and config.optimizer is not None:
        # DeepSpeed's rule (engine._configure_optimizer): the client's optimizer wins, the section is not read.
        log.warning(
            "optimizer= was given, so the config's 'optimizer' section (%s) is ignored, as DeepSpeed does", config.optimizer.type
        )
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if callable(optimizer):
        return optimizer(params)
    if config.optimizer is not None:
        return build_optimizer(config.optimizer, params)
    return None


def _resolve_scheduler(config: DSConfig, lr_scheduler: Any, optimizer: torch.optim.Optimizer | None) -> Any:
    if lr_scheduler is not None:
        if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
            return lr_scheduler(optimizer)
        return lr_scheduler
    if config.scheduler is not None:
        if optimizer is None:
            raise DSCompileConfigError("scheduler", "needs an optimizer", "add an 'optimizer' section or pass optimizer=")
        return build_scheduler(config.scheduler, optimizer)
    return None


def _build_dataloader(
    config: DSConfig, training_data: Any, collate_fn: Callable | None, world_size: int, rank: int, shuffle: bool = True
) -> Any:
    """DeepSpeed's training loader (``dataloader_drop_last`` false by default: the last partial batch is kept)."""
    if training_data is None:
        return None
    drop_last = bool(config.sections.get("dataloader_drop_last", False))
    return EpochLoader(training_data, config.train_micro_batch_size_per_gpu or 1, world_size, rank, collate_fn, drop_last, shuffle)


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int | None = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable | None = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
) -> tuple[DSCompileEngine | PipelineEngine, torch.optim.Optimizer | None, Any, Any]:
    """DeepSpeed's ``initialize``: returns ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    With a ``pipeline`` section the engine is a ``PipelineEngine`` (``engine.train_batch(data_iter)``).

    ``config`` (or ``config_params``, or ``args.deepspeed_config``) is a dict or a path to a
    ds_config.json. Process groups are the caller's (torchrun + ``init_process_group``); when the
    environment names a multi-process launch and none exists, one is created on gloo/NCCL.
    """
    if model is None:
        raise DSCompileConfigError("model", "dscompile.initialize needs model=", "pass the nn.Module to train")
    if mesh_param is not None:
        raise DSCompileConfigError("mesh_param", "device meshes are not supported yet", "drop mesh_param= (tensor_parallel or mpu= lay out the groups)")
    if config is not None and config_params is not None:
        raise DSCompileConfigError("config", "both config= and config_params= given", "pass only one")
    source = config_source(args, config if config is not None else config_params)
    cfg = load_config(source)
    configure_pipeline = getattr(model, "configure_pipeline", None)  # dscompile.pipe.PipelineModule: stages, cuts, loss_fn
    if configure_pipeline is not None:
        cfg = configure_pipeline(cfg)
    init_from_launcher(dist_init_required, distributed_port)
    cfg, mpu = merge_autotp_intent(model, cfg, mpu)  # tp_model_init's record; an mpu naming AutoTP's groups
    world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank() if world_size > 1 else 0
    pipe = cfg.sections.get("pipeline_parallel")
    groups = None
    if mpu is not None:
        from dscompile.runtime.model_parallel_unit import process_groups_from_mpu

        if pipe is not None:
            raise DSCompileConfigError("mpu", "a model-parallel unit together with a pipeline section is not built", "drop mpu= or the pipeline section")
        groups = process_groups_from_mpu(mpu, cfg)
    tc = cfg.sections.get("tensor_parallel")
    tp_size = groups.tp_size if groups is not None else tc.autotp_size if tc is not None and tc.enabled else 1
    if pipe is not None:  # DeepSpeed's rule: a pipeline config gets the pipeline engine (train_batch API)
        from dscompile.engines.pipeline_parallel import check_pipeline_world, refuse_sequence_parallel

        refuse_sequence_parallel(tc)
        check_pipeline_world(world_size, pipe.stages, tp_size)
    else:
        ParallelLayout(world_size, tp_size)  # the TP size must divide the world: says so before batch sizes are resolved
    sp_size = int(cfg.sections.get("sequence_parallel_size") or 1)
    if world_size % sp_size:  # the sequence groups are consecutive ranks, as TP's
        raise DSCompileConfigError(
            "sequence_parallel_size", f"the world size {world_size} is not a multiple of {sp_size}", f"launch a multiple of {sp_size} processes"
        )
    # batch sizes and the data loader count data-parallel replicas: not pipeline stages, not TP or sequence ranks
    per_replica = tp_size * sp_size * (pipe.stages if pipe is not None else 1)
    dp_size = cfg.sections.get("data_parallel_size")
    if dp_size is not None and dp_size != world_size // per_replica:
        raise DSCompileConfigError(
            "data_parallel_size",
            f"{dp_size} contradicts the layout: {world_size} ranks / {per_replica} per replica = {world_size // per_replica}",
            "drop data_parallel_size or make it agree",
        )
    # this rank's data-parallel replica in the one rank layout (pipeline stages outermost, TP and sequence ranks innermost)
    rank = ParallelLayout(world_size, tp_size * sp_size, pipe.stages if pipe is not None else 1).coordinates(rank)[1]
    world_size = world_size // per_replica
    cfg.resolve_batch_sizes(world_size)
    if pipe is not None or _zero_section(cfg) is None:
        materialize(model)  # built under zero.Init but trained without ZeRO: gather the full weights back
    params = list(model_parameters) if model_parameters is not None else [p for p in model.parameters() if p.requires_grad]
    builds_optimizer = cfg.optimizer is not None or (optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer))
    if not params and builds_optimizer:  # say so here, not with torch's "empty parameter list"
        where = "model_parameters is empty" if model_parameters is not None else f"{type(model).__name__} has no trainable parameters"
        raise DSCompileConfigError(
            "model", f"{where}, so the optimizer has nothing to train", "pass a model with parameters that require grad (or no optimizer, for inference)"
        )
    opt = _resolve_optimizer(cfg, optimizer, params)
    if lr_scheduler is not None and cfg.scheduler is not None:
        # DeepSpeed's rule (engine._configure_lr_scheduler): the client's scheduler wins.
        log.warning("lr_scheduler= was given, so the config's 'scheduler' section (%s) is ignored, as DeepSpeed does", cfg.scheduler.type)
    if pipe is not None:
        from dscompile.engines.pipeline_parallel import PipelineEngine

        scheduler = _resolve_scheduler(cfg, lr_scheduler, opt)
        loss_fn = model.loss_fn if configure_pipeline is not None else None
        engine = PipelineEngine(model, cfg, opt, scheduler, loss_fn=loss_fn)  # keeps only this rank's stages' parameters in opt
        if training_data is not None:  # DeepSpeed's pipeline loader: in order, endless; train_batch() draws from it
            engine.set_dataloader(RepeatingLoader(_build_dataloader(cfg, training_data, collate_fn, world_size, rank, shuffle=False)))
        return engine, opt, engine.training_dataloader, scheduler
    # Extensions may move the optimizer (ZeRO steps the shards), so a scheduler built here is built over the engine's.
    ready = lr_scheduler if lr_scheduler is not None and hasattr(lr_scheduler, "step") else None
    engine = DSCompileEngine(model, cfg, opt, ready, model_parallel=groups)
    if ready is None:
        engine.install_lr_scheduler(_resolve_scheduler(cfg, lr_scheduler, engine.optimizer))
    opt, scheduler = engine.optimizer, engine.lr_scheduler
    dataloader = _build_dataloader(cfg, training_data, collate_fn, world_size, rank)
    return engine, opt, dataloader, scheduler


def _zero_section(config: DSConfig) -> Any:
    """The ``zero_optimization`` section when it asks for a stage above 0, else None."""
    section = config.sections.get("zero_optimization")
    return section if section is not None and section.stage > 0 else None
