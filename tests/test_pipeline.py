"""Pass registry, textual pipelines, ordering checks, lint and fake-value verification."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import pytest
import torch
import torch.fx

from dscompile.errors import DSCompilePassError, DSCompilePipelineError
from dscompile.graph import node_value
from dscompile.pipeline import (
    PassContext,
    PassManager,
    check_order,
    invocation,
    parse_pipeline,
    pipeline_from_config,
    register_pass,
)


@dataclass
class _DemoOptions:
    depth: int = 1
    ratio: float = 0.5
    mode: Literal["fast", "slow"] = "fast"
    enabled: bool = True
    names: list[str] | None = None


@register_pass("test_options", graphs=("forward",), options=_DemoOptions)
def _options_pass(gm, ctx, options):
    """Records the options it ran with."""
    ctx.analysis.setdefault("seen", []).append(options)
    return gm


@register_pass("test_needs_options", graphs=("forward",), requires=("test_options",))
def _needs_pass(gm, ctx, options):
    return gm


@register_pass("test_clashes", graphs=("forward",), conflicts=("test_options",))
def _clash_pass(gm, ctx, options):
    return gm


@register_pass("test_corrupt_val", graphs=("forward",))
def _corrupt_pass(gm, ctx, options):
    """Breaks meta['val'] of the first computing node: debug verification must catch it."""
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    node.meta["val"] = torch.empty(7, 7, dtype=torch.float64)
    return gm


@register_pass("test_missing_val", graphs=("forward",))
def _missing_val_pass(gm, ctx, options):
    """Adds a node without meta['val']: the lint must name it."""
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        gm.graph.call_function(torch.ops.aten.neg.default, (x,))
    return gm


def test_parse_typed_options_and_positional():
    (inv,) = parse_pipeline("test_options(3, ratio=2, mode=slow, enabled=false, names=[a;b])")
    opts = inv.options
    assert (opts.depth, opts.ratio, opts.mode, opts.enabled, opts.names) == (3, 2.0, "slow", False, ["a", "b"])
    assert parse_pipeline(inv.spec())[0].options == opts


@pytest.mark.parametrize(
    "spec,message",
    [
        ("test_optionz", "did you mean 'test_options'"),
        ("test_options(deph=2)", "did you mean 'depth'"),
        ("test_options(depth=two)", "expected an integer"),
        ("test_options(mode=medium)", "is not one of"),
        ("test_options(enabled=3)", "expected true or false"),
        ("test_options(depth=1", "unbalanced"),
        ("dce(x=1)", "takes no options"),
    ],
)
def test_bad_specs_fail_clearly(spec, message):
    with pytest.raises(DSCompilePipelineError, match=message.replace("(", r"\(")):
        parse_pipeline(spec)


def test_order_requirements_and_conflicts():
    check_order(parse_pipeline("test_options,test_needs_options"))
    with pytest.raises(DSCompilePipelineError, match="requires 'test_options'.*later"):
        check_order(parse_pipeline("test_needs_options,test_options"))
    with pytest.raises(DSCompilePipelineError, match="requires 'test_options'.*nowhere"):
        check_order(parse_pipeline("test_needs_options"))
    with pytest.raises(DSCompilePipelineError, match="conflicts"):
        check_order(parse_pipeline("test_options,test_clashes"))


def test_config_maps_to_pipeline_with_lowering():
    from dscompile.config import load_config

    specs = [inv.spec() for inv in pipeline_from_config(load_config({"lower": "eager"}))]
    assert specs[-1] == "lower(eager)"
    assert "dce" in specs and "cse" in specs
    specs = [inv.spec() for inv in pipeline_from_config(load_config({"pipeline": "dce"}))]
    assert specs == ["dce", "lower"]


_CAPTURED: dict = {}


@register_pass("test_capture", graphs=("forward",))
def _capture_pass(gm, ctx, options):
    """Keeps the graph it sees for the test to inspect."""
    _CAPTURED["gm"] = gm
    _CAPTURED["ctx"] = ctx
    return gm


def _forward_graph():
    """A real AOT forward graph with fake values, captured through the dscompile backend."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    compiled = torch.compile(model, backend="dscompile", options={"pipeline": "test_capture,lower(eager)"})
    compiled(torch.randn(3, 4)).sum().backward()
    return _CAPTURED["gm"], _CAPTURED["ctx"]


