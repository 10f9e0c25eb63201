"""The gradient strategies of tensor parallelism: data parallelism over the DP group on TP slices.

``TensorParallelGradients`` (no ZeRO) and ``TensorParallelOver`` (ZeRO over the DP group, on slices)
count sliced parameters once per TP group in norms, assemble full parameters over the TP group, and
save and load checkpoints cut to this rank's slices (``tensor_parallel_checkpoint``). The collectives
and slicing they use are ``runtime/tensor_parallel.py``'s.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dscompile.errors import DSCompileConfigError
from dscompile.runtime import tensor_parallel_checkpoint
from dscompile.runtime.checkpoint_formats import checkpoint_kind, read_full_state
from dscompile.runtime.data_parallel import DataParallelGradients
from dscompile.runtime.devices import accelerator_devices, capture_rng
from dscompile.runtime.gradient_strategy import GradientStrategy, scale_gradients_to_norm
from dscompile.runtime.process_groups import ProcessGroups
from dscompile.runtime.sixteen_bit import module_states
from dscompile.runtime.tensor_parallel import SliceSpec, gather_slices, slicing_metadata, tp_file_name
from dscompile.runtime.training_core import TrainingCore
from dscompile.runtime.zero_checkpoint import optimizer_param_names


class TensorParallelGradients(DataParallelGradients):
    """Data parallelism over the DP group; sliced parameters counted once per TP group in norms."""

    name = "tensor_parallel"

    def __init__(
        self, module: nn.Module, groups: ProcessGroups, slices: Callable[[], dict[str, SliceSpec]], defer_optimizer: Callable[[Any], None] | None = None
    ) -> None:
        super().__init__(module, group=groups.dp_group, group_ranks=groups.dp_ranks)
        self.groups = groups
        self._slices = slices  # the pass's plan, known after the first forward captured the graph
        self.defer_optimizer = defer_optimizer  # keeps a checkpoint's optimizer states loaded before the split for after it

    def _sliced_ids(self) -> dict[int, int]:
        """Sliced parameters (by id) -> how many TP ranks hold each copy of their slice (``SliceSpec.replicas``)."""
        specs = self._slices()
        return {id(p): specs[n].replicas for n, p in self.module.named_parameters() if n in specs}

    def clip(self, engine: TrainingCore, params: list[nn.Parameter], max_norm: float) -> float:
        sliced = self._sliced_ids()
        grads = [p for p in params if p.grad is not None]
        if not grads:
            return 0.0
        device = grads[0].grad.device
        sq_sliced = torch.zeros((), dtype=torch.float64, device=device)
        sq_whole = torch.zeros((), dtype=torch.float64, device=device)
        for p in grads:
            sq = p.grad.detach().double().pow(2).sum()
            if id(p) in sliced:
                sq_sliced += sq / sliced[id(p)]  # a slice held by several ranks: counted once over the group
            else:
                sq_whole += sq
        if self.groups.tp_size > 1:
            dist.all_reduce(sq_sliced, group=self.groups.tp_group)
        total = float((sq_sliced + sq_whole).sqrt())
        return scale_gradients_to_norm(grads, total, max_norm)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter at its unpartitioned shape (a collective over the TP group)."""
        specs = self._slices()
        out: dict[str, torch.Tensor] = {}
        for name, p in self.module.named_parameters():
            spec = specs.get(name)
            out[name] = spec.assemble(gather_slices(p.detach(), self.groups)) if spec is not None else p.detach().clone()
        return out

    # -- checkpoints: one file per TP rank (DeepSpeed's mp_rank_XX names), written by DP rank 0 --------
    def save_checkpoint(self, engine: TrainingCore, ckpt: Any, client_state: dict | None) -> None:
        """``mp_rank_{tp:02d}_model_states.pt``: this rank's slices, optimizer, the core's share, and the slicing."""
        specs = self._slices()
        if not specs:
            raise RuntimeError("save_checkpoint before the first batch: the model is not split yet (train one step first)")
        if self.groups.dp_rank != 0:
            return  # DP replicas hold the same slices and optimizer states
        state = {
            **module_states(self.module),  # "module" in DeepSpeed's dtype, the fp32 masters beside it
            "optimizer": engine.optimizer.state_dict() if engine.optimizer is not None else None,
            "optimizer_param_names": optimizer_param_names(engine),
            **engine.core_state_dict(client_state),
            "loss_scaler": engine.loss_scaler.state_dict() if hasattr(engine.loss_scaler, "state_dict") else None,
            "tensor_parallel": slicing_metadata(self.groups, specs),
            "rng": {
                "torch": torch.get_rng_state(),
                "python": random.getstate(),
                "devices": capture_rng(accelerator_devices(self.module.parameters())).to_dict(),  # dropout on a GPU draws from these
            },
        }
        ckpt.save(state, tp_file_name(self.groups.tp_rank))

    def load_checkpoint(
        self, engine: TrainingCore, directory: Any, load_optimizer_states: bool, load_lr_scheduler_states: bool, load_module_only: bool
    ) -> dict | None:
        """Any checkpoint (TP of any size, with or without ZeRO; ZeRO; DeepSpeed's) cut to this rank's slices."""
        full, kind = read_full_state(directory, engine), checkpoint_kind(directory)
        return tensor_parallel_checkpoint.load(
            engine, directory, full, kind, load_optimizer_states, load_lr_scheduler_states, load_module_only, self.groups, self._slices(), self.defer_optimizer
        )


