"""The one plan (issue 34): one rank layout, DeepSpeed's (pipe, data, model), read by process groups and the pipeline
engine alike."""

from __future__ import annotations

from typing import Any

import pytest

from dscompile.planner import ParallelLayout

# DeepSpeed 0.19's PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2).get_coord(r) for r in 0..7, as (pipe, data, model)
DEEPSPEED_PP2_DP2_TP2 = [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]


def test_layout_is_deepspeeds_pipe_data_model_order() -> None:
    layout = ParallelLayout(world_size=8, tp_size=2, pp_size=2)
    assert [layout.coordinates(r) for r in range(8)] == DEEPSPEED_PP2_DP2_TP2
    assert all(layout.rank_of(*layout.coordinates(r)) == r for r in range(8))
    assert layout.pp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.dp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    # PipeDataParallelTopology(num_pp=2, num_dp=2): ranks 0, 1 hold stage 0
    assert [ParallelLayout(4, 1, 2).coordinates(r)[:2] for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_layout_matches_installed_deepspeed_topology() -> None:
    topology = pytest.importorskip("deepspeed.runtime.pipe.topology")
    for pp, dp, tp in [(2, 2, 2), (4, 1, 2), (2, 3, 1), (1, 2, 4)]:
        ds = topology.PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
        layout = ParallelLayout(pp * dp * tp, tp, pp)
        assert [layout.coordinates(r) for r in range(pp * dp * tp)] == [tuple(ds.get_coord(r)) for r in range(pp * dp * tp)]


def test_pipeline_gradients_read_the_one_layout() -> None:
    """The pipeline's stage peers are the layout's ranks (no second formula); dp = 1 needs no process group."""
    from dscompile.runtime.pipeline_gradients import PipelineGradients

    layout = ParallelLayout(4, 2, 2)
    for rank in range(4):
        g = PipelineGradients(layout=layout, global_rank=rank, zero_stage=0)
        stage, dp, tp = layout.coordinates(rank)
        assert (g.stage_id, g.dp_id, g.tp_rank) == (stage, dp, tp) == (rank // 2, 0, rank % 2)
        assert [g.rank_of(0, s) for s in range(2)] == [tp, 2 + tp]


def _tiny() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4), nn.Linear(4, 2))


SGD = {"type": "SGD", "params": {"lr": 0.1}}


def _engines_report() -> dict[str, Any]:
    """What each engine says about its ZeRO stage and layout (built, not run: the plan is decided at construction)."""
    import torch.distributed as dist

    from dscompile.config import load_config
    from dscompile.engines.pipeline_parallel import PipelineEngine
    from dscompile.engines.training import DSCompileEngine
    from dscompile.runtime.optimizers import build_optimizer

    world = dist.get_world_size() if dist.is_initialized() else 1
    out: dict[str, Any] = {}
    pipe = PipelineEngine(_tiny(), {"lower": "eager", "optimizer": SGD, "pipeline": {"stages": 1}, "zero_optimization": {"stage": 1}})
    out["pipeline"] = {
        "stage": pipe.zero_optimization_stage(),
        "plan": (pipe.plan.zero_stage, pipe.plan.zero_by, pipe.plan.zero_sharded, pipe.plan.layout),
        "carried": (pipe.zero is None, pipe.gradients.zero_stage, pipe.gradients.zero1_sharded),
        "coords": (pipe.stage_id, pipe.dp_id, pipe.tp_rank) == pipe.plan.layout.coordinates(pipe.global_rank),
    }
    for stage in (1, 2, 3):
        model = _tiny()
        config = load_config({"lower": "eager", "zero_optimization": {"stage": stage}})
        engine = DSCompileEngine(model, config, build_optimizer(load_config({"optimizer": SGD}).optimizer, list(model.parameters())))
        out[f"zero{stage}"] = {
            "stage": engine.zero_optimization_stage(),
            "plan": (engine.plan.zero_stage, engine.plan.zero_by, engine.plan.zero_sharded, engine.plan.layout),
            "carried": (engine.zero.stage, engine.zero.world),
        }
    out["world"] = world
    return out


