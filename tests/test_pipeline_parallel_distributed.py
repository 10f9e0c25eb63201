"""Pipeline parallelism on real gloo ranks: equality with a single-process run, checkpoints, idle time.

Each test is one spawn that runs several checks, to keep the distributed budget small.
"""

from __future__ import annotations

import time
import warnings

import pytest
import torch

from dscompile.testing.distributed import run_distributed_or_fail

warnings.filterwarnings("ignore", message="Failed to fetch module")
pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 2


def _config(schedule: str, stages: int, m: int, *, compile_: bool, optimizer: str = "SGD", **extra) -> dict:
    params = {"lr": 0.1} if optimizer == "SGD" else {"lr": 1e-2}
    return {
        "lower": "eager",
        "optimizer": {"type": optimizer, "params": params},
        "pipeline": {"stages": stages, "schedule": schedule, "micro_batches": m, "compile": compile_, **extra},
    }


def _data(case, steps: int, m: int, dp_rank: int = 0, dp: int = 1) -> list:
    from dscompile.zoo import make_batch

    return [make_batch(case, 1000 * s + mb * dp + dp_rank) for s in range(steps) for mb in range(m)]


def _reference(name: str, m: int, steps: int, dp: int = 1, optimizer: str = "SGD", **overrides) -> tuple[list[float], dict]:
    """The single-process run: the same micro-batches, gradients accumulated, one step per batch."""
    from dscompile.zoo import build

    case = build(name, **overrides)
    opt = torch.optim.SGD(case.model.parameters(), lr=0.1) if optimizer == "SGD" else torch.optim.Adam(case.model.parameters(), lr=1e-2)
    data = [_data(case, steps, m, d, dp) for d in range(dp)]
    losses = []
    for s in range(steps):
        total = 0.0
        for d in range(dp):
            for mb in range(m):
                loss = case.model(*data[d][s * m + mb])
                (loss / (m * dp)).backward()
                total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total / (m * dp))
    return losses, {n: p.detach().clone() for n, p in case.model.named_parameters()}


def _train(rank: int, name: str, cfg: dict, m: int, steps: int, overrides: dict) -> dict:
    from dscompile.engines.pipeline_parallel import PipelineEngine
    from dscompile.zoo import build

    case = build(name, **overrides)
    engine = PipelineEngine(case.model, cfg)
    data = iter(_data(case, steps, m, engine.dp_id, engine.dp_size))
    losses = [float(engine.train_batch(data)) for _ in range(steps)]
    return {
        "losses": losses,
        "params": engine.stage_parameters(),
        "order": [str(a) for a in engine.last_timeline.order()],
        "optimizer_params": sum(len(g["params"]) for g in engine.optimizer.param_groups),
    }


def _checkpoint_roundtrip(rank: int, tmp: str, m: int, zero_stage: int = 0) -> dict:
    """Train 2 steps with Adam, save, rebuild from another initialisation, load, train 1 more."""
    from dscompile.engines.pipeline_parallel import PipelineEngine
    from dscompile.zoo import build

    cfg = _config("1f1b", 2, m, compile_=False, optimizer="Adam")
    if zero_stage:
        cfg["zero_optimization"] = {"stage": zero_stage}
    case = build("gpt", n_layers=2)
    engine = PipelineEngine(case.model, cfg)
    data = _data(case, 3, m, engine.dp_id, engine.dp_size)
    it = iter(data)
    for _ in range(2):
        engine.train_batch(it)
    engine.save_checkpoint(tmp, tag="t2")
    continued = float(engine.train_batch(it))  # the uninterrupted run
    other = build("gpt", n_layers=2, seed=7)
    fresh = PipelineEngine(other.model, cfg, example_batch=data[0])
    fresh.load_checkpoint(tmp)
    loss = float(fresh.train_batch(iter(data[2 * m :])))
    return {"loss": loss, "continued": continued, "params": fresh.stage_parameters(), "expected": engine.stage_parameters(), "steps": fresh.global_steps}


def _through_initialize(rank: int, m: int, steps: int) -> dict:
    """``dscompile.initialize`` with a ``pipeline`` section returns the pipeline engine, DeepSpeed style."""
    import dscompile
    from dscompile.engines.pipeline_parallel import PipelineEngine
    from dscompile.zoo import build

    case = build("gpt", n_layers=2)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": m,  # the micro-batch count when pipeline.micro_batches is unset
        "lower": "eager",
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "pipeline": {"stages": 2, "schedule": "1f1b", "compile": False},
    }
    engine, optimizer, _, _ = dscompile.initialize(model=case.model, config=cfg)
    assert isinstance(engine, PipelineEngine) and engine.optimizer is optimizer and engine.gradient_accumulation_steps() == m
    with pytest.raises(RuntimeError, match="train_batch"):
        engine(*_data(case, 1, 1)[0])
    it = iter(_data(case, steps, m))
    losses = [float(engine.train_batch(it)) for _ in range(steps)]
    return {"losses": losses, "params": engine.stage_parameters(), "optimizer_params": sum(len(g["params"]) for g in optimizer.param_groups)}


