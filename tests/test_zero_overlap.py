"""``zero_overlap`` keeps at most ``reduce_bucket_size`` elements of reduce-scatter input in flight.

A reduce-scatter holds its input (the full gradient bucket) from its start to its wait. The check
walks the final backward graph of a real 2-rank ZeRO run in schedule order, adds each
reduce-scatter's input bytes at its start (``dscompile.cost`` sizes) and removes them at its wait:
the peak of that sum is the memory the in-flight buckets hold. It must stay within the bound
(or within the largest single collective, which is always alone), while the unbounded schedule,
every wait at the graph's end, would hold them all; some reduce-scatters must still overlap
compute. Losses and parameters equal the single-process reference as in ``test_zero``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_zero import _case, _config, _micro_batch, assert_params_close, reference_run

import dscompile
from dscompile.testing.distributed import requires_backend, run_distributed_or_fail

c10d = torch.ops._c10d_functional
BUCKET = 1500  # elements: several buckets on the test GPT, so the bound binds
STEPS = 4


def inflight_profile(gm: torch.fx.GraphModule) -> dict[str, Any]:
    """Peak bytes of reduce-scatter inputs between their start and their wait, along the graph's order."""
    from dscompile.cost import _shape_hints, evaluate, nbytes

    hints = _shape_hints(gm)
    outstanding: dict[torch.fx.Node, int] = {}
    sizes, peak, overlapped = [], 0, 0
    computing_since: dict[torch.fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is c10d.reduce_scatter_tensor.default:
            size = int(evaluate(nbytes(node.args[0].meta["val"]), hints))
            outstanding[node] = size
            computing_since[node] = 0
            sizes.append(size)
        elif node.op == "call_function" and node.target is c10d.wait_tensor.default and node.args[0] in outstanding:
            del outstanding[node.args[0]]
            overlapped += computing_since.pop(node.args[0]) > 0
        elif node.op == "call_function" and node.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
                                                             torch.ops.aten.bmm.default):
            for start in computing_since:
                computing_since[start] += 1  # a matmul ran while this one was in flight
        peak = max(peak, sum(outstanding.values()))
    return {"peak": peak, "largest": max(sizes, default=0), "total": sum(sizes), "count": len(sizes), "overlapped": overlapped}


def overlap_rank(rank: int, world: int, stage: int) -> dict[str, Any]:
    """Train with a small reduce bucket and overlap on; record the in-flight profile of every backward graph."""
    from dscompile import pipeline

    info = pipeline.get_pass("zero_overlap")
    profiles: list[dict[str, Any]] = []

    def recording(gm: torch.fx.GraphModule, ctx: Any, options: Any) -> torch.fx.GraphModule:
        gm = info.fn(gm, ctx, options)
        if ctx.graph_kind == "backward":
            profiles.append({**inflight_profile(gm), "bound": options.reduce_bucket_size})
        return gm

    pipeline._REGISTRY["zero_overlap"] = dataclasses.replace(info, fn=recording)
    torch.manual_seed(0)
    case = _case("gpt")
    extra = {"reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET, "stage3_prefetch_bucket_size": BUCKET, "overlap_comm": True}
    engine, _, _, _ = dscompile.initialize(model=case.model, config=_config(stage, 1, 0.0, extra))
    losses = []
    for step in range(STEPS):
        loss = engine(*_micro_batch(case, step, 0, rank))
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    itemsize = next(case.model.parameters()).element_size()
    return {"losses": losses, "params": engine.full_parameters(), "profiles": profiles, "itemsize": itemsize}


@pytest.mark.slow
@pytest.mark.distributed
@requires_backend("gloo")
@pytest.mark.parametrize("stage", [2, 3])
def test_reduce_scatters_in_flight_stay_within_the_bucket(stage: int) -> None:
    results = run_distributed_or_fail(overlap_rank, 2, stage, timeout=240)
    ref = reference_run("gpt", 2, 1, 0.0, steps=STEPS)
    for result in results:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
        assert result["profiles"], "no backward graph went through zero_overlap"
        for profile in result["profiles"]:
            bound = profile["bound"] * result["itemsize"]
            assert profile["count"] >= 3 and profile["total"] > bound, profile  # the bound binds: unbounded would hold more
            assert profile["peak"] <= max(bound, profile["largest"]), profile
            assert profile["peak"] < profile["total"], profile
            assert profile["overlapped"] >= 1, profile  # still overlapping compute
    for name, value in ref["params"].items():
        assert_params_close(results[0]["params"][name], value, name)


def _starts(elements: list[int]) -> list[torch.fx.Node]:
    graph = torch.fx.Graph()
    nodes = []
    for i, size in enumerate(elements):
        node = graph.placeholder(f"rs{i}")
        node.meta["dscompile"] = {"zero": {"kind": "reduce_scatter", "elements": size}}
        nodes.append(node)
    return nodes


def test_deadlines_retire_the_oldest_first() -> None:
    from dscompile.passes.zero_overlap import wait_deadlines

    a, b, c, d, e = _starts([600, 500, 700, 2000, 100])
    deadlines = wait_deadlines([a, b, c, d, e], 1500)
    # a+b fit; c would make 1800: a is retired before c; d alone exceeds the bound: b and c before d;
    # e fits beside nothing but d (2100 > 1500): d before e; e is never retired (waits at its consumer)
    assert deadlines == {a: c, b: d, c: d, d: e}
    assert wait_deadlines([a, b, c], 10**9) == {}