class TensorParallelOver(GradientStrategy):
    """Another strategy (ZeRO-1 over the DP group) running on TP slices: its work, with full parameters assembled over TP."""

    def __init__(self, inner: GradientStrategy, groups: ProcessGroups, slices: Callable[[], dict[str, SliceSpec]]) -> None:
        self.inner = inner
        self.groups = groups
        self._slices = slices
        self.name = f"tensor_parallel+{inner.name}"

    def __getattr__(self, name: str) -> Any:  # everything not overridden is the inner strategy's
        return getattr(self.__dict__["inner"], name)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return self.inner.trainable_parameters()

    def reduce(self, engine: TrainingCore) -> None:
        self.inner.reduce(engine)

    def clip(self, engine: TrainingCore, params: list[nn.Parameter], max_norm: float) -> float:
        """By the global norm: shard squares summed over the DP group, and the TP slices' also over the TP group."""
        partition = engine.context.zero
        assert partition is not None  # wraps ZeRO's strategy: ZeRO published its partition
        specs = self._slices()
        device = partition.shards[0].device
        sq = torch.zeros(2, dtype=torch.float64, device=device)  # [sliced, replicated over TP]
        for layout, shard in zip(partition.layouts, partition.shards):
            if shard.grad is not None:
                spec = specs.get(layout.name)  # a slice held by several ranks (replicas): counted once over the group
                sq[0 if spec is not None else 1] += shard.grad.detach().double().pow(2).sum() / (spec.replicas if spec is not None else 1)
        if partition.world > 1:
            dist.all_reduce(sq, group=partition.group)
        if self.groups.tp_size > 1:
            sliced = sq[:1].clone()
            dist.all_reduce(sliced, group=self.groups.tp_group)
            sq[0] = sliced[0]
        total = float(sq.sum().sqrt())
        return scale_gradients_to_norm(params, total, max_norm)

    def after_optimizer_step(self, engine: TrainingCore) -> None:
        self.inner.after_optimizer_step(engine)

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        specs = self._slices()
        return {n: specs[n].assemble(gather_slices(v, self.groups)) if n in specs else v for n, v in self.inner.full_parameters().items()}

    def model_state_tensors(self, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
        return self.inner.model_state_tensors(optimizer)

    def failure_context(self, rank: int, what: str) -> Any:
        return self.inner.failure_context(rank, what)

    def save_checkpoint(self, engine: TrainingCore, ckpt: Any, client_state: dict | None) -> None:
        """Each TP rank's ZeRO group writes a ZeRO checkpoint of its slices (DeepSpeed's ``mp_rank_XX`` names)."""
        if engine.context.zero is None:  # refused on every rank alike, before anything is written
            raise DSCompileConfigError(
                "tensor_parallel", f"checkpoints of tensor parallelism under {self.inner.name} are not built", "save the weights with engine.save_16bit_model()"
            )
        tensor_parallel_checkpoint.save_under_zero(engine, ckpt, client_state, self.groups, self._slices())

    def load_checkpoint(
        self, engine: TrainingCore, directory: Any, load_optimizer_states: bool, load_lr_scheduler_states: bool, load_module_only: bool
    ) -> dict | None:
        """Any checkpoint cut to this rank's slices, then sharded as ZeRO holds them."""
        full, kind = read_full_state(directory, engine), checkpoint_kind(directory)
        return tensor_parallel_checkpoint.load(
            engine, directory, full, kind, load_optimizer_states, load_lr_scheduler_states, load_module_only, self.groups, self._slices(), None
        )