def _two_rank_checks(rank: int, world: int, tmp: str) -> dict:
    out = {}
    out["initialize"] = _through_initialize(rank, 2, STEPS)
    m = 4
    for name in ("gpt", "llama"):
        for schedule in ("gpipe", "1f1b", "interleaved_1f1b"):
            cfg = _config(schedule, 2, m, compile_=True)
            out[(name, schedule)] = _train(rank, name, cfg, m, STEPS, {"n_layers": 4})
    out["checkpoint"] = _checkpoint_roundtrip(rank, tmp, 2)
    return out


def _assert_matches(result: dict, ref_losses: list[float], ref_params: dict, label: str) -> None:
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses, dtype=torch.float32), rtol=1e-5, atol=0, msg=label)
    for key, value in result["params"].items():
        torch.testing.assert_close(value, ref_params[key], rtol=1e-5, atol=1e-6, msg=f"{label}: {key}")


def test_two_ranks_every_schedule_equals_single_process(tmp_path):
    from dscompile.runtime.pipeline_schedules import build_schedule

    results = run_distributed_or_fail(_two_rank_checks, 2, str(tmp_path), timeout=400)
    for name in ("gpt", "llama"):
        ref_losses, ref_params = _reference(name, 4, STEPS, n_layers=4)
        for schedule in ("gpipe", "1f1b", "interleaved_1f1b"):
            owned: set[str] = set()
            for rank, res in enumerate(results):
                r = res[(name, schedule)]
                _assert_matches(r, ref_losses, ref_params, f"{name}/{schedule}/rank{rank}")
                assert r["order"] == [str(a) for a in build_schedule(schedule, rank, 2, 4, 2 if schedule.startswith("inter") else 1)]
                owned |= set(r["params"])
            assert owned == set(ref_params)  # the two ranks together hold the whole model
    # dscompile.initialize with a pipeline section: the same numbers as the single-process run,
    # and each rank's optimizer holds only its own stage's parameters
    ref_losses, ref_params = _reference("gpt", 2, STEPS, n_layers=2)
    for rank, res in enumerate(results):
        _assert_matches(res["initialize"], ref_losses, ref_params, f"initialize/rank{rank}")
        assert res["initialize"]["optimizer_params"] == len(res["initialize"]["params"])
    # checkpoint (Adam): 2 steps + save + load into a differently initialised model + 1 step
    # == the uninterrupted 3 steps; its loss also equals the single-process run's
    ref_losses, _ = _reference("gpt", 2, 3, optimizer="Adam", n_layers=2)
    for res in results:
        ck = res["checkpoint"]
        assert ck["steps"] == 3
        assert ck["loss"] == pytest.approx(ck["continued"], rel=1e-6)
        assert ck["loss"] == pytest.approx(ref_losses[2], rel=1e-5)
        assert set(ck["params"]) == set(ck["expected"])
        for key, value in ck["params"].items():
            torch.testing.assert_close(value, ck["expected"][key], rtol=1e-6, atol=1e-7, msg=key)


# -- four ranks: 4 stages, 2 x 2 (pipeline x data), interleaved over 8 chunks, activation checkpointing
class _SleepRunner:
    """A stage whose forward/backward take fixed wall time, so idle time measures the schedule."""

    def __init__(self, forward_s: float, backward_s: float) -> None:
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, mb, inputs):
        time.sleep(self.forward_s)
        return [inputs[0] + 1.0]

    def backward(self, mb, grads):
        time.sleep(self.backward_s)
        return [grads[0]]


def _idle_fractions(rank: int, world: int, schedule: str, m: int) -> tuple[tuple[float, float, float], list[str]]:
    import torch.distributed as dist

    from dscompile.passes.pipeline_split import InputRef, StageSpec, TensorSpec
    from dscompile.runtime.pipeline_executor import run_actions
    from dscompile.runtime.pipeline_p2p import P2P
    from dscompile.runtime.pipeline_schedules import build_schedule

    spec = TensorSpec((4,), torch.float32, True)
    specs = []
    for s in range(world):
        inputs = [InputRef("input", 0)] if s == 0 else [InputRef("stage", 0, s - 1)]
        specs.append(StageSpec(s, None, inputs, [None if s == 0 else spec], [spec], {0: [s + 1]} if s < world - 1 else {}))
    batches = [(torch.zeros(4),) for _ in range(m)]
    dist.barrier()
    _, timeline = run_actions(
        build_schedule(schedule, rank, world, m), specs, {rank: _SleepRunner(0.03, 0.06)}, P2P(rank), lambda s: s, batches, (world - 1, 0), 1.0 / m
    )
    # perf_counter is the host's monotonic clock, shared by the rank processes
    return (timeline.busy(), timeline.begin, timeline.finish), [str(a) for a in timeline.order()]


