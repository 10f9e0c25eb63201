"""ZeRO checkpoints: bit-exact continuation, re-partitioning onto other world sizes, zero-to-fp32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_zero import _case, _config, _micro_batch

import dscompile
from dscompile.runtime import checkpoint_formats, zero_checkpoint
from dscompile.runtime.checkpoint_io import CheckpointReader
from dscompile.testing.distributed import requires_backend, run_distributed_or_fail

pytestmark = [pytest.mark.slow, pytest.mark.distributed, requires_backend("gloo")]

MODEL = "gpt"


def _engine(stage: int) -> tuple[Any, Any]:
    torch.manual_seed(0)
    case = _case(MODEL)
    config = _config(stage, 1, 0.0, {"reduce_bucket_size": 2000, "allgather_bucket_size": 2000, "stage3_prefetch_bucket_size": 2000})
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 4}}
    engine, _, _, _ = dscompile.initialize(model=case.model, config=config)
    return engine, case


def _train(engine: Any, case: Any, rank: int, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        loss = engine(*_micro_batch(case, engine.global_steps, 0, rank))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def save_rank(rank: int, world: int, stage: int, save_dir: str) -> dict[str, Any]:
    engine, case = _engine(stage)
    _train(engine, case, rank, 3)
    engine.save_checkpoint(save_dir, tag="step3", client_state={"note": "three"})
    losses = _train(engine, case, rank, 3)
    engine.save_checkpoint(save_dir, tag="step6")
    return {"losses": losses, "params": engine.full_parameters()}


def resume_rank(rank: int, world: int, stage: int, save_dir: str) -> dict[str, Any]:
    engine, case = _engine(stage)
    path, client = engine.load_checkpoint(save_dir, tag="step3")
    assert client == {"note": "three"} and engine.global_steps == 3
    losses = _train(engine, case, rank, 3)
    return {"losses": losses, "params": engine.full_parameters(), "lr": engine.get_lr()}


def reshard_rank(rank: int, world: int, stage: int, save_dir: str, tag: str, out_dir: str) -> dict[str, Any]:
    """Load a checkpoint written by another world size, save it again, take one step."""
    engine, case = _engine(stage)
    engine.load_checkpoint(save_dir, tag=tag)
    params = engine.full_parameters()
    engine.save_checkpoint(out_dir, tag="resaved")
    dist.barrier()
    losses = _train(engine, case, rank, 1)
    return {"params": params, "losses": losses, "steps": engine.global_steps}


def _optimizer_states(directory: Path) -> dict[str, dict[str, Any]]:
    reader = CheckpointReader(directory)
    meta = zero_checkpoint.load_meta(reader)
    files = zero_checkpoint._load_shard_files(reader, meta["zero"]["world_size"])
    return zero_checkpoint.full_optimizer_states(meta, files)[0]


def test_checkpoint_resume_reshard_and_consolidate(tmp_path: Path) -> None:
    stage = 3
    ckpt = tmp_path / "ckpt"
    first = run_distributed_or_fail(save_rank, 2, stage, str(ckpt), timeout=180)
    assert (ckpt / "latest").read_text() == "step6"
    assert sorted(p.name for p in (ckpt / "step3").iterdir()) == [
        "manifest.json",
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]

    # Same world size: the continuation is bit-exact.
    resumed = run_distributed_or_fail(resume_rank, 2, stage, str(ckpt), timeout=180)
    for a, b in zip(first, resumed, strict=True):
        assert a["losses"] == b["losses"]
    for name, value in first[0]["params"].items():
        assert torch.equal(resumed[0]["params"][name], value), name

    # zero-to-fp32: the consolidated state_dict holds the trained full parameters (tied names too).
    out = tmp_path / "full.pt"
    assert checkpoint_formats.main([str(ckpt), str(out)]) == 0
    full = torch.load(out)
    for name, value in first[0]["params"].items():
        assert torch.equal(full[name], value), name
    assert torch.equal(full["lm_head.weight"], full["wte.weight"])
    fresh = _case(MODEL).model
    fresh.load_state_dict(full)  # every key of the model, nothing missing

    # 2 -> 4 ranks: the re-partitioned parameters and optimizer states are the same numbers.
    four = tmp_path / "four"
    results = run_distributed_or_fail(reshard_rank, 4, stage, str(ckpt), "step6", str(four), timeout=180)
    for name, value in first[0]["params"].items():
        assert torch.equal(results[0]["params"][name], value), name
    assert results[0]["steps"] == 7 and all(torch.isfinite(torch.tensor(r["losses"])).all() for r in results)
    before, after = _optimizer_states(ckpt / "step6"), _optimizer_states(four / "resaved")
    for name, entries in before.items():
        for key, value in entries.items():
            assert torch.equal(torch.as_tensor(after[name][key]), torch.as_tensor(value)), (name, key)

    # 4 -> 1 rank.
    one = tmp_path / "one"
    single = run_distributed_or_fail(reshard_rank, 1, stage, str(four), "resaved", str(one), timeout=180)
    for name, value in first[0]["params"].items():
        assert torch.equal(single[0]["params"][name], value), name
