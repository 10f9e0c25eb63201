"""Graph-order helpers the collective-scheduling passes share (no pass is registered here).

Scheduling collectives means moving nodes: a start earlier (prefetch), a wait later (overlap),
several collectives into one (bucketing). These helpers keep the graph topologically valid
while changing the order as little as possible. The ZeRO passes (``zero_bucketing``,
``zero_prefetch``, ``zero_overlap``) and tensor parallelism's ``tp_overlap`` use them.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Iterable
from typing import Any

import torch
import torch.fx

from dscompile.errors import DSCompilePassError


def positions(graph: torch.fx.Graph) -> dict[torch.fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def stable_toposort(graph: torch.fx.Graph) -> None:
    """Reorder so every node follows its inputs, keeping the current order wherever it already does."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    pending = {n: len(set(n.all_input_nodes)) for n in nodes}
    ready = [index[n] for n in nodes if pending[n] == 0]
    heapq.heapify(ready)
    order: list[torch.fx.Node] = []
    while ready:
        node = nodes[heapq.heappop(ready)]
        order.append(node)
        for user in node.users:
            pending[user] -= 1
            if pending[user] == 0:
                heapq.heappush(ready, index[user])
    if len(order) != len(nodes):
        raise DSCompilePassError("collective scheduling: the graph has a cycle after rewriting")
    for before, after in zip(order, order[1:], strict=False):
        if before.next is not after:
            before.append(after)


def move_after(anchor: torch.fx.Node, nodes: Iterable[torch.fx.Node]) -> torch.fx.Node:
    """Place ``nodes`` (in the given order) right after ``anchor``; returns the last one placed."""
    cursor = anchor
    for node in nodes:
        if cursor.next is not node:
            cursor.append(node)
        cursor = node
    return cursor


class GraphOrder:
    """Node positions kept correct while nodes move up to right after another one (``move_after``), without
    renumbering the whole graph after every move (which made a pass that moves every gather quadratic in the graph).

    Keys are sparse integers, ``SPACING`` apart at first. A move gives the moved nodes keys between the anchor's and
    that of the node now after them, packed near the anchor (steps of at most ``STEP``) so that the room after them
    is left for the next move, which the prefetch schedule places right after the last node moved. Only when a gap
    is too small does it renumber the whole graph (``positions``). Keys compare like positions; they are not indices.
    """

    SPACING = 1 << 48
    STEP = 1 << 16

    def __init__(self, graph: torch.fx.Graph) -> None:
        self.graph = graph
        self.renumbered = 0
        self._renumber()

    def _renumber(self) -> None:
        self.key: dict[torch.fx.Node, int] = {n: i * self.SPACING for n, i in positions(self.graph).items()}
        self.renumbered += 1

    def __getitem__(self, node: torch.fx.Node) -> int:
        return self.key[node]

    def move_after(self, anchor: torch.fx.Node, nodes: list[torch.fx.Node]) -> None:
        """``move_after(anchor, nodes)``, then keys for the moved nodes between ``anchor`` and the node after them."""
        if not nodes:
            return
        move_after(anchor, nodes)
        low = self.key[anchor]
        after = nodes[-1].next  # the first node that followed ``anchor`` and did not move (or the graph's end)
        high = self.key[after] if after in self.key else low + (len(nodes) + 1) * self.SPACING
        step = min(self.STEP, (high - low) // (len(nodes) + 1))
        if step < 1:
            self._renumber()
            return
        for k, node in enumerate(nodes, 1):
            self.key[node] = low + k * step


def ancestors_after(node: torch.fx.Node, anchor: torch.fx.Node, order: dict[torch.fx.Node, int]) -> list[torch.fx.Node]:
    """Non-placeholder inputs (transitively) of ``node`` that sit after ``anchor``, in graph order."""
    found: set[torch.fx.Node] = set()
    stack = list(node.all_input_nodes)
    while stack:
        item = stack.pop()
        if item in found or item.op == "placeholder" or order[item] <= order[anchor]:
            continue
        found.add(item)
        stack.extend(item.all_input_nodes)
    return sorted(found, key=order.__getitem__)


def sole_user(node: torch.fx.Node) -> torch.fx.Node:
    users = list(node.users)
    if len(users) != 1:
        raise DSCompilePassError(f"collective scheduling: collective {node.name} should have one wait, has {len(users)} users")
    return users[0]


def sink_to_first_use(wait: torch.fx.Node, cheap: Collection[Any], order: GraphOrder | None = None) -> int:
    """Move a collective's ``wait`` and the ``cheap`` ops that only reshape its result (views, a division by
    the world size, bucket slices: ops whose target is in ``cheap``) down to right before their first real
    consumer, so whatever the graph computes in between runs while the collective is in flight. Returns how
    many nodes moved. ``order``: the caller's ``GraphOrder`` of the graph, kept correct (one per pass, not per wait)."""
    chain = [wait]
    stack = list(wait.users)
    while stack:
        node = stack.pop()
        if node in chain or node.op != "call_function" or node.target not in cheap:
            continue
        chain.append(node)
        stack.extend(node.users)
    order = order if order is not None else GraphOrder(wait.graph)
    moved = 0
    for node in sorted(chain, key=order.__getitem__, reverse=True):  # the last first: each then sinks to its own first user
        first = min(node.users, key=order.__getitem__, default=None)
        if first is not None and first is not node.next:  # a user is always after its input: something lies between
            order.move_after(first.prev, [node])  # right before ``first``
            moved += 1
    return moved
