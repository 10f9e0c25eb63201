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


# -- the plan decides ZeRO's schedule and checkpointing; the passes read it ------------------------------------------
ZERO3 = {"stage": 3, "allgather_bucket_size": 700, "reduce_bucket_size": 900, "stage3_prefetch_bucket_size": 500,
         "stage3_max_live_parameters": 4000, "stage3_max_reuse_distance": 30, "unshard_budget": 60, "overlap_comm": False}


def _options(invocations: list[Any]) -> dict[str, Any]:
    return {inv.name: inv.options for inv in invocations}


def test_zero3_schedule_is_what_the_passes_receive() -> None:
    """Every size ZeRO's passes get is the plan's (``ZeroSchedule``); the plan prints them."""
    from dscompile.config import load_config
    from dscompile.pipeline import pipeline_from_config
    from dscompile.planner import plan_parallel

    config = load_config({"zero_optimization": ZERO3, "activation_checkpointing": {"memory_budget": 0.25, "cpu_checkpointing": True}})
    plan = plan_parallel(config, 2)
    s = plan.zero_schedule
    assert (s.stage, s.allgather_bucket_elements, s.reduce_bucket_elements, s.prefetch_elements) == (3, 700, 900, 500)
    assert (s.max_live_parameters, s.max_reuse_distance, s.unshard_budget, s.overlap_comm, s.gather_bucket_elements) == (4000, 30, 60, False, 500)
    options = _options(pipeline_from_config(config))
    zero, bucketing, prefetch, overlap = options["zero"], options["zero_bucketing"], options["zero_prefetch"], options["zero_overlap"]
    assert (zero.stage, zero.unshard_budget, zero.max_reuse_distance) == (3, s.unshard_budget, s.max_reuse_distance)
    assert zero.max_live_parameters == s.max_live_parameters
    assert (bucketing.allgather_bucket_size, bucketing.reduce_bucket_size) == (s.gather_bucket_elements, s.reduce_bucket_elements)
    assert (prefetch.stage3_prefetch_bucket_size, prefetch.stage3_max_live_parameters) == (s.prefetch_elements, s.max_live_parameters)
    assert (overlap.overlap_comm, overlap.reduce_bucket_size) == (s.overlap_comm, s.reduce_bucket_elements)
    c = plan.checkpointing
    checkpoint = options["checkpoint"]
    assert (checkpoint.policy, checkpoint.budget, checkpoint.cpu_offload) == (c.policy, c.memory_budget, c.cpu_offload) == ("budget", 0.25, True)
    text = plan.text()
    assert "ZeRO buckets: all-gather 500 elements, reduce-scatter 900 elements; live parameters <= 4000 elements" in text
    assert "prefetch: ZeRO-3 all-gathers up to 500 elements ahead; overlap_comm off" in text
    assert "activation checkpointing: policy budget, memory budget 0.25, saved activations on the host" in text


def test_engine_compiles_under_its_plan(caplog) -> None:
    """The engine compiles under its plan: a schedule swapped into ``engine.plan`` (as profiling does) reaches the passes
    of the recompiled graphs, though the config says otherwise; the out-of-graph buckets are the plan's too."""
    import logging
    from dataclasses import replace

    import torch

    from dscompile.config import load_config
    from dscompile.engines.training import DSCompileEngine
    from dscompile.runtime.optimizers import build_optimizer

    model = _tiny()
    engine = DSCompileEngine(model, load_config({"lower": "eager", "zero_optimization": ZERO3}),
                             build_optimizer(load_config({"optimizer": SGD}).optimizer, list(model.parameters())))
    assert engine.zero.bucket_bytes == engine.plan.zero_schedule.reduce_bucket_elements * 4
    engine.plan = replace(engine.plan, zero_schedule=replace(engine.plan.zero_schedule, allgather_bucket_elements=123, reduce_bucket_elements=456))
    engine.recompile(engine.config)
    with caplog.at_level(logging.INFO, logger="dscompile.frontend"):
        engine(torch.randn(3, 8)).sum()
    pipelines = [r.getMessage() for r in caplog.records if ": pipeline " in r.getMessage()]
    assert pipelines and all("zero_bucketing(allgather_bucket_size=123,reduce_bucket_size=456)" in p for p in pipelines), pipelines
    assert "zero_overlap(overlap_comm=false,reduce_bucket_size=456)" in pipelines[0]


