"""The pipeline engine's stages come from the ``pipeline_split`` pass, run once in the frontend's capture (issue 34)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from dscompile.engines.pipeline_parallel import PipelineEngine
from dscompile.errors import DSCompilePassError
from dscompile.graph import fill_capture_values, lint_graph
from dscompile.runtime.pipeline_markers import pipeline_split
from dscompile.zoo import build, make_batch


def test_engine_runs_the_stages_the_pass_cut_once(tmp_path, caplog):
    case = build("gpt", n_layers=3)
    cfg = {
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "pipeline": {"stages": 1, "schedule": "interleaved_1f1b", "virtual_stages": 3, "micro_batches": 1, "compile": False},
        "dump": str(tmp_path),
    }
    with caplog.at_level(logging.INFO, logger="dscompile.passes.pipeline_split"):
        engine = PipelineEngine(case.model, cfg, example_batch=make_batch(case, seed=0))
    plans = [r.getMessage() for r in caplog.records if r.name == "dscompile.passes.pipeline_split" and "pipeline partition" in r.getMessage()]
    assert len(plans) == 1 and plans[0] == engine.program.describe()  # one split, by the pass, with the stage graphs cut
    assert "cut: stage 0 output" in plans[0]
    step = tmp_path / "pipeline.dynamo" / "01_pipeline_split"
    assert "pipeline_split(stages=3" in (step / "summary.json").read_text() and "cut=true" in (step / "summary.json").read_text()
    nodes = (step / "nodes.txt").read_text()
    assert all(f'"stage": {s}' in nodes for s in range(3))
    assert (tmp_path / "pipeline_stages.txt").read_text() == engine.program.describe()


def test_cut_needs_the_captured_module():
    case = build("mlp")
    torch._dynamo.reset()
    compiled = torch.compile(case.model, backend="dscompile", options={"pipeline": "pipeline_split(stages=2,cut=true),lower(eager)"})
    with pytest.raises(Exception, match="captured module"):
        compiled(*case.batch())


class _Marked(nn.Module):
    """Three linears with ``dscompile.pipeline_split()`` markers between them: the marker op returns nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        pipeline_split()
        h = torch.relu(self.b(h))
        pipeline_split()
        return nn.functional.mse_loss(self.c(h), y)


def test_engine_cuts_at_markers_through_the_pass():
    """The marker nodes Dynamo records without a value get ``None`` before the pass (the lint needs a value on every
    call); the pass then cuts at them, and the stages' eval loss is the eager loss."""
    torch.manual_seed(0)
    model = _Marked()
    batch = (torch.randn(4, 8), torch.randn(4, 4))
    expected = model(*batch).detach()
    cfg = {
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "pipeline": {"stages": 1, "schedule": "interleaved_1f1b", "virtual_stages": 3, "micro_batches": 1, "compile": False},
    }
    engine = PipelineEngine(model, cfg, example_batch=batch)
    assert engine.program.plan.method == "markers" and len(engine.program.stages) == 3
    owned = [sorted(n for n, _ in s.module.named_parameters()) for s in engine.program.stages]
    assert owned == [["a.bias", "a.weight"], ["b.bias", "b.weight"], ["c.bias", "c.weight"]]
    torch.testing.assert_close(engine.eval_batch(iter([batch])), expected)


def test_export_guard_call_gets_a_none_value():
    """``ExportedProgram.module()`` calls its input guards (``_guards_fn``) with no value: the tensor-parallel pipeline
    runs the pass on such a graph, so the call is given its value (``None``) and the lint passes."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    gm = torch.export.export(model, (torch.randn(2, 4),), strict=False).module()
    guards = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == "_guards_fn"]
    assert len(guards) == 1 and "val" not in guards[0].meta
    with pytest.raises(DSCompilePassError, match="_guards_fn"):
        lint_graph(gm, "check")
    assert fill_capture_values(gm) == 1
    assert guards[0].meta["val"] is None
    lint_graph(gm, "check")


def test_marked_model_compiles_outside_the_pipeline():
    """``pipeline_split()`` is a no-op when not pipelining: a marked model compiles with the backend (default lowering,
    the passes' lint on every graph) to eager's loss and gradients; AOTAutograd traces the marker without a value too."""
    torch.manual_seed(0)
    model = _Marked()
    batch = (torch.randn(4, 8), torch.randn(4, 4))
    expected = model(*batch)
    expected.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch._dynamo.reset()
    loss = torch.compile(model, backend="dscompile", options={"debug": True})(*batch)
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)
