"""Profile-guided ZeRO planning (``zero_optimization.profile_steps``): measure, agree, re-plan, recompile once.

In-process: the planning arithmetic (latency fit, prefetch window, the plan) and the config key.
On two gloo ranks: training with profiling re-plans once, recompiles exactly once, writes the plan
before and after to the dump, and still matches the single-process eager run step by step, also
when the sequence length changes every step and differs between the ranks (so one rank may profile
a static graph while the other profiles a dynamic one).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_zero import _case, _collectives_in, _config, _micro_batch, assert_params_close, greedy_bucket_count
from test_zero_features import _close, _reference

import dscompile
from dscompile.errors import DSCompileConfigError
from dscompile.pipeline import pipeline_from_config
from dscompile.planner import plan_zero_schedule
from dscompile.runtime.zero_profile import AgreedProfile, GraphRun, agree, fit_latency, plan_from_profile, plan_of, prefetch_window
from dscompile.testing.distributed import requires_backend, run_distributed_or_fail

SMALL = {"reduce_bucket_size": 1500, "allgather_bucket_size": 1500, "stage3_prefetch_bucket_size": 600}


# ---------------------------------------------------------------------------------------------
# In-process.
# ---------------------------------------------------------------------------------------------
def test_config_key_and_pipeline() -> None:
    zc = dscompile.load_config({"zero_optimization": {"stage": 3}}).sections["zero_optimization"]
    assert zc.profile_steps == 0
    off = [inv.name for inv in pipeline_from_config(dscompile.load_config({"zero_optimization": {"stage": 3}}))]
    on = [inv.name for inv in pipeline_from_config(dscompile.load_config({"zero_optimization": {"stage": 3, "profile_steps": 2}}))]
    assert "zero_profile" not in off and on[on.index("zero_overlap") + 1] == "zero_profile"
    with pytest.raises(DSCompileConfigError) as info:
        dscompile.load_config({"zero_optimization": {"stage": 3, "profile_steps": -1}})
    assert info.value.key == "zero_optimization.profile_steps"


def test_latency_fit() -> None:
    alpha, beta = fit_latency([(100, 1e-4 + 100e-9), (1000, 1e-4 + 1000e-9), (10_000, 1e-4 + 10_000e-9)])
    assert alpha == pytest.approx(1e-4) and beta == pytest.approx(1e-9)
    assert fit_latency([(100, 1.0), (100, 2.0)]) is None  # one size: no slope to fit
    assert fit_latency([(100, 2.0), (200, 1.0)]) is None  # noise with a negative slope: keep the config


def test_prefetch_window_covers_each_gather_with_compute() -> None:
    gathers = [(10, 1.0), (20, 1.0), (30, 1.0)]
    # Enough compute after each wait: each gather is hidden by the compute right before its use.
    assert prefetch_window(gathers, [5.0, 5.0, 5.0, 5.0]) == 30
    # Half a second between uses: each gather must be in flight two uses ahead.
    assert prefetch_window(gathers, [0.5, 0.5, 0.5, 0.5]) == 50
    # No compute at all: everything up to a gather is in flight at once.
    assert prefetch_window(gathers, [0.0, 0.0, 0.0, 0.0]) == 60


def test_plan_from_profile() -> None:
    config = dscompile.load_config({"zero_optimization": {"stage": 3, "allgather_bucket_size": 10**6, "stage3_prefetch_bucket_size": 10,
                                                          "profile_steps": 2}})
    schedule = plan_zero_schedule(config)
    fwd = GraphRun("forward", [(100, 1e-3 + 100e-6), (1000, 1e-3 + 1000e-6)], [0.0, 0.0, 0.0], [], 0.0, 4000, 4)
    bwd = GraphRun("backward", [], [0.0], [(200, 2e-3 + 200e-6), (400, 2e-3 + 400e-6)], 0.0, 8000, 4)
    new, why = plan_from_profile(schedule, AgreedProfile([fwd, bwd], None))
    plan = plan_of(new)
    assert plan["allgather_bucket_size"] == new.allgather_bucket_elements == 9000  # alpha/beta = 1000 elements, latency <= 10%: 9x that
    assert plan["reduce_bucket_size"] == new.reduce_bucket_elements == 18_000
    assert plan["stage3_prefetch_bucket_size"] == new.prefetch_elements == 1100  # no compute hides anything: both in flight
    assert plan["unshard_budget"] == 0 and "CPU" in why["unshard_budget"]
    # The rest of the schedule is kept; profiling is done.
    assert new.profile_steps == 0 and new.max_live_parameters == schedule.max_live_parameters and new.overlap_comm == schedule.overlap_comm
    assert new.gather_bucket_elements == 1100  # ZeRO-3 gathers at most a prefetch window at once
    # A device memory limit turns the measured headroom into the unshard budget (and caps prefetch).
    new, _ = plan_from_profile(schedule, AgreedProfile([fwd, bwd], 8000 + 4 * 50))
    assert new.unshard_budget == 50 and new.prefetch_elements == 1050


def test_agree_alone_is_identity() -> None:
    runs = [GraphRun("forward", [(8, 0.5)], [0.1, 0.2], [], 0.3, 64, 4)]
    agreed = agree(runs, None)
    assert agreed is not None and agreed.runs[0] == runs[0] and agreed.memory_limit_bytes is None


# ---------------------------------------------------------------------------------------------
# Two gloo ranks.
# ---------------------------------------------------------------------------------------------
def _train(engine: Any, case: Any, rank: int, world: int, steps: int, lengths: Any = None) -> tuple[list[float], list[int]]:
    from torch._dynamo.utils import counters

    losses, compiles = [], []
    for step in range(steps):
        idx, tgt = _micro_batch(case, step, 0, rank)
        if lengths is not None:
            idx, tgt = idx[:, : lengths(step, rank)], tgt[:, : lengths(step, rank)]
        loss = engine(idx, tgt)
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
        compiles.append(int(counters["stats"]["unique_graphs"]))
    return losses, compiles


def _lengths(step: int, rank: int) -> int:
    # Rank 0 keeps length 8 through the profiled steps (a static graph), rank 1 changes at once (dynamic).
    return [[8, 8, 6, 5, 7], [8, 5, 7, 4, 6]][rank][step]


def profile_rank(rank: int, world: int, dump_root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    case = _case("gpt")
    dump = f"{dump_root}/rank{rank}"
    engine, _, _, _ = dscompile.initialize(model=case.model, config=_config(3, 1, 0.0, {**SMALL, "profile_steps": 2}, dump))
    torch._dynamo.utils.counters.clear()
    out["losses"], out["compiles"] = _train(engine, case, rank, world, 5)
    out["params"] = engine.full_parameters()
    out["report"] = engine.zero_profiler.report
    out["replanned"] = engine.zero_profiler.replanned
    out["engine_plan"] = (plan_of(engine.plan.zero_schedule), engine.plan.zero_schedule.profile_steps, engine.plan.text())
    torch._dynamo.reset()

    torch.manual_seed(0)
    case = _case("gpt")
    engine, _, _, _ = dscompile.initialize(model=case.model, config=_config(3, 1, 0.0, {**SMALL, "profile_steps": 2}))
    torch._dynamo.utils.counters.clear()
    out["var_losses"], out["var_compiles"] = _train(engine, case, rank, world, 5, _lengths)
    out["var_params"] = engine.full_parameters()
    out["var_after"] = engine.zero_profiler.report["after"]
    return out


@pytest.mark.slow
@pytest.mark.distributed
@requires_backend("gloo")
def test_profile_guided_replanning_on_two_ranks(tmp_path: Path) -> None:
    results = run_distributed_or_fail(profile_rank, 2, str(tmp_path), timeout=300)
    ref = _reference(5)
    for r in results:
        _close(r["losses"], ref["losses"])
        assert r["replanned"]
        # the re-plan is the engine's one plan now (what the recompiled graphs read): profiling done, new sizes printed
        schedule, profile_steps, text = r["engine_plan"]
        assert schedule == r["report"]["after"] and profile_steps == 0, (schedule, r["report"])
        assert f"reduce-scatter {schedule['reduce_bucket_size']} elements" in text
        # One graph for the two profiled steps, exactly one more after the re-plan, then none.
        assert r["compiles"] == [1, 1, 2, 2, 2], r["compiles"]
    for name, value in ref["params"].items():
        assert_params_close(results[0]["params"][name], value, name)

    # Every rank acted on the same agreed plan; the dump shows it before and after, with the profile.
    assert results[0]["report"] == results[1]["report"]
    report = json.loads((tmp_path / "rank0" / "zero_plan.json").read_text())
    assert report["before"]["stage3_prefetch_bucket_size"] == SMALL["stage3_prefetch_bucket_size"]
    assert set(report["after"]) == set(report["before"]) and report["why"]
    graphs = report["profile"]["graphs"]
    assert [g["kind"] for g in graphs] == ["forward", "backward"]
    assert graphs[0]["gathers"] and graphs[1]["scatters"] and all(t > 0 for _, t in graphs[0]["gathers"])
    assert graphs[0]["peak_live_bytes"] > 0 and graphs[0]["compute_s"] > 0
    for key, value in report["after"].items():
        assert value <= max(report["before"][key], 1) or key == "stage3_prefetch_bucket_size", (key, value)
    # The recompiled graphs follow the new plan: no profiling pass, and gathers bucketed by the new sizes.
    compiles = sorted({p.name.split(".")[0] for p in (tmp_path / "rank0").glob("graph_*.forward")})
    assert len(compiles) == 2, compiles
    for name, plan, profiled in ((compiles[0], report["before"], True), (compiles[1], report["after"], False)):
        steps = sorted(p for p in (tmp_path / "rank0" / f"{name}.forward").iterdir() if p.is_dir())
        assert any(p.name.endswith("_zero_profile") for p in steps) == profiled, steps
        inserted = [size for _, size in _collectives_in(next(p for p in steps if p.name.endswith("_zero")) / "code.py", 2)]
        final = _collectives_in(steps[-1] / "code.py", 2)
        limit = min(plan["allgather_bucket_size"], plan["stage3_prefetch_bucket_size"])
        assert len(final) == greedy_bucket_count(inserted, limit), (name, plan, final)

    # Variable lengths, different per rank: no hang, no compile per step, same numbers.
    ref_var = _reference(5, _lengths)
    for r in results:
        _close(r["var_losses"], ref_var["losses"])
        assert r["var_compiles"][-1] <= 4 and r["var_compiles"][-1] == r["var_compiles"][3], r["var_compiles"]
    assert results[0]["var_after"] == results[1]["var_after"]
    for name, value in ref_var["params"].items():
        assert_params_close(results[0]["var_params"][name], value, name)
