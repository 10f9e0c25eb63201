"""The ``fuse`` pass: which nodes form regions, why the rest are left out, collectives' order."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import operator

import pytest
import torch.fx
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from dscompile.backends.triton import triton_decompositions
from dscompile.config import load_config
from dscompile.graph import lint_graph
from dscompile.passes.fusion import REGION_PREFIX, fuse_regions, region_report
from dscompile.pipeline import pipeline_from_config

aten = torch.ops.aten


def trace(fn, *inputs):
    return make_fx(fn, decomposition_table=triton_decompositions(), tracing_mode="fake")(*inputs)


def regions(gm):
    return [n for n in gm.graph.nodes if n.op == "call_module" and str(n.target).startswith(REGION_PREFIX)]


def test_mlp_block_regions_and_skip_reasons():
    def block(x, w1, b1, w2):
        h = F.gelu(F.linear(x, w1, b1))
        return F.layer_norm(h @ w2 + x, (8,))

    x, w1, b1, w2 = torch.randn(4, 8), torch.randn(16, 8), torch.randn(16), torch.randn(16, 8)
    gm = trace(block, x, w1, b1, w2)
    mms = [n for n in gm.graph.nodes if n.target in (aten.mm.default, aten.addmm.default)]
    names = fuse_regions(gm)
    assert len(names) == 2  # gelu; residual add + layer norm
    for mm in mms:
        assert "matmul" in mm.meta["dscompile"]["fusion_skip_reason"]
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_module", "placeholder"):
            assert "val" in node.meta, node
    for r in regions(gm):
        assert r.meta["dscompile"]["region"] == r.target
        inner = getattr(gm, r.target)
        assert all(n.meta["dscompile"]["region"] == r.target for n in inner.graph.nodes if n.op == "call_function")
    lint_graph(gm, "fuse")
    report = region_report(gm)
    assert "matmul" in report and REGION_PREFIX in report
    torch.testing.assert_close(gm(x, w1, b1, w2), block(x, w1, b1, w2))


def test_non_trailing_reduction_is_left_out():
    gm = trace(lambda a: a.sum(0) + 1, torch.randn(5, 6))
    fuse_regions(gm)
    sums = [n for n in gm.graph.nodes if n.target == aten.sum.dim_IntList]
    assert sums and "only trailing dims" in sums[0].meta["dscompile"]["fusion_skip_reason"]


def _collective_graph() -> torch.fx.GraphModule:
    """x*2 -> all_reduce -> (independent y+1 before the wait) -> wait -> relu(result) + y."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = g.placeholder("y")
    a = g.call_function(aten.mul.Tensor, (x, 2.0))
    ar = g.call_function(torch.ops._c10d_functional.all_reduce.default, (a, "sum", "0"))
    b = g.call_function(aten.add.Tensor, (y, 1.0))
    c = g.call_function(aten.exp.default, (b,))
    w = g.call_function(torch.ops._c10d_functional.wait_tensor.default, (ar,))
    d = g.call_function(aten.relu.default, (w,))
    e = g.call_function(aten.add.Tensor, (d, c))
    g.output(e)
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    vals = {x: mode.from_tensor(torch.randn(4)), y: mode.from_tensor(torch.randn(4))}
    with mode:
        vals[a] = vals[x] * 2.0
        vals[ar] = torch.empty_like(vals[a])
        vals[b] = vals[y] + 1.0
        vals[c] = vals[b].exp()
        vals[w] = torch.empty_like(vals[ar])
        vals[d] = vals[w].relu()
        vals[e] = vals[d] + vals[c]
    for node, v in vals.items():
        node.meta["val"] = v
    return gm


def test_regions_never_cross_a_collective_wait():
    gm = _collective_graph()
    fuse_regions(gm)
    order = [n for n in gm.graph.nodes]
    pos = {n: i for i, n in enumerate(order)}
    ar = next(n for n in order if n.target == torch.ops._c10d_functional.all_reduce.default)
    wait = next(n for n in order if n.target == torch.ops._c10d_functional.wait_tensor.default)
    assert "collective" in ar.meta["dscompile"]["fusion_skip_reason"]
    for r in regions(gm):
        inner = [n.target for n in getattr(gm, r.target).graph.nodes if n.op == "call_function"]
        if aten.exp.default in inner:
            # the independent compute stays between the collective and its wait, overlapping it
            assert pos[ar] < pos[r] < pos[wait]
            assert aten.relu.default not in inner
        if aten.relu.default in inner:
            assert pos[r] > pos[wait]
    assert pos[ar] < pos[wait]


