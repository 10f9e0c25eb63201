"""ZeRO step-time choices that must not change the maths: which collectives share a flat bucket,
and the fused Adam/AdamW the shards are stepped with (``bench/zero.py`` measures their effect)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.fx
from torch import nn

from dscompile.graph import ds_meta
from dscompile.passes.zero_bucketing import CPU_ALONE_ABOVE, _buckets
from dscompile.runtime.zero_extension import shard_optimizer
from dscompile.runtime.zero_ops import GLOO_BROADCASTS_ABOVE
from dscompile.runtime.zero_shard import ZeroPartition
from dscompile.testing.distributed import requires_backend, run_distributed_or_fail


def _starts(elements: list[int], device: str = "cpu") -> list[torch.fx.Node]:
    graph = torch.fx.Graph()
    nodes = []
    for i, n in enumerate(elements):
        shard = graph.placeholder(f"shard{i}")
        shard.meta["val"] = torch.empty(n // 2, device="meta") if device == "meta" else torch.empty(0).new_empty(n // 2)
        start = graph.call_function(torch.ops._c10d_functional.all_gather_into_tensor.default, (shard, 2, "g"))
        ds_meta(start)["zero"] = {"kind": "all_gather", "elements": n, "group": "g", "world": 2, "shard_numel": n // 2, "members": 1}
        nodes.append(start)
    return nodes


def test_cpu_buckets_hold_only_small_collectives() -> None:
    big = CPU_ALONE_ABOVE + 2
    starts = _starts([8, 8, big, 8, big, big, 8, 8])
    sizes = [[int(ds_meta(n)["zero"]["elements"]) for n in bucket] for bucket in _buckets(starts, limit=10**9)]
    assert sizes == [[8, 8], [big], [8], [big], [big], [8, 8]]  # big ones alone (copy-free), small ones merged between them
    assert [len(b) for b in _buckets(starts, limit=10**9, alone_above=10**9)] == [8]  # an explicit limit: everything merges
    assert [len(b) for b in _buckets(_starts([8, 8, big, 8], "meta"), limit=10**9)] == [4]  # accelerators (here: not CPU) merge all sizes


def test_shards_are_stepped_by_fused_adamw_with_the_plain_results() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    reference = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    reference.load_state_dict(model.state_dict())
    partition = ZeroPartition(model, stage=1)  # world size 1: the shard is the whole flat parameter
    sharded = shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01), partition)
    assert all(group["fused"] is True for group in sharded.param_groups)
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        for shard, p in zip(partition.shards, reference.parameters(), strict=True):
            grad = torch.randn(p.shape, generator=g)
            p.grad, shard.grad = grad, grad.reshape(-1).clone()
        sharded.step()
        plain.step()
    for shard, p in zip(partition.shards, reference.parameters(), strict=True):
        torch.testing.assert_close(shard.detach(), p.detach().reshape(-1), rtol=1e-6, atol=1e-7)  # rounding only
    explicit = shard_optimizer(torch.optim.AdamW(model.parameters(), foreach=False), ZeroPartition(model, stage=1))
    assert explicit.param_groups[0]["fused"] is None  # the user's choice of implementation is kept
    assert shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), ZeroPartition(model, stage=1)).param_groups[0].get("fused") in (None, False)


def _wide_model() -> nn.Module:
    """Two weights over ``CPU_ALONE_ABOVE`` elements (one of odd size, so padded at world 2), small ones between."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(257, 259), nn.Tanh(), nn.Linear(259, 64), nn.Tanh(), nn.Linear(64, 1040))


def _batch(rank: int) -> torch.Tensor:
    return torch.randn(3, 257, generator=torch.Generator().manual_seed(10 + rank))


