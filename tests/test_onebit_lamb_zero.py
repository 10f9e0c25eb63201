"""OneBitLamb with ZeRO-1 and ZeRO-2 on real gloo ranks: the reduce-scatter goes 1-bit after the freeze (as
OneBitAdam's), the trust ratios and the frozen-coefficient factors come from the shards' partial norms (one small
all-gather per step). Checked against a single-process simulation of the same algorithm (whole-parameter LAMB fed
the averaged gradients the ZeRO run received), the uncompressed LAMB at the same stage, ZeRO-2 against ZeRO-1, and
a bit-exact resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dscompile
from dscompile.cli import main
from dscompile.runtime.onebit import OneBitLamb
from dscompile.runtime.onebit.predict import predict_step_bytes
from dscompile.testing.distributed import run_distributed_or_fail
from dscompile.testing.onebit import Workload, bigram_batch, bigram_table, build_model

pytestmark = pytest.mark.distributed

WORK = Workload("onebitlamb", steps=0, seq_len=16, d_model=16, n_layers=1, batch_size=4)
FREEZE, STEPS, SAVE_AT = 3, 6, 4
ARGS = {"lr": 1e-2, "weight_decay": 0.01, "freeze_step": FREEZE}


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    return bigram_batch(7 * step + 1000 * rank, WORK.batch_size, WORK.seq_len, bigram_table(0))


ZERO_ONE = {"type": "ZeroOneAdam", "params": {"lr": 3e-3, "var_freeze_step": 3, "var_update_scaler": 1, "local_step_scaler": 2, "local_step_clipper": 2}}


def _config(stage: int, freeze_step: int = FREEZE, optimizer: dict | None = None, dump: str = "") -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 2000} if stage else {"stage": 0}  # several buckets
    optimizer = optimizer or {"type": "OneBitLamb", "params": {**ARGS, "freeze_step": freeze_step, "bucket_size": 3000}}
    extra = {"dump": dump} if dump else {}
    return {"train_micro_batch_size_per_gpu": WORK.batch_size, "optimizer": optimizer, "zero_optimization": zero, "lower": "eager", **extra}


def _flat(engine) -> torch.Tensor:
    return torch.cat([v.reshape(-1) for v in engine.full_parameters().values()])


def _averaged_gradients(engine, world: int) -> list[torch.Tensor]:
    """The whole averaged gradients the ZeRO optimizer is about to step on (its shards' gradients, gathered)."""
    zero = engine.gradients.partition
    out = []
    for shard, layout in zip(zero.shards, zero.layouts):
        gathered = torch.empty(layout.shard_numel * world)
        gather = getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor  # renamed in torch 2.13
        gather(gathered, shard.grad.detach().float().contiguous())
        out.append(gathered[: layout.numel].view(layout.shape))
    return out


def _run(
    stage: int,
    rank: int,
    world: int,
    steps: int = STEPS,
    freeze_step: int = FREEZE,
    simulate: bool = False,
    directory: str = "",
    optimizer: dict | None = None,
    dump: str = "",
) -> dict:
    torch.manual_seed(0)
    engine, *_ = dscompile.initialize(model=build_model(WORK), config=_config(stage, freeze_step, optimizer, dump))
    sim = sim_opt = None
    if simulate:  # the same algorithm in one process: whole-parameter 1-bit LAMB fed the averaged gradients, nothing sent
        sim = [p.detach().clone().requires_grad_(True) for p in engine.full_parameters().values()]
        sim_opt = OneBitLamb(sim, **ARGS, local=True)
        averaged: list[torch.Tensor] = []
        reduce = engine.gradients.reduce

        def reduce_and_record(engine_) -> None:  # the shards' gradients are complete once the boundary has waited for them
            reduce(engine_)
            averaged[:] = _averaged_gradients(engine_, world)

        engine.gradients.reduce = reduce_and_record
    losses, deviation, sent = [], [], []
    for step in range(1, steps + 1):
        loss = engine(*_batch(step, rank))
        engine.backward(loss)
        engine.step()
        if sim_opt is not None:
            for p, g in zip(sim, averaged):
                p.grad = g.clone()
        losses.append(loss.item())
        sent.append(engine.communication_stats()["extensions"]["onebit"]["bytes_sent_last_step"])
        if sim_opt is not None:
            sim_opt.step()
            deviation.append(max((a - b.detach()).abs().max().item() for a, b in zip(engine.full_parameters().values(), sim)))
        if directory and step == SAVE_AT:
            engine.save_checkpoint(directory, tag="t")
    out = {"losses": losses, "params": _flat(engine), "deviation": deviation, "sent": sent, "stats": engine.communication_stats()}
    out["strategy"] = type(engine.gradients).__name__
    if directory:
        torch.manual_seed(123)  # another start: everything must come from the checkpoint
        resumed, *_ = dscompile.initialize(model=build_model(WORK), config=_config(stage, freeze_step))
        resumed.load_checkpoint(directory, tag="t")
        resumed_losses = []
        for step in range(SAVE_AT + 1, steps + 1):
            loss = resumed(*_batch(step, rank))
            resumed.backward(loss)
            resumed.step()
            resumed_losses.append(loss.item())
        out["resumed"], out["resumed_params"] = resumed_losses, _flat(resumed)
    return out


def lamb_zero2_four_rank(rank: int, world: int) -> dict:
    """The 4-rank case (run in test_onebit_optimizers' 4-rank group: one spawn for several files)."""
    return _run(2, rank, world, simulate=True)


def _lamb_zero_rank(rank: int, world: int, directory: str) -> dict:
    return {
        0: _run(0, rank, world, dump=f"{directory}/dump0"),
        1: _run(1, rank, world, simulate=True, directory=f"{directory}/stage1"),
        2: _run(2, rank, world, simulate=True, directory=f"{directory}/stage2", dump=f"{directory}/dump2"),
        "zero_one": _run(0, rank, world, steps=8, optimizer=ZERO_ONE, dump=f"{directory}/dump_zero_one"),
        "lamb1": _run(1, rank, world, steps=FREEZE + 1, freeze_step=10**9),  # uncompressed LAMB, same stage
    }


def _check_against_simulation(run: dict) -> None:
    assert run["strategy"] == "OneBitZeroGradients"
    # warm-up and compressed steps alike: whole-parameter LAMB on the same averaged gradients; only the norms'
    # summation order differs (shards' partial sums, added in rank order)
    assert max(run["deviation"]) <= 1e-6, run["deviation"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[list[dict], Path]:
    """One spawn of 2 ranks serves this file's 2-rank tests (spawning costs more than the checks)."""
    directory = tmp_path_factory.mktemp("onebit_lamb_zero")
    return run_distributed_or_fail(_lamb_zero_rank, 2, str(directory), timeout=600), directory


def test_onebit_lamb_zero1_zero2_two_ranks(two_ranks):
    ranks, _ = two_ranks
    for rank in ranks:
        plain, zero1, zero2, lamb1 = rank[0], rank[1], rank[2], rank["lamb1"]
        for run in (zero1, zero2):
            _check_against_simulation(run)
        # warm-up: bitwise the uncompressed LAMB at the same ZeRO stage (and, to rounding, LAMB without ZeRO)
        assert zero1["losses"][: FREEZE + 1] == lamb1["losses"]
        assert zero1["losses"][: FREEZE + 1] == pytest.approx(plain["losses"][: FREEZE + 1], rel=1e-6)
        # ZeRO-2 differs from ZeRO-1 only in where the gradients live: the same bits
        assert zero2["losses"] == zero1["losses"] and torch.equal(zero2["params"], zero1["params"])
        for run in (zero1, zero2):
            assert run["resumed"] == run["losses"][SAVE_AT:], "resume is not bit-exact"
            assert torch.equal(run["params"], run["resumed_params"])
        # after the freeze: 1-bit gradients plus one small all-gather of partial norms per step, far fewer bytes
        assert min(zero1["sent"][FREEZE:]) > 0 and max(zero1["sent"][FREEZE:]) * 1.5 < min(zero1["sent"][:FREEZE])
        assert "compressed_gradient.all_to_all" in zero1["stats"]["onebit"] and "lamb_norms.all_gather" in zero1["stats"]["onebit"]
    assert torch.equal(ranks[0][1]["params"], ranks[1][1]["params"])


def _numels() -> list[int]:
    return [p.numel() for p in build_model(WORK).parameters() if p.requires_grad]


@pytest.mark.parametrize(("dump", "stage", "optimizer"), [("dump0", 0, None), ("dump2", 2, None), ("dump_zero_one", 0, ZERO_ONE)])
def test_dump_prediction_equals_the_measured_bytes(two_ranks, dump, stage, optimizer):
    """``dscompile dump``'s predicted bytes per step and phase (no engine run) equal what the engine measured."""
    _, directory = two_ranks
    prediction = predict_step_bytes(_numels(), 2, dscompile.load_config(_config(stage, optimizer=optimizer)))
    assert prediction is not None
    for rank in (0, 1):
        record = json.loads((directory / dump / f"communication_rank{rank}.json").read_text())
        phases = {s["phase"] for s in record["steps"]}
        assert phases == ({"full_precision", "compressed", "local"} if optimizer else {"full_precision", "compressed"})
        for step in record["steps"]:
            assert step["bytes_sent"] == prediction["bytes_sent_per_step"][step["phase"]], (step, prediction)
        assert record["fp32_all_reduce_bytes_per_step"] == prediction["fp32_all_reduce_bytes_per_step"]


def test_onebit_lamb_zero2_four_ranks():
    from test_onebit_optimizers import suite  # its 4-rank group runs lamb_zero2_four_rank too: one spawn for both files

    ranks = [r["lamb_zero2"] for r in suite(4)]
    for rank in ranks:
        _check_against_simulation(rank)
    assert all(torch.equal(ranks[0]["params"], r["params"]) for r in ranks)


def test_dump_cli_prints_the_predicted_bytes(tmp_path, capsys):
    """``dscompile dump`` runs no engine: it plans the engine's buckets and prints the bytes per step and phase."""
    (tmp_path / "target.py").write_text(
        "from dscompile.testing.onebit import Workload, bigram_batch, bigram_table, build_model\n"
        "def factory():\n"
        "    work = Workload('onebitlamb', steps=0, seq_len=16, d_model=16, n_layers=1, batch_size=4)\n"
        "    return build_model(work), bigram_batch(0, 4, 16, bigram_table(0))\n"
    )
    config = _config(2)
    (tmp_path / "ds.json").write_text(json.dumps(config))
    out = tmp_path / "dump"
    assert main(["dump", f"{tmp_path / 'target.py'}:factory", "--config", str(tmp_path / "ds.json"), "--world-size", "4", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    expected = predict_step_bytes(_numels(), 4, dscompile.load_config(config))
    assert json.loads((out / "communication_predicted.json").read_text()) == expected
    assert "predicted: OneBitLamb on 4 ranks, ZeRO stage 2" in printed
    for phase, sent in expected["bytes_sent_per_step"].items():
        assert f"{phase:16} {sent:>12} bytes sent" in printed
    assert expected["bytes_sent_per_step"]["compressed"] < expected["bytes_sent_per_step"]["full_precision"]
