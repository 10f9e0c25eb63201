"""fp16 loss scaling: DeepSpeed's schedule, step skipping that corrupts nothing, all ranks agreeing.

The expected schedules below are worked out by hand from DeepSpeed's documented rules (initial
scale 2**initial_scale_power; an overflow uses up one unit of hysteresis, or halves the scale
when none is left, never below min_loss_scale; the scale doubles after loss_scale_window clean
steps counted from the last overflow, restoring the hysteresis).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dscompile
from dscompile.runtime.loss_scaler import (
    DynamicLossScaler,
    LossScaleAtMinimumError,
    StaticLossScaler,
    build_loss_scaler,
    grads_overflow,
)


def _run(scaler: DynamicLossScaler, pattern: str) -> list[float]:
    """Feed overflow pattern ('x' overflow, '.' clean); return the scale after each step."""
    scales = []
    for ch in pattern:
        scaler.update(ch == "x")
        scales.append(scaler.loss_scale)
    return scales


def test_initial_scale_and_growth_after_window() -> None:
    s = DynamicLossScaler(initial_scale_power=4, loss_scale_window=3, hysteresis=1)
    assert s.loss_scale == 16.0
    # clean steps 0,1,2 -> after the third the scale doubles; again after three more
    assert _run(s, "......") == [16, 16, 32, 32, 32, 64]


def test_halving_without_hysteresis_and_window_counted_from_last_overflow() -> None:
    s = DynamicLossScaler(initial_scale_power=4, loss_scale_window=3, hysteresis=1)
    # overflow at iter 1 halves; growth needs 3 clean steps after it (iters 2,3,4 -> grow at 4)
    assert _run(s, ".x...") == [16, 8, 8, 8, 16]


def test_hysteresis_delays_halving() -> None:
    s = DynamicLossScaler(initial_scale_power=4, loss_scale_window=100, hysteresis=3)
    # two overflows use up hysteresis (3 -> 2 -> 1), the third halves, later ones keep halving
    assert _run(s, "xxxx") == [16, 16, 8, 4]
    assert s.cur_hysteresis == 1


def test_hysteresis_not_consecutive_is_only_restored_by_growth() -> None:
    s = DynamicLossScaler(initial_scale_power=4, loss_scale_window=4, hysteresis=2)
    # x (hyst 2->1), clean, x (hyst 1: halve 16->8), then 4 clean after it -> grow, hysteresis back to 2
    assert _run(s, "x.x....") == [16, 16, 8, 8, 8, 8, 16]
    assert s.cur_hysteresis == 2
    assert _run(s, "x") == [16]  # hysteresis absorbs this one again


def test_consecutive_hysteresis_restored_by_any_clean_step() -> None:
    s = DynamicLossScaler(initial_scale_power=4, loss_scale_window=100, hysteresis=2, consecutive_hysteresis=True)
    # isolated overflows never lower the scale; two in a row do
    assert _run(s, "x.x.x.") == [16] * 6
    assert _run(s, "xx") == [16, 8]


def test_floor_at_min_loss_scale_then_error() -> None:
    s = DynamicLossScaler(initial_scale_power=2, loss_scale_window=100, hysteresis=1, min_loss_scale=1.0)
    assert _run(s, "xx") == [2, 1]
    with pytest.raises(LossScaleAtMinimumError, match="min_loss_scale"):
        s.update(True)
    t = DynamicLossScaler(initial_scale_power=2, hysteresis=1, min_loss_scale=1.5, raise_error_at_min_scale=False)
    assert _run(t, "xxx") == [2, 1.5, 1.5]


def test_static_scale_never_moves() -> None:
    s = StaticLossScaler(128.0)
    for overflow in (True, False, True):
        s.update(overflow)
    assert s.loss_scale == 128.0


def test_state_dict_round_trip() -> None:
    s = DynamicLossScaler(initial_scale_power=5, loss_scale_window=3, hysteresis=2)
    _run(s, "x..x.")
    t = DynamicLossScaler(initial_scale_power=5, loss_scale_window=3, hysteresis=2)
    t.load_state_dict(copy.deepcopy(s.state_dict()))
    assert _run(s, "..x....") == _run(t, "..x....")


def test_build_from_config_section() -> None:
    cfg = dscompile.load_config({"fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 3}})
    s = build_loss_scaler(cfg.sections["fp16"])
    assert isinstance(s, DynamicLossScaler) and s.loss_scale == 256 and s.delayed_shift == 3 and s.scale_window == 1000
    cfg = dscompile.load_config({"fp16": {"enabled": True, "loss_scale": 64}})
    assert type(build_loss_scaler(cfg.sections["fp16"])) is StaticLossScaler


def test_overflow_detection_and_unscale() -> None:
    p = nn.Parameter(torch.ones(3))
    q = nn.Parameter(torch.ones(2))
    p.grad = torch.tensor([2.0, 4.0, 8.0])
    q.grad = torch.tensor([16.0, 32.0])
    s = StaticLossScaler(4.0)
    assert not s.unscale_and_check([p, q])
    assert torch.equal(p.grad, torch.tensor([0.5, 1.0, 2.0])) and torch.equal(q.grad, torch.tensor([4.0, 8.0]))
    for bad in (float("inf"), float("-inf"), float("nan")):
        q.grad = torch.tensor([1.0, bad])
        before = p.grad.clone()
        assert s.unscale_and_check([p, q])
        assert torch.equal(p.grad, before)  # an overflowing step leaves the gradients alone


# ---------------------------------------------------------------------------------------------
# Through the engine: skipped steps corrupt nothing and follow the schedule.
# ---------------------------------------------------------------------------------------------


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.fc2(torch.relu(self.fc1(x))), y)


def _engine(fp16: dict) -> dscompile.DSCompileEngine:
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "fp16": {"enabled": True, **fp16},
        "lower": "eager",
    }
    engine, _, _, _ = dscompile.initialize(model=_Tiny(), config=config)
    return engine


def _snapshot(engine: dscompile.DSCompileEngine) -> tuple[dict, dict]:
    params = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    state = copy.deepcopy(engine.optimizer.state_dict())
    return params, state


def _same_optimizer_state(a: dict, b: dict) -> bool:
    if a["state"].keys() != b["state"].keys():
        return False
    for key in a["state"]:
        for name, value in a["state"][key].items():
            other = b["state"][key][name]
            if isinstance(value, torch.Tensor):
                if not torch.equal(value, other):
                    return False
            elif value != other:
                return False
    return True


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_engine_skips_overflowing_steps_bit_identically(bad: float) -> None:
    engine = _engine({"initial_scale_power": 10, "loss_scale_window": 2, "hysteresis": 2})
    assert engine.loss_scaler.loss_scale == 1024
    inject = {"on": False}
    engine.module.fc1.weight.register_hook(lambda g: torch.full_like(g, bad) if inject["on"] else g)
    gen = torch.Generator().manual_seed(0)
    pattern = ".xx..x.x..xx"  # clean/overflow per step
    expected = DynamicLossScaler(initial_scale_power=10, loss_scale_window=2, hysteresis=2)
    for step, ch in enumerate(pattern):
        x, y = torch.randn(4, 8, generator=gen), torch.randint(0, 4, (4,), generator=gen)
        inject["on"] = ch == "x"
        before = _snapshot(engine)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        expected.update(ch == "x")
        after = _snapshot(engine)
        if ch == "x":
            assert all(torch.equal(before[0][k], after[0][k]) for k in before[0]), f"step {step}: parameters changed"
            assert _same_optimizer_state(before[1], after[1]), f"step {step}: optimizer state changed"
        else:
            assert not all(torch.equal(before[0][k], after[0][k]) for k in before[0]), f"step {step}: clean step did not update"
        assert engine.loss_scaler.loss_scale == expected.loss_scale, f"step {step}"
        assert all(p.grad is None for p in engine.module.parameters())
    assert engine.skipped_steps == pattern.count("x")
    assert engine.global_steps == len(pattern)


def test_engine_unscales_before_clipping_and_step() -> None:
    """A clean fp16 step applies the same update as fp32 with the same (unscaled) gradients."""
    torch.manual_seed(0)
    engine = _engine({"initial_scale_power": 12})
    ref = _Tiny()
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    loss = engine(x, y)
    engine.backward(loss)
    grads = {n: p.grad.clone() for n, p in engine.module.named_parameters()}
    scale = engine.loss_scaler.loss_scale
    with torch.autocast("cpu", dtype=torch.float16):
        ref_loss = ref(x, y)
    ref_loss.backward()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name] / scale, p.grad, rtol=2e-2, atol=1e-4)
    engine.step()
    opt.step()
    assert engine.skipped_steps == 0


def test_loss_scale_saved_in_checkpoints(tmp_path) -> None:
    engine = _engine({"initial_scale_power": 6, "hysteresis": 1})
    engine.module.fc2.bias.register_hook(lambda g: torch.full_like(g, float("inf")))
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    engine.backward(engine(x, y))
    engine.step()
    assert engine.loss_scaler.loss_scale == 32
    engine.save_checkpoint(tmp_path)
    fresh = _engine({"initial_scale_power": 6, "hysteresis": 1})
    fresh.load_checkpoint(tmp_path)
    assert fresh.loss_scaler.loss_scale == 32 and fresh.skipped_steps == 1


# ---------------------------------------------------------------------------------------------
# All ranks skip together (2 gloo processes).
# ---------------------------------------------------------------------------------------------


def _overflow_on_rank1(rank: int, world_size: int) -> list[bool]:
    p = nn.Parameter(torch.zeros(4))
    results = []
    for step in range(3):
        p.grad = torch.ones(4)
        if rank == 1 and step == 1:
            p.grad[2] = float("nan")
        results.append(grads_overflow([p]))
    return results


def test_overflow_flag_is_all_reduced() -> None:
    from dscompile.testing.distributed import run_distributed

    results = run_distributed(_overflow_on_rank1, 2, timeout=120)
    assert results == [[False, True, False], [False, True, False]]