def _four_rank_checks(rank: int, world: int, tmp: str) -> dict:
    out = {}
    out["zero1_checkpoint"] = _checkpoint_roundtrip(rank, tmp, 2, zero_stage=1)
    out["pp4_1f1b_gpt"] = _train(rank, "gpt", _config("1f1b", 4, 4, compile_=False), 4, STEPS, {"n_layers": 4})
    out["pp2dp2_gpipe_gpt_ckpt"] = _train(
        rank, "gpt", _config("gpipe", 2, 2, compile_=False, activation_checkpoint_interval=1), 2, STEPS, {"n_layers": 4}
    )
    zero1 = _config("1f1b", 2, 2, compile_=True)  # SGD: exact against one process (Adam amplifies rounding)
    zero1["zero_optimization"] = {"stage": 1}
    out["pp2dp2_zero1_gpt"] = _train(rank, "gpt", zero1, 2, STEPS, {"n_layers": 4})
    out["pp4_interleaved_llama"] = _train(rank, "llama", _config("interleaved_1f1b", 4, 4, compile_=False), 4, STEPS, {"n_layers": 4})
    for schedule in ("gpipe", "1f1b"):
        out[("idle", schedule)] = _idle_fractions(rank, world, schedule, 4)
    return out


def test_four_ranks_layouts_equal_single_process_and_idle_time(tmp_path):
    from dscompile.runtime.pipeline_schedules import bubble_fraction, build_schedule

    results = run_distributed_or_fail(_four_rank_checks, 4, str(tmp_path), timeout=600)
    gpt_losses, gpt_params = _reference("gpt", 4, STEPS, n_layers=4)
    dp_losses, dp_params = _reference("gpt", 2, STEPS, dp=2, n_layers=4)
    llama_losses, llama_params = _reference("llama", 4, STEPS, n_layers=4)
    for rank, res in enumerate(results):
        # ZeRO-1 across the two pipelines: each replica steps half of its stage's tensors
        _assert_matches(res["pp2dp2_zero1_gpt"], dp_losses, dp_params, f"pp2xdp2 zero-1 rank{rank}")
        assert 0 < res["pp2dp2_zero1_gpt"]["optimizer_params"] < len(res["pp2dp2_zero1_gpt"]["params"])
        # ZeRO-1 checkpoint: each replica saves and reloads its shard of the optimizer states
        ck = res["zero1_checkpoint"]
        assert ck["steps"] == 3 and ck["loss"] == pytest.approx(ck["continued"], rel=1e-6)
        for key, value in ck["params"].items():
            torch.testing.assert_close(value, ck["expected"][key], rtol=1e-6, atol=1e-7, msg=f"zero-1 checkpoint {key}")
        _assert_matches(res["pp4_1f1b_gpt"], gpt_losses, gpt_params, f"pp4 rank{rank}")
        _assert_matches(res["pp2dp2_gpipe_gpt_ckpt"], dp_losses, dp_params, f"pp2xdp2 rank{rank}")
        _assert_matches(res["pp4_interleaved_llama"], llama_losses, llama_params, f"interleaved pp4 rank{rank}")
        # DeepSpeed's rank order (pipe, data): ranks 0 and 1 hold stage 0 (replicas 0 and 1), ranks 2 and 3 stage 1.
        # Before the one rank layout this test fed and checked data-parallel outermost (stage = rank % 2).
        assert res["pp2dp2_gpipe_gpt_ckpt"]["order"] == [str(a) for a in build_schedule("gpipe", rank // 2, 2, 2)]
    for schedule in ("gpipe", "1f1b"):
        begin = min(res[("idle", schedule)][0][1] for res in results)
        finish = max(res[("idle", schedule)][0][2] for res in results)
        for rank, res in enumerate(results):
            (busy, _, _), order = res[("idle", schedule)]
            assert order == [str(a) for a in build_schedule(schedule, rank, 4, 4)]
            idle = 1.0 - busy / (finish - begin)  # idle share of the whole step on this rank
            assert idle == pytest.approx(bubble_fraction(4, 4), abs=0.06), (schedule, rank, idle)


def test_train_gpt_example_runs_the_pipeline_config(tmp_path):
    """What the README tells a new user to type: torchrun + examples/train_gpt.py + examples/pipeline.json."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(root / "examples" / "train_gpt.py"), "--config", str(root / "examples" / "pipeline.json"),
           "--steps", "2", "--layers", "2", "--save", str(tmp_path)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "pipeline 2 stages x 1 data-parallel, schedule 1f1b" in proc.stdout
    assert "step    2  loss" in proc.stdout
    saved = sorted(p.name for p in (tmp_path / "global_step2").iterdir())
    assert saved == ["manifest.json", "pipe_rank_00_states.pt", "pipe_rank_01_states.pt", "pipe_stage_00_model_states.pt", "pipe_stage_01_model_states.pt"]
