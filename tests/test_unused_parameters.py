"""A parameter that gets no gradient on one rank (a branch taken on one rank only), on 2 gloo ranks.

Plain data parallelism and ZeRO-1 reduce every gradient out of the graphs: ranks agree on which
parameters have a gradient anywhere and send zeros where a rank has none. ZeRO-2/3 reduce inside
the compiled graphs: a branch chosen by a Python attribute gives each rank its own graph, the
``zero_agree`` pass sees the schedules differ before anything moves, and the engine switches to
up-front collectives. A data-dependent branch (a graph break) needs no switch. Every result is
compared with one process running each rank's micro-batch with that rank's branch. One spawn.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dscompile
from dscompile.testing.distributed import requires_backend, run_distributed_or_fail

pytestmark = [pytest.mark.slow, pytest.mark.distributed, requires_backend("gloo")]

LR, WD, STEPS = 0.01, 0.01, 3


class Branchy(nn.Module):
    """``extra`` runs only where ``use_extra`` says (``"data"``: where the batch sums positive); ``never`` never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8, bias=False)
        self.extra = nn.Linear(8, 8, bias=False)
        self.b = nn.Linear(8, 4, bias=False)
        self.never = nn.Linear(8, 8, bias=False)
        self.use_extra: bool | str = True

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if self.use_extra is True or (self.use_extra == "data" and bool(x.sum() > 0)):
            h = torch.relu(self.extra(h))
        return ((self.b(h) - y) ** 2).mean()


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(2, 8, generator=generator).abs(), torch.randn(2, 4, generator=generator)
    return (x if rank == 0 else -x), y  # rank 0's inputs sum positive, rank 1's negative


def _branch(mode: str, rank: int) -> bool | str:
    return "data" if mode == "data" else rank == 0


def _config(stage: int, ignore_unused: bool = True) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "torch_adam": True}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, "ignore_unused_parameters": ignore_unused},
        "lower": "eager",
    }


def reference(mode: str) -> dict[str, torch.Tensor]:
    """One process: each rank's micro-batch with that rank's branch, gradients averaged, eager PyTorch."""
    torch.manual_seed(0)
    model = Branchy()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for step in range(STEPS):
        for rank in range(2):
            model.use_extra = _branch(mode, rank)
            (model(*_batch(step, rank)) / 2).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def unused_rank(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode, stages in (("rank", (0, 1, 2, 3)), ("data", (0, 3))):
        for stage in stages:
            torch.manual_seed(0)
            model = Branchy()
            model.use_extra = _branch(mode, rank)
            engine, *_ = dscompile.initialize(model=model, config=_config(stage))
            for step in range(STEPS):
                loss = engine(*_batch(step, rank))
                engine.backward(loss)
                engine.step()
            up_front = engine.zero_module.collectives_up_front if engine.zero_module is not None else None
            out[(mode, stage)] = {"params": engine.full_parameters(), "up_front": up_front}
            torch._dynamo.reset()
    # Same parameters everywhere but other sequence lengths per rank, so one rank recompiles while the other
    # does not: the schedules still agree (no false alarm, no fall-back).
    from dscompile.zoo import build, make_batch

    case = build("gpt", seed=3, batch_size=2, seq_len=8, d_model=16, n_heads=2, n_layers=1, vocab_size=40)
    engine, *_ = dscompile.initialize(model=case.model, config=_config(3))
    for step in range(4):
        idx, tgt = make_batch(case, seed=10 * step + rank)
        length = 4 + (step + rank) % 3
        engine.backward(engine(idx[:, :length], tgt[:, :length]))
        engine.step()
    out["lengths_up_front"] = engine.zero_module.collectives_up_front
    torch._dynamo.reset()
    for stage in (0, 1, 3):  # ignore_unused_parameters: false makes the unused parameters an error, on every rank
        torch.manual_seed(0)
        model = Branchy()
        model.use_extra = rank == 0
        engine, *_ = dscompile.initialize(model=model, config=_config(stage, ignore_unused=False))
        try:
            engine.backward(engine(*_batch(0, rank)))
            engine.step()
            out[("strict", stage)] = None
        except Exception as exc:
            out[("strict", stage)] = f"{type(exc).__name__}: {exc}"
        dist.barrier()
        torch._dynamo.reset()
    return out


def test_unused_parameters_match_a_single_process() -> None:
    results = run_distributed_or_fail(unused_rank, 2, timeout=900)
    for mode in ("rank", "data"):
        expected = reference(mode)
        for stage in (0, 1, 2, 3) if mode == "rank" else (0, 3):
            got = results[0][(mode, stage)]
            for name, value in expected.items():
                if name == "never.weight" and stage >= 2:
                    # When the ZeRO ops end a graph of their own (up-front collectives, or a graph break in the
                    # model), that graph's backward reduce-scatters zeros for a parameter no rank used (DeepSpeed's
                    # zero-fill), so AdamW's weight decay still applies to it; elsewhere it gets no gradient, no step.
                    value = value * (1 - LR * WD) ** STEPS
                torch.testing.assert_close(got["params"][name], value, rtol=1e-5, atol=1e-6, msg=f"{mode} stage {stage}: {name}")
            assert torch.equal(results[1][(mode, stage)]["params"]["a.weight"], got["params"]["a.weight"])
            if stage >= 2:
                assert got["up_front"] is (mode == "rank"), (mode, stage)  # a graph break needs no switch
    assert results[0]["lengths_up_front"] is False and results[1]["lengths_up_front"] is False
    expected_names = ("extra.weight (on 1 of 2 ranks)", "never.weight (on 2 of 2 ranks)")
    for stage in (0, 1):
        for rank in range(2):
            error = results[rank][("strict", stage)]
            assert error is not None and all(n in error for n in expected_names) and "ignore_unused_parameters is false" in error, error
    for rank in range(2):
        error = results[rank][("strict", 3)]
        assert error is not None and error.startswith("ZeroScheduleDivergence") and "ignore_unused_parameters is false" in error, error
