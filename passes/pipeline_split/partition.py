"""Where to cut: ``plan_partition`` picks the stage boundaries from markers, split points or a partition method.

``min_max_partition`` is the exact dynamic programme that minimises the most expensive stage (README.md: "Partition").
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx

from dscompile.errors import DSCompileConfigError
from dscompile.passes.pipeline_split.facts import GraphFacts, module_path

_DP_BLOCK = 256  # run ends handled together: a (units + 1) x 256 float64 matrix per step


def min_max_partition(unit_costs: Sequence[float], cut_costs: Sequence[float], stages: int) -> list[int]:
    """Cut ``units`` into ``stages`` non-empty contiguous runs minimising the largest run cost.

    A run ``[i, j)`` costs ``sum(unit_costs[i:j]) + cut_costs[i] + cut_costs[j]``; the ends
    ``cut_costs[0]`` and ``cut_costs[n]`` are ignored and ``inf`` marks a forbidden cut.
    Returns the ``stages + 1`` boundaries ``[0, c1, ..., n]``. Exact: dp[s][j] is the best
    largest cost of ``s`` runs covering the first ``j`` units; ties prefer smaller total cost.
    """
    costs = torch.as_tensor(unit_costs, dtype=torch.float64).reshape(-1)
    n = len(costs)
    if stages < 1 or stages > n:
        raise ValueError(f"cannot cut {n} units into {stages} non-empty stages")
    cuts = torch.as_tensor(cut_costs, dtype=torch.float64).reshape(-1).clone()
    cuts[0] = cuts[n] = 0.0
    prefix = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(costs, 0)])
    inf = float("inf")
    best = torch.full((stages + 1, n + 1), inf, dtype=torch.float64)
    total = torch.full((stages + 1, n + 1), inf, dtype=torch.float64)
    choice = torch.zeros((stages + 1, n + 1), dtype=torch.long)
    best[0, 0] = 0.0
    total[0, 0] = 0.0
    starts = torch.arange(n + 1)
    for s in range(1, stages + 1):
        # every run end j at once (in column blocks to bound memory): rows are run starts i < j
        for lo in range(s, n + 1, _DP_BLOCK):
            ends = torch.arange(lo, min(lo + _DP_BLOCK, n + 1))
            run = prefix[ends][None, :] - prefix[:, None] + cuts[:, None] + cuts[ends][None, :]
            allowed = (starts[:, None] >= s - 1) & (starts[:, None] < ends[None, :])
            worst = torch.where(allowed, torch.maximum(best[s - 1][:, None], run), inf)
            tot = torch.where(allowed, total[s - 1][:, None] + run, inf)
            lowest = worst.min(dim=0).values
            # among (near-)optimal starts pick the one with the smallest total cost (first on ties)
            near = worst <= lowest * (1 + 1e-12) + 1e-300
            k = torch.where(near, tot, inf).argmin(dim=0)
            reachable = torch.isfinite(lowest)
            cols = ends[reachable]
            best[s, cols] = worst[k, ends - lo][reachable]
            total[s, cols] = tot[k, ends - lo][reachable]
            choice[s, cols] = k[reachable]
    if not torch.isfinite(best[stages, n]):
        raise ValueError(f"no valid way to cut the graph into {stages} stages (every boundary is forbidden)")
    bounds = [n]
    j = n
    for s in range(stages, 0, -1):
        j = int(choice[s, j])
        bounds.append(j)
    return bounds[::-1]


@dataclass
class PartitionPlan:
    """Where the graph is cut, and what each stage costs (FLOPs, memory) and sends."""

    method: str
    bounds: list[int]  # node-index boundaries, len = stages + 1
    stage_flops: list[float]
    stage_memory: list[float]
    stage_params: list[int]
    cut_bytes: list[int]  # bytes crossing each inner boundary
    objective: list[float]  # the cost-model objective of every stage

    @property
    def stages(self) -> int:
        return len(self.bounds) - 1

    def stage_of(self, index: int) -> int:
        for s in range(self.stages):
            if self.bounds[s] <= index < self.bounds[s + 1]:
                return s
        raise IndexError(index)


def _objective(facts: GraphFacts, memory_weight: float, flops_per_byte: float) -> tuple[torch.Tensor, torch.Tensor]:
    total_flops = max(float(facts.flops.sum()), 1.0)
    total_memory = max(float(facts.memory.sum()), 1.0)
    units = facts.flops / total_flops + memory_weight * facts.memory / total_memory
    cuts = torch.where(facts.cut_valid, flops_per_byte * facts.cut_bytes / total_flops, float("inf"))
    return units, cuts


def _layer_units(facts: GraphFacts) -> list[tuple[int, int, str]]:
    """Maximal runs of consecutive nodes of one layer: (start, end, layer)."""
    runs: list[tuple[int, int, str]] = []
    start = 0
    for i in range(1, len(facts.nodes) + 1):
        if i == len(facts.nodes) or facts.layers[i] != facts.layers[start]:
            runs.append((start, i, facts.layers[start]))
            start = i
    # merge runs whose front boundary cannot be cut into the run before them
    merged: list[tuple[int, int, str]] = []
    for run in runs:
        if merged and not facts.cut_valid[run[0]]:
            merged[-1] = (merged[-1][0], run[1], merged[-1][2])
        else:
            merged.append(run)
    return merged


def _split_point_bounds(facts: GraphFacts, split_points: Sequence[str], strip: str) -> list[int]:
    bounds = [0]
    for name in split_points:
        found = None
        for i, node in enumerate(facts.nodes):
            path = module_path(node, strip)
            if (path == name or path.startswith(name + ".")) and i > bounds[-1]:
                found = i
                break
        if found is None:
            raise DSCompileConfigError(
                "pipeline.split_points", f"no node after the previous split point runs inside module {name!r}", "name modules in forward order, e.g. 'blocks.2'"
            )
        if not facts.cut_valid[found]:
            raise DSCompileConfigError("pipeline.split_points", f"cannot cut in front of {name!r}: a non-tensor value crosses there")
        bounds.append(found)
    return bounds + [len(facts.nodes)]


def plan_partition(
    facts: GraphFacts,
    stages: int,
    method: str = "cost",
    *,
    split_points: Sequence[str] = (),
    memory_weight: float = 0.1,
    flops_per_byte: float = 1.0,
    strip: str = "",
) -> PartitionPlan:
    """Choose the cut: markers, then split points, then the partition method."""
    n = len(facts.nodes)
    units, cuts = _objective(facts, memory_weight, flops_per_byte)
    if facts.markers:
        bounds = sorted(set([0, *facts.markers, n]))
        method = "markers"
    elif split_points:
        bounds = _split_point_bounds(facts, split_points, strip)
        method = "split_points"
    elif method == "cost":
        bounds = min_max_partition(units, cuts, stages)
    else:
        runs = _layer_units(facts)
        if len(runs) < stages:
            raise DSCompileConfigError(
                "pipeline.stages",
                f"the model has {len(runs)} layers, too few for {stages} stages with partition_method {method!r}",
                "use partition_method 'cost' (cuts inside layers) or fewer stages",
            )
        if method == "uniform":
            weights = torch.ones(len(runs), dtype=torch.float64)
        elif method == "parameters":
            weights = torch.tensor([float(facts.param_count[a:b].sum()) for a, b, _ in runs], dtype=torch.float64)
        else:
            pattern = re.compile(method[5:], re.IGNORECASE)
            weights = torch.tensor([1.0 if pattern.search(facts.layer_types.get(layer, "")) else 0.0 for _, _, layer in runs], dtype=torch.float64)
            if not weights.any():
                classes = sorted(set(facts.layer_types.values()))
                raise DSCompileConfigError("pipeline.partition_method", f"no layer class matches {method[5:]!r}; layer classes: {classes}")
        # ties between equal-weight splits are broken by the cost model (a tiny second term)
        tie = torch.tensor([float(units[a:b].sum()) for a, b, _ in runs], dtype=torch.float64) * 1e-6
        layer_bounds = min_max_partition(weights + tie, torch.zeros(len(runs) + 1, dtype=torch.float64), stages)
        bounds = [runs[k][0] if k < len(runs) else n for k in layer_bounds]
    if len(bounds) - 1 != stages:
        raise DSCompileConfigError("pipeline.stages", f"the model's split markers / split points make {len(bounds) - 1} stages, config asks for {stages}")
    flops = [float(facts.flops[a:b].sum()) for a, b in zip(bounds, bounds[1:])]
    memory = [float(facts.memory[a:b].sum()) for a, b in zip(bounds, bounds[1:])]
    params = [int(facts.param_count[a:b].sum()) for a, b in zip(bounds, bounds[1:])]
    crossing = [int(facts.cut_bytes[b]) for b in bounds[1:-1]]
    cuts0 = torch.where(torch.isfinite(cuts), cuts, 0.0)
    objective = [float(units[a:b].sum() + (cuts0[a] if a else 0.0) + (cuts0[b] if b < n else 0.0)) for a, b in zip(bounds, bounds[1:])]
    return PartitionPlan(method, list(bounds), flops, memory, params, crossing, objective)
