"""The training core: the optimizer step every training engine shares, over the engine core.

``DSCompileEngine`` and ``PipelineEngine`` derive from ``TrainingCore``: each decides how a batch runs (one compiled
module; a pipeline schedule over stages) and hands everything around the optimizer step to it: the gradient strategy
(``runtime/gradient_strategy.py``), accumulation, overflow agreement, clipping, the scheduler, loss scaling (through
the mixed-precision extension), timers and memory snapshots, and the core state every checkpoint stores. The step
and the extension hooks it calls are described in docs/architecture.md ("The engine core").
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from dscompile.errors import DSCompileConfigError
from dscompile.planner import ParallelPlan, plan_parallel
from dscompile.runtime.checkpoint_io import check_tag_agreement
from dscompile.runtime.comm_stats import collecting
from dscompile.runtime.devices import collective_device
from dscompile.runtime.engine_context import refuse_engine_write
from dscompile.runtime.engine_core import EngineCore, world_info
from dscompile.runtime.engine_metrics import MemoryBreakdown, StepTimers, ThroughputTimer, log_every
from dscompile.runtime.gradient_strategy import GradientStrategy
from dscompile.runtime.loss_scaler import MixedPrecision

if TYPE_CHECKING:
    from dscompile.runtime.process_groups import ProcessGroups
    from dscompile.runtime.zero_profile import ZeroProfiler
    from dscompile.runtime.zero_shard import ZeroPartition

log = logging.getLogger("dscompile.engines.training")

MODEL_STATES = "mp_rank_00_model_states.pt"
LATEST = "latest"


def _agree_any(flag: bool, group: Any = None) -> bool:
    """True on every rank when ``flag`` is True on any rank: overflow agreement (one scalar all-reduce, MAX)."""
    t = torch.tensor([1.0 if flag else 0.0], device=collective_device())  # NCCL needs it on the GPU
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item() > 0)


class TrainingCore(EngineCore):
    """The optimizer step and its state, over the engine core (see the module docstring).

    Attributes an engine sets before ``init_core``: ``module`` (the user's model). ``init_core``
    sets the rest; the engine then installs its default ``gradients`` strategy and calls
    ``configure_extensions``.
    """

    # True on the pipeline engine, whose stages the engine runs itself: what is not built for them refuses it
    runs_pipeline: ClassVar[bool] = False

    def init_core(self, config: Any, optimizer: torch.optim.Optimizer | None, lr_scheduler: Any, plan: ParallelPlan | None = None) -> None:
        """``plan``: the engine's parallel plan when it decided it already (the pipeline engine, for its layout);
        otherwise it is decided here from ``config`` and the world size."""
        # the one plan (DESIGN.md): layout, effective ZeRO stage and who carries it out, offload, prefetch, checkpointing
        plan = plan if plan is not None else plan_parallel(config, world_info()[0])
        self.init_engine(config, plan, timed_collectives=bool(config.wall_clock_breakdown))
        self.in_engine_backward = False  # True while engine.backward runs (a plain loss.backward() is scaled by hooks)
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.global_steps = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._global_grad_norm: float | None = None
        self.gradients: GradientStrategy | None = None
        self.timers = StepTimers(bool(config.wall_clock_breakdown))
        self.memory = MemoryBreakdown(bool(config.memory_breakdown), self.model_state_bytes)
        self.last_logged: dict[str, Any] = {}
        self.offloaded_states: Any = None  # what offload_states parked on the host (an OffloadedStates), until reload_states
        self._boundary_override: bool | None = None  # set_gradient_accumulation_boundary's value (None: counted)
        throughput = (config.sections.get("timers") or {}).get("throughput", {})
        self.tput_timer = ThroughputTimer(  # DeepSpeed's; its batch size is set once the layout is known
            None, config.steps_per_print, enabled=bool(throughput.get("enabled", True)), synchronized=bool(throughput.get("synchronized", True))
        )

    @property
    def config(self) -> Any:
        """The ``DSConfig`` the engine trains under (``engine._config`` too, DeepSpeed's name)."""
        return self._config

    # -- the shared state users, tests and checkpoints read: read-only views of engine.context -------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        refuse_engine_write(self, name)
        super().__setattr__(name, value)

    @property
    def compile_target(self) -> nn.Module | None:
        """What the engine compiles and calls (the model, or an extension's module over it)."""
        return self.context.compile_target

    @property
    def compiles_model(self) -> bool:
        """The engine torch.compiles ``compile_target`` (TP/SP modules compile their own graph)."""
        return self.context.compiles_model

    @property
    def zero(self) -> ZeroPartition | None:
        """The ZeRO partition when ZeRO is on, else None."""
        return self.context.zero

    @property
    def process_groups(self) -> ProcessGroups | None:
        """The TP x DP groups (tensor parallelism, or a script's mpu), else None."""
        return self.context.process_groups

    @property
    def zero_profiler(self) -> ZeroProfiler | None:
        """ZeRO profiling's profiler (``zero_optimization.profile_steps``), else None."""
        return self.context.zero_profiler

    @property
    def communication_data_type(self) -> torch.dtype | None:
        """The dtype of gradient reductions outside graphs (None: the gradients' own)."""
        return self.context.communication_data_type

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The training precision: the dtype of ``save_16bit_model``'s copy (None: fp32)."""
        return self.context.compute_dtype

    # -- what extensions may replace of the core's own state ------------------------------------------------------------
    def replace_optimizer(self, optimizer: Any) -> None:
        """An extension's optimizer in place of the engine's (ZeRO's over the shards, offload's); the scheduler follows."""
        self.optimizer = optimizer
        if self.lr_scheduler is not None and hasattr(self.lr_scheduler, "optimizer"):
            self.lr_scheduler.optimizer = optimizer

    def install_gradients(self, strategy: GradientStrategy) -> None:
        """An extension's gradient strategy in place of the engine's (``runtime/gradient_strategy.py``)."""
        self.gradients = strategy

    def install_lr_scheduler(self, scheduler: Any) -> None:
        """The scheduler the engine steps after each optimizer step, set after the engine is built: the config's
        (``initialize`` builds it over the engine's optimizer, which extensions may have replaced) or a Trainer's."""
        self.lr_scheduler = scheduler

    def restore_counters(self, global_steps: int, micro_steps: int | None = None, skipped_steps: int = 0) -> None:
        """The step counters a checkpoint saved; ``micro_steps`` missing (DeepSpeed's and older checkpoints): the global
        steps times the gradient accumulation."""
        self.global_steps = int(global_steps)
        self.micro_steps = int(micro_steps) if micro_steps is not None else self.global_steps * self.gradient_accumulation_steps()
        self.skipped_steps = int(skipped_steps or 0)

    # -- extensions ----------------------------------------------------------------------------
    def configure_extensions(self, config: Any | None = None) -> None:
        """The core's extensions (``EngineCore.configure_extensions``), then the throughput timer learns the batch size
        (an optimizer an extension replaced already took the scheduler along: ``replace_optimizer``)."""
        super().configure_extensions(config)
        with contextlib.suppress(DSCompileConfigError):  # no batch size in the config: DeepSpeed's timer counts 1 per step
            self.tput_timer.batch_size = self.train_batch_size()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if loss.dtype in (torch.float16, torch.bfloat16):
            loss = loss.float()  # as DeepSpeed: a 16-bit loss times the loss scale would overflow
        for extension in self.extensions:
            loss = extension.scale_loss(self, loss)
        return loss

    def loss_gradient_seed(self, factor: float) -> float:
        """The gradient backward starts from for ``factor * loss`` (loss scaling applied): for pipelines."""
        return float(self.scale_loss(torch.tensor(factor, dtype=torch.float64, device="cpu")))  # a host scalar, read back at once

    @property
    def loss_scaler(self) -> Any:
        """The loss scaler in use (the mixed-precision extension's), or None."""
        extension = self.extension("mixed_precision")
        return getattr(extension, "scaler", None)

    @loss_scaler.setter
    def loss_scaler(self, scaler: Any) -> None:
        extension = self.extension("mixed_precision")
        if extension is None:
            if scaler is not None:
                self.extensions.append(MixedPrecision(scaler=scaler))  # no configure: only the scaler is set
            return
        assert isinstance(extension, MixedPrecision)
        extension.scaler = scaler

    # -- the optimizer step ----------------------------------------------------------------------
    def trainable_parameters(self) -> list[nn.Parameter]:
        """The tensors the optimizer steps (the model's parameters, this rank's ZeRO shards, this stage's)."""
        assert self.gradients is not None
        return self.gradients.trainable_parameters()

    def optimizer_step(self) -> bool:
        """The accumulation boundary: reduce, agree on overflow, clip, step; returns True when skipped."""
        if self.optimizer is None:
            raise RuntimeError("engine.step(): no optimizer; pass optimizer= or set 'optimizer' in the config")
        assert self.gradients is not None
        self.check_states_resident("engine.step()")
        with collecting(self.comm_stats):
            params = self.gradients.trainable_parameters()
            self.gradients.reduce(self)
            self._hook("on_gradients_ready", params)
            overflow = any([extension.check_overflow(self, params) for extension in self.extensions])
            if self.world_size > 1 and any(e.checks_overflow for e in self.extensions):
                with self.comm_stats.timed("engine", "overflow_agreement", 4):
                    overflow = _agree_any(overflow)  # gradients differ per rank: every rank skips or none does
            if overflow:
                self.skipped_steps += 1
                log.warning("step %d skipped: gradient overflow", self.global_steps)
            else:
                if self.config.gradient_clipping > 0:
                    self._global_grad_norm = self.gradients.clip(self, params, self.config.gradient_clipping)
                elif self.context.grad_norm_every_step:
                    self._global_grad_norm = self.gradients.clip(self, params, math.inf)  # an infinite bound scales nothing
                self._hook("before_optimizer_step", params)
                self.optimizer.step()
                self.gradients.after_optimizer_step(self)
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.gradients.zero_grad()
            self.global_steps += 1
            self._hook("after_optimizer_step", overflow)
        return overflow

    def end_optimizer_step(self, *, speak: bool) -> None:
        """After the step phase closed: per-step timers and memory, and the ``steps_per_print`` log."""
        self.timers.end_step()
        if self.global_steps % self.config.steps_per_print == 0 and self.global_rank == 0:
            log.info("step %d: lr %s", self.global_steps, self.get_lr())
        logged = log_every(log, self.global_steps, self.config.steps_per_print, self.global_rank, self.timers, self.memory, speak=speak)
        if logged:
            self.last_logged = logged

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a phase (``wall_clock_breakdown``), snapshot memory after it, count its collectives."""
        with self.timers.time(name), self.memory.phase(name), collecting(self.comm_stats):
            yield

    # -- what users read (DeepSpeed's accessors, with DeepSpeed's signatures) ----------------------
    @property
    def device(self) -> torch.device:
        """Where the model's parameters live (DeepSpeed's ``engine.device``)."""
        from dscompile.runtime.devices import device_of

        return device_of(self.module.parameters())

    def fp16_enabled(self) -> bool:
        section = self.config.sections.get("fp16")
        return bool(section is not None and section.enabled)

    def bfloat16_enabled(self) -> bool:
        section = self.config.sections.get("bf16")
        return bool(section is not None and section.enabled)

    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return self.config.accumulation_steps

    def data_parallel_world_size(self) -> int:
        """Ranks that train on different data (every rank here; a pipeline engine counts pipelines;
        tensor parallelism counts its DP group)."""
        groups = self.process_groups
        return groups.dp_size if groups is not None else self.world_size

    def train_micro_batch_size_per_gpu(self) -> int:
        micro = self.config.train_micro_batch_size_per_gpu
        if micro is None:
            tb = self.config.train_batch_size
            if tb is None:
                raise DSCompileConfigError(
                    "train_micro_batch_size_per_gpu", "is not set (nor train_batch_size)", 'add "train_micro_batch_size_per_gpu" to the config'
                )
            micro = tb // (self.gradient_accumulation_steps() * self.data_parallel_world_size())
        return micro

    def train_batch_size(self) -> int:
        """Samples per optimizer step over all data-parallel ranks: micro batch x accumulation x ranks."""
        tb = self.config.train_batch_size
        if tb is None:
            tb = self.train_micro_batch_size_per_gpu() * self.gradient_accumulation_steps() * self.data_parallel_world_size()
        return tb

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next ``step()`` applies the optimizer (the last micro-step of a batch), or as set by
        ``set_gradient_accumulation_boundary``."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """DeepSpeed's manual override of the boundary: set it before each forward/backward, True on the last
        one, and call ``step()`` once after them (``None`` returns to counting micro-steps)."""
        self._boundary_override = None if is_boundary is None else bool(is_boundary)

    # -- offload_states / reload_states (DeepSpeed's; runtime/offload/states.py) -------------------
    def offload_states(self, include: Any = None, device: Any = "cpu", pin_memory: bool = True, non_blocking: bool = False) -> None:
        """Copy model states to the host and free their device storage (ZeRO 1-3), as DeepSpeed's.

        ``include``: ``OffloadStateTypeEnum`` members (None: all); ``device``: ``OffloadDeviceEnum.cpu``.
        Training needs ``reload_states()`` first.
        """
        from dscompile.runtime.offload.states import offload

        self.offloaded_states = offload(self, include, device, pin_memory, non_blocking, self.offloaded_states)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring back what ``offload_states`` moved, bit for bit, into the same tensors."""
        from dscompile.runtime.offload.states import reload

        if self.offloaded_states is not None:
            reload(self.offloaded_states, None, non_blocking)
            self.offloaded_states = None

    def check_states_resident(self, what: str) -> None:
        """A clear error instead of a shape error when training runs on offloaded states."""
        if self.offloaded_states is not None and self.offloaded_states.parked:
            kinds = ", ".join(k.value for k in self.offloaded_states.parked)
            raise RuntimeError(f"{what}: model states ({kinds}) are offloaded by engine.offload_states(); call engine.reload_states() first")

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups] if self.optimizer is not None else []

    def validate_checkpoint_tag(self, tag: str) -> None:
        """``checkpoint.tag_validation`` (Warn, the default; Fail; Ignore): every rank must save under ``tag``."""
        check_tag_agreement(tag, str((self.config.sections.get("checkpoint") or {}).get("tag_validation", "Warn")))

    def get_global_grad_norm(self) -> float | None:
        return self._global_grad_norm

    def zero_optimization_stage(self) -> int:
        """DeepSpeed's accessor: the ZeRO stage in use (0 when off), as the plan decided it (``plan.zero_by`` says who
        carries it out: the ZeRO partition, or the pipeline engine's gradient strategy at stage 1)."""
        return self.plan.zero_stage

    def wall_clock_breakdown(self) -> bool:
        """DeepSpeed's accessor: whether per-step timers are on (read them with ``step_timings()``)."""
        return bool(self.config.wall_clock_breakdown)

    def memory_breakdown(self) -> bool:
        """DeepSpeed's accessor: whether per-phase memory is recorded (read it with ``step_memory()``)."""
        return bool(self.config.memory_breakdown)

    def step_timings(self) -> dict[str, float]:
        """Milliseconds of forward, backward and step in the last optimizer step (needs ``wall_clock_breakdown``)."""
        if not self.timers.enabled:
            raise DSCompileConfigError("wall_clock_breakdown", "is off, so no step timings were taken", 'set "wall_clock_breakdown": true')
        return self.timers.last_ms()

    def step_memory(self) -> dict[str, dict[str, int]]:
        """Memory after each phase of the last step, in bytes (needs ``memory_breakdown``)."""
        if not self.memory.enabled:
            raise DSCompileConfigError("memory_breakdown", "is off, so no memory was recorded", 'set "memory_breakdown": true')
        return {phase: dict(snapshot) for phase, snapshot in self.memory.last.items()}

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter's full value by name (gathered where partitioned; a collective)."""
        assert self.gradients is not None
        return self.gradients.full_parameters()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's ``state_dict`` with every parameter's full value (gathered where partitioned; a collective).

        Tied names share one tensor, as in the module; buffers are the module's own.
        """
        full = self.full_parameters()
        state = dict(self.module.state_dict())
        first_names: dict[int, str] = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            first = first_names.setdefault(id(p), name)
            if first in full:
                state[name] = full[first]
        return state

    def model_state_bytes(self) -> int:
        """Bytes of parameters, gradients and optimizer states this rank holds (distinct storages)."""
        from dscompile.runtime.zero_shard import state_bytes

        if self.gradients is None:
            return 0
        return state_bytes(self.gradients.model_state_tensors(self.optimizer))

    # -- checkpoints ---------------------------------------------------------------------------
    def core_state_dict(self, client_state: dict | None = None) -> dict[str, Any]:
        """What every checkpoint layout stores beside the model and optimizer: counters, scheduler, extensions."""
        return {
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "extensions": {e.name: state for e in self.extensions if (state := e.state_dict()) is not None},
            "global_steps": self.global_steps,
            "micro_steps": self.micro_steps,
            "skipped_steps": self.skipped_steps,
            "client_state": client_state or {},
            "ds_config": self.config.raw,
        }

    def load_core_state_dict(self, state: dict[str, Any], load_lr_scheduler_states: bool = True) -> None:
        if load_lr_scheduler_states and self.lr_scheduler is not None and state.get("lr_scheduler") is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        saved = state.get("extensions", {})
        for extension in self.extensions:
            if extension.name in saved:
                extension.load_state_dict(saved[extension.name])
        self.restore_counters(state["global_steps"], state.get("micro_steps", 0), state.get("skipped_steps", 0))

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        """Write the full model in the training precision (rank 0), DeepSpeed's ``save_16bit_model``.

        Under ZeRO-3 the parameters are gathered only when
        ``zero_optimization.stage3_gather_16bit_weights_on_model_save`` is true, as in DeepSpeed;
        otherwise nothing is written and False is returned. A collective on every rank.
        """

        section = self.config.sections.get("zero_optimization")
        if self.plan.zero_stage == 3 and not (
            section.stage3_gather_16bit_weights_on_model_save or section.stage3_gather_fp16_weights_on_model_save
        ):
            log.warning(
                "save_16bit_model: nothing saved; under ZeRO-3 set zero_optimization.stage3_gather_16bit_weights_on_model_save "
                "to true to gather the weights (or use save_checkpoint + zero_to_fp32)"
            )
            return False
        state = self.full_state_dict()
        if self.global_rank == 0:
            write_16bit_state(state, self.compute_dtype, save_dir, save_filename)
        if self.world_size > 1:
            dist.barrier()
        return True


def write_16bit_state(state: dict[str, torch.Tensor], dtype: torch.dtype | None, save_dir: str, save_filename: str) -> None:
    """``save_16bit_model``'s file: the full state dict in the training precision (floating tensors cast), one ``torch.save``."""
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    os.makedirs(save_dir, exist_ok=True)
    torch.save(state, os.path.join(save_dir, save_filename))


def params_or_error(module: nn.Module, needs_training: bool) -> list[nn.Parameter]:
    """The model's trainable parameters; a clear error when training needs some and there are none."""
    params = [p for p in module.parameters() if p.requires_grad]
    if needs_training and not params:
        raise DSCompileConfigError(
            "model",
            f"{type(module).__name__} has no trainable parameters, so there is nothing for the optimizer or ZeRO to train",
            "pass a model with parameters that require grad (or no optimizer, for inference only)",
        )
    return params
