"""The planner: the one plan (DESIGN.md) of the parallel layout and of where each rank's model states live.

``plan_parallel`` decides, from the config and the world size before compiling, the ``ParallelPlan`` every engine
holds (``engine.plan``): the one rank layout (``ParallelLayout``: pipeline stages outermost, tensor parallelism
innermost, DeepSpeed's order), the effective ZeRO stage and who carries it out, what is offloaded, ZeRO's
communication schedule (``ZeroSchedule``: bucket sizes, the ZeRO-3 prefetch window, live-parameter and reuse limits,
the unshard budget, whether reductions overlap, profiling) and the activation-checkpointing plan
(``CheckpointingPlan``). ``dscompile plan`` and the dump print it. The passes read their part from it, not from the
config: an engine compiles with ``options=PlannedConfig(config, plan)``, the backend builds the pipeline
``compiling_under(plan)``, and the config rules ask ``zero_schedule_of`` / ``checkpointing_of``, which decide from the
config alone under a plain ``torch.compile``.

The placement part below decides where model states live (device, host or NVMe) before the first step.

Today it places ZeRO's optimizer states (``zero_optimization.offload_optimizer``). From the ZeRO
layout (each parameter's elements, its shard, whether a full copy is kept) it predicts every rank's
model-state bytes on the device (ZeRO's formula: parameters, gradients, fp32 shards, optimizer
states) and, under ``zero_optimization.offload_memory_limit`` (bytes per rank, dscompile's own key;
0 means no limit), offloads only the optimizer states that do not fit, in parameter order: with a
limit that holds everything nothing is offloaded, below it just enough (DeepCompile's adaptive
offload). Without a limit it offloads what the user asked (``ratio`` of the states). The plan prints
as a table (``dscompile plan``, the engine's log): per parameter its bytes, where its states live and
when they move, and the predicted peak of model states per device.

``plan_param_offload`` places ZeRO-3's parameter shards (``zero_optimization.offload_param``): every
partitioned shard goes to the host or NVMe (persistent, kept-whole parameters stay on the device), or under
``offload_memory_limit`` only the shards that do not fit beside the other model states, and
it sets the read-ahead distance (how many shards are read ahead of their all-gather, in the order the
graphs use them) from ``buffer_count``, capped so the shards in flight stay within ``buffer_count x
buffer_size`` and ``max_in_cpu`` elements (at least one shard is always read); the optimizer step's shard reads
are part of that order (read ahead from the end of backward). It also sets how many shard writes stay in flight
after the step (write-behind: the largest shards whose buffers fit in the same window; at least one).

For NVMe it also sizes the swap tiles (``nvme_tile_elements``) when ``sub_group_size`` is not given:
large enough that each tile's read and write is many ``block_size`` calls, small enough that the
``buffer_count`` tile buffers alive during the step hold a small share of the offloaded states.

What it does not model yet: activations and temporary buffers (the cost model's job).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dscompile.errors import DSCompileConfigError

FP32 = 4

TILE_MIN_ELEMENTS = 1 << 20
"""Smallest planned NVMe tile: 8 MiB of Adam states, eight 1-MiB I/O calls each way."""
TILE_MAX_ELEMENTS = 1 << 24
TILE_BUFFER_SHARE = 8
"""Planned tiles keep the ``buffer_count`` buffers alive during the step under 1/8 of the offloaded states."""


@dataclass(frozen=True)
class ParallelLayout:
    """The one rank layout: sizes and each rank's coordinates; pure arithmetic, no process groups.

    Global rank ``r`` sits at ``(pp, dp, tp)`` with ``r = (pp * dp_size + dp) * tp_size + tp``, DeepSpeed's
    ``PipeModelDataParallelTopology`` order (axes pipe, data, model): the ranks of one tensor-parallel group are
    consecutive (on one node, where bandwidth is highest), a data-parallel group joins the ranks holding the same
    slices of the same stage, and pipeline stages are the outermost stride. Process groups
    (``runtime/process_groups.py``) and the pipeline engine read ranks from here only.
    """

    world_size: int
    tp_size: int = 1
    pp_size: int = 1

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.pp_size < 1 or self.world_size % (self.tp_size * self.pp_size) != 0:
            raise DSCompileConfigError(
                "tensor_parallel.autotp_size",
                f"the world size {self.world_size} is not a multiple of tensor-parallel size {self.tp_size} × pipeline stages {self.pp_size}",
                "choose sizes whose product divides the number of ranks",
            )

    @property
    def dp_size(self) -> int:
        return self.world_size // (self.tp_size * self.pp_size)

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """``(pp, dp, tp)`` of global ``rank``."""
        tp = rank % self.tp_size
        dp = (rank // self.tp_size) % self.dp_size
        pp = rank // (self.tp_size * self.dp_size)
        return pp, dp, tp

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        return (pp * self.dp_size + dp) * self.tp_size + tp

    def tp_groups(self) -> list[list[int]]:
        return [[self.rank_of(pp, dp, t) for t in range(self.tp_size)] for pp in range(self.pp_size) for dp in range(self.dp_size)]

    def dp_groups(self) -> list[list[int]]:
        return [[self.rank_of(pp, d, tp) for d in range(self.dp_size)] for pp in range(self.pp_size) for tp in range(self.tp_size)]

    def pp_groups(self) -> list[list[int]]:
        return [[self.rank_of(p, dp, tp) for p in range(self.pp_size)] for dp in range(self.dp_size) for tp in range(self.tp_size)]


def nvme_tile_elements(offloaded_elements: int, buffer_count: int, sub_group_size: int | None) -> int:
    """Elements per NVMe swap tile: ``sub_group_size`` where the user gave it (DeepSpeed's meaning), else planned.

    DeepSpeed's default (1e9 elements) makes one tile of every model under a billion parameters, so the step
    holds all the states in memory at once and cannot overlap reading one tile with stepping another.
    """
    if sub_group_size is not None:
        return max(1, int(sub_group_size))
    share = -(-max(1, offloaded_elements) // (TILE_BUFFER_SHARE * max(1, buffer_count)))
    return min(TILE_MAX_ELEMENTS, max(TILE_MIN_ELEMENTS, share))


@dataclass(frozen=True)
class PlannedParameter:
    """One ZeRO parameter as the planner sees it (elements, not bytes)."""

    name: str
    numel: int
    shard_numel: int
    full_copy: bool  # a full copy is kept on every rank (ZeRO-1/2, persistent ZeRO-3 parameters)


@dataclass
class PlanRow:
    name: str
    state_bytes: int
    placement: str  # "device", "host" or "nvme"
    moves: str


@dataclass
class OffloadPlan:
    """Where each parameter's optimizer states live, and the predicted model-state bytes per rank."""

    device: str  # what the user asked: "cpu" or "nvme"
    stage: int
    world: int
    limit: int  # bytes per rank; 0: no limit
    rows: list[PlanRow] = field(default_factory=list)
    fixed_bytes: int = 0  # parameters, gradients and fp32 shards: stay on the device whatever is offloaded
    host_is_device: bool = False  # a CPU-only run: "host" memory is the same memory as the device's
    tile_elements: int = 0  # nvme: elements per swap tile
    tile_planned: bool = False  # the planner chose the tile (``sub_group_size`` not given)
    buffer_count: int = 0  # nvme: tile buffers alive during the step

    @property
    def offloaded_names(self) -> list[str]:
        return [r.name for r in self.rows if r.placement != "device"]

    @property
    def offloaded_bytes(self) -> int:
        return sum(r.state_bytes for r in self.rows if r.placement != "device")

    @property
    def device_bytes(self) -> int:
        """Predicted model-state bytes per rank on the device after offload."""
        kept = sum(r.state_bytes for r in self.rows if r.placement == "device" or (r.placement == "host" and self.host_is_device))
        return self.fixed_bytes + kept

    @property
    def fits(self) -> bool:
        return self.limit <= 0 or self.device_bytes <= self.limit

    def ratio(self, shard_numels: dict[str, int]) -> float:
        """The fraction of shard elements offloaded (what ``OffloadedOptimizer`` takes, in parameter order)."""
        total = sum(shard_numels.values())
        moved = sum(shard_numels[name] for name in self.offloaded_names)
        return moved / total if total else 0.0

    def table(self) -> str:
        title = (
            f"offload plan: ZeRO-{self.stage}, world {self.world}, offload_optimizer.device={self.device}, "
            f"limit {_mib(self.limit) if self.limit > 0 else 'none'} per rank"
        )
        lines = _placement_table(title, "optimizer state bytes", self.rows)
        lines.append(
            f"predicted model states per rank on the device: {_mib(self.device_bytes)} "
            f"(parameters, gradients and fp32 shards {_mib(self.fixed_bytes)}; optimizer states offloaded {_mib(self.offloaded_bytes)})"
        )
        if self.device == "nvme" and self.offloaded_bytes:
            lines.append(
                f"NVMe tiles: {self.tile_elements} elements ({'planned: sub_group_size not given' if self.tile_planned else 'sub_group_size'}), "
                f"{self.buffer_count} tile buffers alive during the step"
            )
        if self.host_is_device and any(r.placement == "host" for r in self.rows):
            lines.append("note: the device is the host here (no accelerator), so host offload frees no memory; nvme does")
        if not self.fits:
            lines.append(f"WARNING: {_mib(self.device_bytes)} exceeds the limit {_mib(self.limit)} even with this plan")
        return "\n".join(lines)


def _placement_table(title: str, bytes_title: str, rows: list[PlanRow]) -> list[str]:
    """The lines every plan prints: a title, then one row per tensor (bytes, placement, when it moves)."""
    width = max([len("tensor")] + [len(r.name) for r in rows]) + 2
    lines = [title, f"{'tensor':<{width}}{bytes_title:>22}  {'placement':<10} when it moves"]
    lines += [f"{r.name:<{width}}{r.state_bytes:>22}  {r.placement:<10} {r.moves}" for r in rows]
    return lines


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def fixed_model_state_bytes(params: list[PlannedParameter], stage: int) -> int:
    """Bytes per rank that optimizer offload cannot move: parameters, gradients and fp32 shards (ZeRO's formula)."""
    total = 0
    for p in params:
        full = FP32 * p.numel if p.full_copy else 0
        grads = FP32 * (p.numel if stage == 1 else p.shard_numel)
        total += full + grads + FP32 * p.shard_numel
    return total


def plan_optimizer_offload(
    params: list[PlannedParameter],
    stage: int,
    world: int,
    device: str,
    state_bytes_per_element: int,
    ratio: float = 1.0,
    limit: int = 0,
    host_is_device: bool = False,
    sub_group_size: int | None = None,
    buffer_count: int = 4,
) -> OffloadPlan:
    """Place each parameter's optimizer states (``state_bytes_per_element``: 8 for Adam) on the device or ``device``.

    No limit: the first ``ratio`` of the shard elements are offloaded. A limit: only as many states as
    needed to fit (never more than ``ratio``), in parameter order.
    """
    plan = OffloadPlan(device=device, stage=stage, world=world, limit=int(limit), host_is_device=host_is_device)
    plan.fixed_bytes = fixed_model_state_bytes(params, stage)
    sizes = [state_bytes_per_element * p.shard_numel for p in params]
    total_elements = sum(p.shard_numel for p in params)
    cap = ratio * total_elements  # at most the user's ratio
    if limit > 0:
        excess = plan.fixed_bytes + sum(sizes) - limit
        if device == "cpu" and host_is_device:
            excess = 0  # moving states to the host frees nothing when the host is the device: keep them where they are
    else:
        excess = None
    moves = {
        "cpu": "gradient device→host at the step; parameter host→device after it",
        "nvme": "read ahead of its tile's step, written back after it (tile by tile)",
    }[device]
    placement = "host" if device == "cpu" else "nvme"
    taken, saved = 0, 0
    for p, nbytes in zip(params, sizes, strict=True):
        wanted = (excess is None and taken + p.shard_numel <= cap + 1e-9) or (excess is not None and saved < excess and taken + p.shard_numel <= cap + 1e-9)
        if wanted and p.shard_numel > 0:
            taken += p.shard_numel
            saved += nbytes
            plan.rows.append(PlanRow(p.name, nbytes, placement, moves))
        else:
            plan.rows.append(PlanRow(p.name, nbytes, "device", "stays; stepped on the device"))
    if device == "nvme":
        plan.tile_elements = nvme_tile_elements(taken, buffer_count, sub_group_size)
        plan.tile_planned = sub_group_size is None
        plan.buffer_count = buffer_count
    return plan


def zero_parameters(
    named_numels: list[tuple[str, int]], stage: int, world: int, persistence_threshold: int = 0, model_persistence_threshold: int | None = None
) -> list[PlannedParameter]:
    """The ZeRO layout the engine will build (``runtime/zero_shard.ZeroPartition``'s rules), without building it."""
    params = []
    kept = 0
    for name, numel in named_numels:
        full = stage < 3
        if not full and numel <= persistence_threshold:
            budget = model_persistence_threshold if model_persistence_threshold is not None else float("inf")
            full = kept + numel <= budget
            kept += numel if full else 0
        params.append(PlannedParameter(name, numel, -(-numel // world) if numel else 0, full))
    return params


def non_shard_device_bytes(
    params: list[PlannedParameter], bytes_per_element: int, optimizer_plan: OffloadPlan | None = None, state_bytes_per_element: int = 8
) -> int:
    """ZeRO-3's model-state bytes per rank on the device besides the partitioned parameter shards: gradients,
    kept-whole parameters, and the optimizer states the optimizer's offload plan keeps (all of them without one)."""
    fixed = fixed_model_state_bytes(params, 3) - sum(bytes_per_element * p.shard_numel for p in params if not p.full_copy)
    if optimizer_plan is not None:
        return fixed + optimizer_plan.device_bytes - optimizer_plan.fixed_bytes
    return fixed + state_bytes_per_element * sum(p.shard_numel for p in params)


@dataclass
class ParamPlan:
    """Where each ZeRO-3 parameter shard lives, and how far ahead of its gather it is read."""

    device: str  # "cpu" or "nvme"
    world: int
    rows: list[PlanRow] = field(default_factory=list)
    prefetch_distance: int = 1
    write_behind: int = 1  # shard writes left in flight after the optimizer step updated them
    window_elements: int = 0  # the cap on elements read ahead (buffer_count x buffer_size, max_in_cpu)
    limit: int = 0  # bytes of model states per rank (offload_memory_limit); 0: none, every partitioned shard moves
    other_device_bytes: int = 0  # model-state bytes per rank on the device besides the partitioned shards
    kept_bytes: int = 0  # partitioned shards the limit leaves on the device

    @property
    def offloaded_names(self) -> list[str]:
        return [r.name for r in self.rows if r.placement != "device"]

    @property
    def offloaded_bytes(self) -> int:
        return sum(r.state_bytes for r in self.rows if r.placement != "device")

    @property
    def device_bytes(self) -> int:
        """Predicted model-state bytes per rank on the device (what the limit is compared with)."""
        return self.other_device_bytes + self.kept_bytes

    def table(self) -> str:
        title = (
            f"parameter offload plan: ZeRO-3, world {self.world}, offload_param.device={self.device}, "
            f"read ahead {self.prefetch_distance} shard(s), write behind {self.write_behind} (window {self.window_elements} elements), "
            f"limit {_mib(self.limit) if self.limit > 0 else 'none'} per rank"
        )
        lines = _placement_table(title, "shard bytes", self.rows)
        lines.append(f"parameter shards offloaded per rank: {_mib(self.offloaded_bytes)}")
        if self.limit > 0:
            lines.append(f"predicted model states per rank on the device: {_mib(self.device_bytes)}")
            if self.device_bytes > self.limit:
                lines.append(f"WARNING: {_mib(self.device_bytes)} exceeds the limit {_mib(self.limit)} even with every shard offloaded")
        return "\n".join(lines)


def plan_param_offload(
    params: list[PlannedParameter],
    world: int,
    device: str,
    bytes_per_element: int = FP32,
    buffer_count: int = 5,
    buffer_size: int = 100_000_000,
    max_in_cpu: int = 1_000_000_000,
    limit: int = 0,
    other_device_bytes: int = 0,
    host_is_device: bool = False,
) -> ParamPlan:
    """Place the partitioned (not kept-whole) ZeRO-3 shards on the device or ``device`` and size the read-ahead window.

    No limit: every partitioned shard moves (DeepSpeed's behaviour). A limit (bytes of model states per rank, with
    ``other_device_bytes`` already on the device: gradients, kept-whole parameters, the optimizer states the optimizer
    plan keeps): shards stay on the device in parameter order while they fit, the rest move; with a limit that holds
    everything nothing moves. Moving shards to the host frees nothing when the host is the device, so then none do.
    """
    window = max(1, min(int(buffer_count) * int(buffer_size), int(max_in_cpu)))
    plan = ParamPlan(device=device, world=world, window_elements=window, limit=int(limit), other_device_bytes=int(other_device_bytes))
    placement = "host" if device == "cpu" else "nvme"
    moves = {
        "cpu": "host→device copy before its all-gather (forward and backward); device→host after the step",
        "nvme": "read ahead of its all-gather (forward and backward), freed after it; written back after the step",
    }[device]
    if limit <= 0:
        budget = None
    elif device == "cpu" and host_is_device:
        budget = float("inf")
    else:
        budget = limit - other_device_bytes
    kept = 0
    shards = []
    for p in params:
        nbytes = bytes_per_element * p.shard_numel
        if p.full_copy or p.shard_numel == 0:
            plan.rows.append(PlanRow(p.name, nbytes, "device", "kept whole on every rank (persistent)"))
        elif budget is not None and kept + nbytes <= budget:
            kept += nbytes
            plan.rows.append(PlanRow(p.name, nbytes, "device", "fits under offload_memory_limit: stays on the device"))
        else:
            plan.rows.append(PlanRow(p.name, nbytes, placement, moves))
            shards.append(p.shard_numel)
    plan.kept_bytes = kept
    largest = sorted(shards, reverse=True)
    distance = 0
    while distance < min(int(buffer_count), len(largest)) and sum(largest[: distance + 1]) <= window:
        distance += 1
    plan.prefetch_distance = max(1, distance)
    # Writes after the optimizer step: each updated shard's buffer is written back in the background while the step
    # and the next forward go on (only a read of the same shard waits for its write). Their buffers are parameter
    # elements held in host memory, so as many writes stay in flight as the largest shards fit in the window.
    behind = 0
    while behind < len(largest) and sum(largest[: behind + 1]) <= window:
        behind += 1
    plan.write_behind = max(1, behind)
    return plan


# -- the ZeRO communication schedule and activation checkpointing ---------------------------------
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


# -- the parallel plan ---------------------------------------------------------------------------
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


@dataclass(frozen=True)
class PlannedConfig:
    """``torch.compile``'s ``options`` from an engine: its config and the plan its graphs compile under.

    The backend (``frontend.dscompile_backend``) runs the config rules ``compiling_under(plan)``. Dynamo compares a
    backend's options to reuse a compile, so a re-planned engine's recompile (same config, new plan) is a new compile.
    """

    config: Any
    plan: ParallelPlan


_COMPILING_UNDER: ContextVar[ParallelPlan | None] = ContextVar("dscompile_compiling_under", default=None)


@contextmanager
def compiling_under(plan: ParallelPlan | None) -> Iterator[None]:
    """While the backend builds a pipeline from the config rules: the plan they read (None: no engine, no plan)."""
    token = _COMPILING_UNDER.set(plan)
    try:
        yield
    finally:
        _COMPILING_UNDER.reset(token)


def zero_schedule_of(config: Any) -> ZeroSchedule:
    """The ZeRO schedule of the graphs compiled now: the engine's plan's, else (a plain ``torch.compile``) the planner
    decides it from ``config``."""
    plan = _COMPILING_UNDER.get()
    return plan.zero_schedule if plan is not None else plan_zero_schedule(config)


def checkpointing_of(config: Any) -> CheckpointingPlan:
    """The activation-checkpointing plan of the graphs compiled now: the engine's, else decided from ``config``."""
    plan = _COMPILING_UNDER.get()
    return plan.checkpointing if plan is not None else plan_activation_checkpointing(config)


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
    return ParallelPlan(layout=ParallelLayout(world_size, tp_size))


PLAN_FILE = "plan.txt"


def write_plan(plan: ParallelPlan, dump_dir: str | os.PathLike[str]) -> Path:
    """``DUMP/plan.txt``: the plan beside the dumped graphs (``print_summaries`` shows it)."""
    root = Path(dump_dir)
    root.mkdir(parents=True, exist_ok=True)
    path = root / PLAN_FILE
    path.write_text(plan.text() + "\n")
    return path
