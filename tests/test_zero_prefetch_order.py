"""``zero_prefetch`` on a generated graph of a few hundred gathers: the same schedule as the straightforward algorithm
(graph positions recomputed for every gather, what the pass did before), with positions computed a bounded number of
times instead of once per gather (quadratic in the graph)."""

from __future__ import annotations

import operator
import random

import pytest
import torch.fx

import dscompile.passes.zero_prefetch as zero_prefetch_module
import dscompile.passes.zero_schedule as zero_schedule
from dscompile.graph import ds_meta
from dscompile.passes.zero import is_zero_start
from dscompile.passes.zero_prefetch import ZeroPrefetchOptions, zero_prefetch
from dscompile.passes.zero_schedule import ancestors_after, move_after, sole_user
from dscompile.pipeline import PassContext

GATHERS = 300


def _gather(shard: object) -> object:  # stand-ins: the pass reads only the graph's structure and the zero metadata
    return shard


def _wait(value: object) -> object:
    return value


def _cat(*parts: object) -> object:
    return parts


def generated_graph(seed: int, gathers: int = GATHERS) -> torch.fx.GraphModule:
    """A forward-like graph: per layer an all-gather (some of a bucket concatenated from two shards, some of a view of
    the shard, as the ZeRO pass emits) and its wait, consumed by a few compute nodes; sizes vary."""
    rng = random.Random(seed)
    graph = torch.fx.Graph()
    h = graph.placeholder("x")
    shards = [graph.placeholder(f"shard_{i}") for i in range(gathers)]
    for i, shard in enumerate(shards):
        kind = rng.randrange(3)
        if kind == 0:
            source = graph.call_function(_cat, (shard, shards[(i + 1) % gathers]))
        elif kind == 1:
            source = graph.call_function(operator.getitem, (shard, slice(None)))
        else:
            source = shard
        start = graph.call_function(_gather, (source,))
        ds_meta(start)["zero"] = {"kind": "all_gather", "elements": rng.choice([10, 100, 1000, 5000])}
        wait = graph.call_function(_wait, (start,))
        for _ in range(rng.randrange(1, 4)):
            h = graph.call_function(operator.add, (h, wait))
    graph.output(h)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def reference_hoist(graph: torch.fx.Graph, options: ZeroPrefetchOptions) -> None:
    """The pass's schedule written the straightforward way: positions recomputed before every gather it moves."""
    starts = [n for n in graph.nodes if is_zero_start(n, "all_gather")]
    waits = [sole_user(s) for s in starts]
    sizes = [ds_meta(s)["zero"]["elements"] for s in starts]
    limit = min(options.stage3_prefetch_bucket_size, options.stage3_max_live_parameters)
    last_placeholder = [n for n in graph.nodes if n.op == "placeholder"][-1]
    plan, window_start, window = [], 0, 0
    for i, size in enumerate(sizes):
        window += size
        while window_start < i and window > limit:
            window -= sizes[window_start]
            window_start += 1
        plan.append(window_start)
    for i, start in enumerate(starts):
        j = plan[i]
        if j == i:
            continue
        anchor = last_placeholder if j == 0 else waits[j - 1]
        order = {n: k for k, n in enumerate(graph.nodes)}
        anchor_point = starts[i - 1] if order[starts[i - 1]] > order[anchor] else anchor
        if order[anchor_point] >= order[start]:
            continue
        chain = ancestors_after(start, anchor_point, order) + [start]
        move_after(anchor_point, chain)
        ds_meta(start)["zero"]["prefetch_after"] = anchor_point.name


def _schedule(gm: torch.fx.GraphModule) -> list[tuple[str, str | None]]:
    return [(n.name, ds_meta(n).get("zero", {}).get("prefetch_after")) for n in gm.graph.nodes]


def _run_pass(gm: torch.fx.GraphModule, options: ZeroPrefetchOptions) -> PassContext:
    ctx = PassContext(config=None, graph_kind="forward", graph_name="forward")
    zero_prefetch(gm, ctx, options)
    gm.graph.lint()
    return ctx


def count_positions(monkeypatch: pytest.MonkeyPatch, *pass_modules: object) -> list[int]:
    """Count every whole-graph position computation, whichever module (``zero_schedule`` or a pass module that
    imported it) the pass reaches it through."""
    calls = [0]
    real = zero_schedule.positions

    def counted(graph: torch.fx.Graph) -> dict[torch.fx.Node, int]:
        calls[0] += 1
        return real(graph)

    for module in (zero_schedule, *pass_modules):
        monkeypatch.setattr(module, "positions", counted, raising=False)
    return calls


# Budgets (elements): a window of a few gathers, a wide one, and one that holds every gather (all hoisted to the top).
BUDGETS = [(2_000, 10**9), (30_000, 10**9), (10**9, 10**9), (10**9, 8_000)]


@pytest.mark.parametrize(("bucket", "live"), BUDGETS)
@pytest.mark.parametrize("seed", [0, 1])
def test_same_schedule_as_the_straightforward_algorithm(monkeypatch: pytest.MonkeyPatch, seed: int, bucket: int, live: int) -> None:
    options = ZeroPrefetchOptions(stage3_prefetch_bucket_size=bucket, stage3_max_live_parameters=live)
    expected = generated_graph(seed)
    reference_hoist(expected.graph, options)
    calls = count_positions(monkeypatch, zero_prefetch_module)
    got = generated_graph(seed)
    ctx = _run_pass(got, options)
    assert _schedule(got) == _schedule(expected)
    prefetched = ctx.analysis["zero_prefetch"]["forward"]["prefetched"]
    assert prefetched > GATHERS // 2  # the comparison means something: most gathers moved
    assert calls[0] <= 2, f"positions computed {calls[0]} times for {GATHERS} gathers"


def test_same_schedule_when_the_keys_run_out_of_room(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny gaps between keys force the fallback (renumber the graph) again and again: still the same schedule."""
    monkeypatch.setattr(zero_schedule.GraphOrder, "SPACING", 2)
    monkeypatch.setattr(zero_schedule.GraphOrder, "STEP", 1)
    options = ZeroPrefetchOptions(stage3_prefetch_bucket_size=30_000, stage3_max_live_parameters=10**9)
    expected = generated_graph(3)
    reference_hoist(expected.graph, options)
    calls = count_positions(monkeypatch, zero_prefetch_module)
    got = generated_graph(3)
    _run_pass(got, options)
    assert _schedule(got) == _schedule(expected)
    assert calls[0] > 2  # the fallback did run


def test_graph_order_keys_follow_the_graph() -> None:
    """After every move the keys sort the nodes in graph order."""
    gm = generated_graph(5, gathers=40)
    graph = gm.graph
    order = zero_schedule.GraphOrder(graph)
    starts = [n for n in graph.nodes if is_zero_start(n, "all_gather")]
    last_placeholder = [n for n in graph.nodes if n.op == "placeholder"][-1]
    rng = random.Random(5)
    for start in starts[1:]:
        anchor = rng.choice([n for n in graph.nodes if order[last_placeholder] <= order[n] < order[start]])
        order.move_after(anchor, ancestors_after(start, anchor, order.key) + [start])
        nodes = list(graph.nodes)
        assert sorted(nodes, key=order.__getitem__) == nodes
    graph.lint()