def test_config_rule_adds_fuse_for_triton_only():
    names = lambda cfg: [inv.name for inv in pipeline_from_config(load_config(cfg))]  # noqa: E731
    assert "fuse" in names({"lower": "triton"})
    assert "fuse" not in names({"lower": "eager"})
    auto = names({})
    assert ("fuse" in auto) == torch.cuda.is_available()


def test_multi_output_region_getitems_keep_values():
    def fn(a):
        s = torch.softmax(a, -1)
        return s, s.amax(-1)

    gm = trace(fn, torch.randn(3, 7))
    assert len(fuse_regions(gm)) == 1
    getitems = [n for n in gm.graph.nodes if n.target is operator.getitem]
    assert getitems and all("val" in n.meta for n in getitems)


@pytest.mark.slow
def test_fuse_with_inductor_lowering_leaves_the_graph_to_inductor(caplog):
    import logging

    model = torch.nn.Sequential(torch.nn.GELU(), torch.nn.LayerNorm(8))
    x = torch.randn(3, 8)
    with caplog.at_level(logging.INFO, logger="dscompile.passes.fuse"), torch.no_grad():
        out = torch.compile(model, backend="dscompile", options={"pipeline": "fuse,lower(inductor)"})(x)
        torch.testing.assert_close(out, model(x))
    assert "left unchanged" in caplog.text


def _phases_from_table(table: str) -> tuple[list[str], dict[str, int], dict[str, dict]]:
    """(collective ops in order, collectives before each node, dscompile meta) from a dump's nodes.txt."""
    import json

    order, phase, meta, count = [], {}, {}, 0
    for line in table.splitlines()[1:]:
        parts = line.split()
        if len(parts) < 2:
            continue
        name, op = parts[0], parts[1]
        if "_c10d_functional" in op:
            count += 1
            order.append(op)
        phase[name] = count
        brace = line.find("{")
        meta[name] = json.loads(line[brace:]) if brace >= 0 else {}
    return order, phase, meta


def _zero3_triton_rank(rank: int, world: int, dump: str) -> float:
    import dscompile
    from dscompile.zoo import build

    torch.manual_seed(0)
    case = build("gpt", seed=3, batch_size=2, seq_len=8, d_model=16, n_heads=2, n_layers=1, vocab_size=40, bias=False)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "lower": "triton",
        "dump": f"{dump}/rank{rank}",
    }
    engine, _, _, _ = dscompile.initialize(model=case.model, config=config)
    loss = engine(*case.batch())
    engine.backward(loss)
    engine.step()
    return float(loss)


@pytest.mark.slow
@pytest.mark.distributed
def test_zero3_collectives_keep_their_place_through_fuse(tmp_path):
    """Real ZeRO-3 graphs on two gloo ranks: after ``fuse`` the collectives keep their order and
    every fused op sits between the same collectives (and waits) as before."""
    from dscompile.testing.distributed import run_distributed_or_fail

    run_distributed_or_fail(_zero3_triton_rank, 2, str(tmp_path), timeout=400, env={"TRITON_INTERPRET": "1"})
    checked = 0
    for graph_dir in sorted((tmp_path / "rank0").glob("*.forward")) + sorted((tmp_path / "rank0").glob("*.backward")):
        steps = sorted(p for p in graph_dir.iterdir() if p.is_dir() and p.name[:2].isdigit())
        fuse_at = next(i for i, p in enumerate(steps) if p.name.endswith("_fuse"))
        before_order, before_phase, _ = _phases_from_table((steps[fuse_at - 1] / "nodes.txt").read_text())
        after_order, after_phase, after_meta = _phases_from_table((steps[fuse_at] / "nodes.txt").read_text())
        assert before_order and after_order == before_order
        for name, meta in after_meta.items():
            for inner in meta.get("region_nodes", []):
                assert before_phase[inner] == after_phase[name], (graph_dir.name, name, inner)
                checked += 1
    assert checked > 10
