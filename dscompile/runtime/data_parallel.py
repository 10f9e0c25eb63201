"""Plain data parallelism: the engine core's default gradient strategy.

Every rank holds the whole model. At construction rank 0's parameters and buffers are broadcast
(so every rank starts equal); at each accumulation boundary the gradients are averaged with one
flat all-reduce (in ``engine.context.communication_data_type`` when set, with DeepSpeed's
``prescale_gradients`` / ``gradient_predivide_factor``), so the optimizer steps identical
gradients everywhere and clipping needs no further communication. A single process is the same
strategy with nothing to reduce. Checkpoints are one file written by rank 0:
``tag/mp_rank_00_model_states.pt`` (module, optimizer, RNG, and the core's share).
"""

from __future__ import annotations

import contextlib
import random
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dscompile.runtime.checkpoint_io import CheckpointReader, CheckpointWriter
from dscompile.runtime.comm_stats import tensor_bytes
from dscompile.runtime.devices import RngState, accelerator_devices, capture_rng, restore_rng
from dscompile.runtime.engine_core import world_info
from dscompile.runtime.gradient_strategy import GradientStrategy
from dscompile.runtime.sixteen_bit import module_states, saved_module_state
from dscompile.runtime.training_core import MODEL_STATES, TrainingCore
from dscompile.runtime.zero_shard import check_unused_parameters, explain_collective_failure


class DataParallelGradients(GradientStrategy):
    """Whole-model replicas whose gradients are averaged across all ranks."""

    name = "data_parallel"

    def __init__(self, module: nn.Module, group: Any = None, group_ranks: list[int] | None = None) -> None:
        """``group``: the data-parallel group (default the world; tensor parallelism passes its DP group)."""
        self.module = module
        self.group = group
        self.world_size, self.rank = world_info()
        if group_ranks is not None:
            self.world_size = len(group_ranks)
        if self.world_size > 1:
            src = group_ranks[0] if group_ranks is not None else 0
            with torch.no_grad():
                for tensor in list(module.parameters()) + list(module.buffers()):
                    dist.broadcast(tensor, src=src, group=group)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def reduce(self, engine: TrainingCore) -> None:
        """All-reduce every trainable gradient in one flat buffer, the same layout on every rank.

        A parameter that got no gradient on a rank (a branch taken elsewhere) contributes zeros
        there; a count of the ranks that had one travels in the same buffer, so a parameter no rank
        used keeps ``grad=None`` (skipped by the optimizer, as in PyTorch).
        """
        params = self.trainable_parameters()
        if self.world_size == 1 or not params:
            return
        config = engine.config
        flat, grads = self.reduce_buffer(engine, params)
        values = flat[: -len(params)]
        with engine.comm_stats.timed("data_parallel", "all_reduce", tensor_bytes(flat)):
            dist.all_reduce(flat, group=self.group)
        self.finish_average(engine, values)
        counts = [round(c) for c in flat[-len(params) :].tolist()]
        names = {id(p): n for n, p in self.module.named_parameters()}
        check_unused_parameters([names.get(id(p), "?") for p in params], counts, self.world_size, config.sections.get("zero_optimization"))
        offset = 0
        for p, g, count in zip(params, grads, counts, strict=True):
            if count == 0:
                p.grad = None
            else:
                g.copy_(values[offset : offset + g.numel()].view_as(g))
                p.grad = g
            offset += g.numel()

    def reduce_buffer(self, engine: TrainingCore, params: list[nn.Parameter]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """What ``reduce`` all-reduces for ``params``: their gradients (zeros where missing, returned as ``grads``)
        and a has-a-gradient flag each in one flat buffer, in ``communication_data_type`` when set (copied back into
        each gradient's dtype after), the gradients pre-divided as ``prescale_gradients`` /
        ``gradient_predivide_factor`` say. The 1-bit strategy sends it bucket by bucket."""
        config = engine.config
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        present = torch.tensor([float(p.grad is not None) for p in params], dtype=grads[0].dtype, device=grads[0].device)
        flat = torch.cat([g.reshape(-1) for g in grads] + [present])
        if engine.context.communication_data_type is not None:
            flat = flat.to(engine.context.communication_data_type)
        values = flat[: -len(params)]
        if config.prescale_gradients:
            values /= self.world_size
        elif config.gradient_predivide_factor != 1.0:
            values /= config.gradient_predivide_factor
        return flat, grads

    def finish_average(self, engine: TrainingCore, values: torch.Tensor) -> None:
        """The summed gradients in ``values`` (in place) into their mean: what pre-division left to do."""
        config = engine.config
        if not config.prescale_gradients:
            values /= self.world_size / config.gradient_predivide_factor

    def failure_context(self, rank: int, what: str) -> contextlib.AbstractContextManager[None]:
        """On several ranks a failed collective means a dead, stalled or diverged peer: say so."""
        return explain_collective_failure(rank, f"data-parallel {what}") if self.world_size > 1 else contextlib.nullcontext()

    def clip(self, engine: TrainingCore, params: list[nn.Parameter], max_norm: float) -> float:
        # Gradients are equal on every rank after the all-reduce: the local norm is the global one.
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.module.named_parameters()}

    def model_state_tensors(self, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
        tensors: list[torch.Tensor] = []
        for p in self.module.parameters():
            tensors += [p.data, p.grad]
        if optimizer is not None:
            for st in optimizer.state.values():
                tensors += [v for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        return tensors

    # -- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self, engine: TrainingCore, ckpt: CheckpointWriter, client_state: dict | None) -> None:
        """Rank 0 writes ``directory/mp_rank_00_model_states.pt``."""
        if self.rank != 0:
            return
        state = {
            **module_states(self.module),  # "module" in DeepSpeed's dtype (16 bits under bf16/fp16), the fp32 masters beside it
            "optimizer": engine.optimizer.state_dict() if engine.optimizer is not None else None,
            **engine.core_state_dict(client_state),
            "loss_scaler": engine.loss_scaler.state_dict() if hasattr(engine.loss_scaler, "state_dict") else None,  # read on re-layout
            "world_size": self.world_size,
            "rng": {
                "torch": torch.get_rng_state(),
                "python": random.getstate(),
                "devices": capture_rng(accelerator_devices(self.module.parameters())).to_dict(),  # dropout on a GPU draws from these
            },
        }
        ckpt.save(state, MODEL_STATES)

    def load_checkpoint(
        self, engine: TrainingCore, directory: Path, load_optimizer_states: bool, load_lr_scheduler_states: bool, load_module_only: bool
    ) -> dict | None:
        state: dict[str, Any] = CheckpointReader(directory).load(MODEL_STATES)  # verified against the checkpoint's manifest
        self.module.load_state_dict(saved_module_state(state))
        if not load_module_only:
            if load_optimizer_states and engine.optimizer is not None and state["optimizer"] is not None:
                engine.optimizer.load_state_dict(state["optimizer"])
            engine.load_core_state_dict(state, load_lr_scheduler_states)
            torch.set_rng_state(state["rng"]["torch"])
            if "devices" in state["rng"]:
                restore_rng(RngState.from_dict(state["rng"]["devices"]))
            random.setstate(state["rng"]["python"])
        return state["client_state"]
