"""DeepSpeed's engine API and conventions, each against what DeepSpeed does or plain PyTorch.

Accessors with DeepSpeed's signatures, ``destroy()``, ``loss.backward()`` + ``engine.step()``,
the optimizer/scheduler precedence and defaults, the training loaders, and the 16-bit convention
(16-bit inputs in, the 16-bit module's output dtypes out, fp32 master weights kept).
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import dscompile
from dscompile.engines.pipeline_parallel import PipelineEngine
from dscompile.runtime.engine_core import EngineExtension
from dscompile.zoo import build, make_batch

SGD = {"type": "SGD", "params": {"lr": 0.1}}


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(4, 8, generator=gen), torch.randint(0, 4, (4,), generator=gen)


# -- accessors -------------------------------------------------------------------------------------
def test_accessors_are_deepspeeds_methods(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")
    model = _Net()
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3, "optimizer": SGD, "bf16": {"enabled": True}, "lower": "eager"}
    engine, optimizer, _, _ = dscompile.initialize(model=model, config=cfg)
    assert engine.train_micro_batch_size_per_gpu() == 2
    assert engine.gradient_accumulation_steps() == 3
    assert engine.train_batch_size() == 6  # micro x accumulation x one rank
    assert engine.bfloat16_enabled() is True and engine.fp16_enabled() is False
    assert engine.zero_optimization_stage() == 0
    assert (engine.local_rank, engine.global_rank, engine.world_size) == (0, 0, 1)
    assert engine.device == torch.device("cpu")
    assert engine.module is model and engine.optimizer is optimizer
    assert engine.get_lr() == [0.1]
    monkeypatch.setenv("LOCAL_RANK", "3")
    fp16, *_ = dscompile.initialize(model=_Net(), config={"train_batch_size": 8, "fp16": {"enabled": True}, "lower": "eager"})
    assert fp16.local_rank == 3 and fp16.fp16_enabled() and not fp16.bfloat16_enabled()
    assert (fp16.train_batch_size(), fp16.train_micro_batch_size_per_gpu(), fp16.gradient_accumulation_steps()) == (8, 8, 1)


def test_accumulation_boundary_and_global_grad_norm() -> None:
    cfg = {"gradient_accumulation_steps": 2, "gradient_clipping": 1e-3, "optimizer": SGD, "lower": "eager"}
    engine, *_ = dscompile.initialize(model=_Net(), config=cfg)
    seen = []
    for step in range(4):
        x, y = _batch(step)
        seen.append(engine.is_gradient_accumulation_boundary())
        engine.backward(nn.functional.cross_entropy(engine(x), y))
        engine.step()
    assert seen == [False, True, False, True]
    assert engine.global_steps == 2 and engine.get_global_grad_norm() > 1e-3  # the norm before clipping


def test_pipeline_engine_answers_the_same_accessors() -> None:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "optimizer": SGD, "pipeline": {"stages": 1, "compile": False}}
    engine, *_ = dscompile.initialize(model=build("mlp").model, config=cfg)
    assert isinstance(engine, PipelineEngine)
    assert (engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu(), engine.train_batch_size()) == (2, 2, 4)
    assert engine.bfloat16_enabled() is False and engine.is_gradient_accumulation_boundary() is False


# -- destroy ---------------------------------------------------------------------------------------
def test_destroy_releases_the_compiled_module_and_is_idempotent() -> None:
    model = _Net()
    engine, *_ = dscompile.initialize(model=model, config={"optimizer": SGD, "lower": "eager"})
    x, y = _batch(0)
    engine(x)
    calls = []

    class Released(EngineExtension):
        name = "released"

        def destroy(self, engine: Any) -> None:
            calls.append(engine)

    engine.add_extension(Released())
    engine.destroy()
    engine.destroy()
    assert calls == [engine]  # each extension released once
    with pytest.raises(RuntimeError, match="destroyed"):
        engine(x)
    torch.testing.assert_close(model(x), _Net()(x))  # the module itself stays usable

    pipe, *_ = dscompile.initialize(model=build("mlp").model, config={"optimizer": SGD, "pipeline": {"stages": 1, "compile": False}})
    case = build("mlp")
    pipe.train_batch(iter([make_batch(case, seed=0)]))
    pipe.destroy()
    pipe.destroy()
    assert pipe.runners == {} and pipe.program is None
    with pytest.raises(RuntimeError, match="destroyed"):
        pipe.train_batch(iter([make_batch(case, seed=1)]))


# -- loss.backward() -------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", [None, "fp16"])
def test_loss_backward_then_step_trains_as_engine_backward(precision: str | None) -> None:
    """DeepSpeed divides a plain ``loss.backward()``'s gradients by the accumulation steps; so does
    dscompile, and with fp16 it also applies the loss scale, so both spellings step alike."""
    cfg: dict[str, Any] = {"gradient_accumulation_steps": 2, "optimizer": SGD}
    if precision:
        cfg[precision] = {"enabled": True, "loss_scale": 1024.0}

    def train(direct: bool) -> nn.Module:
        engine, *_ = dscompile.initialize(model=_Net(), config=cfg)
        for step in range(4):
            x, y = _batch(step)
            loss = nn.functional.cross_entropy(engine(x).float(), y)
            loss.backward() if direct else engine.backward(loss)
            engine.step()
        return engine.module

    direct, managed = train(True), train(False)
    for (name, a), b in zip(direct.named_parameters(), managed.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    if precision is None:  # and both equal plain PyTorch: the mean gradient of each pair of micro-batches
        ref = _Net()
        opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for step in range(4):
            x, y = _batch(step)
            (nn.functional.cross_entropy(ref(x), y) / 2).backward()
            if step % 2:
                opt.step()
                opt.zero_grad()
        for (name, a), b in zip(direct.named_parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


# -- optimizer and scheduler precedence, defaults -----------------------------------------------------
def test_optimizer_argument_wins_over_the_config_section(caplog: pytest.LogCaptureFixture) -> None:
    model = _Net()
    mine = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.StepLR(mine, step_size=1, gamma=0.5)
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "scheduler": {"type": "WarmupLR", "params": {}}, "lower": "eager"}
    with caplog.at_level(logging.WARNING, logger="dscompile.engines.training"):
        engine, optimizer, _, lr_scheduler = dscompile.initialize(model=model, optimizer=mine, lr_scheduler=scheduler, config=cfg)
    assert optimizer is mine and lr_scheduler is scheduler
    assert "'optimizer' section (AdamW) is ignored" in caplog.text and "'scheduler' section (WarmupLR) is ignored" in caplog.text
    plain = {"optimizer": cfg["optimizer"], "lower": "eager"}
    callable_opt, *_ = dscompile.initialize(model=_Net(), optimizer=lambda p: torch.optim.SGD(p, lr=0.25), config=plain)
    assert isinstance(callable_opt.optimizer, torch.optim.SGD) and callable_opt.get_lr() == [0.25]


@pytest.mark.parametrize(
    ("kind", "params", "cls", "weight_decay"),
    [
        ("AdamW", {}, torch.optim.AdamW, 0.0),  # DeepSpeed's FusedAdam default, not torch's 0.01
        ("Adam", {}, torch.optim.AdamW, 0.0),
        ("Adam", {"adam_w_mode": False}, torch.optim.Adam, 0.0),
        ("AdamW", {"torch_adam": True}, torch.optim.AdamW, 0.01),  # DeepSpeed builds torch's AdamW with torch's defaults
        ("AdamW", {"weight_decay": 0.1}, torch.optim.AdamW, 0.1),
    ],
)
def test_adam_weight_decay_defaults_are_deepspeeds(kind: str, params: dict, cls: type, weight_decay: float) -> None:
    _, optimizer, _, _ = dscompile.initialize(model=_Net(), config={"optimizer": {"type": kind, "params": {"lr": 1e-3, **params}}, "lower": "eager"})
    assert type(optimizer) is cls and optimizer.param_groups[0]["weight_decay"] == weight_decay


# -- data --------------------------------------------------------------------------------------------
def _dataset(n: int = 10) -> TensorDataset:
    return TensorDataset(torch.arange(n, dtype=torch.float32).unsqueeze(1), torch.arange(n))


def test_training_data_loader_is_deepspeeds() -> None:
    """DistributedSampler (shuffled, seed 0), micro-batches, last partial batch kept, a new shuffle each pass."""
    data = _dataset()
    _, _, loader, _ = dscompile.initialize(model=_Net(), config={"train_micro_batch_size_per_gpu": 4, "lower": "eager"}, training_data=data)
    first = [y.tolist() for _, y in loader]
    expected = [y.tolist() for _, y in DataLoader(data, batch_size=4, sampler=DistributedSampler(data, num_replicas=1, rank=0))]
    assert first == expected and [len(b) for b in first] == [4, 4, 2] and sorted(sum(first, [])) == list(range(10))
    assert first != [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]  # shuffled
    second = [y.tolist() for _, y in loader]
    assert second != first and sorted(sum(second, [])) == list(range(10))  # epoch 1: another order
    loader.data_sampler.set_epoch(0)
    assert [y.tolist() for _, y in loader] == first  # an epoch the script set is kept
    _, _, dropping, _ = dscompile.initialize(
        model=_Net(), config={"train_micro_batch_size_per_gpu": 4, "dataloader_drop_last": True, "lower": "eager"}, training_data=data
    )
    assert [len(y) for _, y in dropping] == [4, 4]


class _Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_pipeline_train_batch_draws_from_training_data_in_order() -> None:
    """No iterator: the engine's own loader (in order, endless), as DeepSpeed's pipeline engine."""
    data = _dataset(6)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "optimizer": SGD, "pipeline": {"stages": 1, "compile": False}}
    loss_fn = lambda out, y: nn.functional.mse_loss(out.squeeze(1), y.float())  # noqa: E731
    engine = PipelineEngine(_Regression(), cfg, None, loss_fn=loss_fn)
    reference = PipelineEngine(_Regression(), cfg, None, loss_fn=loss_fn)
    from dscompile.engines.training import _build_dataloader
    from dscompile.utils import RepeatingLoader

    engine.set_dataloader(RepeatingLoader(_build_dataloader(engine.config, data, None, 1, 0, shuffle=False)))
    ordered = iter(RepeatingLoader(DataLoader(data, batch_size=2)))
    for _ in range(4):  # 6 samples, 4 per step: the loader restarts
        torch.testing.assert_close(engine.train_batch(), reference.train_batch(ordered), rtol=0, atol=0)
    _, _, loader, _ = dscompile.initialize(model=_Regression(), config=cfg, training_data=data)
    assert isinstance(loader, RepeatingLoader)


# -- the 16-bit convention ------------------------------------------------------------------------------
class _Cnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).flatten(1))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_sixteen_bit_inputs_in_sixteen_bit_outputs_out(precision: str) -> None:
    """A DeepSpeed script casts its inputs to the 16-bit dtype: the engine takes them, returns the
    16-bit module's outputs, and keeps fp32 master weights with fp32 gradients (default Inductor lowering)."""
    low = torch.bfloat16 if precision == "bf16" else torch.float16
    model = _Cnn()
    reference = copy.deepcopy(model)
    engine, *_ = dscompile.initialize(model=model, config={precision: {"enabled": True}, "optimizer": SGD})
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 3, 8, 8, generator=gen), torch.randint(0, 5, (4,), generator=gen)
    out = engine(x.to(low))
    assert out.dtype == low == reference.to(low)(x.to(low)).dtype
    reference.float()
    torch.testing.assert_close(out.float(), reference(x.to(low).float()), rtol=3e-2, atol=3e-2)
    engine.backward(nn.functional.cross_entropy(out.float(), y))
    assert all(p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    nn.functional.cross_entropy(reference(x.to(low).float()), y).backward()
    scale = engine.loss_scaler.loss_scale  # fp16: gradients stay scaled until the step unscales them
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad / scale, r.grad, rtol=5e-2, atol=5e-2)
    engine.step()
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_sixteen_bit_convention_on_a_hugging_face_model() -> None:
    """GPT-2 from a config: the logits come back in the dtype of the model cast to bf16, the loss
    (HF upcasts the logits for it) in fp32, both close to fp32 eager; master weights stay fp32."""
    pytest.importorskip("transformers")
    case, reference = build("hf_gpt2"), build("hf_gpt2")
    engine, *_ = dscompile.initialize(model=case.model, config={"bf16": {"enabled": True}, "optimizer": SGD})
    ids, targets = make_batch(case, seed=1)
    logits, loss = engine(ids), engine(ids, targets)
    sixteen = copy.deepcopy(reference.model).bfloat16()
    assert (logits.dtype, loss.dtype) == (sixteen(ids).dtype, sixteen(ids, targets).dtype) == (torch.bfloat16, torch.float32)
    torch.testing.assert_close(logits.float(), reference.model(ids), rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(loss, reference.model(ids, targets), rtol=2e-2, atol=2e-2)
    engine.backward(loss)
    engine.step()
    assert all(p.dtype == torch.float32 for p in case.model.parameters())
