"""Pipeline split (single process): config, partition balance, split points, markers, dump, numerics."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from dscompile.config import load_config
from dscompile.engines.pipeline_parallel import PipelineEngine, capture_graph
from dscompile.errors import DSCompileConfigError
from dscompile.passes.pipeline_split import describe_plan, graph_facts, min_max_partition, plan_partition, split_program
from dscompile.runtime.pipeline_markers import pipeline_split
from dscompile.zoo import build, make_batch

warnings.filterwarnings("ignore", message="Failed to fetch module")


def _captured(name: str, **overrides):
    case = build(name, **overrides)
    gm, params = capture_graph(case.model, case.batch())
    return case, gm, params, graph_facts(gm, params)


# -- config ---------------------------------------------------------------------------------------
def test_pipeline_section_parses_and_validates():
    cfg = load_config({"pipeline": {"stages": 2, "schedule": "interleaved_1f1b", "micro_batches": 4, "partition_method": "type:block"}})
    section = cfg.sections["pipeline_parallel"]
    assert (section.stages, section.virtual_stages, section.num_model_stages) == (2, 2, 4)
    for bad, key in [
        ({"stages": 0}, "stages"),
        ({"micro_batches": 0}, "micro_batches"),
        ({"schedule": "zigzag"}, "schedule"),
        ({"partition_method": "balanced"}, "partition_method"),
        ({"partition_method": "type:("}, "partition_method"),
        ({"stages": 2, "split_points": ["blocks.1", "blocks.2"]}, "split_points"),
        ({"virtual_stages": 2}, "virtual_stages"),
        ({"stagez": 2}, "stagez"),
    ]:
        with pytest.raises(DSCompileConfigError, match=key):
            load_config({"pipeline": bad})


def test_world_size_must_divide_stages():
    case = build("mlp")
    with pytest.raises(DSCompileConfigError, match="not divisible by 2 pipeline stages"):
        PipelineEngine(case.model, {"pipeline": {"stages": 2}})


def test_zero_above_stage_1_is_refused():
    case = build("mlp")
    with pytest.raises(DSCompileConfigError, match="use stage 1"):
        PipelineEngine(case.model, {"pipeline": {"stages": 1}, "zero_optimization": {"stage": 2}})


def test_initialize_returns_the_pipeline_engine_for_a_pipeline_config():
    """DeepSpeed style: dscompile.initialize + a pipeline section -> train_batch; numbers equal eager."""
    import dscompile
    from dscompile.engines.training import DSCompileEngine

    cfg = {"gradient_accumulation_steps": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "pipeline": {"stages": 1, "compile": False}}
    case, ref = build("mlp"), build("mlp")
    engine, optimizer, _, _ = dscompile.initialize(model=case.model, config=cfg)
    assert isinstance(engine, PipelineEngine) and engine.gradient_accumulation_steps() == 2
    with pytest.raises(RuntimeError, match="train_batch"):
        engine.backward(torch.zeros(()))
    with pytest.raises(DSCompileConfigError, match="PipelineEngine"):
        DSCompileEngine(ref.model, load_config(cfg), None)
    batches = [make_batch(case, seed=i) for i in range(4)]
    opt = torch.optim.SGD(ref.model.parameters(), lr=0.1)
    for step in range(2):
        loss = engine.train_batch(iter(batches[2 * step : 2 * step + 2]))
        expected = sum(ref.model(*b) / 2 for b in batches[2 * step : 2 * step + 2])
        expected.backward()
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-6, atol=0)
    for name, p in ref.model.named_parameters():
        torch.testing.assert_close(engine.stage_parameters()[name], p.detach(), rtol=1e-6, atol=1e-7)
    assert engine.get_lr() == [0.1] and optimizer is engine.optimizer


# -- the dynamic program --------------------------------------------------------------------------
def _brute_force(costs, cuts, stages):
    import itertools

    n = len(costs)
    best = float("inf")
    for inner in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *inner, n]
        worst = max(sum(costs[a:b]) + (cuts[a] if a else 0) + (cuts[b] if b < n else 0) for a, b in zip(bounds, bounds[1:]))
        best = min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_min_max_partition_is_exact(seed):
    gen = torch.Generator().manual_seed(seed)
    n, stages = 9, 1 + seed % 4
    costs = torch.rand(n, generator=gen).tolist()
    cuts = (torch.rand(n + 1, generator=gen) * 0.3).tolist()
    cuts[3] = float("inf")  # a forbidden boundary
    bounds = min_max_partition(costs, cuts, stages)
    assert 3 not in bounds[1:-1]
    got = max(sum(costs[a:b]) + (cuts[a] if a else 0) + (cuts[b] if b < n else 0) for a, b in zip(bounds, bounds[1:]))
    assert got == pytest.approx(_brute_force(costs, cuts, stages))


# -- balance on the zoo models --------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gpt", "llama"])
@pytest.mark.parametrize("stages", [2, 4])
def test_cost_partition_balances_flops_and_beats_layer_methods(name, stages):
    _, _, _, facts = _captured(name, n_layers=8)
    cost = plan_partition(facts, stages, "cost")
    mean = sum(cost.stage_flops) / stages
    assert max(cost.stage_flops) <= 1.10 * mean
    for method in ("parameters", "uniform", "type:block"):
        other = plan_partition(facts, stages, method)
        assert max(cost.objective) <= max(other.objective) + 1e-12, method
        assert max(cost.stage_flops) <= max(other.stage_flops) * 1.02, method


def test_layer_methods_cut_between_layers():
    _, _, _, facts = _captured("gpt", n_layers=4)
    plan = plan_partition(facts, 2, "uniform")
    cut = facts.nodes[plan.bounds[1]]
    assert facts.layers[plan.bounds[1]] != facts.layers[plan.bounds[1] - 1], cut.name
    with pytest.raises(DSCompileConfigError, match="no layer class matches"):
        plan_partition(facts, 2, "type:Conv")


# -- split points, markers, numerics --------------------------------------------------------------
def _run_sequentially(program, batch):
    outs = {}
    for spec in program.stages:
        args = [batch[r.index] if r.kind == "input" else outs[(r.stage, r.index)] for r in spec.inputs]
        for i, value in enumerate(spec.module(*args)):
            outs[(spec.index, i)] = value
    return outs[program.loss]


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_split_stages_reproduce_loss_and_gradients(name):
    case, gm, params, facts = _captured(name, n_layers=3)
    plan = plan_partition(facts, 3, "cost")
    program = split_program(gm, case.model, facts, plan, params, case.batch())
    assert len(program.stages) == 3
    owned = [{id(p) for p in s.module.parameters()} for s in program.stages]
    assert set().union(*owned) == {id(p) for p in case.model.parameters()}
    loss = _run_sequentially(program, case.batch())
    grads = torch.autograd.grad(loss, list(case.model.parameters()))
    ref = case.model(*case.batch())
    ref_grads = torch.autograd.grad(ref, list(case.model.parameters()))
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)
    # activations crossing forward carry gradients back; rotary tables are recomputed per stage
    crossing = [t for s in program.stages for ref_, t in zip(s.inputs, s.input_specs) if ref_.kind == "stage"]
    assert crossing and all(t.requires_grad for t in crossing)
    text = describe_plan(program, plan, facts)
    assert "stage 2:" in text and "activation + gradient back" in text


def test_split_points_by_module_name():
    case, gm, params, facts = _captured("gpt", n_layers=4)
    plan = plan_partition(facts, 3, split_points=["blocks.1", "blocks.3"])
    assert plan.method == "split_points"
    from dscompile.passes.pipeline_split import module_path

    assert [module_path(facts.nodes[b]).startswith(n) for b, n in zip(plan.bounds[1:-1], ["blocks.1", "blocks.3"])] == [True, True]
    with pytest.raises(DSCompileConfigError, match="blocks.9"):
        plan_partition(facts, 2, split_points=["blocks.9"])


class _Marked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        pipeline_split()
        h = torch.relu(self.b(h))
        pipeline_split()
        return nn.functional.mse_loss(self.c(h), y)


def test_marker_calls_cut_the_graph_and_are_removed():
    torch.manual_seed(0)
    model = _Marked()
    batch = (torch.randn(4, 8), torch.randn(4, 4))
    assert model(*batch).requires_grad  # the marker is a no-op in eager
    gm, params = capture_graph(model, batch)
    facts = graph_facts(gm, params)
    assert len(facts.markers) == 2
    plan = plan_partition(facts, 3)
    assert plan.method == "markers"
    program = split_program(gm, model, facts, plan, params, batch)
    assert [sorted(n for n, _ in s.module.named_parameters()) for s in program.stages] == [
        ["a.bias", "a.weight"], ["b.bias", "b.weight"], ["c.bias", "c.weight"]
    ]
    assert not any("pipeline_split" in str(n.target) for s in program.stages for n in s.module.graph.nodes)
    torch.testing.assert_close(_run_sequentially(program, batch), model(*batch))


def test_dump_annotates_stages(tmp_path):
    """The inspection pass colours the Dynamo graph by stage inside a normal torch.compile."""
    case = build("gpt")
    torch._dynamo.reset()
    compiled = torch.compile(case.model, backend="dscompile", options={"pipeline": "pipeline_split(stages=2),lower(eager)", "dump": str(tmp_path)})
    compiled(*case.batch())
    nodes = (tmp_path / "graph_0.dynamo" / "01_pipeline_split" / "nodes.txt").read_text()
    assert '"stage": 0' in nodes and '"stage": 1' in nodes
    dot = (tmp_path / "graph_0.dynamo" / "01_pipeline_split" / "graph.dot").read_text()
    assert "#cfe2f3" in dot and "#d9ead3" in dot  # one colour per stage