def _check_consistent(report: dict[str, Any]) -> None:
    from dscompile.planner import ZERO_BY_PARTITION, ZERO_BY_PIPELINE

    world = report["world"]
    pipe = report["pipeline"]
    # ZeRO-1 under the pipeline: stage 1 everywhere, carried out by the pipeline's gradients, not a ZeRO partition
    assert pipe["stage"] == 1
    assert pipe["plan"] == (1, ZERO_BY_PIPELINE, world > 1, ParallelLayout(world, 1, 1))
    assert pipe["carried"] == (True, 1, world > 1)
    assert pipe["coords"]
    for stage in (1, 2, 3):
        r = report[f"zero{stage}"]
        assert r["stage"] == stage
        assert r["plan"] == (stage, ZERO_BY_PARTITION, world > 1, ParallelLayout(world))
        assert r["carried"] == (stage, ParallelLayout(world).dp_size)


def test_engines_report_one_zero_stage_and_layout_single_process() -> None:
    _check_consistent(_engines_report())


def _distributed_report(rank: int, world: int) -> dict[str, Any]:
    return _engines_report()


@pytest.mark.distributed
def test_engines_report_one_zero_stage_and_layout_two_ranks() -> None:
    """On two ranks the pipeline's ZeRO-1 shards across the two replicas of its one stage, and ZeRO-1/2/3 across the
    two data-parallel ranks: every engine says so through its plan."""
    from dscompile.testing.distributed import run_distributed_or_fail

    for report in run_distributed_or_fail(_distributed_report, 2, timeout=300):
        _check_consistent(report)


def test_cli_plan_prints_the_parallel_plan(tmp_path, capsys) -> None:
    """``dscompile plan`` without offload: the layout, its groups, the stage and who carries it out, prefetch,
    checkpointing; with offload the tables follow (tests/test_zero_offload.py)."""
    import json

    from dscompile.cli import main

    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"pipeline": {"stages": 2, "activation_checkpoint_interval": 1}, "tensor_parallel": {"autotp_size": 2},
                                  "zero_optimization": {"stage": 1}}))
    assert main(["plan", "dscompile.zoo.targets:mlp", "--config", str(config), "--world", "8"]) == 0
    out = capsys.readouterr().out
    assert "world 8 = pipeline 2 × data 2 × tensor 2" in out
    assert "ZeRO stage 1, carried out by the pipeline's gradient strategy" in out
    assert "pipeline groups: [[0, 4], [1, 5], [2, 6], [3, 7]]" in out and "data groups: [[0, 2], [1, 3], [4, 6], [5, 7]]" in out
    assert "activation checkpointing: pipeline stages recompute every 1 layer(s)" in out
    config.write_text(json.dumps({"zero_optimization": {"stage": 3}, "activation_checkpointing": {"memory_budget": 0.5}}))
    assert main(["plan", "dscompile.zoo.targets:mlp", "--config", str(config), "--world", "2"]) == 0
    out = capsys.readouterr().out
    assert "ZeRO stage 3, carried out by the ZeRO partition" in out and "prefetch: ZeRO-3 all-gathers up to 50000000 elements ahead" in out
    assert "overlap_comm on" in out and "activation checkpointing: policy budget, memory budget 0.5" in out
    config.write_text(json.dumps({"pipeline": {"stages": 2}, "zero_optimization": {"stage": 2}}))
    assert main(["plan", "dscompile.zoo.targets:mlp", "--config", str(config), "--world", "2"]) == 2
    assert "zero_optimization.stage" in capsys.readouterr().err


def test_dump_shows_the_plan(tmp_path, capsys) -> None:
    import json

    from dscompile.cli import main

    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    assert main(["dump", "dscompile.zoo.targets:mlp", "--config", str(config), "--out", str(tmp_path / "d"), "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "== parallel plan ==\nparallel plan: world 2 = pipeline 1 × data 2 × tensor 1" in out
    assert "ZeRO stage 1, carried out by the ZeRO partition" in (tmp_path / "d" / "plan.txt").read_text()


def test_engine_dump_writes_its_plan(tmp_path) -> None:
    from dscompile.config import load_config
    from dscompile.engines.training import DSCompileEngine

    engine = DSCompileEngine(_tiny(), load_config({"lower": "eager", "dump": str(tmp_path), "zero_optimization": {"stage": 2}}), None)
    assert (tmp_path / "plan.txt").read_text() == engine.plan.text() + "\n"
    assert "ZeRO stage 2, carried out by the ZeRO partition (engine.zero)" in engine.plan.text()
