"""``TensorParallelExtension``: tensor parallelism's part in the engine core.

At init it refuses what TP does not combine with yet, lays out the TP x DP groups, broadcasts the weights, wraps
the model in ``TensorParallelModule`` and installs gradient averaging over the DP group; once the first batch has
split the model it runs the extensions that partition parameters themselves (ZeRO) and restores deferred states.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dscompile.errors import DSCompileConfigError
from dscompile.passes.tensor_parallel.config import TensorParallelConfig, split_graph_sections, tensor_parallel_config
from dscompile.passes.tensor_parallel.graph_facts import SECTION
from dscompile.passes.tensor_parallel.module import TensorParallelModule
from dscompile.passes.tensor_parallel.split import TensorParallelPlan
from dscompile.planner import PlannedConfig
from dscompile.runtime.engine_core import EngineExtension, register_engine_extension
from dscompile.runtime.process_groups import ProcessGroups, process_groups_for
from dscompile.runtime.tensor_parallel import SliceSpec, gather_slices
from dscompile.runtime.tensor_parallel_checkpoint import restore_optimizer
from dscompile.runtime.tensor_parallel_gradients import TensorParallelGradients, TensorParallelOver
from dscompile.runtime.training_core import TrainingCore


def refuse_untested_compositions(engine: TrainingCore) -> None:
    """What tensor parallelism is not built to combine with yet: a clear error, never a silently wrong step."""
    sections = engine.config.sections
    zero = sections.get("zero_optimization")
    clashes = {
        "zero_optimization.offload_optimizer": zero is not None and getattr(zero.offload_optimizer, "enabled", False),
        "pipeline": sections.get("pipeline_parallel") is not None or engine.runs_pipeline,
    }
    for key, clash in clashes.items():
        if clash:
            raise DSCompileConfigError(SECTION, f"tensor parallelism together with {key} is not built yet", f"remove {key} or the tensor_parallel section")
    refuse_layouts_per_head(sections, "tensor parallelism", "turn tensor_parallel off")


def refuse_layouts_per_head(sections: Mapping[str, Any], parallelism: str, fix: str) -> None:
    """Under tensor or sequence parallelism each rank's attention holds a share of the heads, and the sparse
    attention pass would give it the first heads' layouts: a layout per head is refused, not silently wrong."""
    sparse = sections.get("sparse_attention")
    if sparse is not None and getattr(sparse, "different_layout_per_head", False):
        raise DSCompileConfigError(
            "sparse_attention.different_layout_per_head",
            f"a layout per head under {parallelism} (each rank attends with a share of the heads) is not built",
            f"set different_layout_per_head to false, or {fix}",
        )


class TensorParallelExtension(EngineExtension):
    """Lays out the groups, wraps the model, and installs data parallelism over the DP group only."""

    name = "tensor_parallel"

    def __init__(self, tc: TensorParallelConfig) -> None:
        self.tc = tc
        self.groups: ProcessGroups | None = None
        self.module: TensorParallelModule | None = None

    def configure(self, engine: TrainingCore) -> None:
        refuse_untested_compositions(engine)
        groups = process_groups_for(self.tc.autotp_size)  # those tp_model_init laid out, or new ones
        self.groups = groups
        if engine.world_size > 1:
            with torch.no_grad():  # every rank slices the same full weights
                for tensor in list(engine.module.parameters()) + list(engine.module.buffers()):
                    dist.broadcast(tensor, src=0)
        # the split graph compiles under the engine's config, less this section (the frontend refuses it on its own),
        # and under the engine's plan as it is when the graph compiles (at the first batch: a plan swapped in before counts)
        split_config = dataclasses.replace(engine.config, sections=split_graph_sections(engine.config.sections))
        options = (lambda: PlannedConfig(split_config, engine.plan)) if engine.context.compiles_model else None
        engine.context.compiles_model = False  # the module compiles its split graph itself
        self.module = TensorParallelModule(engine.module, groups, self.tc, options, self._after_split)
        engine.context.compile_target = self.module
        engine.context.process_groups = groups
        engine.install_gradients(TensorParallelGradients(engine.module, groups, self.slices, defer_optimizer=self._defer_optimizer))
        self.engine = engine
        self._pending: Any = None  # a checkpoint's optimizer states (and generators) loaded before the first batch split the model
        # extensions that partition parameters themselves (ZeRO) append here: run once the model is split, each
        # takes the module that runs the split graph and returns the one to run (ZeRO-2/3 wrap it over their shards)
        engine.context.after_parameters_split = []

    def _after_split(self, split: nn.Module) -> nn.Module:
        """Run the extensions waiting for the split parameters; each may wrap the module that runs (ZeRO-2/3)."""
        engine = self.engine
        for callback in engine.context.after_parameters_split or ():
            split = callback(split)
        if not isinstance(engine.gradients, TensorParallelGradients):  # ZeRO-1 took over: gather its TP slices too
            engine.install_gradients(TensorParallelOver(engine.gradients, self.groups, self.slices))  # type: ignore[arg-type]
        if self._pending is not None:
            assert self.groups is not None
            restore_optimizer(engine, self._pending, self.slices(), self.groups)
            self._pending = None
        return split

    def _defer_optimizer(self, full: Any) -> None:
        """``load_checkpoint`` before the first batch: the optimizer states wait until the slices (and shards) exist."""
        self._pending = full

    @property
    def plan(self) -> TensorParallelPlan | None:
        """The pass's decisions (None until the first batch captured the graph)."""
        return self.module.plan if self.module is not None else None

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Every parameter's gradient at the unpartitioned shape (a collective over the TP group): for checks."""
        assert self.groups is not None and self.module is not None
        specs = self.slices()
        out = {}
        for name, p in self.module.model.named_parameters():
            if p.grad is not None:
                g = p.grad.detach()
                out[name] = specs[name].assemble(gather_slices(g, self.groups)) if name in specs else g.clone()
        return out

    def slices(self) -> dict[str, SliceSpec]:
        return self.module.plan.slices if self.module is not None and self.module.plan is not None else {}

    def counters(self) -> dict[str, Any]:
        plan = self.module.plan if self.module is not None else None
        if plan is None:
            return {}
        out = {"tp_size": plan.tp_size, "blocks_split": len(plan.split), "blocks_replicated": len(plan.replicated)}
        if plan.sequence_parallel is not None:
            sp = plan.sequence_parallel
            gathers = sp["all_gathers_before_blocks"] + sp["all_gathers_for_readers"]
            out |= {"sequence_parallel": True, "sp_reduce_scatters": sp["reduce_scatters"], "sp_all_gathers": gathers}
        return out


@register_engine_extension(8, "tensor_parallel")
def _tensor_parallel_extension(config: Any) -> EngineExtension | None:
    tc = tensor_parallel_config(config)
    return TensorParallelExtension(tc) if tc is not None else None
