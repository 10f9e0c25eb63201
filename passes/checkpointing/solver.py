"""The min cut on the joint graph, and the budget search over it.

Every forward value ``v`` is split into ``v_in -> v_out``; cutting that edge means *save v* (cost: its bytes), and
a ``source -> v_in`` edge of capacity ``lam * seconds(v)`` is cut when backward *recomputes v*. One cut minimises
``saved bytes + lam * recompute seconds`` exactly; a bisection on ``lam`` brackets a budget between two points of
the Pareto front's hull, and a knapsack over the nodes of the feasible one (``_refine``) fills the gap.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from dscompile.passes.checkpointing.joint import JointInfo, _is_random, storage_base

log = logging.getLogger("dscompile.passes.checkpoint")


@dataclass
class Cut:
    """One cut's decision (the forward values saved, those backward recomputes) and its predicted price."""

    saved: set[torch.fx.Node]
    recomputed: set[torch.fx.Node]
    saved_bytes: float
    recompute_flops: int
    recompute_seconds: float  # roofline estimate, the quantity the cut minimises
    rng_replays: int


class CutSolver:
    """Builds the flow network once; ``solve(lam)`` prices one second of recomputation at ``lam`` bytes.

    Backward nodes are not modelled one by one: a forward value some backward node reads gets an
    infinite edge to the sink (backward must get it, saved or recomputed), which keeps the
    network to the forward half of the graph.
    """

    def __init__(self, info: JointInfo, *, may_save: Callable[[torch.fx.Node], bool] | None = None,
                 extra_banned: Iterable[torch.fx.Node] = ()) -> None:
        import networkx as nx
        from networkx.algorithms.flow import boykov_kolmogorov

        self.info = info
        # a policy's bans never override a pin to recompute (ZeRO-3 gathers stay recomputed under ``full``)
        self.banned = set(info.banned) | {n for n in extra_banned if n not in info.must_recompute}
        self.nodes = info.primals + info.forward
        graph = nx.DiGraph()
        graph.add_node("source")
        graph.add_node("sink")
        for node in self.nodes:
            node_in, node_out = f"{node.name}_in", f"{node.name}_out"
            size = info.size[node]
            if may_save is not None and node.op != "placeholder" and not may_save(node) and node not in self.banned:
                size = math.inf
            if node in info.must_recompute and node not in self.banned:
                size = math.inf
            graph.add_edge(node_in, node_out, capacity=size)
            for user in node.users:
                if user in info.backward:
                    graph.add_edge(node_out, "sink", capacity=math.inf)
                elif user.op != "output":
                    graph.add_edge(node_out, f"{user.name}_in", capacity=math.inf)
        self.graph = graph
        self.nx = nx
        self.flow_func = boykov_kolmogorov  # the fastest of networkx's max-flow routines on these graphs

    def recompute_price(self, node: torch.fx.Node, lam: float) -> float:
        """Bytes-equivalent cost of recomputing ``node`` in backward."""
        if node.op == "placeholder" or node in self.banned:
            return math.inf
        if node not in self.info.required_fw:
            return 0.0  # computed once either way: in backward instead of forward
        seconds = self.info.seconds[node]
        if node in self.info.must_recompute:
            lam = 0.0  # recomputed whatever the cut: its time is a constant, not a choice (and lam may be inf)
        price = (lam * seconds if seconds > 0 else 0.0) + 1e-3 * (1 + 1e9 * seconds)  # tie-break: recompute less
        if _is_random(node):
            price += self.info.rng_state_bytes
        return price

    def solve(self, lam: float) -> Cut:
        graph = self.graph
        for node in self.nodes:
            price = self.recompute_price(node, lam)
            if price > 0:
                graph.add_edge("source", f"{node.name}_in", capacity=price)
            elif graph.has_edge("source", f"{node.name}_in"):
                graph.remove_edge("source", f"{node.name}_in")
        _value, (reachable, _rest) = self.nx.minimum_cut(graph, "source", "sink", flow_func=self.flow_func)
        saved, recomputed = set(), set()
        for node in self.nodes:
            node_in, node_out = f"{node.name}_in", f"{node.name}_out"
            if node_in in reachable and node_out not in reachable:
                saved.add(node)
            elif node_in not in reachable and node.op != "placeholder":
                recomputed.add(node)
        # Recomputing something backward never uses is pointless (and would force its inputs).
        recomputed &= self.info.needed_by_bw
        extra = [n for n in recomputed if n in self.info.required_fw]
        held: dict[torch.fx.Node, float] = {}  # one storage held once, however many of its aliases are saved
        for node in saved:
            base = storage_base(node)
            held[base] = max(held.get(base, 0.0), self.info.size[node])
        saved_bytes = sum(held.values())
        replays = sum(1 for n in extra if _is_random(n))
        return Cut(saved, recomputed, saved_bytes + replays * self.info.rng_state_bytes,
                   sum(self.info.flops[n] for n in extra), sum(self.info.seconds[n] for n in extra), replays)


