"""The ``fuse`` pass: which nodes form regions, why the rest are left out, collectives' order."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import operator

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
