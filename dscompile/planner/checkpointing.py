"""The activation-checkpointing plan (``CheckpointingPlan``): what forward saves and backward recomputes.

``plan_activation_checkpointing`` decides it from the ``activation_checkpointing`` section (else the pipeline's
recompute interval); the ``checkpoint`` pass reads it through ``checkpointing_of``, never from the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CheckpointingPlan:
    """What forward saves and backward recomputes: the ``checkpoint`` pass's options (``passes/checkpointing``'s config
    rule reads them from the plan), or the pipeline's recompute interval."""

    policy: str | None = None  # none, full, selective or budget; None: no activation_checkpointing section, no pass
    memory_budget: float | None = None  # policy budget: the share (0..1) of the bytes saved without checkpointing kept
    number_checkpoints: int = 0  # policy full: checkpointed segments (0: one per block)
    cpu_offload: bool = False  # saved activations go to host memory
    partition_activations: bool = False  # saved activations sharded across partition_group_size ranks
    partition_group_size: int = 0
    profile: bool = False  # log each graph's decision
    synchronize_boundary: bool = False
    pipeline_interval: int = 0  # pipeline stages recompute every this many layers in backward (0: not a pipeline's)

    def text(self) -> str:
        if self.policy is not None:
            out = f"policy {self.policy}" + (f", memory budget {self.memory_budget}" if self.memory_budget is not None else "")
            if self.number_checkpoints:
                out += f", {self.number_checkpoints} segments"
            if self.cpu_offload:
                out += ", saved activations on the host"
            if self.partition_activations:
                out += f", saved activations partitioned across {self.partition_group_size or 'the'} ranks"
            return out
        if self.pipeline_interval:
            return f"pipeline stages recompute every {self.pipeline_interval} layer(s) in backward"
        return "none"


def plan_activation_checkpointing(config: Any) -> CheckpointingPlan:
    """The checkpointing plan of ``config``: its ``activation_checkpointing`` section, else the pipeline's interval."""
    sections = getattr(config, "sections", {})
    ac = sections.get("activation_checkpointing")
    if ac is not None:
        return CheckpointingPlan(
            policy=ac.policy,
            memory_budget=ac.memory_budget,
            number_checkpoints=ac.number_checkpoints or 0,
            cpu_offload=bool(ac.cpu_checkpointing),
            partition_activations=bool(ac.partition_activations),
            partition_group_size=ac.partition_group_size or 0,
            profile=bool(ac.profile),
            synchronize_boundary=bool(ac.synchronize_checkpoint_boundary),
        )
    pipe = sections.get("pipeline_parallel")
    return CheckpointingPlan(pipeline_interval=int(pipe.activation_checkpoint_interval or 0) if pipe is not None else 0)
