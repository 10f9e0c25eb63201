"""The pipeline engine's stages come from the ``pipeline_split`` pass, run once in the frontend's capture (issue 34)."""

from __future__ import annotations

import logging

import pytest
import torch

from dscompile.engines.pipeline_parallel import PipelineEngine
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
