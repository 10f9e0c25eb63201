"""ZeRO's gloo-only collective choices follow the backend that carries each tensor.

On gloo a reduce-scatter runs as an all-to-all plus a local sum and a big all-gather as one broadcast per rank
(faster there, measured in ``bench/zero.py``); NCCL must keep its own ``reduce_scatter_tensor`` /
``all_gather_into_tensor``. No NCCL here, so the tests make a gloo group report NCCL (``get_backend_config``
patched: the lowest layer the decision reads) and check that the in-graph pass (``zero_gloo``) and the
out-of-graph ZeRO-1 paths (``ZeroPartition``) then keep the plain collectives, and that the real gloo report
still gets the gloo way.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from dscompile.graph import ds_meta, op_name
from dscompile.passes.zero import zero_gloo
from dscompile.pipeline import PassContext
from dscompile.runtime.devices import backend_serving
from dscompile.runtime.zero_ops import GLOO_BROADCASTS_ABOVE, moves_like_gloo
from dscompile.runtime.zero_shard import ZeroPartition
from dscompile.testing.distributed import requires_backend, run_distributed_or_fail

c10d = torch.ops._c10d_functional


def test_backend_serving_is_read_per_device_type(monkeypatch: pytest.MonkeyPatch) -> None:
    """A mixed ``cpu:gloo,cuda:nccl`` group moves CPU tensors the gloo way and CUDA tensors NCCL's way."""
    configs = {"mixed": ("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl"), "nccl": ("cuda:nccl", "nccl"), "gloo": ("cpu:gloo,cuda:gloo", "gloo")}
    for name, (config, backend) in configs.items():
        monkeypatch.setattr(dist, "get_backend_config", lambda group=None, c=config: c)
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        got = {device: (backend_serving(None, device), moves_like_gloo(None, device)) for device in ("cpu", "cuda")}
        want = {
            "mixed": {"cpu": ("gloo", True), "cuda": ("nccl", False)},
            "nccl": {"cpu": ("nccl", False), "cuda": ("nccl", False)},  # no CPU entry: the group's backend
            "gloo": {"cpu": ("gloo", True), "cuda": ("gloo", True)},
        }[name]
        assert got == want, (name, got)


@pytest.fixture
def one_rank_gloo() -> Iterator[str]:
    """A real one-process gloo group; yields its name (what the graphs' collectives carry)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


def _zero_graph(group: str, device: str) -> torch.fx.GraphModule:
    """A backward-like graph: one gradient reduce-scatter and one big parameter all-gather, each waited (world 2)."""
    graph = torch.fx.Graph()
    elements = 2 * GLOO_BROADCASTS_ABOVE + 2
    with FakeTensorMode():
        grad_val, shard_val = torch.empty(elements, device=device), torch.empty(elements // 2, device=device)
    grad, shard = graph.placeholder("grad"), graph.placeholder("shard")
    grad.meta["val"], shard.meta["val"] = grad_val, shard_val
    outs = []
    for target, args, kind in (
        (c10d.reduce_scatter_tensor.default, (grad, "sum", 2, group), "reduce_scatter"),
        (c10d.all_gather_into_tensor.default, (shard, 2, group), "all_gather"),
    ):
        start = graph.call_function(target, args)
        ds_meta(start)["zero"] = {"kind": kind, "elements": elements, "group": group, "world": 2, "shard_numel": elements // 2, "members": 1}
        wait = graph.call_function(c10d.wait_tensor.default, (start,))
        with grad_val.fake_mode:
            start.meta["val"] = target(*[a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args])
            wait.meta["val"] = torch.empty_like(start.meta["val"])
        outs.append(wait)
    graph.output(tuple(outs))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _ops_after_zero_gloo(group: str, device: str) -> set[str]:
    gm = _zero_graph(group, device)
    ctx = PassContext(config=None, graph_kind="backward", graph_name="g.backward")
    gm = zero_gloo(gm, ctx, None)
    return {op_name(n).split(".")[-1] for n in gm.graph.nodes if n.op == "call_function"}


def test_graph_collectives_follow_the_backend_of_their_tensors(one_rank_gloo: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``zero_gloo`` rewrites the collectives gloo carries and keeps NCCL's: with the group reporting
    ``cpu:gloo,cuda:nccl``, the CPU graph gets the all-to-all and broadcasts, the CUDA one keeps
    ``reduce_scatter_tensor`` / ``all_gather_into_tensor``."""
    gloo_way = {"all_to_all_single", "zero_sum_received", "zero_broadcast_gather"}
    plain = {"reduce_scatter_tensor", "all_gather_into_tensor", "wait_tensor"}
    cpu_ops = _ops_after_zero_gloo(one_rank_gloo, "cpu")
    assert gloo_way <= cpu_ops and not cpu_ops & {"reduce_scatter_tensor", "all_gather_into_tensor"}, cpu_ops

    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:nccl")
    cuda_ops = _ops_after_zero_gloo(one_rank_gloo, "cuda")
    assert cuda_ops == plain, cuda_ops
    cpu_ops = _ops_after_zero_gloo(one_rank_gloo, "cpu")  # the same mixed group's CPU tensors: still gloo
    assert gloo_way <= cpu_ops, cpu_ops


