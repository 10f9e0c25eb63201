"""The one plan (DESIGN.md): ``ParallelPlan``, decided by ``plan_parallel`` from the config and the world size before
compiling, and its text (``dscompile plan``, the dump's ``plan.txt`` written by ``write_plan``).

It gathers the other planner modules' decisions: the rank layout, the effective ZeRO stage and who carries it out,
what is offloaded, ZeRO's communication schedule and the activation-checkpointing plan. Every engine holds one
(``engine.plan``); nobody re-derives these from the config.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dscompile.errors import DSCompileConfigError
from dscompile.planner.checkpointing import CheckpointingPlan, plan_activation_checkpointing
from dscompile.planner.layout import ParallelLayout
from dscompile.planner.offload import OffloadPlan, ParamPlan
from dscompile.planner.zero_schedule import ZeroSchedule, plan_zero_schedule

ZERO_BY_PARTITION = "zero_partition"
ZERO_BY_PIPELINE = "pipeline_gradients"
ZERO_OFF = "none"


@dataclass(frozen=True)
class ParallelPlan:
    """The one plan (DESIGN.md): decided once from the config and the world size before compiling, read by the engines
    (``engine.plan``), ``zero_optimization_stage()``, ``dscompile plan`` and the dump.

    ``zero_stage`` is the ZeRO stage in effect and ``zero_by`` who carries it out: the ZeRO partition
    (``runtime/zero_shard.py``, ``engine.zero``), the pipeline engine's gradient strategy (ZeRO-1 across the
    replicas of each stage, ``runtime/pipeline_gradients.py``; ``engine.zero`` stays None), or nobody (stage 0).
    The offload plans are the engine's once its ZeRO extension placed the states (``with_placements``).
    """

    layout: ParallelLayout
    zero_stage: int = 0
    zero_by: str = ZERO_OFF
    sequence_parallel_size: int = 1
    offload_optimizer: str = "none"  # the device optimizer states go to: none, cpu, nvme
    offload_param: str = "none"  # the device ZeRO-3 parameter shards go to: none, cpu, nvme
    zero_schedule: ZeroSchedule = ZeroSchedule()  # buckets, prefetch, overlap, unsharding: what ZeRO's passes are given
    checkpointing: CheckpointingPlan = CheckpointingPlan()  # what the checkpoint pass is given, or the pipeline's interval
    optimizer_offload: OffloadPlan | None = None
    param_offload: ParamPlan | None = None
    inference: bool = False  # an inference engine's plan (``plan_inference``): only the layout applies

    @property
    def data_parallel_size(self) -> int:
        """Replicas the batch is split over (sequence-parallel ranks share one replica's batch)."""
        return max(1, self.layout.dp_size // self.sequence_parallel_size)

    @property
    def zero_sharded(self) -> bool:
        """True when model states are actually partitioned (a ZeRO stage and more than one replica to share them)."""
        return self.zero_stage > 0 and self.layout.dp_size > 1

    def with_placements(self, optimizer: OffloadPlan | None = None, param: ParamPlan | None = None) -> ParallelPlan:
        """This plan with the offload plans the ZeRO extension made from the partition (the ones already set kept)."""
        return replace(self, optimizer_offload=optimizer or self.optimizer_offload, param_offload=param or self.param_offload)

    def text(self) -> str:
        lay = self.layout
        who = {
            ZERO_BY_PARTITION: "the ZeRO partition (engine.zero)",
            ZERO_BY_PIPELINE: "the pipeline's gradient strategy (optimizer states sharded across each stage's replicas)",
            ZERO_OFF: "nobody",
        }[self.zero_by]
        if self.inference:
            lines = [
                f"inference plan: world {lay.world_size} = data {lay.dp_size} (independent model copies) × tensor {lay.tp_size}",
                "rank order: rank = replica * tensor + tensor_rank (each copy on consecutive ranks)",
                "no ZeRO, offload or activation checkpointing (inference keeps whole weights, or its tensor-parallel slice)",
            ]
            if lay.world_size > 1:
                lines += [f"{kind} groups: {ranks}" for kind, ranks in (("tensor", lay.tp_groups()), ("data", lay.dp_groups())) if len(ranks[0]) > 1]
            return "\n".join(lines)
        lines = [
            f"parallel plan: world {lay.world_size} = pipeline {lay.pp_size} × data {lay.dp_size} × tensor {lay.tp_size}"
            + (f" (sequence parallel {self.sequence_parallel_size} inside the data axis: {self.data_parallel_size} batch replicas)"
               if self.sequence_parallel_size > 1 else ""),
            "rank order: rank = (stage * data + replica) * tensor + tensor_rank (DeepSpeed's pipe, data, model)",
            f"ZeRO stage {self.zero_stage}, carried out by {who}" + ("" if self.zero_sharded or not self.zero_stage else "; one replica: nothing to shard"),
            f"offload: optimizer states {self.offload_optimizer}, parameters {self.offload_param}",
            self.zero_schedule.text(),
            f"activation checkpointing: {self.checkpointing.text()}",
        ]
        if lay.world_size > 1:
            groups = [("tensor", lay.tp_groups()), ("data", lay.dp_groups()), ("pipeline", lay.pp_groups())]
            lines += [f"{kind} groups: {ranks}" for kind, ranks in groups if len(ranks[0]) > 1]
        for plan in (self.param_offload, self.optimizer_offload):
            if plan is not None:
                lines.append(plan.table())
        return "\n".join(lines)


def plan_parallel(config: Any, world_size: int, tp_size: int | None = None) -> ParallelPlan:
    """The parallel plan of ``config`` (a loaded ``DSConfig``) on ``world_size`` ranks.

    ``tp_size``: the tensor-parallel size when a script's model-parallel unit gives it (else the config's
    ``tensor_parallel.autotp_size``). Raises where the layout cannot hold (sizes that do not divide the world,
    ZeRO-2/3 with pipeline stages).
    """
    sections = config.sections
    tc = sections.get("tensor_parallel")
    if tp_size is None:
        tp_size = tc.autotp_size if tc is not None and tc.enabled else 1
    pipe = sections.get("pipeline_parallel")
    layout = ParallelLayout(world_size, tp_size, pipe.stages if pipe is not None else 1)
    sp = int(sections.get("sequence_parallel_size") or 1)
    zc = sections.get("zero_optimization")
    stage = int(zc.stage) if zc is not None else 0
    if pipe is not None and stage > 1:
        raise DSCompileConfigError(
            "zero_optimization.stage",
            f"ZeRO stage {stage} cannot be combined with pipeline parallelism (each rank already holds only its stage's "
            "parameters and gradients)",
            "use stage 1 (optimizer states partitioned across the data-parallel replicas) or 0, as DeepSpeed requires",
        )
    zero_by = ZERO_OFF if stage == 0 else ZERO_BY_PIPELINE if pipe is not None else ZERO_BY_PARTITION
    oc = zc.offload_optimizer if zc is not None and stage > 0 else None
    op = zc.offload_param if zc is not None and stage == 3 else None
    return ParallelPlan(
        layout=layout,
        zero_stage=stage,
        zero_by=zero_by,
        sequence_parallel_size=sp,
        offload_optimizer=oc.device if oc is not None and oc.enabled else "none",
        offload_param=op.device if op is not None and op.enabled else "none",
        zero_schedule=plan_zero_schedule(config),
        checkpointing=plan_activation_checkpointing(config),
    )


PLAN_FILE = "plan.txt"


def write_plan(plan: ParallelPlan, dump_dir: str | os.PathLike[str]) -> Path:
    """``DUMP/plan.txt``: the plan beside the dumped graphs (``print_summaries`` shows it)."""
    root = Path(dump_dir)
    root.mkdir(parents=True, exist_ok=True)
    path = root / PLAN_FILE
    path.write_text(plan.text() + "\n")
    return path
