"""DeepSpeed's ``engine.offload_states()`` / ``reload_states()`` and ``set_gradient_accumulation_boundary``.

ZeRO in one process (world size 1, no process group) under the default lowering: offloading parks
the states on the host and empties their tensors; reloading restores them bit for bit, and training
continues exactly as a run that never offloaded.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dscompile
from dscompile.errors import DSCompileConfigError
from dscompile.zoo import build, make_batch

MODEL = {"seq_len": 8, "d_model": 16, "n_heads": 2, "n_layers": 1, "vocab_size": 40, "bias": False}


def _engine(stage: int, lower: str = "inductor") -> tuple:
    case = build("gpt", seed=3, **MODEL)
    cfg = {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 20},  # small ones persistent: lp_params too
        "lower": lower,
    }
    engine, *_ = dscompile.initialize(model=case.model, config=cfg)
    return engine, case


def _train(engine: dscompile.DSCompileEngine, case: object, steps: range) -> list[float]:
    losses = []
    for step in steps:
        loss = engine(*make_batch(case, seed=step))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _states(engine: dscompile.DSCompileEngine) -> list[torch.Tensor]:
    """Every model state tensor the engine holds (optimizer step counters included)."""
    tensors = [*engine.zero.shards, *[p for p in engine.zero.full_params if p.numel()]]
    return tensors + [v for s in engine.optimizer.state.values() for v in s.values()]


def _snapshot(engine: dscompile.DSCompileEngine) -> list[torch.Tensor]:
    return [t.detach().clone() for t in _states(engine)]


@pytest.mark.slow
@pytest.mark.parametrize("stage, lower", [(3, "inductor"), (2, "eager"), (1, "eager")])
def test_offload_and_reload_states_continue_training_bit_for_bit(stage: int, lower: str) -> None:
    """Train, offload, reload, train on: equal bit for bit to the same engine trained on from the same
    states without offloading (one engine, one compilation: it is rewound to the snapshot)."""
    from dscompile.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

    engine, case = _engine(stage, lower)
    _train(engine, case, range(2))
    before = _snapshot(engine)
    expected_losses = _train(engine, case, range(2, 4))  # the run without offloading
    expected = _snapshot(engine)
    with torch.no_grad():
        for t, saved in zip(_states(engine), before, strict=True):
            t.copy_(saved)  # rewind
    held = engine.model_state_bytes()
    engine.offload_states(include=[OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.hp_params], device=OffloadDeviceEnum.cpu)
    moved = engine.offloaded_states.host_bytes()
    assert moved == 3 * sum(t.numel() * 4 for t in before[: len(engine.zero.shards)])  # fp32 shards and AdamW's two moments
    assert all(s.numel() == 0 for s in engine.zero.shards)
    assert all(v.numel() == 0 for s in engine.optimizer.state.values() for v in s.values() if v.dim() > 0)
    assert engine.model_state_bytes() == held - moved
    engine.offload_states()  # the rest: lp_params (no gradients are held between steps)
    lp_bytes = sum(p.numel() * 4 for p in engine.zero.full_params)
    assert lp_bytes == 0 and engine.model_state_bytes() == 0
    assert engine.offloaded_states.host_bytes() > moved  # the full copies (persistent ones under ZeRO-3) went too
    with pytest.raises(RuntimeError, match="reload_states"):
        engine(*make_batch(case, seed=9))
    engine.reload_states()
    assert engine.offloaded_states is None and engine.model_state_bytes() == held
    for a, b in zip(_snapshot(engine), before, strict=True):
        assert torch.equal(a, b)
    assert _train(engine, case, range(2, 4)) == expected_losses
    for a, b in zip(_snapshot(engine), expected, strict=True):
        assert torch.equal(a, b)


def test_offload_states_refusals() -> None:
    plain, *_ = dscompile.initialize(model=nn.Linear(3, 2), config={"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "lower": "eager"})
    with pytest.raises(DSCompileConfigError, match="offload_states"):
        plain.offload_states()
    engine, _ = _engine(1, "eager")
    with pytest.raises(DSCompileConfigError, match="OffloadDeviceEnum.cpu"):
        engine.offload_states(device="nvme")


@pytest.mark.parametrize("stage", [0, 1])
def test_set_gradient_accumulation_boundary_steps_once_after_the_micro_batches(stage: int) -> None:
    """DeepSpeed's idiom: boundary False on every micro-batch but the last, one step() at the end;
    the same parameters as counting micro-steps with a step() after each."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    twin = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    twin.load_state_dict(net.state_dict())
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    if stage:
        cfg["zero_optimization"] = {"stage": stage}
    manual, *_ = dscompile.initialize(model=net, config=cfg)
    counted, *_ = dscompile.initialize(model=twin, config=cfg)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(2, 4, generator=g), torch.randn(2, 1, generator=g)) for _ in range(3)]
    for i, (x, y) in enumerate(batches):
        manual.set_gradient_accumulation_boundary(i == 2)
        assert manual.is_gradient_accumulation_boundary() is (i == 2)
        manual.backward(nn.functional.mse_loss(manual(x), y))
        counted.backward(nn.functional.mse_loss(counted(x), y))
        counted.step()
    assert manual.global_steps == 0
    manual.step()
    assert manual.global_steps == 1 == counted.global_steps
    for a, b in zip(net.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    manual.set_gradient_accumulation_boundary(None)
    assert manual.is_gradient_accumulation_boundary() is False  # counting again: micro-step 1 of 3


class _Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(512, 512)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).square().mean()


def test_cpu_memory_allocated_drops_by_the_parked_states_and_comes_back() -> None:
    """DeepSpeedExamples' ``training/offload_states`` asserts ``get_accelerator().memory_allocated()`` drops after
    ``offload_states()`` and rises after ``reload_states()``. On CPU (memory: the process's resident set, as DeepSpeed's
    CPU accelerator reports it) the parked states are the host's, as on a GPU: ``memory_allocated`` drops by the bytes
    parked, ``memory_reserved`` (the memory itself) does not, and nothing is copied (the device is the host)."""
    from dscompile.accelerator import CPUAccelerator
    from dscompile.runtime.offload.states import host_parked_bytes

    acc = CPUAccelerator()
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}, "zero_optimization": {"stage": 3}, "lower": "eager"}
    engine, *_ = dscompile.initialize(model=_Wide(), config=cfg)
    loss = engine(torch.randn(4, 512))
    engine.backward(loss)
    engine.step()
    storages = [t.untyped_storage().data_ptr() for t in _states(engine) if t.dim() > 0]
    before, reserved = acc.memory_allocated(), acc.memory_reserved()
    engine.offload_states()
    parked = engine.offloaded_states.host_bytes()
    after = acc.memory_allocated()
    assert parked == host_parked_bytes() >= 3 * 4 * 512 * 513  # fp32 shards and AdamW's two moments (one rank: everything)
    assert 0.9 * parked <= before - after <= 1.1 * parked, (before, after, parked)
    assert abs(acc.memory_reserved() - reserved) < 0.1 * parked  # the same memory, now the host's
    assert sorted(p.host.untyped_storage().data_ptr() for items in engine.offloaded_states.parked.values() for p in items) == sorted(storages)
    engine.reload_states()
    assert host_parked_bytes() == 0 and acc.memory_allocated() - after >= 0.9 * parked