def _gather_chain(sizes: list[int]) -> Any:
    """A forward graph as ZeRO leaves it before scheduling: each all-gather starts right before its use."""
    import torch
    import torch.fx

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    shards = [graph.placeholder(f"shard{i}") for i in range(len(sizes))]
    for i, (shard, size) in enumerate(zip(shards, sizes, strict=True)):
        start = graph.call_function(torch.ops._c10d_functional.all_gather_into_tensor.default, (shard, 2, "0"))
        start.meta["dscompile"] = {"zero": {"kind": "all_gather", "elements": size, "group": "0", "world": 2, "shard_numel": size // 2, "members": 1}}
        start.name = f"gather{i}"
        wait = graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (start,))
        x = graph.call_function(torch.ops.aten.add.Tensor, (x, wait))
    graph.output(x)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _gather_positions(schedule: Any) -> list[int]:
    """Where the ``zero_prefetch`` pass the config rule builds for a plan with ``schedule`` puts each gather."""
    from dataclasses import replace

    from dscompile.config import load_config
    from dscompile.pipeline import PassContext, pipeline_from_config
    from dscompile.planner import compiling_under, plan_parallel

    config = load_config({"zero_optimization": ZERO3})
    with compiling_under(replace(plan_parallel(config, 2), zero_schedule=schedule)):
        prefetch = next(inv for inv in pipeline_from_config(config) if inv.name == "zero_prefetch")
    gm = _gather_chain([100, 100, 100, 100])
    prefetch.info.fn(gm, PassContext(config, "forward", "g"), prefetch.options)
    order = {node.name: i for i, node in enumerate(gm.graph.nodes)}
    return [order[f"gather{i}"] for i in range(4)]


def test_a_changed_schedule_changes_what_the_passes_do() -> None:
    """Same config, two plans: prefetch window 0 leaves every gather at its use, a large one issues them all up front."""
    from dataclasses import replace

    from dscompile.config import load_config
    from dscompile.planner import plan_zero_schedule

    schedule = plan_zero_schedule(load_config({"zero_optimization": ZERO3}))
    at_use = _gather_positions(replace(schedule, prefetch_elements=0))
    ahead = _gather_positions(replace(schedule, prefetch_elements=10**6))
    # at its use: each gather follows the previous one's add; up front: the four gathers come right after the inputs, in order
    assert at_use == [5, 8, 11, 14], at_use
    assert ahead == [5, 6, 7, 8], ahead


def _issue_order(gm: Any) -> list[str]:
    import torch

    return [n.name for n in gm.graph.nodes if n.target is torch.ops._c10d_functional.all_gather_into_tensor.default]


@pytest.mark.parametrize("window", [200, 300, 10**6])  # room for 2, 3, all gathers
@pytest.mark.parametrize("compute_first", [False, True])
def test_prefetch_keeps_the_issue_order_of_the_gathers(window: int, compute_first: bool) -> None:
    """``zero_prefetch`` moves all-gathers ahead of their use, never one ahead of another: the first gather (right
    after the inputs, or after compute that does not need it) is issued first, whatever the window."""
    import torch

    from dscompile.config import load_config
    from dscompile.passes.zero_prefetch import ZeroPrefetchOptions, zero_prefetch
    from dscompile.pipeline import PassContext

    gm = _gather_chain([100, 100, 100, 100, 100])
    if compute_first:  # the graph computes on x before the first gather's use
        x = next(iter(gm.graph.nodes))
        with gm.graph.inserting_after(next(n for n in gm.graph.nodes if n.op != "placeholder").prev):
            pre = gm.graph.call_function(torch.ops.aten.mul.Tensor, (x, 2.0))
        x.replace_all_uses_with(pre, delete_user_cb=lambda user: user is not pre)
    before = _issue_order(gm)
    assert before == [f"gather{i}" for i in range(5)]
    options = ZeroPrefetchOptions(stage3_prefetch_bucket_size=window, stage3_max_live_parameters=10**9)
    zero_prefetch(gm, PassContext(load_config({"zero_optimization": ZERO3}), "forward", "g"), options)
    gm.graph.lint()
    assert _issue_order(gm) == before
    order = {node.name: i for i, node in enumerate(gm.graph.nodes)}
    waits = {n.args[0].name: order[n.name] for n in gm.graph.nodes if n.target is torch.ops._c10d_functional.wait_tensor.default}
    # and still prefetched: each gather starts before the previous one's wait
    assert all(order[f"gather{i}"] < waits[f"gather{i - 1}"] for i in range(1, 5)), (order, waits)


def _gather_lines(code: str) -> int:
    """The sum of the line numbers where all-gathers start (smaller: issued earlier)."""
    return sum(i for i, line in enumerate(code.splitlines()) if "all_gather_into_tensor" in line)


def _gather_names(code: str) -> list[str]:
    """The all-gathers of a dumped graph's code, in the order they are issued."""
    calls = [line.split("=", 1) for line in code.splitlines() if "=" in line]
    return [name.split(":")[0].strip() for name, call in calls if "_c10d_functional.all_gather_into_tensor" in call]


def replanned_rank(rank: int, world: int, dump_root: str) -> dict[str, Any]:
    """A ZeRO-3 engine whose plan is swapped (as profiling does) and recompiled: the new graphs follow the new plan."""
    from dataclasses import replace
    from pathlib import Path

    import torch
    from test_zero import _case, _config, _micro_batch

    import dscompile

    out: dict[str, Any] = {"losses": [], "ahead": [], "moved": [], "orders": []}
    small = {"reduce_bucket_size": 1500, "allgather_bucket_size": 1500, "stage3_prefetch_bucket_size": 3000, "stage3_max_reuse_distance": 0}
    torch.manual_seed(0)
    case = _case("gpt")
    engine, _, _, _ = dscompile.initialize(model=case.model, config=_config(3, 1, 0.0, small, f"{dump_root}/rank{rank}"))
    for window in (0, 10**9):
        engine.plan = replace(engine.plan, zero_schedule=replace(engine.plan.zero_schedule, prefetch_elements=window))
        engine.recompile(engine.config)
        loss = engine(*_micro_batch(case, 0, 0, rank))
        engine.backward(loss)
        out["losses"].append(float(loss.detach()))
        engine.optimizer.zero_grad()  # no step: both plans compute the same loss and gradients
        graph = sorted(Path(f"{dump_root}/rank{rank}").glob("*.forward"))[-1]
        code = {p.name.split("_", 1)[1]: (p / "code.py").read_text() for p in graph.iterdir() if p.is_dir()}
        # what zero_prefetch did: how many lines earlier the all-gathers start than where bucketing left them
        out["ahead"].append(_gather_lines(code["zero_bucketing"]) - _gather_lines(code["zero_prefetch"]))
        out["moved"].append(code["zero_prefetch"] != code["zero_bucketing"])
        for kind in ("forward", "backward"):  # the all-gathers issue in the order bucketing left them
            graph = sorted(Path(f"{dump_root}/rank{rank}").glob(f"*.{kind}"))[-1]
            code = {p.name.split("_", 1)[1]: (p / "code.py").read_text() for p in graph.iterdir() if p.is_dir()}
            out["orders"].append((_gather_names(code["zero_bucketing"]), _gather_names(code["zero_prefetch"])))
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_a_replanned_engine_compiles_to_its_new_schedule(tmp_path) -> None:
    from dscompile.testing.distributed import run_distributed_or_fail

    for r in run_distributed_or_fail(replanned_rank, 2, str(tmp_path), timeout=300):
        assert r["moved"] == [False, True] and r["ahead"][0] == 0 and r["ahead"][1] > 0, r  # window 0: no gather moved ahead
        assert r["losses"][0] == r["losses"][1]  # scheduling moves collectives, never the numbers
        for before, after in r["orders"]:
            assert len(before) > 2 and after == before, (before, after)


def test_the_checkpoint_pass_reads_the_plan() -> None:
    """The ``checkpoint`` pass gets the plan's policy, not the config's section."""
    from dataclasses import replace

    from dscompile.config import load_config
    from dscompile.pipeline import pipeline_from_config
    from dscompile.planner import CheckpointingPlan, compiling_under, plan_parallel

    config = load_config({"activation_checkpointing": {"memory_budget": 0.5}})
    assert _options(pipeline_from_config(config))["checkpoint"].budget == 0.5
    with compiling_under(replace(plan_parallel(config, 1), checkpointing=CheckpointingPlan(policy="full", number_checkpoints=2))):
        options = _options(pipeline_from_config(config))["checkpoint"]
    assert (options.policy, options.budget, options.number_checkpoints) == ("full", None, 2)
    with compiling_under(replace(plan_parallel(config, 1), checkpointing=CheckpointingPlan())):
        assert "checkpoint" not in _options(pipeline_from_config(config))


def _pipelines_compiled(engine: Any, batch: tuple[Any, ...]) -> list[str]:
    """The pass pipelines the backend logs while ``engine`` runs one training step on ``batch``."""
    import logging

    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if ": pipeline " in record.getMessage():
                messages.append(record.getMessage())

    logger, handler = logging.getLogger("dscompile.frontend"), Keep()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        engine.backward(engine(*batch))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return messages


def replanned_tensor_parallel_rank(rank: int, world: int) -> list[str]:
    """TP=2 with ZeRO-2: a schedule and a checkpointing plan swapped into ``engine.plan`` before the first batch reach
    the split graph, which the TP module compiles itself."""
    from dataclasses import replace

    import dscompile
    from dscompile.planner import CheckpointingPlan
    from dscompile.zoo import build, make_batch

    case = build("gpt", seed=3, seq_len=8, d_model=16, n_heads=2, n_layers=1, vocab_size=40)
    config = {"optimizer": SGD, "lower": "eager", "tensor_parallel": {"autotp_size": 2}, "zero_optimization": {"stage": 2}}
    engine, *_ = dscompile.initialize(model=case.model, config=config)
    schedule = replace(engine.plan.zero_schedule, allgather_bucket_elements=123, reduce_bucket_elements=456)
    engine.plan = replace(engine.plan, zero_schedule=schedule, checkpointing=CheckpointingPlan(policy="full"))
    return _pipelines_compiled(engine, make_batch(case, seed=0))


@pytest.mark.distributed
def test_tensor_parallel_compiles_under_the_engines_plan() -> None:
    from dscompile.testing.distributed import run_distributed_or_fail

    for pipelines in run_distributed_or_fail(replanned_tensor_parallel_rank, 2, timeout=300):
        assert pipelines, "the split graph was not compiled"
        for p in pipelines:
            assert "zero_bucketing(allgather_bucket_size=123,reduce_bucket_size=456)" in p and "checkpoint(policy=full" in p, p


def test_pipeline_stages_compile_under_the_engines_plan(caplog) -> None:
    """The pipeline's stages compile under its plan (a plan swapped in before the first batch reaches them); the plan
    puts no ZeRO pass in a stage (ZeRO-1 is the pipeline's gradient strategy) and the checkpointing of the stage
    config (the pipeline's interval is its own recompute, no ``checkpoint`` pass)."""
    import logging
    from dataclasses import replace

    import torch

    from dscompile.engines.pipeline_parallel import PipelineEngine
    from dscompile.pipeline import pipeline_from_config
    from dscompile.planner import CheckpointingPlan, compiling_under

    config = {"optimizer": SGD, "lower": "eager", "pipeline": {"stages": 1, "activation_checkpoint_interval": 1}, "zero_optimization": {"stage": 1}}
    pipe = PipelineEngine(_tiny(), config, loss_fn=lambda out, y: torch.nn.functional.mse_loss(out, y))
    stage_config = pipe._stage_config()
    specs = [inv.spec() for inv in pipeline_from_config(stage_config)]
    with compiling_under(pipe.plan):
        assert [inv.spec() for inv in pipeline_from_config(stage_config)] == specs  # what stages got before the plan reached them
    assert not any(s.startswith("zero") or s.startswith("checkpoint(") for s in specs), specs
    pipe.plan = replace(pipe.plan, checkpointing=CheckpointingPlan(policy="full"))
    with caplog.at_level(logging.INFO, logger="dscompile.frontend"):
        pipe.train_batch(iter([(torch.randn(4, 8), torch.randn(4, 2))]))
    pipelines = [r.getMessage() for r in caplog.records if ": pipeline " in r.getMessage()]
    assert pipelines and all("checkpoint(policy=full" in p for p in pipelines), pipelines
