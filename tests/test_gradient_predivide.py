"""DeepSpeed's ``gradient_predivide_factor`` / ``prescale_gradients`` under ZeRO, on 2 gloo ranks.

Each rank divides its gradient by the factor (by the world size with ``prescale_gradients``) before the
sum and the sum by ``world / factor`` after it: the mean is the same, but the sum of fp16 gradients stays
in range. Here each rank's fp16 gradient is 40000 (fits fp16, max 65504); their sum, 80000, does not:
at factor 1 the fp16 reduce-scatter overflows and the step is skipped, at factor 3 (or prescaled) the step
is taken and moves the weight by ``lr * 40000``. With gradients in range, factors 1 and 3 give the same
update within fp16 rounding. Stage 2 (the reduce-scatter in the backward graph, Inductor) and stage 1
(the engine's reduce-scatter after backward).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import dscompile
from dscompile.testing.distributed import requires_backend, run_distributed_or_fail

WORLD = 2
BIG = 40000.0
LR = 1e-6
SETTINGS: dict[str, dict[str, Any]] = {
    "factor1": {},
    "factor3": {"gradient_predivide_factor": 3.0},
    "prescale": {"prescale_gradients": True},
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Linear(4, 2, bias=False)
    with torch.no_grad():
        net.weight.fill_(0.01)
    return net


def _train(stage: int, setting: str, batches: list[torch.Tensor], lower: str) -> list[tuple[int, torch.Tensor]]:
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "fp16": {"enabled": True, "loss_scale": 1.0},
        "zero_optimization": {"stage": stage},
        "lower": lower,
        **SETTINGS[setting],
    }
    engine, _, _, _ = dscompile.initialize(model=_model(), config=config)
    seen = []
    for x in batches:
        loss = engine(x).float().sum()  # d loss / d weight[i, j] = x[j]
        engine.backward(loss)
        engine.step()
        seen.append((engine.skipped_steps, engine.full_parameters()["weight"].float()))
    return seen


def predivide_rank(rank: int, world: int, stage: int, lower: str) -> dict[str, Any]:
    big = torch.full((1, 4), BIG)
    small = torch.linspace(0.5, 2.0, 4).view(1, 4) * (1.0 + rank) * 100  # mean over the ranks: 1.5x
    return {setting: _train(stage, setting, [big, small], lower) for setting in SETTINGS}


@requires_backend("gloo")
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("stage,lower", [(2, "inductor"), (1, "eager")])
def test_predivide_keeps_the_fp16_sum_in_range(stage: int, lower: str) -> None:
    results = run_distributed_or_fail(predivide_rank, WORLD, stage, lower, timeout=300)
    start = torch.full((2, 4), 0.01)
    small_mean = (torch.linspace(0.5, 2.0, 4) * 100 * 1.5).expand(2, 4)
    for r in results:
        (skipped, weight), (skipped_after, weight_after) = r["factor1"]
        assert skipped == 1 and torch.equal(weight, start), "factor 1: the fp16 sum 80000 overflows, the step is skipped"
        assert skipped_after == 1
        torch.testing.assert_close(weight_after, start - LR * small_mean, rtol=0, atol=LR * 0.5)
        for setting in ("factor3", "prescale"):
            (skipped, weight), (skipped_after, weight_after) = r[setting]
            assert skipped == 0 and skipped_after == 0, f"{setting}: the pre-divided sum fits fp16"
            torch.testing.assert_close(weight, start - LR * BIG, rtol=1e-3, atol=0)
            # gradients in range: the same mean as at factor 1, within fp16 rounding
            torch.testing.assert_close(weight_after - weight, -LR * small_mean, rtol=0, atol=LR * 0.5)