def out_of_graph_rank(rank: int, world: int) -> dict[str, Any]:
    model = _wide_model()
    partition = ZeroPartition(model, stage=1)  # ZeRO-1: full gradients reduced, full copies refreshed, both outside the graphs
    model(_batch(rank)).square().sum().backward()
    partition.reduce_gradients()
    grads = [shard.grad.clone() for shard in partition.shards]
    with torch.no_grad():
        for shard in partition.shards:
            shard.add_(shard.grad)
    partition.gather_full_params()
    return {"grads": grads, "params": [p.detach().clone() for p in model.parameters()], "copy_free": partition.copy_free_collectives,
            "shard_numels": [layout.shard_numel for layout in partition.layouts]}


@pytest.mark.distributed
@requires_backend("gloo")
def test_out_of_graph_collectives_of_big_parameters_skip_the_flat_copies() -> None:
    """ZeRO-1's gradient reduce-scatter and the post-step refresh: a big unpadded parameter's collectives read the
    gradient and write the full copy themselves; the padded one and the small ones go through flat buffers; all
    give the averaged gradients and the updated parameters of one process."""
    results = run_distributed_or_fail(out_of_graph_rank, 2, timeout=120)
    reference = _wide_model()
    for rank in range(2):
        (reference(_batch(rank)).square().sum() / 2).backward()
    expected = [p.detach() + p.grad for p in reference.parameters()]
    for rank, result in enumerate(results):
        # once each way for the 64x1040 weight and for the last bias (a bucket of its own after it); the odd 257x259 weight is padded
        assert result["copy_free"] == 4, result["copy_free"]
        for grad, p, length in zip(result["grads"], reference.parameters(), result["shard_numels"], strict=True):
            flat = torch.nn.functional.pad(p.grad.reshape(-1), (0, 2 * length - p.numel()))
            # the ranks' matmuls run single-threaded, the reference's with this process's threads: another blocking of
            # the same sums, a few ulps apart (1.1e-5 relative seen on CI); a missing average is 2x off
            torch.testing.assert_close(grad, flat[rank * length : (rank + 1) * length], rtol=1e-5, atol=1e-5)
        for got, want in zip(result["params"], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _big_model() -> nn.Module:
    """One weight over ``GLOO_BROADCASTS_ABOVE`` elements that divides evenly, one that is padded, a small bias."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 513, bias=False), nn.Tanh(), nn.Linear(513, 515))


def broadcast_gather_rank(rank: int, world: int) -> dict[str, Any]:
    """ZeRO-1 over a data-parallel subgroup ({0, 2} and {1, 3}): shards moved by one, then refreshed."""
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group = groups[rank % 2]
    model = _big_model()
    partition = ZeroPartition(model, stage=1, group=group)
    calls = {"broadcast": 0, "all_gather_into_tensor": 0}
    originals = {name: getattr(dist, name) for name in calls}

    def spy(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return originals[name](*args, **kwargs)
        return call

    with torch.no_grad():
        for shard in partition.shards:
            shard.add_(1.0)
    for name in calls:
        setattr(dist, name, spy(name))
    try:
        partition.gather_full_params()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return {"calls": calls, "params": [p.detach().clone() for p in model.parameters()],
            "sizes": [layout.shard_numel * partition.world for layout in partition.layouts]}


@pytest.mark.distributed
@requires_backend("gloo")
def test_big_gathers_on_gloo_run_as_one_broadcast_per_rank() -> None:
    """Gloo's all-gather is two to three times slower than one broadcast per rank for the same bytes: the refresh
    moves each gather over ``GLOO_BROADCASTS_ABOVE`` elements that way (into the parameter itself, or through the
    padded flat buffer) and the small ones by all-gather, and every rank of every data-parallel group ends with
    the updated full parameters."""
    results = run_distributed_or_fail(broadcast_gather_rank, 4, timeout=120)
    expected = [p.detach() + 1.0 for p in _big_model().parameters()]
    for result in results:
        big = sum(size > GLOO_BROADCASTS_ABOVE for size in result["sizes"])
        assert big == 2, result["sizes"]
        assert result["calls"] == {"broadcast": 2 * big, "all_gather_into_tensor": 1}, result["calls"]  # world 2 per group; the bias alone
        for got, want in zip(result["params"], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def _big_batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 512, generator=torch.Generator().manual_seed(100 * step + rank))


def zero3_big_rank(rank: int, world: int, dump: str) -> dict[str, Any]:
    """ZeRO-3 under the default lowering (Inductor) on ``_big_model``: its two weights are gathered in the graphs."""
    import json
    from pathlib import Path

    import dscompile

    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0},
              "dump": f"{dump}/rank{rank}"}
    engine, _, _, _ = dscompile.initialize(model=_big_model(), config=config)
    losses = []
    for step in range(2):
        loss = engine(_big_batch(step, rank)).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    ops: dict[str, int] = {}
    for graph_dir in Path(dump, f"rank{rank}").glob("*.*ward"):  # forward and backward graphs, after their last pass
        final = sorted(p for p in graph_dir.iterdir() if p.is_dir())[-1]
        for op, n in json.loads((final / "summary.json").read_text())["nodes_by_op"].items():
            ops[op.split(".")[-1]] = ops.get(op.split(".")[-1], 0) + n
    return {"losses": losses, "params": [p.clone() for p in engine.full_parameters().values()], "ops": ops}


@pytest.mark.distributed
@requires_backend("gloo")
def test_zero3_big_gathers_in_the_graphs_run_as_broadcasts_on_gloo(tmp_path: Any) -> None:
    """The graphs' all-gathers over ``GLOO_BROADCASTS_ABOVE`` elements run as one broadcast per rank
    (``zero_broadcast_gather``), in forward and again in backward, and the reduce-scatters as all-to-alls; the
    training equals one process's (Inductor lowering, two steps, AdamW)."""
    results = run_distributed_or_fail(zero3_big_rank, 2, str(tmp_path), timeout=300)
    reference = _big_model()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    losses = []
    for step in range(2):
        total = 0.0
        for rank in range(2):
            loss = reference(_big_batch(step, rank)).square().mean() / 2
            loss.backward()
            total += float(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    for result in results:
        ops = result["ops"]
        assert ops.get("zero_broadcast_gather", 0) == 3, ops  # both weights in forward; backward needs only the second
        assert ops.get("all_to_all_single", 0) >= 2 and ops.get("reduce_scatter_tensor", 0) == 0, ops
        for got, want in zip(result["params"], reference.parameters(), strict=True):
            # summation order, scaled by Adam where v is tiny (6.3e-5 seen on CI); a step not taken is off by lr = 1e-2
            torch.testing.assert_close(got, want.detach(), rtol=1e-4, atol=2e-4)
    mean_losses = [sum(r["losses"][s] for r in results) / 2 for s in range(2)]
    assert mean_losses == pytest.approx(losses, rel=1e-5)


class _DoneWork(dist.Work):
    def wait(self, timeout: Any = None) -> bool:
        return True


class _FailedWork(dist.Work):
    def wait(self, timeout: Any = None) -> bool:
        raise RuntimeError("peer gone")


def test_a_failed_broadcast_raises_at_the_graphs_wait() -> None:
    """``zero_broadcast_gather`` registers its broadcasts as one ``AllOf`` work: ``wait_tensor`` on the result
    waits for each, so one that failed (a dead rank) raises there instead of leaving the gathered tensor half-written."""
    from dscompile.runtime.zero_ops import AllOf

    done = torch.empty(4)
    torch._C._distributed_c10d._register_work(done, AllOf([_DoneWork(), _DoneWork()]))
    torch.ops._c10d_functional.wait_tensor(done)
    failed = torch.empty(4)
    torch._C._distributed_c10d._register_work(failed, AllOf([_DoneWork(), _FailedWork()]))
    with pytest.raises(RuntimeError, match="peer gone"):
        torch.ops._c10d_functional.wait_tensor(failed)
