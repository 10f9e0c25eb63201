"""ZeRO's communication schedule (``ZeroSchedule``): bucket sizes, the ZeRO-3 prefetch window, live-parameter and
reuse limits, the unshard budget, whether reductions overlap, profiling.

``plan_zero_schedule`` decides it from the config's ``zero_optimization`` section alone (not the world size), so a
plain ``torch.compile`` and an engine get the same schedule; ZeRO's passes read it through ``zero_schedule_of``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ZeroSchedule:
    """ZeRO's communication schedule (sizes in elements, as DeepSpeed counts them): what the ``zero``,
    ``zero_bucketing``, ``zero_prefetch`` and ``zero_overlap`` passes are given (``passes/zero.py``'s config rule
    reads it from the plan), and the bucket of the reductions done outside the graphs (ZeRO-1, ``runtime/zero_extension.py``).

    ``plan_zero_schedule`` decides it from the config; ``profile_steps`` > 0 re-plans it once from measurements
    (``runtime/zero_profile.py``), and the engine swaps the new one into ``engine.plan`` before recompiling.
    """

    stage: int = 0  # the ZeRO stage; the graphs carry ZeRO's collectives from stage 2 (ZeRO-1 reduces outside them)
    allgather_bucket_elements: int = 0  # cap on one bucketed all-gather (allgather_bucket_size)
    reduce_bucket_elements: int = 0  # cap on one bucketed reduce-scatter, and reduce-scatter elements in flight
    prefetch_elements: int = 0  # ZeRO-3: all-gather elements issued ahead of their use (stage3_prefetch_bucket_size)
    max_live_parameters: int = 0  # ZeRO-3: gathered elements alive at once (prefetch window) and kept from forward to backward
    max_reuse_distance: int = 0  # ZeRO-3: a parameter reused within this many elements stays gathered into backward
    unshard_budget: int = 0  # ZeRO-3: elements of the largest other gathers kept from forward to backward
    overlap_comm: bool = False  # reduce-scatter waits sink towards their consumers (stage 2-3)
    profile_steps: int = 0  # steps to time before re-planning this schedule from the measurements (0: never)

    @property
    def in_graphs(self) -> bool:
        """True when the compiled graphs carry ZeRO's collectives (stages 2 and 3)."""
        return self.stage >= 2

    @property
    def gather_bucket_elements(self) -> int:
        """The all-gather bucket the graphs use: under ZeRO-3 at most a prefetch window at once (a bigger all-gather
        bucket would gather more than the window and undo the sharding)."""
        bucket = min(self.allgather_bucket_elements, self.prefetch_elements) if self.stage == 3 else self.allgather_bucket_elements
        return max(1, bucket)

    def text(self) -> str:
        """The plan's lines for the schedule (``dscompile plan``, the dump)."""
        prefetch = f"ZeRO-3 all-gathers up to {self.prefetch_elements} elements ahead" if self.stage == 3 and self.prefetch_elements else "none"
        lines = [f"prefetch: {prefetch}; overlap_comm {'on' if self.overlap_comm else 'off'}"]
        if self.in_graphs:
            line = f"ZeRO buckets: all-gather {self.gather_bucket_elements} elements, reduce-scatter {self.reduce_bucket_elements} elements"
            if self.stage == 3:
                line += (
                    f"; live parameters <= {self.max_live_parameters} elements, kept gathered when reused within "
                    f"{self.max_reuse_distance} elements, unshard budget {self.unshard_budget} elements"
                )
            lines.append(line)
            if self.profile_steps:
                lines.append(f"ZeRO schedule re-planned from {self.profile_steps} profiled step(s), then recompiled once")
        elif self.stage == 1:
            lines.append(f"ZeRO buckets: reduce-scatter {self.reduce_bucket_elements} elements (outside the graphs)")
        return "\n".join(lines)


def plan_zero_schedule(config: Any) -> ZeroSchedule:
    """ZeRO's communication schedule for ``config`` (a loaded ``DSConfig``), from its ``zero_optimization`` section.

    It does not depend on the world size, so a plain ``torch.compile(backend="dscompile")`` (no engine, no plan)
    gets the same schedule an engine would.
    """
    zc = getattr(config, "sections", {}).get("zero_optimization")
    if zc is None or zc.stage == 0:
        return ZeroSchedule()
    stage = int(zc.stage)
    return ZeroSchedule(
        stage=stage,
        allgather_bucket_elements=int(zc.allgather_bucket_size),
        reduce_bucket_elements=int(zc.reduce_bucket_size),
        prefetch_elements=int(zc.stage3_prefetch_bucket_size),
        max_live_parameters=int(zc.stage3_max_live_parameters),
        max_reuse_distance=int(zc.stage3_max_reuse_distance),
        unshard_budget=int(zc.unshard_budget),
        overlap_comm=bool(zc.overlap_comm) and stage >= 2,
        profile_steps=int(zc.profile_steps),
    )
