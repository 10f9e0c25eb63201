"""ZeRO step-time choices that must not change the maths: which collectives share a flat bucket,
and the fused Adam/AdamW the shards are stepped with (``bench/zero.py`` measures their effect)."""

from __future__ import annotations

import torch
import torch.fx
from torch import nn

from dscompile.graph import ds_meta
from dscompile.passes.zero_bucketing import CPU_ALONE_ABOVE, _buckets
from dscompile.runtime.zero_extension import shard_optimizer
from dscompile.runtime.zero_shard import ZeroPartition


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
