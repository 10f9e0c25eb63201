"""The pipeline engine's gradient strategy: tied weights, replicas of a stage, ZeRO-1 across pipelines.

Ranks are laid out by the one rank layout (``dscompile.planner.ParallelLayout``, DeepSpeed's order:
``rank = (stage * dp + data_parallel_rank) * tp + tp_rank``, tensor parallelism innermost). At the accumulation boundary a
parameter used by several stages (tied embeddings) has its gradients summed over the ranks that
hold it, then every stage's gradients are averaged over its data-parallel replicas (in
``engine.context.communication_data_type`` when set). Clipping takes the norm of the whole model: every
stage's squares summed over all ranks, a tied parameter counted once, a parameter tensor parallelism
left whole (replicated on every TP rank) counted once, its split ones summed over their slices. With
``zero_optimization.stage`` 1 each replica of a stage owns about ``1/dp`` of its elements (whole
tensors, greedy, largest first; the same on every replica), keeps only their optimizer state, and
broadcasts them after the step, as DeepSpeed's ZeRO-1 does across pipelines.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dscompile.errors import DSCompileConfigError
from dscompile.planner import ParallelLayout
from dscompile.runtime.comm_stats import tensor_bytes
from dscompile.runtime.devices import collective_device
from dscompile.runtime.gradient_strategy import GradientStrategy
from dscompile.runtime.training_core import TrainingCore


class PipelineGradients(GradientStrategy):
    """Gradients of this rank's stages, made consistent across tied holders and data-parallel replicas."""

    name = "pipeline"

    def __init__(self, *, layout: ParallelLayout, global_rank: int, zero_stage: int) -> None:
        self.layout = layout
        self.stage_id, self.dp_id, self.tp_rank = layout.coordinates(global_rank)
        self.num_stages, self.dp_size, self.tp_size = layout.pp_size, layout.dp_size, layout.tp_size
        self.global_rank, self.world_size = global_rank, layout.world_size
        self.zero_stage = zero_stage
        self.tp_sliced: set[int] = set()  # ids of the parameters tensor parallelism split (the others are replicated)
        self.tp_replicas: dict[int, int] = {}  # ids of split parameters whose slice several TP ranks hold (KV heads) -> how many
        self.params: list[nn.Parameter] = []
        self.names: dict[int, str] = {}
        self.tied: list[tuple[list[nn.Parameter], Any]] = []
        self.owner: dict[int, int] = {}
        self.dp_group: Any = None
        if self.dp_size > 1:  # every rank creates every group, in the same order
            for ranks in layout.dp_groups():
                group = dist.new_group(ranks)
                if global_rank in ranks:
                    self.dp_group = group

    def rank_of(self, dp: int, stage: int, tp: int | None = None) -> int:
        """Global rank of data-parallel replica ``dp``'s ``stage`` at tensor-parallel rank ``tp`` (default: this rank's)."""
        return self.layout.rank_of(stage, dp, self.tp_rank if tp is None else tp)

    @property
    def zero1_sharded(self) -> bool:
        """True when ZeRO-1 partitions this stage's optimizer states across data-parallel replicas."""
        return self.zero_stage == 1 and self.dp_size > 1

    def bind(self, params: list[nn.Parameter], names: dict[int, str], owners: dict[int, set[int]], by_id: dict[int, nn.Parameter]) -> list[nn.Parameter]:
        """Take this rank's parameters once the model is split; returns those its optimizer steps."""
        self.params = params
        self.names = names
        self._make_tied_groups(owners, by_id)
        return self._zero1_partition()

    def _make_tied_groups(self, owners: dict[int, set[int]], by_id: dict[int, nn.Parameter]) -> None:
        tied_sets: dict[tuple[int, ...], list[int]] = {}
        for pid, ranks in owners.items():
            if len(ranks) > 1 and by_id[pid].requires_grad:
                tied_sets.setdefault(tuple(sorted(ranks)), []).append(pid)
        for ranks, pids in sorted(tied_sets.items()):
            for d in range(self.dp_size):
                for t in range(self.tp_size):
                    members = [self.rank_of(d, r, t) for r in ranks]
                    group = dist.new_group(members) if self.world_size > 1 else None
                    if d == self.dp_id and t == self.tp_rank and self.stage_id in ranks:
                        self.tied.append(([by_id[pid] for pid in pids], group))

    def _zero1_partition(self) -> list[nn.Parameter]:
        self.owner = {}
        if not self.zero1_sharded:
            return list(self.params)
        if len(self.params) < self.dp_size:
            raise DSCompileConfigError(
                "zero_optimization.stage",
                f"stage {self.stage_id} has {len(self.params)} parameter tensors, fewer than {self.dp_size} data-parallel replicas to shard over",
                "use ZeRO stage 0 for this layout",
            )
        loads = [0] * self.dp_size
        for i in sorted(range(len(self.params)), key=lambda i: (-self.params[i].numel(), i)):
            d = min(range(self.dp_size), key=lambda d: (loads[d], d))
            self.owner[id(self.params[i])] = d
            loads[d] += self.params[i].numel()
        return [p for p in self.params if self.owner[id(p)] == self.dp_id]

    # -- the step ------------------------------------------------------------------------------
    def trainable_parameters(self) -> list[nn.Parameter]:
        return list(self.params)

    def _all_reduce(self, engine: TrainingCore, params: list[nn.Parameter], group: Any, what: str, divide: int = 1) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dtype = flat.dtype
        if engine.context.communication_data_type is not None:
            flat = flat.to(engine.context.communication_data_type)
        with engine.comm_stats.timed("pipeline", what, tensor_bytes(flat)):
            dist.all_reduce(flat, group=group)
        flat = flat.to(dtype)
        if divide > 1:
            flat /= divide
        offset = 0
        for p in params:
            value = flat[offset : offset + p.numel()].view_as(p)
            if p.grad is None:
                p.grad = value.clone()
            else:
                p.grad.copy_(value)
            offset += p.numel()

    def reduce(self, engine: TrainingCore) -> None:
        for params, group in self.tied:
            self._all_reduce(engine, params, group, "tied_all_reduce")
        if self.dp_size > 1:
            self._all_reduce(engine, self.params, self.dp_group, "data_parallel_all_reduce", self.dp_size)

    def clip(self, engine: TrainingCore, params: list[nn.Parameter], max_norm: float) -> float:
        """Clip by the norm of the whole model: each tied parameter is counted once (lowest rank), and so is
        each parameter tensor parallelism replicates (TP rank 0's); split ones add their slices' squares."""
        skip: set[int] = set()
        for tied, group in self.tied:
            members = dist.get_process_group_ranks(group) if group is not None else [self.global_rank]
            if self.global_rank != min(members):
                skip.update(id(p) for p in tied)
        if self.tp_rank != 0:
            skip.update(id(p) for p in self.params if id(p) not in self.tp_sliced)
        sq = torch.zeros((), dtype=torch.float64, device=collective_device(like=self.params[0] if self.params else None))
        for p in self.params:
            if p.grad is not None and id(p) not in skip:
                sq += p.grad.double().pow(2).sum() / self.tp_replicas.get(id(p), 1)  # a shared slice: counted once
        if self.world_size > 1:
            with engine.comm_stats.timed("pipeline", "norm_all_reduce", tensor_bytes(sq)):
                dist.all_reduce(sq)
            sq /= self.dp_size
        norm = float(sq.sqrt())
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(coef)
        return norm

    def after_optimizer_step(self, engine: TrainingCore) -> None:
        if self.zero1_sharded:
            self._broadcast_updated(engine)

    def _broadcast_updated(self, engine: TrainingCore) -> None:
        """ZeRO-1: every replica sends the parameters it stepped to the others of its stage."""
        group = self.dp_group
        with torch.no_grad():
            for d in range(self.dp_size):
                params = [p for p in self.params if self.owner[id(p)] == d]
                flat = torch.cat([p.detach().reshape(-1) for p in params])
                with engine.comm_stats.timed("pipeline", "zero1_broadcast", tensor_bytes(flat)):
                    dist.broadcast(flat, src=self.rank_of(d, self.stage_id), group=group)
                if d != self.dp_id:
                    offset = 0
                    for p in params:
                        p.copy_(flat[offset : offset + p.numel()].view_as(p))
                        offset += p.numel()

    def zero_grad(self) -> None:
        for p in self.params:  # the optimizer's zero_grad would miss, under ZeRO-1, the parameters other replicas step
            p.grad = None

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's parameters by the model's names (the pipeline never gathers the whole model)."""
        return {self.names[id(p)]: p.detach().clone() for p in self.params if id(p) in self.names}

    def model_state_tensors(self, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
        tensors: list[torch.Tensor] = []
        for p in self.params:
            tensors += [p.data, p.grad]
        if optimizer is not None:
            for st in optimizer.state.values():
                tensors += [v for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        return tensors
