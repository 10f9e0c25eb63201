"""``zero_overlap`` (and the ``sink_to_first_use`` it shares with ``tp_overlap``) on a generated backward graph of a
few hundred reduce-scatters: the same schedule as the straightforward algorithm (graph positions recomputed for every
reduce-scatter and every node sunk, what the pass did before), with positions computed a bounded number of times."""

from __future__ import annotations

import random

import pytest
import torch
import torch.fx
from test_zero_prefetch_order import count_positions

import dscompile.passes.zero_overlap as zero_overlap_module
import dscompile.passes.zero_schedule as zero_schedule
from dscompile.graph import ds_meta
from dscompile.passes.zero import is_zero_start
from dscompile.passes.zero_overlap import _CHEAP, _PREPARE, ZeroOverlapOptions, wait_deadlines, zero_overlap
from dscompile.passes.zero_schedule import move_after, positions, sole_user
from dscompile.pipeline import PassContext

aten = torch.ops.aten
SCATTERS = 300


def _reduce_scatter(value: object) -> object:  # a stand-in: the pass reads only the graph's structure and metadata
    return value


def generated_graph(seed: int, scatters: int = SCATTERS) -> torch.fx.GraphModule:
    """A backward-like graph: the gradients computed layer by layer, then (where tracing puts them) each gradient
    laid out for its reduce-scatter (views, some buckets concatenated from two gradients), the reduce-scatter, its
    wait and the division by the world size; some reduced gradients are read by compute placed between them."""
    rng = random.Random(seed)
    graph = torch.fx.Graph()
    h = graph.placeholder("grad_out")
    weights = [graph.placeholder(f"w_{i}") for i in range(scatters)]
    grads = []
    for w in weights:
        h = graph.call_function(aten.mul.Tensor, (h, w))
        for _ in range(rng.randrange(0, 3)):
            h = graph.call_function(aten.add.Tensor, (h, w))
        grads.append(graph.call_function(aten.mm.default, (h, w)))
    reduced = []
    for i, grad in enumerate(grads):
        flat = graph.call_function(aten.view.default, (grad, [-1]))
        if rng.random() < 0.3:
            other = graph.call_function(aten.view.default, (grads[(i + 7) % scatters], [-1]))
            flat = graph.call_function(aten.cat.default, ([flat, other],))
        start = graph.call_function(_reduce_scatter, (flat,))
        ds_meta(start)["zero"] = {"kind": "reduce_scatter", "elements": rng.choice([10, 1000, 50_000, 400_000])}
        wait = graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (start,))
        reduced.append(graph.call_function(aten.div.Tensor, (wait, 2)))
        if reduced and rng.random() < 0.4:  # compute that reads an earlier reduced gradient
            h = graph.call_function(aten.add.Tensor, (h, rng.choice(reduced)))
    graph.output((h, *reduced))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def reference_issue_early(start: torch.fx.Node) -> None:
    chain: set[torch.fx.Node] = set()
    stack = list(start.all_input_nodes)
    while stack:
        node = stack.pop()
        if node in chain or node.op != "call_function" or node.target not in _PREPARE:
            continue
        if not all(user in chain or user is start for user in node.users):
            continue
        chain.add(node)
        stack.extend(node.all_input_nodes)
    order = positions(start.graph)
    needed = {arg for node in (*chain, start) for arg in node.all_input_nodes if arg not in chain}
    anchor = max(needed, key=order.__getitem__)
    prepared = sorted(chain, key=order.__getitem__)
    if order[anchor] + len(prepared) + 1 < order[start]:
        move_after(anchor, [*prepared, start])


def reference_sink(wait: torch.fx.Node) -> None:
    chain = [wait]
    stack = list(wait.users)
    while stack:
        node = stack.pop()
        if node in chain or node.op != "call_function" or node.target not in _CHEAP:
            continue
        chain.append(node)
        stack.extend(node.users)
    order = positions(wait.graph)
    for node in sorted(chain, key=order.__getitem__, reverse=True):
        order = positions(wait.graph)
        first = min(node.users, key=order.__getitem__, default=None)
        if first is not None and order[first] > order[node] + 1:
            first.prepend(node)


def reference_overlap(graph: torch.fx.Graph, options: ZeroOverlapOptions) -> None:
    """The pass written the straightforward way: positions recomputed for every move."""
    starts = [n for n in graph.nodes if is_zero_start(n, "reduce_scatter")]
    for start in starts:
        reference_issue_early(start)
    order = positions(graph)
    starts.sort(key=order.__getitem__)
    for start in starts:
        reference_sink(sole_user(start))
    deadlines = wait_deadlines(starts, options.reduce_bucket_size)
    order = positions(graph)
    for start, deadline in deadlines.items():
        if order[sole_user(start)] > order[deadline]:
            deadline.prepend(sole_user(start))
    for start in starts:
        ds_meta(start)["zero"]["wait_before"] = deadlines[start].name if start in deadlines else None


def _schedule(gm: torch.fx.GraphModule) -> list[tuple[str, str | None]]:
    return [(n.name, ds_meta(n).get("zero", {}).get("wait_before")) for n in gm.graph.nodes]


@pytest.mark.parametrize("bucket", [50_000, 1_000_000, 10**12])
@pytest.mark.parametrize("seed", [0, 1])
def test_same_schedule_as_the_straightforward_algorithm(monkeypatch: pytest.MonkeyPatch, seed: int, bucket: int) -> None:
    options = ZeroOverlapOptions(reduce_bucket_size=bucket)
    expected = generated_graph(seed)
    before = [n.name for n in expected.graph.nodes]
    reference_overlap(expected.graph, options)
    assert [n.name for n in expected.graph.nodes] != before  # the comparison means something: the schedule moved nodes
    calls = count_positions(monkeypatch, zero_overlap_module)
    got = generated_graph(seed)
    zero_overlap(got, PassContext(config=None, graph_kind="backward", graph_name="backward"), options)
    got.graph.lint()
    assert _schedule(got) == _schedule(expected)
    assert calls[0] <= 2, f"positions computed {calls[0]} times for {SCATTERS} reduce-scatters"


def test_same_schedule_when_the_keys_run_out_of_room(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny gaps between keys force the fallback (renumber the graph) again and again: still the same schedule."""
    monkeypatch.setattr(zero_schedule.GraphOrder, "SPACING", 2)
    monkeypatch.setattr(zero_schedule.GraphOrder, "STEP", 1)
    options = ZeroOverlapOptions(reduce_bucket_size=1_000_000)
    expected = generated_graph(3)
    reference_overlap(expected.graph, options)
    got = generated_graph(3)
    zero_overlap(got, PassContext(config=None, graph_kind="backward", graph_name="backward"), options)
    assert _schedule(got) == _schedule(expected)


def test_graph_order_keys_follow_the_graph_after_the_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pass's one ``GraphOrder`` still sorts the nodes in graph order after every hoist and every sink."""
    orders: list[zero_schedule.GraphOrder] = []

    class Recorded(zero_schedule.GraphOrder):
        def __init__(self, graph: torch.fx.Graph) -> None:
            super().__init__(graph)
            orders.append(self)

    monkeypatch.setattr(zero_overlap_module, "GraphOrder", Recorded)
    gm = generated_graph(4, scatters=60)
    zero_overlap(gm, PassContext(config=None, graph_kind="backward", graph_name="backward"), ZeroOverlapOptions(reduce_bucket_size=10**12))
    nodes = list(gm.graph.nodes)
    assert len(orders) == 1 and sorted(nodes, key=orders[0].__getitem__) == nodes