def _big_model() -> nn.Module:
    """Two weights over ``GLOO_BROADCASTS_ABOVE`` elements (one unpadded, one padded at world 2) and a small bias."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 520, bias=False), nn.Tanh(), nn.Linear(520, 515))


def _batch(rank: int) -> torch.Tensor:
    return torch.randn(3, 512, generator=torch.Generator().manual_seed(20 + rank))


SPIED = ("reduce_scatter_tensor", "all_to_all_single", "all_gather_into_tensor", "broadcast")


def out_of_graph_rank(rank: int, world: int, report: str) -> dict[str, Any]:
    """ZeRO-1's gradient reduce-scatter and post-step refresh with the group reporting ``report``; counts the calls."""
    if report != "gloo":
        dist.get_backend_config = lambda group=None: f"cpu:{report}"  # this rank's process only
    calls = dict.fromkeys(SPIED, 0)
    originals = {name: getattr(dist, name) for name in SPIED}

    def spy(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return originals[name](*args, **kwargs)

        return call

    model = _big_model()
    partition = ZeroPartition(model, stage=1)
    model(_batch(rank)).square().sum().backward()
    for name in SPIED:
        setattr(dist, name, spy(name))
    try:
        partition.reduce_gradients()
        with torch.no_grad():
            for shard in partition.shards:
                shard.add_(shard.grad)
        partition.gather_full_params()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return {"calls": calls, "params": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.distributed
@requires_backend("gloo")
@pytest.mark.parametrize("report", ["gloo", "nccl"])
def test_out_of_graph_collectives_follow_the_backend(report: str) -> None:
    """Reported gloo: the big gradients are exchanged by all-to-all and the big parameters refreshed by broadcasts;
    reported NCCL: every bucket by ``reduce_scatter_tensor`` and ``all_gather_into_tensor``. The parameters after
    the step are the same either way (one process's, with the averaged gradient added)."""
    results = run_distributed_or_fail(out_of_graph_rank, 2, report, timeout=120)
    reference = _big_model()
    for rank in range(2):
        (reference(_batch(rank)).square().sum() / 2).backward()
    expected = [p.detach() + p.grad for p in reference.parameters()]
    for result in results:
        calls = result["calls"]
        if report == "gloo":
            assert calls["all_to_all_single"] >= 2 and calls["broadcast"] >= 4, calls  # two big weights, world 2
            assert calls["reduce_scatter_tensor"] == 0, calls
        else:
            assert calls["all_to_all_single"] == 0 and calls["broadcast"] == 0, calls
            assert calls["reduce_scatter_tensor"] >= 2 and calls["all_gather_into_tensor"] >= 2, calls
        for got, want in zip(result["params"], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
