"""ZeRO's part of the engine: partition at construction, the sharded gradient strategy, checkpoints.

``ZeroExtension.configure`` partitions the parameters (``runtime/zero_shard.py``), hands the engine
a ``ZeroModule`` to compile for stages 2 and 3 (whose graphs carry the reduce-scatters, and ZeRO-3's
all-gathers, placed by the ``zero*`` passes), moves the optimizer onto this rank's flat shards and
installs ``ZeroGradients`` as the engine's gradient strategy:

- ``reduce``: ZeRO-1 reduce-scatters the full gradients once per batch at the accumulation
  boundary; stages 2 and 3 already reduced in the graphs;
- ``clip``: the global norm sums every rank's shard norms;
- ``after_optimizer_step``: the kept full copies (ZeRO-1/2, persistent ZeRO-3 parameters) are
  refreshed from the updated shards (all-gather, or with ``allgather_partitions: false`` one
  broadcast per rank, as DeepSpeed);
- checkpoints are per-rank shard files (``runtime/zero_checkpoint.py``).

Without a process group ZeRO runs as world size 1 (every shard is the whole parameter).
``zero_optimization.ignore_unused_parameters: false`` makes a parameter that got no gradient in a
batch (on any rank) an error naming it, as DeepSpeed does. The optimizer's class is rebuilt over
the shards; that equals the unsharded step only for optimizers that update each element on its own,
so other classes need ``zero_allow_untested_optimizer: true`` (DeepSpeed's key).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dscompile.errors import DSCompileConfigError
from dscompile.runtime.engine_core import EngineExtension
from dscompile.runtime.gradient_strategy import GradientStrategy, scale_gradients_to_norm
from dscompile.runtime.optimizers import DeepSpeedCPUAdam, FusedAdam
from dscompile.runtime.training_core import TrainingCore, params_or_error
from dscompile.runtime.zero_leaf import apply_leaf_module_config
from dscompile.runtime.zero_shard import ZeroModule, ZeroPartition, explain_collective_failure, model_state_tensors

ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adadelta,
    FusedAdam,
    DeepSpeedCPUAdam,
)
"""Optimizers whose update of an element depends on that element alone: stepping flat shards is exact."""


def check_zero_optimizer(optimizer: torch.optim.Optimizer, allow_untested: bool) -> None:
    """Refuse optimizers whose sharded step could differ from the unsharded one, unless allowed."""
    if getattr(optimizer, "over_shards", None) is not None:
        return  # it rebuilds itself over the shards (1-bit Adam), or refuses there with its own reason
    if type(optimizer) in ELEMENTWISE_OPTIMIZERS or allow_untested:
        return
    names = ", ".join(cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS)
    raise DSCompileConfigError(
        "zero_allow_untested_optimizer",
        f"ZeRO steps {type(optimizer).__name__} on flat per-rank shards; that equals the unsharded step only for optimizers "
        f"that update every element on its own (tested: {names}), and {type(optimizer).__name__} is not one of them",
        'use one of those, or set "zero_allow_untested_optimizer": true if its update is element-wise',
    )


FUSED_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps")


def _fusable(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    """Adam/AdamW whose implementation the user left open (``fused`` and ``foreach`` both None): step the
    shards with torch's fused kernel. On CPU it makes one pass over memory per shard where the default
    for-loop makes about ten (a ZeRO step's largest single cost there; results differ only in rounding)."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    if group.get("fused") is not None or group.get("foreach") is not None or group.get("differentiable") or group.get("capturable"):
        return False
    params = group["params"]
    return bool(params) and all(p.is_floating_point() and p.device.type in FUSED_DEVICE_TYPES for p in params)


def shard_optimizer(optimizer: torch.optim.Optimizer, partition: ZeroPartition, fuse: bool = True) -> torch.optim.Optimizer:
    """The same optimizer (class, groups, hyper-parameters) over the shards instead of the full parameters."""
    if optimizer.state:
        raise DSCompileConfigError("optimizer", "already holds state; ZeRO must partition it before the first step", "build the engine before training")
    groups = []
    for group in optimizer.param_groups:
        entry = {k: v for k, v in group.items() if k != "params"}
        entry["params"] = [partition.shard_for(p) for p in group["params"] if any(p is q for q in partition.full_params)]
        if fuse and _fusable(optimizer, entry):
            entry["fused"] = True
        groups.append(entry)
    over_shards = getattr(optimizer, "over_shards", None)
    if over_shards is not None:  # settings outside the param groups (1-bit Adam's freeze_step) travel too
        return over_shards(groups)
    try:
        return type(optimizer)(groups)
    except TypeError:
        return type(optimizer)(groups, lr=optimizer.defaults.get("lr", 1e-3))


def take_param_groups(optimizer: torch.optim.Optimizer, sharded: torch.optim.Optimizer) -> None:
    """``optimizer`` (without state yet) takes ``sharded``'s parameter groups: the same object now steps the shards.

    For an engine that partitions after ``initialize`` returned (tensor parallelism splits the model at
    its first batch), so that the optimizer the user holds is the one stepped.
    """
    if optimizer.state:
        raise DSCompileConfigError("optimizer", "already holds state; ZeRO must partition it before the first step", "build the engine before training")
    optimizer.param_groups.clear()
    for group in sharded.param_groups:
        optimizer.add_param_group(dict(group))
    optimizer.defaults = dict(sharded.defaults)


class ZeroGradients(GradientStrategy):
    """Flat per-rank shards: the optimizer steps them, gradients arrive reduced into them."""

    name = "zero"

    def __init__(self, partition: ZeroPartition, ignore_unused_parameters: bool = True) -> None:
        self.partition = partition
        self.ignore_unused_parameters = ignore_unused_parameters

    def trainable_parameters(self) -> list[nn.Parameter]:
        return list(self.partition.shards)

    def reduce(self, engine: TrainingCore) -> None:
        zero = self.partition
        if zero.stage != 1:
            if not self.ignore_unused_parameters:
                self._refuse_unused()
            return  # ZeRO-2/3 reduce-scattered in the backward graphs; ZeRO-1's reduce below checks its agreed counts
        zero.comm_dtype = engine.context.communication_data_type
        zero.predivisor = engine.config.gradient_predivisor(zero.world)
        itemsize = (engine.context.communication_data_type or zero.shards[0].dtype).itemsize
        nbytes = sum(layout.shard_numel * zero.world for layout in zero.layouts) * itemsize
        with engine.comm_stats.timed("zero", "reduce_scatter", nbytes if zero.world > 1 else 0):
            zero.reduce_gradients()  # ZeRO-1: the only gradient communication, once per batch

    def _refuse_unused(self) -> None:
        """``ignore_unused_parameters: false``: every rank raises together, naming the parameters and on how many ranks."""
        zero = self.partition
        if zero.stage == 1:  # full gradients differ per rank: agree on the counts first
            zero.check_unused(zero.gradient_counts([p.grad is not None for p in zero.full_params]))
        else:  # shards' gradients come from graphs every rank runs alike
            zero.check_unused()

    def clip(self, engine: TrainingCore, params: list[nn.Parameter], max_norm: float) -> float:
        world = self.partition.world
        with engine.comm_stats.timed("zero", "clip_norm.all_reduce", 4 if world > 1 else 0):
            total = float(self.partition.grad_norm_squared().sqrt())  # one fp32 scalar summed over the ranks
        return scale_gradients_to_norm(params, total, max_norm)

    def after_optimizer_step(self, engine: TrainingCore) -> None:
        zero = self.partition
        if not any(layout.persistent for layout in zero.layouts):
            return  # ZeRO-3 with nothing kept whole: the graphs gather what they use
        nbytes = sum(layout.shard_numel * zero.world for layout in zero.layouts if layout.persistent) * zero.shards[0].element_size()
        op = "all_gather" if zero.allgather_partitions else "broadcast"
        with engine.comm_stats.timed("zero", op, nbytes if zero.world > 1 else 0):
            zero.gather_full_params()  # refresh the full copies kept on every rank

    def zero_grad(self) -> None:
        self.partition.zero_grad()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return self.partition.full_state()

    def model_state_tensors(self, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
        return model_state_tensors(self.partition, optimizer)

    def failure_context(self, rank: int, what: str) -> contextlib.AbstractContextManager[None]:
        """Under multi-rank ZeRO a failed collective means a dead, stalled or diverged peer: say so."""
        return explain_collective_failure(rank, f"ZeRO {what}") if self.partition.world > 1 else contextlib.nullcontext()

    def save_checkpoint(self, engine: TrainingCore, ckpt: Any, client_state: dict | None) -> None:
        from dscompile.runtime import zero_checkpoint

        zero_checkpoint.save(engine, ckpt, client_state)

    def load_checkpoint(
        self, engine: TrainingCore, directory: Path, load_optimizer_states: bool, load_lr_scheduler_states: bool, load_module_only: bool
    ) -> dict | None:
        from dscompile.runtime import zero_checkpoint

        return zero_checkpoint.load(engine, directory, load_optimizer_states, load_lr_scheduler_states, load_module_only)


class ZeroExtension(EngineExtension):
    """Partitions the model at engine construction and installs ``ZeroGradients``."""

    name = "zero"

    def __init__(self, zc: Any) -> None:
        self.zc = zc
        self.partition: ZeroPartition | None = None

    def configure(self, engine: TrainingCore) -> None:
        if not self.zc.compute_grad_norm and engine.config.gradient_clipping > 0:
            raise DSCompileConfigError(
                "zero_optimization.compute_grad_norm", "false needs gradient_clipping 0: clipping computes the norm (as DeepSpeed refuses it)",
                "drop compute_grad_norm, or set gradient_clipping to 0",
            )
        engine.context.grad_norm_every_step = bool(self.zc.compute_grad_norm)  # get_global_grad_norm() every step, as DeepSpeed's ZeRO
        if engine.optimizer is not None:
            check_zero_optimizer(engine.optimizer, bool(engine.config.zero_allow_untested_optimizer))
        params_or_error(engine.module, needs_training=True)
        later = engine.context.after_parameters_split
        if later is not None:  # tensor parallelism reshapes the parameters at the first batch: partition its slices then
            later.append(lambda split: self._partition_split(engine, split))
            return
        self._partition(engine)

    def _partition_split(self, engine: TrainingCore, split: nn.Module) -> nn.Module:
        """Partition the parameters of a model split at its first batch; the module to run in its place.

        ``split`` runs the model on the same ``nn.Parameter`` objects, under the same names (tensor
        parallelism's split graph). ZeRO-2/3 run it over the shards, as ``ZeroModule`` runs the model.
        The optimizer ``initialize`` returned is moved onto the shards in place: it is the one stepped.
        """
        self._partition(engine, keep_optimizer_object=True)
        if self.zc.stage >= 2:
            assert self.partition is not None
            return ZeroModule(split, self.partition)
        return split

    def _partition(self, engine: TrainingCore, keep_optimizer_object: bool = False) -> None:
        zc = self.zc
        params = params_or_error(engine.module, needs_training=True)
        threshold = zc.stage3_param_persistence_threshold if zc.stage == 3 else 0
        apply_leaf_module_config(engine.module, zc.leaf_modules)  # as DeepSpeed, at every stage; ZeRO-3 gathers each leaf as a unit
        groups = engine.context.process_groups  # ZeRO shards over the data-parallel group only
        self.partition = ZeroPartition(
            engine.module,
            zc.stage,
            groups.dp_group if groups is not None else None,
            threshold,
            bucket_bytes=engine.plan.zero_schedule.reduce_bucket_elements * params[0].element_size(),  # the planner's bucket
            model_persistence_threshold=zc.stage3_model_persistence_threshold if zc.stage == 3 else None,
            allgather_partitions=zc.allgather_partitions,
            ignore_unused_parameters=zc.ignore_unused_parameters,
        )
        engine.context.zero = self.partition  # the handle checkpoints, tests and tools read
        if zc.stage >= 2 and not keep_optimizer_object:
            engine.context.compile_target = ZeroModule(engine.module, self.partition)
        if engine.optimizer is not None:
            # Offloaded host steps keep torch's fused CPU AdamW (the fast one) and stay bitwise equal to no offload:
            # cpu offload steps whole shards, NVMe tiles cut shards only at vector-aligned positions (CUT_ELEMENTS).
            sharded = shard_optimizer(engine.optimizer, self.partition)
            if keep_optimizer_object and type(sharded) is type(engine.optimizer):
                take_param_groups(engine.optimizer, sharded)
            else:
                engine.replace_optimizer(sharded)  # the scheduler follows
        engine.install_gradients(ZeroGradients(self.partition, zc.ignore_unused_parameters))
