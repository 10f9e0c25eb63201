"""Quantization-aware training through ``torch.compile(backend="dscompile")`` with the schedule driven
by a plain training loop (the engine will make these calls): the loss falls and the bit width
follows DeepSpeed's MoQ schedule at the configured steps, without recompiling."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call

from dscompile.compression import get_compression_scheduler, init_compression
from dscompile.kernels.quantize import activation_values, fake_quantize
from dscompile.zoo import build

CONFIG = {
    "compression_training": {
        "weight_quantization": {
            "shared_parameters": {"enabled": True, "schedule_offset": 2, "quantize_groups": 4, "quantization_type": "symmetric"},
            "different_groups": {"wq": {"params": {"start_bits": 8, "target_bits": 5, "quantization_period": 3}, "modules": [r"layers|blocks"]}},
        },
        "activation_quantization": {
            "shared_parameters": {"enabled": True, "schedule_offset": 4},
            "different_groups": {"aq": {"params": {"bits": 8}, "modules": [r"\.fc$"]}},
        },
    }
}
# DeepSpeed's MoQ from step 2: k = step - 1 quantizations, bits drop at k = 3, 6, 12 (period doubling)
EXPECTED_BITS = {0: None, 1: None, 2: 8, 3: 8, 4: 7, 6: 7, 7: 6, 12: 6, 13: 5, 20: 5}


def reference_loss(model: nn.Module, plain: nn.Module, step: int, bits: int | None, inputs: tuple, targets: torch.Tensor) -> torch.Tensor:
    """The same step in eager: ``plain`` (an unprepared copy: the prepared model's own calls are
    compressed) with ``model``'s weights, quantized in the matched layers, and quantized fc inputs."""
    params = dict(model.named_parameters())
    replaced = dict(params)
    if bits is not None:
        for name, p in params.items():
            if name.endswith("weight") and ("layers." in name or "blocks." in name) and p.dim() == 2:
                replaced[name] = fake_quantize(p.detach(), bits, 4)
    handles = []
    if step >= 4:
        for name, module in plain.named_modules():
            if name.endswith(".fc"):
                handles.append(module.register_forward_pre_hook(lambda m, args: (activation_values(args[0], bits=8, symmetric=True, per="token"),)))
    try:
        with torch.no_grad():
            return functional_call(plain, replaced, (*inputs, targets))
    finally:
        for h in handles:
            h.remove()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert", "gpt"])
def test_qat_trains_with_the_bit_schedule(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from dscompile import frontend

    compiles = [0]
    original = frontend.GraphCompiler.compile
    monkeypatch.setattr(frontend.GraphCompiler, "compile", lambda self, gm, inputs: (compiles.__setitem__(0, compiles[0] + 1), original(self, gm, inputs))[1])

    case = build(name, d_model=32, n_layers=2)
    model = case.model
    plain = copy.deepcopy(model)
    init_compression(model, CONFIG)
    scheduler = get_compression_scheduler(model)
    compiled = torch.compile(model, backend="dscompile", options=CONFIG)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    inputs, targets = case.example_inputs, case.targets
    losses = []
    for step in range(21):
        scheduler.step(step)
        bits = scheduler.bits()["layers.0.fc" if name == "bert" else "blocks.0.mlp.fc"]
        if step in EXPECTED_BITS:
            assert bits == EXPECTED_BITS[step], (step, bits)
        loss = compiled(*inputs, targets)
        if step in (1, 4, 13):  # the compiled graph really runs at the scheduled bits
            torch.testing.assert_close(loss.detach(), reference_loss(model, plain, step, bits, inputs, targets), rtol=1e-5, atol=1e-5)
        loss.backward()
        scheduler.after_backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.6 * losses[0], losses
    assert compiles[0] == 1