def test_debug_verification_names_the_pass():
    gm, ctx = _forward_graph()
    manager = PassManager([invocation("test_corrupt_val")], debug=True)
    with pytest.raises(DSCompilePassError, match="test_corrupt_val"):
        manager.run(gm, ctx)


def test_lint_catches_node_without_value():
    gm, ctx = _forward_graph()
    with pytest.raises(DSCompilePassError, match="test_missing_val.*without meta"):
        PassManager([invocation("test_missing_val")]).run(gm, ctx)


def test_manager_runs_only_matching_graph_kinds_and_times_passes():
    gm, ctx = _forward_graph()
    manager = PassManager(parse_pipeline("test_options(depth=5),dce"))
    backward_ctx = PassContext(config=ctx.config, graph_kind="backward", graph_name="g.backward")
    manager.run(gm, backward_ctx)
    assert [r.pass_spec for r in manager.records] == ["dce"]
    manager.run(gm, ctx)
    assert ctx.analysis["seen"][-1].depth == 5
    assert all(r.seconds >= 0 for r in manager.records)


def test_cleanup_passes_keep_numerics_and_remove_duplicates():
    def f(x):
        a = torch.sin(x) + torch.sin(x)  # duplicate sin: CSE merges it
        unused = torch.cos(x)  # noqa: F841 - dead: DCE drops it
        return a.view(a.shape) * 2  # a no-op view

    x = torch.randn(5, 3)
    out = torch.compile(f, backend="dscompile", options={"pipeline": "cse,noop_views,dce,test_capture,lower(eager)", "debug": True})(x)
    captured = _CAPTURED
    torch.testing.assert_close(out, f(x), rtol=0, atol=0)
    targets = [n.target for n in captured["gm"].graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.aten.sin.default) == 1
    assert torch.ops.aten.cos.default not in targets
    assert torch.ops.aten.view.default not in targets
    assert all(node_value(n) is not None for n in captured["gm"].graph.nodes if n.op == "call_function")


def test_cse_never_merges_random_ops():
    def f(x):
        return torch.rand_like(x) - torch.rand_like(x)

    out = torch.compile(f, backend="dscompile", options={"pipeline": "cse,dce,lower(eager)"})(torch.zeros(1000))
    assert out.abs().sum() > 0


class _ScaleInPlace(torch.autograd.Function):
    """Forward and backward each change a fresh tensor in place and return it, as a Megatron layer's
    ``x = x.clone(); dist.all_reduce(x); return x`` does (Dynamo makes that ``x.copy_(all_reduce(x))``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        y = x.clone()
        y.mul_(2.0)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        g = grad.clone()
        g.mul_(3.0)
        return g


@pytest.mark.parametrize("lower", ["eager", "default"])
def test_dce_keeps_in_place_methods_inside_autograd_function_bodies(lower: str) -> None:
    """fx's dead-code elimination recurses into subgraphs with its own rule, which dropped the unused
    ``y.mul_(2.0)`` of an autograd.Function body: the forward returned x and the gradient was unscaled."""

    def f(x: torch.Tensor) -> torch.Tensor:
        return (_ScaleInPlace.apply(x.sin()) ** 2).sum()

    x = torch.randn(5, requires_grad=True)
    f(x).backward()
    expected_grad = x.grad.clone()
    x.grad = None
    options = {"lower": "eager"} if lower == "eager" else {}
    out = torch.compile(f, backend="dscompile", options=options)(x)
    out.backward()
    torch.testing.assert_close(out, f(x.detach()))
    torch.testing.assert_close(x.grad, expected_grad)
