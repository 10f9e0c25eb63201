"""The cost model: FLOP formulas, peak live bytes, symbolic sizes."""

from __future__ import annotations

import sympy
import torch

from dscompile.cost import evaluate, graph_cost
from dscompile.pipeline import register_pass

_GRAPHS: dict = {}


@register_pass("test_cost_capture", graphs=("forward",))
def _capture(gm, ctx, options):
    """Keeps the forward graph for the cost tests."""
    _GRAPHS["forward"] = gm
    return gm


def _forward_of(fn, *inputs, dynamic=False):
    torch.compile(fn, backend="dscompile", options={"pipeline": "test_cost_capture,lower(eager)"}, dynamic=dynamic)(*inputs)
    return _GRAPHS["forward"]


def test_matmul_flops_are_2mnk():
    gm = _forward_of(lambda a, b: a @ b, torch.randn(8, 16), torch.randn(16, 4))
    assert evaluate(graph_cost(gm).flops) == 2 * 8 * 16 * 4


def test_peak_counts_live_intermediates():
    def chain(x):
        a = x * 2  # 4 KiB
        b = a + 1  # 4 KiB, a dies after this
        return b.sum()

    gm = _forward_of(chain, torch.randn(1024))
    cost = graph_cost(gm)
    # x is an input (4 KiB, held by the caller), a and b overlap once (8 KiB), plus the scalar.
    assert 3 * 4096 <= cost.peak_bytes <= 3 * 4096 + 64


def test_symbolic_sizes_give_expressions():
    gm = _forward_of(lambda a, b: a @ b, torch.randn(8, 16), torch.randn(16, 4), dynamic=True)
    flops = graph_cost(gm).flops
    assert isinstance(flops, sympy.Expr) and flops.free_symbols
    assert evaluate(flops, {s: 1 for s in flops.free_symbols}) >= 2
