"""``dscompile.initialize``: DeepSpeed's engine API over a dscompile-compiled model.

A DeepSpeed training script ports by changing its import: ``engine(batch)``,
``engine.backward(loss)``, ``engine.step()``, ``save_checkpoint``/``load_checkpoint``, with the
config's optimizer, scheduler, gradient accumulation and clipping. With several processes and no
ZeRO, gradients are averaged across ranks (plain data parallelism).

With ``zero_optimization.stage`` 1-3 the engine partitions the parameters
(``dscompile.runtime.zero_shard``): the optimizer steps this rank's flat shards, ZeRO-2/3 compile a
``ZeroModule`` whose graphs carry the gradient reduce-scatters (and ZeRO-3's parameter
all-gathers) placed by the ``zero*`` passes, ZeRO-1 reduce-scatters gradients once per batch at
the accumulation boundary. Clipping uses the global norm over all shards, an overflow reported by
``loss_scaler`` on any rank skips the step on every rank, and checkpoints are per-rank shard files
(``dscompile.runtime.zero_checkpoint``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from dscompile.config import DSConfig, load_config
from dscompile.errors import DSCompileConfigError
from dscompile.runtime.checkpoint_io import CheckpointReader, CheckpointWriter, resolve_checkpoint_dir
from dscompile.runtime.optimizers import build_optimizer
from dscompile.runtime.schedulers import build_scheduler
from dscompile.runtime.zero_shard import ZeroModule, ZeroPartition, collective_failures_explained, explain_collective_failure, run_agreeing

if TYPE_CHECKING:
    from dscompile.runtime.pipeline_engine import PipelineEngine

log = logging.getLogger("dscompile.engine")

MODEL_STATES = "mp_rank_00_model_states.pt"
LATEST = "latest"


EngineExtension = Callable[["DSCompileEngine"], None]
_ENGINE_EXTENSIONS: list[tuple[int, str, EngineExtension]] = []


def register_engine_extension(order: int, name: str) -> Callable[[EngineExtension], EngineExtension]:
    """Let a capability module configure every new engine (set a loss scaler, shard the optimizer...).

    ``fn(engine)`` runs at the end of ``DSCompileEngine.__init__`` (before the model is compiled),
    in ``order``; it reads ``engine.config.sections`` and does nothing when its capability is off.
    """

    def decorator(fn: EngineExtension) -> EngineExtension:
        _ENGINE_EXTENSIONS[:] = [e for e in _ENGINE_EXTENSIONS if e[1] != name]
        _ENGINE_EXTENSIONS.append((order, name, fn))
        _ENGINE_EXTENSIONS.sort(key=lambda e: (e[0], e[1]))
        return fn

    return decorator


class LossScaler:
    """Protocol a mixed-precision loss scaler implements; the engine calls it when one is set."""

    def scale(self, loss: torch.Tensor) -> torch.Tensor:  # pragma: no cover - protocol
        raise NotImplementedError

    def unscale_and_check(self, parameters: list[nn.Parameter]) -> bool:  # pragma: no cover - protocol
        """Divide gradients by the scale; return True when any rank saw inf/NaN."""
        raise NotImplementedError

    def update(self, overflow: bool) -> None:  # pragma: no cover - protocol
        raise NotImplementedError


class DSCompileEngine(nn.Module):
    """Training engine: a compiled module, its optimizer and the step logic around them."""

    def __init__(
        self,
        model: nn.Module,
        config: DSConfig,
        optimizer: torch.optim.Optimizer | None,
        lr_scheduler: Any = None,
        *,
        compile_model: bool = True,
    ) -> None:
        super().__init__()
        if config.sections.get("pipeline_parallel") is not None:
            raise DSCompileConfigError(
                "pipeline", "DSCompileEngine does not run pipeline parallelism", "use dscompile.initialize(...), which returns a PipelineEngine for it"
            )
        self.module = model
        self.config = config
        self.world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.rank = dist.get_rank() if self.world_size > 1 else 0
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.loss_scaler: LossScaler | None = None
        self.global_steps = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._global_grad_norm: float | None = None
        # dtype of the gradient reductions done here (set from ``communication_data_type`` by the
        # mixed-precision extension); None reduces in the gradients' own dtype.
        self.communication_data_type: torch.dtype | None = None
        self.zero_config = _zero_section(config)
        self.zero: ZeroPartition | None = None
        self.zero_module: nn.Module | None = None
        if self.zero_config is not None:
            self._setup_zero()
        elif self.world_size > 1:
            self._broadcast_parameters()
        for _order, _name, extension in _ENGINE_EXTENSIONS:
            extension(self)
        target = self.zero_module if self.zero_module is not None else model
        self._compiled = torch.compile(target, backend="dscompile", options=config) if compile_model else target
        self.zero_profiler: Any = None  # dscompile.runtime.zero_profile.ZeroProfiler while profile_steps last
        if compile_model and self.zero_config is not None and self.zero_config.profile_steps > 0:
            from dscompile.runtime.zero_profile import engine_profiler

            self.zero_profiler = engine_profiler(self, target)  # re-plans ZeRO once, after the profiled steps

    # -- ZeRO ----------------------------------------------------------------------------------
    def _setup_zero(self) -> None:
        """Partition the parameters, and move the optimizer onto this rank's shards."""
        zc = self.zero_config
        threshold = zc.stage3_param_persistence_threshold if zc.stage == 3 else 0
        itemsize = next(self.module.parameters()).element_size()
        self.zero = ZeroPartition(
            self.module, zc.stage, None, threshold, bucket_bytes=zc.reduce_bucket_size * itemsize, ignore_unused_parameters=zc.ignore_unused_parameters
        )
        if zc.stage >= 2:
            self.zero_module = ZeroModule(self.module, self.zero)
        if self.optimizer is not None:
            self.optimizer = shard_optimizer(self.optimizer, self.zero)
            if self.lr_scheduler is not None and hasattr(self.lr_scheduler, "optimizer"):
                self.lr_scheduler.optimizer = self.optimizer

    def zero_optimization_stage(self) -> int:
        """DeepSpeed's accessor: the ZeRO stage in use (0 when off)."""
        return self.zero.stage if self.zero is not None else 0

    # -- forward / backward / step -------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self._explain_collective_failure("forward"):
            return run_agreeing(self._compiled, self.zero_module, args, kwargs)  # ranks whose ZeRO graphs differ: fall back

    def _explain_collective_failure(self, what: str) -> contextlib.AbstractContextManager[None]:
        """On several ranks a failed collective means a dead, stalled or diverged peer: say so."""
        if self.world_size > 1:
            return explain_collective_failure(self.rank, f"{'ZeRO' if self.zero is not None else 'data-parallel'} {what}")
        return contextlib.nullcontext()

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.config.accumulation_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next ``step()`` applies the optimizer (the last micro-step of a batch)."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backpropagate ``loss``, divided by the accumulation steps as DeepSpeed does."""
        if not loss.requires_grad:
            raise RuntimeError("engine.backward(loss): loss does not require grad; call it on the training output of engine(...)")
        scaled = loss / self.gradient_accumulation_steps if scale_wrt_gas and self.gradient_accumulation_steps > 1 else loss
        if self.loss_scaler is not None:
            scaled = self.loss_scaler.scale(scaled)
        with self._explain_collective_failure("backward"):
            scaled.backward()
        return loss

    @collective_failures_explained("engine.step()")
    def step(self) -> None:
        """At an accumulation boundary: average gradients, clip, step the optimizer and scheduler."""
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        if self.optimizer is None:
            raise RuntimeError("engine.step(): no optimizer; pass optimizer= or set 'optimizer' in the config")
        params = self.trainable_parameters()
        if self.zero is not None:
            if self.zero.stage == 1:
                self.zero.reduce_gradients()  # ZeRO-1: the only gradient communication, once per batch
            else:
                self.zero.check_unused()  # ignore_unused_parameters: false
        elif self.world_size > 1:
            self._average_gradients(params)
        overflow = self.loss_scaler.unscale_and_check(params) if self.loss_scaler is not None else False
        if self.zero is not None and self.world_size > 1:
            overflow = _agree_any(bool(overflow))  # shards differ per rank: every rank skips or none does
        if overflow:
            self.skipped_steps += 1
            log.warning("step %d skipped: gradient overflow", self.global_steps)
        else:
            if self.config.gradient_clipping > 0:
                self._global_grad_norm = self._clip_gradients(params, self.config.gradient_clipping)
            self.optimizer.step()
            if self.zero is not None:
                self.zero.gather_full_params()  # refresh the full copies kept on every rank
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow)
        self.optimizer.zero_grad(set_to_none=True)
        if self.zero is not None:
            self.zero.zero_grad()
        self.global_steps += 1
        if self.zero_profiler is not None:
            self.zero_profiler.after_step()  # at the same step on every rank: agrees, re-plans, recompiles once
        if self.global_steps % self.config.steps_per_print == 0 and self.rank == 0:
            log.info("step %d: lr %s", self.global_steps, self.get_lr())

    def _clip_gradients(self, params: list[nn.Parameter], max_norm: float) -> float:
        """Clip by the global norm; with ZeRO the norm is summed over every rank's shard."""
        if self.zero is None:
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        total = float(self.zero.grad_norm_squared().sqrt())
        coef = min(1.0, max_norm / (total + 1e-6))
        if coef < 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coef)
        return total

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=set_to_none)
        if self.zero is not None:
            self.zero.zero_grad()

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The tensors the optimizer steps: the model's parameters, or this rank's ZeRO shards."""
        if self.zero is not None:
            return list(self.zero.shards)
        return [p for p in self.module.parameters() if p.requires_grad]

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter's full value by name (gathered from the shards under ZeRO; a collective)."""
        if self.zero is not None:
            return self.zero.full_state()
        return {n: p.detach().clone() for n, p in self.module.named_parameters()}

    def model_state_bytes(self) -> int:
        """Bytes of parameters, gradients and optimizer states this rank holds (distinct storages)."""
        from dscompile.runtime.zero_shard import model_state_tensors, state_bytes

        if self.zero is not None:
            return state_bytes(model_state_tensors(self.zero, self.optimizer))
        tensors: list[torch.Tensor] = []
        for p in self.module.parameters():
            tensors += [p.data, p.grad]
        if self.optimizer is not None:
            for st in self.optimizer.state.values():
                tensors += [v for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        return state_bytes(tensors)

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups] if self.optimizer else []

    def get_global_grad_norm(self) -> float | None:
        return self._global_grad_norm

    # -- data parallelism without ZeRO ---------------------------------------------------------
    def _broadcast_parameters(self) -> None:
        with torch.no_grad():
            for tensor in list(self.module.parameters()) + list(self.module.buffers()):
                dist.broadcast(tensor, src=0)

    def _average_gradients(self, params: list[nn.Parameter]) -> None:
        """All-reduce every trainable gradient in one flat buffer, the same layout on every rank.

        A parameter that got no gradient on a rank (a branch taken elsewhere) contributes zeros
        there; a count of the ranks that had one travels in the same buffer, so a parameter no rank
        used keeps ``grad=None`` (skipped by the optimizer, as in PyTorch).
        """
        from dscompile.runtime.zero_shard import check_unused_parameters

        if not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads] + [torch.tensor([float(p.grad is not None) for p in params], dtype=grads[0].dtype)])
        if self.communication_data_type is not None:
            flat = flat.to(self.communication_data_type)  # copied back into each gradient's dtype below
        values = flat[: -len(params)]
        if self.config.prescale_gradients:
            values /= self.world_size
        elif self.config.gradient_predivide_factor != 1.0:
            values /= self.config.gradient_predivide_factor
        dist.all_reduce(flat)
        if not self.config.prescale_gradients:
            values /= self.world_size / self.config.gradient_predivide_factor
        counts = [round(c) for c in flat[-len(params) :].tolist()]
        names = {id(p): n for n, p in self.module.named_parameters()}
        check_unused_parameters([names.get(id(p), "?") for p in params], counts, self.world_size, self.config.sections.get("zero_optimization"))
        offset = 0
        for p, g, count in zip(params, grads, counts, strict=True):
            if count == 0:
                p.grad = None
            else:
                g.copy_(values[offset : offset + g.numel()].view_as(g))
                p.grad = g
            offset += g.numel()

    # -- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self, save_dir: str | os.PathLike, tag: str | None = None, client_state: dict | None = None, save_latest: bool = True) -> Path:
        """Write ``save_dir/tag/mp_rank_00_model_states.pt`` (module, optimizer, scheduler, counters, RNG)."""
        tag = tag or f"global_step{self.global_steps}"
        state = None
        if self.zero is None and self.rank == 0:
            state = {
                "module": self.module.state_dict(),
                "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
                "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
                "loss_scaler": self.loss_scaler.state_dict() if hasattr(self.loss_scaler, "state_dict") else None,
                "global_steps": self.global_steps,
                "micro_steps": self.micro_steps,
                "skipped_steps": self.skipped_steps,
                "client_state": client_state or {},
                "ds_config": self.config.raw,
                "world_size": self.world_size,
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
            }
        # Every rank writes into a staging directory; committed (manifest, rename, 'latest' last) only when all succeeded.
        with CheckpointWriter(save_dir, str(tag), save_latest=save_latest) as ckpt:
            if self.zero is not None:
                from dscompile.runtime import zero_checkpoint

                zero_checkpoint.save(self, ckpt, client_state)
            elif state is not None:
                ckpt.save(state, MODEL_STATES)
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
        from dscompile.runtime import zero_checkpoint

        if self.zero is not None or zero_checkpoint.checkpoint_kind(directory) != "dscompile-full":  # ZeRO, DeepSpeed's, re-layout
            return str(directory), zero_checkpoint.load_into(self, directory, load_optimizer_states, load_lr_scheduler_states, load_module_only)
        path = directory / MODEL_STATES
        state = CheckpointReader(directory).load(MODEL_STATES)  # verified against the checkpoint's manifest
        self.module.load_state_dict(state["module"])
        if not load_module_only:
            if load_optimizer_states and self.optimizer is not None and state["optimizer"] is not None:
                self.optimizer.load_state_dict(state["optimizer"])
            if load_lr_scheduler_states and self.lr_scheduler is not None and state["lr_scheduler"] is not None:
                self.lr_scheduler.load_state_dict(state["lr_scheduler"])
            if state.get("loss_scaler") is not None and hasattr(self.loss_scaler, "load_state_dict"):
                self.loss_scaler.load_state_dict(state["loss_scaler"])
            self.global_steps = state["global_steps"]
            self.micro_steps = state["micro_steps"]
            self.skipped_steps = state.get("skipped_steps", 0)
            torch.set_rng_state(state["rng"]["torch"])
            random.setstate(state["rng"]["python"])
        return str(path.parent), state["client_state"]


