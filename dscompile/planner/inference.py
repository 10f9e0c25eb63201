"""The inference engine's plan (``plan_inference``, for ``init_inference``): tensor parallelism over consecutive
ranks, data parallelism over the rest; no ZeRO, offload or checkpointing. Kept apart from ``plan.py`` because it is
decided from ``tensor_parallel.tp_size`` and the world alone, not from a training config.
"""

from __future__ import annotations

from dscompile.errors import DSCompileConfigError
from dscompile.planner.layout import ParallelLayout
from dscompile.planner.plan import ParallelPlan


def plan_inference(world_size: int, tp_size: int) -> ParallelPlan:
    """The inference engine's plan (``init_inference``): ``tp_size`` consecutive ranks of tensor parallelism hold one
    copy of the model (``tensor_parallel.tp_size``), data parallelism (independent copies) spans the rest; no ZeRO,
    offload or checkpointing. Raises when ``tp_size`` does not divide the world."""
    if tp_size < 1 or world_size % tp_size:
        raise DSCompileConfigError(
            "tensor_parallel.tp_size",
            f"{tp_size} ranks per model do not divide the world of {world_size} process(es)",
            f"launch with torchrun --nproc-per-node {tp_size} (or a multiple), or lower tp_size",
        )
    return ParallelPlan(layout=ParallelLayout(world_size, tp_size), inference=True)
