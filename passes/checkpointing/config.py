"""The ``activation_checkpointing`` section and the ``checkpoint`` pass's options.

DeepSpeed's keys keep their meaning where a compiler can honour them (plus ``policy`` and ``memory_budget``);
importing this module registers the section and the config rule that maps it to a ``checkpoint(...)`` item.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from dscompile.config import parse_dataclass, register_section
from dscompile.errors import DSCompileConfigError, DSCompileNotSupportedError
from dscompile.pipeline import invocation, register_config_rule
from dscompile.planner import checkpointing_of

Policy = Literal["none", "full", "selective", "budget"]


@dataclass
class ActivationCheckpointingConfig:
    """``activation_checkpointing``: DeepSpeed's keys keep their meaning where a compiler can honour them.

    ``policy`` defaults to ``budget`` when ``memory_budget`` is given and to ``full`` otherwise
    (a DeepSpeed user who configures checkpointing checkpoints every block).
    ``number_checkpoints`` groups consecutive blocks into that many checkpointed segments
    (or, for a model without repeated blocks, cuts its forward into that many segments).
    ``partition_group_size`` (dscompile's own key) names the ranks ``partition_activations`` shards
    across: consecutive ranks in groups of that size, which must compute identical activations
    (DeepSpeed takes them from its ``mpu``'s model-parallel group).
    """

    partition_activations: bool = False
    partition_group_size: int | None = None
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False
    policy: Policy | None = None
    memory_budget: float | None = None

    def validate(self, path: str) -> None:
        if self.memory_budget is not None and not 0.0 <= self.memory_budget <= 1.0:
            raise DSCompileConfigError(f"{path}.memory_budget", f"must be between 0 and 1, got {self.memory_budget}")
        if self.policy is None:
            self.policy = "budget" if self.memory_budget is not None else "full"
        if self.policy == "budget" and self.memory_budget is None:
            raise DSCompileConfigError(f"{path}.memory_budget", "policy 'budget' needs a memory_budget", "set e.g. \"memory_budget\": 0.5")
        if self.policy != "budget" and self.memory_budget is not None:
            raise DSCompileConfigError(
                f"{path}.memory_budget", f"is only used by policy 'budget', but policy is {self.policy!r}", "drop memory_budget or set policy to 'budget'"
            )
        if self.number_checkpoints is not None and self.number_checkpoints <= 0:
            raise DSCompileConfigError(f"{path}.number_checkpoints", f"must be positive, got {self.number_checkpoints}")
        if self.partition_group_size is not None:
            if self.partition_group_size <= 0:
                raise DSCompileConfigError(f"{path}.partition_group_size", f"must be positive, got {self.partition_group_size}")
            if not self.partition_activations:
                raise DSCompileConfigError(f"{path}.partition_group_size", "is only used with partition_activations",
                                           "set \"partition_activations\": true or drop partition_group_size")
        if self.contiguous_memory_optimization:
            # DeepSpeed copies checkpoints into one preallocated buffer; not built here.
            raise DSCompileNotSupportedError(f"{path}.contiguous_memory_optimization", "contiguous checkpoint buffers")


class PartitionGroupMissingError(DSCompileConfigError):
    """``partition_activations`` on several ranks without ``partition_group_size``: sharding is only
    valid across ranks that compute identical activations (DeepSpeed's model-parallel group), and
    dscompile cannot know which ranks do (data-parallel ranks do not), so it refuses to guess."""

    def __init__(self, world_size: int, key: str = "activation_checkpointing.partition_group_size") -> None:
        super().__init__(
            key,
            f"partition_activations on {world_size} ranks needs the group of ranks that compute identical activations "
            "(DeepSpeed shards across its model-parallel group); data-parallel ranks hold different activations, "
            "so there is nothing to partition across them",
            f"set partition_group_size to the number of consecutive ranks that are replicas (a divisor of {world_size}), "
            "or set partition_activations to false (to cut activation memory use policy 'full' or a memory_budget)",
        )


def _parse_section(value: Any, path: str) -> ActivationCheckpointingConfig:
    return parse_dataclass(ActivationCheckpointingConfig, value, path)


register_section("activation_checkpointing", _parse_section, "activation checkpointing")


@register_config_rule(85, "checkpointing")  # after the clean-up: it plans on the joint graph the partitioner gets
def _checkpointing_rule(config: Any) -> list[Any]:
    """The ``checkpoint`` pass with the planner's decision (``planner.CheckpointingPlan``, the engine's plan when an
    engine compiles)."""
    plan = checkpointing_of(config)
    if plan.policy is None:
        return []
    return [
        invocation(
            "checkpoint",
            policy=plan.policy,
            budget=plan.memory_budget,
            number_checkpoints=plan.number_checkpoints,
            cpu_offload=plan.cpu_offload,
            partition_activations=plan.partition_activations,
            partition_group_size=plan.partition_group_size,
            profile=plan.profile,
            synchronize_boundary=plan.synchronize_boundary,
        )
    ]


@dataclass
class CheckpointOptions:
    policy: Literal["auto", "none", "full", "selective", "budget"] = field(
        default="auto", metadata={"help": "auto: budget when budget is given, else full"}
    )
    budget: float | None = field(default=None, metadata={"help": "fraction (0..1) of the bytes saved without checkpointing to keep"})
    number_checkpoints: int = field(default=0, metadata={"help": "segments for policy full (0: one per block)"})
    cpu_offload: bool = field(default=False, metadata={"help": "move saved activations to host memory"})
    partition_activations: bool = field(default=False, metadata={"help": "shard saved activations across ranks"})
    partition_group_size: int = field(default=0, metadata={"help": "consecutive ranks with identical activations to shard across"})
    profile: bool = field(default=False, metadata={"help": "log the decision of every graph at INFO"})
    synchronize_boundary: bool = field(default=False, metadata={"help": "DeepSpeed's synchronize_checkpoint_boundary (no effect)"})

    def resolved_policy(self) -> str:
        if self.policy == "auto":
            return "budget" if self.budget is not None else "full"
        return self.policy

    def __post_init__(self) -> None:
        if self.budget is not None and not 0.0 <= self.budget <= 1.0:
            raise ValueError(f"budget must be between 0 and 1, got {self.budget}")
        if self.policy == "budget" and self.budget is None:
            raise ValueError("policy=budget needs budget=<0..1>")
        if self.partition_group_size < 0:
            raise ValueError(f"partition_group_size must be >= 0, got {self.partition_group_size}")