def _resolve_optimizer(
    config: DSConfig, optimizer: Any, params: Iterable[Any]
) -> torch.optim.Optimizer | None:
    if optimizer is not None and config.optimizer is not None:
        raise DSCompileConfigError("optimizer", "given both in the config and as the optimizer= argument", "keep only one of them")
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if callable(optimizer):
        return optimizer(params)
    if config.optimizer is not None:
        return build_optimizer(config.optimizer, params)
    return None


def _resolve_scheduler(config: DSConfig, lr_scheduler: Any, optimizer: torch.optim.Optimizer | None) -> Any:
    if lr_scheduler is not None and config.scheduler is not None:
        raise DSCompileConfigError("scheduler", "given both in the config and as the lr_scheduler= argument", "keep only one of them")
    if lr_scheduler is not None:
        if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
            return lr_scheduler(optimizer)
        return lr_scheduler
    if config.scheduler is not None:
        if optimizer is None:
            raise DSCompileConfigError("scheduler", "needs an optimizer", "add an 'optimizer' section or pass optimizer=")
        return build_scheduler(config.scheduler, optimizer)
    return None


def _build_dataloader(config: DSConfig, training_data: Any, collate_fn: Callable | None, world_size: int, rank: int) -> Any:
    if training_data is None:
        return None
    from torch.utils.data import DataLoader, DistributedSampler

    batch_size = config.train_micro_batch_size_per_gpu or 1
    sampler = DistributedSampler(training_data, num_replicas=world_size, rank=rank) if world_size > 1 else None
    return DataLoader(training_data, batch_size=batch_size, sampler=sampler, shuffle=False, collate_fn=collate_fn, drop_last=True)


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
    if mpu is not None or mesh_param is not None:
        raise DSCompileConfigError("mpu", "model-parallel units are not supported yet", "drop mpu=/mesh_param=")
    if config is not None and config_params is not None:
        raise DSCompileConfigError("config", "both config= and config_params= given", "pass only one")
    source = config if config is not None else config_params
    if source is None and args is not None:
        source = getattr(args, "deepspeed_config", None) or getattr(args, "ds_config", None)
    cfg = load_config(source)
    _maybe_init_distributed(dist_init_required, distributed_port)
    world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank() if world_size > 1 else 0
    pipe = cfg.sections.get("pipeline_parallel")
    if pipe is not None:  # DeepSpeed's rule: a pipeline config gets the pipeline engine (train_batch API)
        from dscompile.runtime.pipeline_engine import check_pipeline_world

        check_pipeline_world(world_size, pipe.stages)
        world_size, rank = world_size // pipe.stages, rank // pipe.stages  # batch sizes count pipelines, not stages
    cfg.resolve_batch_sizes(world_size)
    params = list(model_parameters) if model_parameters is not None else [p for p in model.parameters() if p.requires_grad]
    opt = _resolve_optimizer(cfg, optimizer, params)
    if pipe is not None:
        from dscompile.runtime.pipeline_engine import PipelineEngine

        scheduler = _resolve_scheduler(cfg, lr_scheduler, opt)
        engine = PipelineEngine(model, cfg, opt, scheduler)  # keeps only this rank's stages' parameters in opt
        return engine, opt, _build_dataloader(cfg, training_data, collate_fn, world_size, rank), scheduler
    if _zero_section(cfg) is not None:
        # ZeRO moves the optimizer onto the shards, so the scheduler must be built over that one.
        ready = lr_scheduler if lr_scheduler is not None and hasattr(lr_scheduler, "step") else None
        engine = DSCompileEngine(model, cfg, opt, ready)
        if ready is None:
            engine.lr_scheduler = _resolve_scheduler(cfg, lr_scheduler, engine.optimizer)
        opt, scheduler = engine.optimizer, engine.lr_scheduler
    else:
        scheduler = _resolve_scheduler(cfg, lr_scheduler, opt)
        engine = DSCompileEngine(model, cfg, opt, scheduler)
    dataloader = _build_dataloader(cfg, training_data, collate_fn, world_size, rank)
    return engine, opt, dataloader, scheduler


def _maybe_init_distributed(required: bool | None, port: int | None) -> None:
    if not dist.is_available() or dist.is_initialized() or required is False:
        return
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 and not required:
        return
    if port is not None:
        os.environ.setdefault("MASTER_PORT", str(port))
    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")


def _zero_section(config: DSConfig) -> Any:
    section = config.sections.get("zero_optimization")
    return section if section is not None and section.stage > 0 else None


def _agree_any(flag: bool) -> bool:
    t = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def shard_optimizer(optimizer: torch.optim.Optimizer, partition: ZeroPartition) -> torch.optim.Optimizer:
    """The same optimizer (class, groups, hyper-parameters) over the shards instead of the full parameters."""
    if optimizer.state:
        raise DSCompileConfigError("optimizer", "already holds state; ZeRO must partition it before the first step", "build the engine before training")
    groups = []
    for group in optimizer.param_groups:
        entry = {k: v for k, v in group.items() if k != "params"}
        entry["params"] = [partition.shard_for(p) for p in group["params"] if any(p is q for q in partition.full_params)]
        groups.append(entry)
    try:
        return type(optimizer)(groups)
    except TypeError:
        return type(optimizer)(groups, lr=optimizer.defaults.get("lr", 1e-3))
