"""Offload placement: where each rank's model states live (device, host or NVMe), decided before the first step.

Optimizer states (``zero_optimization.offload_optimizer``, ``plan_optimizer_offload``): from the ZeRO layout (each
parameter's elements, its shard, whether a full copy is kept) the planner predicts every rank's model-state bytes on
the device (ZeRO's formula: parameters, gradients, fp32 shards, optimizer states) and, under
``zero_optimization.offload_memory_limit`` (bytes per rank, dscompile's own key; 0 means no limit), offloads only the
optimizer states that do not fit, in parameter order: with a limit that holds everything nothing is offloaded, below it
just enough (DeepCompile's adaptive offload). Without a limit it offloads what the user asked (``ratio`` of the
states). The plan prints as a table (``dscompile plan``, the engine's log): per parameter its bytes, where its states
live and when they move, and the predicted peak of model states per device.

ZeRO-3 parameter shards (``zero_optimization.offload_param``, ``plan_param_offload``): every partitioned shard goes
to the host or NVMe (persistent, kept-whole parameters stay on the device), or under ``offload_memory_limit`` only
the shards that do not fit beside the other model states. It sets the read-ahead distance (how many shards are read
ahead of their all-gather, in the order the graphs use them) from ``buffer_count``, capped so the shards in flight
stay within ``buffer_count x buffer_size`` and ``max_in_cpu`` elements (at least one shard is always read); the
optimizer step's shard reads are part of that order (read ahead from the end of backward). It also sets how many
shard writes stay in flight after the step (write-behind: the largest shards whose buffers fit in the same window;
at least one).

For NVMe it also sizes the swap tiles (``nvme_tile_elements``) when ``sub_group_size`` is not given: large enough
that each tile's read and write is many ``block_size`` calls, small enough that the ``buffer_count`` tile buffers
alive during the step hold a small share of the offloaded states.

What it does not model yet: activations and temporary buffers (the cost model's job).
"""

from __future__ import annotations

from dataclasses import dataclass, field

FP32 = 4

TILE_MIN_ELEMENTS = 1 << 20
"""Smallest planned NVMe tile: 8 MiB of Adam states, eight 1-MiB I/O calls each way."""
TILE_MAX_ELEMENTS = 1 << 24
TILE_BUFFER_SHARE = 8
"""Planned tiles keep the ``buffer_count`` buffers alive during the step under 1/8 of the offloaded states."""


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


class _PlacedRows:
    """What both offload plans say of their rows: which tensors leave the device, and how many bytes."""

    rows: list[PlanRow]

    @property
    def offloaded_names(self) -> list[str]:
        return [r.name for r in self.rows if r.placement != "device"]

    @property
    def offloaded_bytes(self) -> int:
        return sum(r.state_bytes for r in self.rows if r.placement != "device")


@dataclass
class OffloadPlan(_PlacedRows):
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
class ParamPlan(_PlacedRows):
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
