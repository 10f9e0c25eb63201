"""Data parallelism without ZeRO: 2 gloo ranks, each on half the batch, equal one process on all of it."""

from __future__ import annotations

import copy

import pytest
import torch

from dscompile.testing.distributed import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

CONFIG = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "lower": "eager", "gradient_clipping": 1.0}


def _batches(steps: int):
    from dscompile.zoo import build, make_batch

    case = build("mlp", batch_size=8)
    return case, [make_batch(case, seed=s) for s in range(steps)]


def _data_parallel_rank(rank: int, world_size: int, steps: int):
    import dscompile

    case, batches = _batches(steps)
    engine, *_ = dscompile.initialize(model=case.model, config=CONFIG)
    per_rank = batches[0][0].shape[0] // world_size
    for inputs, targets in batches:
        shard = slice(rank * per_rank, (rank + 1) * per_rank)
        loss = engine(inputs[shard], targets[shard])
        engine.backward(loss)
        engine.step()
    return [p.detach() for p in case.model.parameters()]


def test_two_ranks_equal_single_process():
    steps = 3
    results = run_distributed(_data_parallel_rank, 2, steps, timeout=180)
    case, batches = _batches(steps)
    model = copy.deepcopy(case.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)  # DeepSpeed's AdamW default
    for inputs, targets in batches:
        half = inputs.shape[0] // 2
        # Each rank's loss is a mean over its half: the averaged gradient is the mean of the halves.
        loss = (model(inputs[:half], targets[:half]) + model(inputs[half:], targets[half:])) / 2
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    for rank_params in results:
        for a, b in zip(rank_params, model.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
