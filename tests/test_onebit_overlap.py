"""The 1-bit exchanges overlap backward without changing a bit (2 gloo ranks, one spawn).

- After an overlapped backward every bucket's compressed exchange is still in flight: no post-accumulate-grad hook
  waited for one (the step takes them), and the results equal the same run with the hooks removed (every exchange
  at the boundary) bitwise: OneBitAdam and OneBitLamb without ZeRO, OneBitAdam with ZeRO-2.
- The fp32 warm-up's bucketed all-reduce stays overlapped with ``communication_data_type``,
  ``gradient_predivide_factor`` and ``prescale_gradients`` set, and equals the engine's one-buffer all-reduce bitwise.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dscompile
from dscompile.testing.distributed import run_distributed_or_fail
from dscompile.testing.onebit import Workload, bigram_batch, bigram_table, build_model

pytestmark = pytest.mark.distributed

WORK = Workload("onebitadam", steps=0, seq_len=16, d_model=16, n_layers=2, batch_size=4)
STEPS = 4
FREEZE = 2
BUCKET = 600  # values per bucket: the small GPT splits into several buckets, so exchanges pipeline
ARGS = {
    "OneBitAdam": {"lr": 3e-3, "freeze_step": FREEZE, "bucket_size": BUCKET},
    "OneBitLamb": {"lr": 3e-2, "freeze_step": FREEZE, "bucket_size": BUCKET},
}
WARMUP_KEYS = {
    "fp16_comm_predivide": {"communication_data_type": "fp16", "gradient_predivide_factor": 2.0},
    "prescale": {"prescale_gradients": True},
}


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    return bigram_batch(7 * step + 1000 * rank, WORK.batch_size, WORK.seq_len, bigram_table(0))


def _train(config: dict[str, Any], rank: int, overlap: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    engine, *_ = dscompile.initialize(model=build_model(WORK), config={"train_micro_batch_size_per_gpu": WORK.batch_size, "lower": "eager", **config})
    strategy = engine.gradients
    if not overlap:
        strategy.detach()  # every exchange at the boundary or in the step: the reference
    losses, in_flight, logs = [], [], []
    for step in range(1, STEPS + 1):
        loss = engine(*_batch(step, rank))
        engine.backward(loss)
        pending = getattr(strategy, "_in_flight", None)  # ZeRO: the strategy's bucket exchanges
        in_flight.append(len(pending) if pending is not None else engine.optimizer.exchanges_in_flight())
        engine.step()
        losses.append(loss.item())
        logs.append(list(strategy.exchange_log))
    buckets = len(getattr(strategy, "buckets", None) or engine.optimizer.buckets)
    params = torch.cat([v.reshape(-1) for v in engine.full_parameters().values()])
    return {"losses": losses, "params": params, "in_flight": in_flight, "logs": logs, "buckets": buckets}


def _overlap_rank(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, args in ARGS.items():
        config = {"optimizer": {"type": name, "params": args}}
        out[name] = {overlap: _train(config, rank, overlap) for overlap in (True, False)}
    zero2 = {"optimizer": {"type": "OneBitAdam", "params": ARGS["OneBitAdam"]}, "zero_optimization": {"stage": 2, "reduce_bucket_size": BUCKET}}
    out["zero2"] = {overlap: _train(zero2, rank, overlap) for overlap in (True, False)}
    for name, keys in WARMUP_KEYS.items():
        config = {"optimizer": {"type": "OneBitAdam", "params": {**ARGS["OneBitAdam"], "freeze_step": STEPS}}, **keys}
        out[name] = {overlap: _train(config, rank, overlap) for overlap in (True, False)}
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed_or_fail(_overlap_rank, 2, timeout=600)


@pytest.mark.parametrize("name", [*ARGS, "zero2"])
def test_compressed_exchanges_stay_in_flight_through_backward_and_change_no_bit(ranks, name):
    for rank in ranks:
        overlapped, boundary = rank[name][True], rank[name][False]
        assert overlapped["buckets"] >= 3
        # warm-up steps: fp32 all-reduces (waited at the boundary); compressed steps: every bucket started from backward
        # and none taken before the step (no hook waited for its exchange)
        assert overlapped["in_flight"][FREEZE:] == [overlapped["buckets"]] * (STEPS - FREEZE), overlapped["in_flight"]
        for log in overlapped["logs"]:
            assert log == [(b, True) for b in reversed(range(overlapped["buckets"]))], log
        assert all(not log or not log[0][1] for log in boundary["logs"])
        assert overlapped["losses"] == boundary["losses"]
        assert torch.equal(overlapped["params"], boundary["params"]), name
    assert torch.equal(ranks[0][name][True]["params"], ranks[1][name][True]["params"])  # replicas agree


@pytest.mark.parametrize("name", list(WARMUP_KEYS))
def test_warmup_all_reduce_overlaps_with_communication_dtype_and_prescaling(ranks, name):
    for rank in ranks:
        overlapped, boundary = rank[name][True], rank[name][False]
        buckets = overlapped["buckets"]
        for log in overlapped["logs"]:  # every warm-up all-reduce started from backward, last bucket first
            assert log == [(b, True) for b in reversed(range(buckets))], log
        # ...and equal, bit for bit, to the engine's single all-reduce of every gradient (DataParallelGradients.reduce)
        assert overlapped["losses"] == boundary["losses"]
        assert torch.equal(overlapped["params"], boundary["params"]), name
    # the keys change the arithmetic (fp16 on the wire): the two settings do not train identically
    assert ranks[0]["fp16_comm_predivide"][True]["losses"][1:] != ranks[0]["prescale"][True]["losses"][1:]