def solve_budget(info: JointInfo, budget: float, reference: float | None = None) -> tuple[Cut, Cut]:
    """The least-recompute-time cut whose saved bytes are at most ``budget`` x ``reference``.

    ``reference``: the bytes saved without activation checkpointing (``no_checkpointing_saved_bytes``);
    None: the no-recompute cut's. Returns (chosen cut, baseline cut). Bisection on ``lam`` in log
    space (saved bytes fall monotonically as ``lam``, the price of a second, falls) brackets the
    budget between two hull points; ``_refine`` then spends the slack the feasible one leaves.
    """
    solver = CutSolver(info)
    baseline = solver.solve(math.inf)
    target = budget * (baseline.saved_bytes if reference is None else reference)
    return solve_target(solver, target, baseline), baseline


def solve_target(solver: CutSolver, target: float, baseline: Cut) -> Cut:
    """The least-recompute-time cut of ``solver`` that saves at most ``target`` bytes (or the least it
    can); ``baseline`` is its no-recompute cut."""
    info = solver.info
    if baseline.saved_bytes <= target:
        return baseline
    best = solver.solve(0.0)
    if best.saved_bytes > target:
        log.warning("a memory budget of %.0f bytes is below what recomputing everything recomputable reaches (%.0f bytes); "
                    "saving that", target, best.saved_bytes)
        return best
    total_seconds = sum(info.seconds[n] for n in info.forward) or 1e-9
    scale = max(1.0, baseline.saved_bytes) / total_seconds  # lam at which recomputing everything costs the baseline
    low, high = math.log(scale * 1e-5), math.log(scale * 1e5)
    for _ in range(24):
        mid = (low + high) / 2
        cut = solver.solve(math.exp(mid))
        if cut.saved_bytes <= target:
            low = mid
            if cut.recompute_seconds <= best.recompute_seconds:
                best = cut
        else:
            high = mid
        if high - low < 0.05 or best.saved_bytes >= 0.99 * target:
            break
    return _refine(solver, math.exp(low), best, target)


def _refine(solver: CutSolver, lam: float, cut: Cut, target: float, limit: int = 16) -> Cut:
    """A knapsack step between the two hull points around the budget.

    Bandwidth-bound ops all trade bytes for time at about one ratio (a roofline op moves about
    twice what it saves), so many of them tie at one ``lam`` and the hull jumps from "recompute
    none" to "recompute all of them": which of those to recompute is a knapsack the Lagrangian
    cannot see. Price each candidate (one of the ``limit`` costliest nodes the feasible cut
    recomputes) by one solve with it forbidden to recompute,
    pick the set to forbid by an exact knapsack on those prices (assumed additive), and keep the
    result only if the real cut of that set meets the budget and recomputes less; when additivity
    fails, drop the least efficient pick and try again (three tries)."""
    info = solver.info
    candidates = sorted((n for n in cut.recomputed if info.seconds[n] > 0 and n in info.required_fw and n not in solver.banned
                         and n not in info.must_recompute),
                        key=lambda n: (-info.seconds[n], n.name))[:limit]
    best = cut
    items: list[tuple[torch.fx.Node, float, float]] = []  # (node, extra bytes, seconds saved) if forbidden alone
    for node in candidates:
        trial = _solve_banning(solver, lam, [node])
        saved_seconds = cut.recompute_seconds - trial.recompute_seconds
        if saved_seconds <= 0:
            continue
        items.append((node, trial.saved_bytes - cut.saved_bytes, saved_seconds))
        if trial.saved_bytes <= target and trial.recompute_seconds < best.recompute_seconds:
            best = trial
    chosen = _knapsack(items, target - cut.saved_bytes)
    for _ in range(3):
        if len(chosen) < 2:
            break
        trial = _solve_banning(solver, lam, [node for node, _b, _s in chosen])
        if trial.saved_bytes <= target:
            if trial.recompute_seconds < best.recompute_seconds:
                best = trial
            break
        chosen.remove(min(chosen, key=lambda item: item[2] / max(item[1], 1.0)))
    return best


def _solve_banning(solver: CutSolver, lam: float, nodes: list[torch.fx.Node]) -> Cut:
    """``solver.solve(lam)`` with ``nodes`` also forbidden to recompute."""
    added = [n for n in nodes if n not in solver.banned]
    solver.banned.update(added)
    try:
        return solver.solve(lam)
    finally:
        solver.banned.difference_update(added)


def _knapsack(items: list[tuple[Any, float, float]], room: float) -> list[tuple[Any, float, float]]:
    """The subset of ``(item, cost, value)`` with the largest total value whose total cost stays
    within ``room`` (exact: a Pareto frontier of (cost, value) over the items; items are few)."""
    frontier: list[tuple[float, float, tuple[int, ...]]] = [(0.0, 0.0, ())]
    for index, (_item, cost, value) in enumerate(items):
        grown = [(c + cost, v + value, picked + (index,)) for c, v, picked in frontier if c + cost <= room]
        merged = sorted(frontier + grown, key=lambda entry: (entry[0], -entry[1]))
        frontier = []
        for entry in merged:  # keep only states no cheaper state beats
            if not frontier or entry[1] > frontier[-1][1]:
                frontier.append(entry)
    best = max(frontier, key=lambda entry: entry[1])
    return [items[i] for i in best[2]]
