"""The engine core shared by ``DSCompileEngine`` and ``PipelineEngine``: the extension protocol, the
``wall_clock_breakdown`` / ``memory_breakdown`` reports, ZeRO without a process group, the config
keys the core reads, and clear errors where tracebacks were."""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dscompile
from dscompile.errors import DSCompileConfigError, DSCompileError
from dscompile.runtime import engine_extension
from dscompile.runtime.engine_core import EngineExtension, register_engine_extension
from dscompile.zoo import build, make_batch


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.fc2(torch.relu(self.fc1(x))), y)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(4, 8, generator=gen), torch.randint(0, 4, (4,), generator=gen)


# ---------------------------------------------------------------------------------------------
# the extension protocol
# ---------------------------------------------------------------------------------------------
class _Recorder(EngineExtension):
    """Scales the loss by 4 and unscales in check_overflow (so training is unchanged), records every hook,
    reports an overflow at the optimizer step given by ``overflow_at``, and keeps a counter in its state."""

    name = "recorder"
    checks_overflow = True

    def __init__(self, overflow_at: int) -> None:
        self.calls: list[str] = []
        self.overflow_at = overflow_at
        self.boundaries = 0

    def configure(self, engine: Any) -> None:
        self.calls.append("configure")

    def before_forward(self, engine: Any) -> None:
        self.calls.append("before_forward")

    def after_forward(self, engine: Any) -> None:
        self.calls.append("after_forward")

    def scale_loss(self, engine: Any, loss: torch.Tensor) -> torch.Tensor:
        self.calls.append("scale_loss")
        return loss * 4.0

    def after_backward(self, engine: Any) -> None:
        self.calls.append("after_backward")

    def on_gradients_ready(self, engine: Any, params: list) -> None:
        self.calls.append("on_gradients_ready")

    def check_overflow(self, engine: Any, params: list) -> bool:
        self.calls.append("check_overflow")
        for p in params:
            if p.grad is not None:
                p.grad.div_(4.0)
        return self.boundaries == self.overflow_at

    def before_optimizer_step(self, engine: Any, params: list) -> None:
        self.calls.append("before_optimizer_step")

    def after_optimizer_step(self, engine: Any, overflow: bool) -> None:
        self.calls.append(f"after_optimizer_step({overflow})")
        self.boundaries += 1

    def state_dict(self) -> dict[str, Any]:
        return {"boundaries": self.boundaries}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.boundaries = state["boundaries"]

    def counters(self) -> dict[str, Any]:
        return {"boundaries": self.boundaries}


@pytest.fixture
def recorder() -> Any:
    """Register the recording extension for the engines built in one test, then remove it."""
    dscompile.load_config({})  # the capability modules register their extensions first
    saved = list(engine_extension._FACTORIES)
    made: list[_Recorder] = []

    @register_engine_extension(50, "recorder")
    def _factory(config: Any) -> _Recorder:
        made.append(_Recorder(overflow_at=1))
        return made[-1]

    yield made
    engine_extension._FACTORIES[:] = saved


def _plain_training(batches: list, gas: int, skip: set[int]) -> nn.Module:
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, batch in enumerate(batches):
        (model(*batch) / gas).backward()
        if (i + 1) % gas == 0:
            if (i + 1) // gas - 1 not in skip:
                opt.step()
            opt.zero_grad()
    return model


def test_extension_hooks_run_in_order_in_the_data_parallel_engine(recorder: list, tmp_path: Path) -> None:
    engine, *_ = dscompile.initialize(model=_Net(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), config={"gradient_accumulation_steps": 2, "lower": "eager"})
    ext = recorder[0]
    assert engine.extension("recorder") is ext and ext.calls == ["configure"]
    batches = [_batch(i) for i in range(6)]
    for batch in batches:
        engine.backward(engine(*batch))
        engine.step()
    micro = ["before_forward", "after_forward", "scale_loss", "after_backward"]
    clean = ["on_gradients_ready", "check_overflow", "before_optimizer_step", "after_optimizer_step(False)"]
    skipped = ["on_gradients_ready", "check_overflow", "after_optimizer_step(True)"]
    assert ext.calls == ["configure", *micro, *micro, *clean, *micro, *micro, *skipped, *micro, *micro, *clean]
    assert engine.skipped_steps == 1 and engine.global_steps == 3
    reference = _plain_training(batches, 2, skip={1})  # the x4 loss scale is undone: same numbers as plain SGD
    for p, q in zip(engine.module.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert engine.communication_stats()["extensions"] == {"recorder": {"boundaries": 3}}
    engine.save_checkpoint(tmp_path)
    fresh, *_ = dscompile.initialize(model=_Net(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), config={"gradient_accumulation_steps": 2, "lower": "eager"})
    assert recorder[1].boundaries == 0
    fresh.load_checkpoint(tmp_path)
    assert recorder[1].boundaries == 3 and fresh.skipped_steps == 1  # its share of the checkpoint came back


def test_extension_hooks_run_in_the_pipeline_engine(recorder: list, tmp_path: Path) -> None:
    from dscompile.engines.pipeline_parallel import PipelineEngine

    cfg = {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "pipeline": {"stages": 1, "micro_batches": 2, "compile": False}}
    engine = PipelineEngine(_Net(), cfg)
    ext = recorder[0]
    batches = [_batch(i) for i in range(6)]
    data = iter(batches)
    for _ in range(3):
        engine.train_batch(data)
    # forward and backward interleave inside the schedule: before/after_forward wrap it, the loss seed is scaled once
    batch_calls = ["before_forward", "scale_loss", "after_forward", "after_backward"]
    clean = ["on_gradients_ready", "check_overflow", "before_optimizer_step", "after_optimizer_step(False)"]
    skipped = ["on_gradients_ready", "check_overflow", "after_optimizer_step(True)"]
    assert ext.calls == ["configure", *batch_calls, *clean, *batch_calls, *skipped, *batch_calls, *clean]
    assert engine.skipped_steps == 1
    reference = _plain_training(batches, 2, skip={1})
    for name, q in reference.named_parameters():
        torch.testing.assert_close(engine.stage_parameters()[name], q.detach(), rtol=1e-6, atol=1e-7)
    engine.save_checkpoint(tmp_path)
    fresh = PipelineEngine(_Net(), cfg, example_batch=batches[0])
    fresh.load_checkpoint(tmp_path)
    assert recorder[1].boundaries == 3 and fresh.skipped_steps == 1 and fresh.global_steps == 3


# ---------------------------------------------------------------------------------------------
# wall_clock_breakdown and memory_breakdown
# ---------------------------------------------------------------------------------------------
FORWARD_S, BACKWARD_S, STEP_S = 0.02, 0.3, 0.25


class _Slow(_Net):
    """Sleeps a known time in forward, in backward (a gradient hook) and in the optimizer step."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1.weight.register_hook(self._slow_backward)

    @staticmethod
    def _slow_backward(grad: torch.Tensor) -> torch.Tensor:
        time.sleep(BACKWARD_S)
        return grad

    @torch.compiler.disable
    def _slow_forward(self) -> None:
        time.sleep(FORWARD_S)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self._slow_forward()
        return super().forward(x, y)


class _SlowSGD(torch.optim.SGD):
    def step(self, closure: Any = None) -> Any:
        time.sleep(STEP_S)
        return super().step(closure)


def test_wall_clock_breakdown_times_each_phase(caplog: pytest.LogCaptureFixture) -> None:
    model = _Slow()
    cfg = {"gradient_accumulation_steps": 2, "wall_clock_breakdown": True, "steps_per_print": 2, "lower": "eager"}
    engine, *_ = dscompile.initialize(model=model, optimizer=_SlowSGD(model.parameters(), lr=0.1), config=cfg)
    assert engine.wall_clock_breakdown() is True
    caplog.set_level(logging.INFO, logger="dscompile.engines.training")
    for i in range(8):
        engine.backward(engine(*_batch(i)))
        engine.step()
        if i == 3:  # the first optimizer step also compiled the model
            first = engine.step_timings()
    last = engine.step_timings()
    # seconds of overhead allowed per phase (a loaded 2-core machine); still under the smallest sleep another phase
    # adds (a step: 0.25 s), so time counted in the wrong phase fails
    margin = 0.2
    for timings in (first, last):
        # two micro-batches per optimizer step: forward and backward sum over them, the step counts once
        assert 2 * FORWARD_S * 1e3 <= timings["forward"] < (2 * FORWARD_S + margin) * 1e3, timings
        assert 2 * BACKWARD_S * 1e3 <= timings["backward"] < (2 * BACKWARD_S + margin) * 1e3, timings
        assert STEP_S * 1e3 <= timings["step"] < (STEP_S + margin) * 1e3, timings
    lines = [r.getMessage() for r in caplog.records if "time (ms" in r.getMessage()]
    assert len(lines) == 2 and lines[0].startswith("step 2 ") and lines[1].startswith("step 4 ")  # every steps_per_print
    assert "forward:" in lines[0] and "backward:" in lines[0] and "step:" in lines[0]
    assert engine.last_logged["times_ms"]["step"] >= STEP_S * 1e3
    quiet, *_ = dscompile.initialize(model=_Net(), config={"lower": "eager"})
    assert quiet.wall_clock_breakdown() is False
    with pytest.raises(DSCompileConfigError, match="wall_clock_breakdown"):
        quiet.step_timings()


class _Blob(_Net):
    """Keeps a 64 MiB tensor alive from the forward of the step where ``grow`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.grow = False
        self.blob: torch.Tensor | None = None

    @torch.compiler.disable
    def _maybe_grow(self) -> None:
        if self.grow and self.blob is None:
            self.blob = torch.ones(16 << 20)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self._maybe_grow()
        return super().forward(x, y)


def _expected_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, grads: bool) -> int:
    params = sum(p.numel() * 4 for p in model.parameters())
    states = sum(v.numel() * 4 for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    return params * (2 if grads else 1) + states


def test_memory_breakdown_reports_each_phase(caplog: pytest.LogCaptureFixture) -> None:
    model = _Blob()
    cfg = {"memory_breakdown": True, "steps_per_print": 2, "lower": "eager", "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    engine, optimizer, *_ = dscompile.initialize(model=model, config=cfg)
    caplog.set_level(logging.INFO, logger="dscompile.engines.training")
    snapshots = []
    for i in range(2):
        model.grow = i == 1
        engine.backward(engine(*_batch(i)))
        engine.step()
        snapshots.append(engine.step_memory())
    for snap in snapshots:
        assert list(snap) == ["forward", "backward", "step"]
        for phase in snap.values():
            assert phase["rss_bytes"] > 0 and phase["peak_rss_bytes"] >= phase["rss_bytes"] * 0.9
    second = snapshots[1]
    # model states: after backward the gradients exist, after the step they are cleared (Adam's states stay)
    assert second["backward"]["model_state_bytes"] == _expected_state_bytes(model, optimizer, grads=True)
    assert second["step"]["model_state_bytes"] == _expected_state_bytes(model, optimizer, grads=False)
    assert snapshots[0]["forward"]["model_state_bytes"] == _expected_state_bytes(model, optimizer, grads=False) - sum(
        v.numel() * 4 for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0
    )  # before the first step Adam has no state yet
    grown = second["forward"]["rss_bytes"] - snapshots[0]["step"]["rss_bytes"]
    assert grown >= 48 << 20, grown  # the 64 MiB kept alive in the second forward shows in the resident set
    assert any("memory (GiB)" in r.getMessage() and "after forward" in r.getMessage() for r in caplog.records)
    with pytest.raises(DSCompileConfigError, match="memory_breakdown"):
        dscompile.initialize(model=_Net(), config={"lower": "eager"})[0].step_memory()


def test_pipeline_engine_reports_timers_and_memory(tmp_path: Path) -> None:
    from dscompile.engines.pipeline_parallel import PipelineEngine

    cfg = {
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "pipeline": {"stages": 1, "micro_batches": 2, "compile": False},
        "wall_clock_breakdown": True,
        "memory_breakdown": True,
    }
    model = _Net()  # the pipeline captures forward whole (no sleeping there); backward and step sleep
    model.fc1.weight.register_hook(_Slow._slow_backward)
    engine = PipelineEngine(model, cfg, _SlowSGD(model.parameters(), lr=0.1))
    data = iter([_batch(i) for i in range(4)])
    for _ in range(2):
        engine.train_batch(data)
    timings = engine.step_timings()
    assert set(timings) == {"forward", "backward", "step", "p2p_wait"}
    assert 0 < timings["forward"] < 2 * BACKWARD_S * 1e3  # forward and backward told apart
    assert 2 * BACKWARD_S * 1e3 <= timings["backward"] and STEP_S * 1e3 <= timings["step"]
    memory = engine.step_memory()
    assert list(memory) == ["schedule", "step"]
    assert memory["step"]["model_state_bytes"] == sum(p.numel() * 4 for p in model.parameters())  # SGD: no state, grads cleared
    assert memory["schedule"]["model_state_bytes"] == 2 * sum(p.numel() * 4 for p in model.parameters())
    assert engine.save_16bit_model(str(tmp_path), "model.pt") is True  # one stage: the whole model in one file
    saved = torch.load(tmp_path / "model.pt")
    assert saved.keys() == model.state_dict().keys()
    for name, value in model.state_dict().items():
        assert torch.equal(saved[name], value), name


# ---------------------------------------------------------------------------------------------
# ZeRO in one process without init_process_group (world size 1), default lowering
# ---------------------------------------------------------------------------------------------
ZERO_MODEL = {"seq_len": 8, "d_model": 16, "n_heads": 2, "n_layers": 1, "vocab_size": 40, "bias": False}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_runs_in_one_process_without_a_process_group(stage: int) -> None:
    assert not dist.is_initialized()
    case = build("gpt", seed=3, **ZERO_MODEL)
    reference = copy.deepcopy(case.model)
    cfg = {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "gradient_clipping": 0.5,
    }
    engine, *_ = dscompile.initialize(model=case.model, config=cfg)  # default lowering: Inductor on CPU
    assert engine.zero.world == 1 and engine.zero.group_name == ""
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    for step in range(3):
        batch = make_batch(case, seed=step)
        loss = engine(*batch)
        engine.backward(loss)
        engine.step()
        ref = reference(*batch)
        ref.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    full = engine.full_parameters()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
    assert not dist.is_initialized()


def test_stage3_model_persistence_threshold_caps_the_parameters_kept_whole() -> None:
    def persistent(model_threshold: int | None) -> list[str]:
        case = build("gpt", seed=3, **ZERO_MODEL)
        zero = {"stage": 3, "stage3_param_persistence_threshold": 64}
        if model_threshold is not None:
            zero["stage3_model_persistence_threshold"] = model_threshold
        engine, *_ = dscompile.initialize(model=case.model, config={"zero_optimization": zero, "lower": "eager"})
        return [layout.name for layout in engine.zero.layouts if layout.persistent]

    small = persistent(None)  # every parameter of at most 64 elements: the norms' weights here
    assert small and all(n.endswith("weight") and ("ln" in n) for n in small)
    sizes = {n: p.numel() for n, p in build("gpt", seed=3, **ZERO_MODEL).model.named_parameters()}
    capped = persistent(sizes[small[0]] + sizes[small[1]])  # room for the first two only, in parameter order
    assert capped == small[:2]
    assert persistent(0) == []


# ---------------------------------------------------------------------------------------------
# config keys the core reads
# ---------------------------------------------------------------------------------------------
def test_save_16bit_model_gathers_under_zero3_only_when_asked(tmp_path: Path) -> None:
    def engine_for(gather: bool | None) -> Any:
        case = build("gpt", seed=3, **ZERO_MODEL)
        zero: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 0}
        if gather is not None:
            zero["stage3_gather_16bit_weights_on_model_save"] = gather
        cfg = {"zero_optimization": zero, "bf16": {"enabled": True}, "lower": "eager", "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
        engine, *_ = dscompile.initialize(model=case.model, config=cfg)
        engine.backward(engine(*make_batch(case, seed=0)))
        engine.step()
        return engine

    assert engine_for(None).save_16bit_model(str(tmp_path / "off")) is False  # DeepSpeed's default: nothing written
    assert not (tmp_path / "off").exists()
    engine = engine_for(True)
    assert engine.save_16bit_model(str(tmp_path / "on"), "model.pt") is True
    saved = torch.load(tmp_path / "on" / "model.pt", weights_only=True)
    full = engine.full_parameters()
    assert saved.keys() == engine.module.state_dict().keys()  # the tied lm_head name included
    for name, value in full.items():
        assert saved[name].dtype == torch.bfloat16
        torch.testing.assert_close(saved[name], value.to(torch.bfloat16), rtol=0, atol=0, msg=name)
    torch.testing.assert_close(saved["lm_head.weight"], saved["wte.weight"], rtol=0, atol=0)
    plain, *_ = dscompile.initialize(model=_Net(), config={"lower": "eager"})
    assert plain.save_16bit_model(str(tmp_path / "plain")) is True  # no ZeRO-3: the full fp32 model
    assert torch.load(tmp_path / "plain" / "pytorch_model.bin", weights_only=True)["fc1.weight"].dtype == torch.float32


class _Unused(_Net):
    def __init__(self) -> None:
        super().__init__()
        self.spare = nn.Linear(8, 8)


@pytest.mark.parametrize("stage", [1, 2])
def test_ignore_unused_parameters_false_names_the_parameter(stage: int) -> None:
    def run(ignore: bool | None) -> Any:
        zero: dict[str, Any] = {"stage": stage}
        if ignore is not None:
            zero["ignore_unused_parameters"] = ignore
        cfg = {"zero_optimization": zero, "lower": "eager", "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
        engine, *_ = dscompile.initialize(model=_Unused(), config=cfg)
        engine.backward(engine(*_batch(0)))
        engine.step()
        return engine

    assert run(None).global_steps == 1  # DeepSpeed's default: unused parameters are fine
    with pytest.raises(DSCompileError, match=r"spare\.weight \(on 1 of 1 ranks\), spare\.bias .*ignore_unused_parameters"):
        run(False)


class _MyOptimizer(torch.optim.SGD):
    """Not in the tested list, though element-wise: needs zero_allow_untested_optimizer."""


def test_zero_refuses_untested_optimizers_unless_allowed() -> None:
    def run(allow: bool | None) -> Any:
        model = _Net()
        cfg: dict[str, Any] = {"zero_optimization": {"stage": 2}, "lower": "eager"}
        if allow is not None:
            cfg["zero_allow_untested_optimizer"] = allow
        return dscompile.initialize(model=model, optimizer=_MyOptimizer(model.parameters(), lr=0.1), config=cfg)[0]

    with pytest.raises(DSCompileConfigError, match="element") as info:
        run(None)
    assert info.value.key == "zero_allow_untested_optimizer"
    engine = run(True)
    assert type(engine.optimizer) is _MyOptimizer
    engine.backward(engine(*_batch(0)))
    engine.step()
    model = _Net()  # a tested optimizer needs nothing
    dscompile.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config={"zero_optimization": {"stage": 2}, "lower": "eager"})


def test_backend_mode_applies_inductor_options_or_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._inductor.compile_fx as compile_fx

    seen: list[bool] = []
    original = compile_fx.compile_fx_inner

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(bool(torch._inductor.config.max_autotune))
        return original(*args, **kwargs)

    monkeypatch.setattr(compile_fx, "compile_fx_inner", spy)
    model = _Net()
    batch = _batch(0)
    out = torch.compile(model, backend="dscompile", mode="max-autotune-no-cudagraphs")(*batch)
    torch.testing.assert_close(out, model(*batch), rtol=1e-5, atol=1e-6)
    assert seen and all(seen)  # Inductor compiled every graph with the mode's options
    assert not torch._inductor.config.max_autotune  # ... and only inside dscompile's compile
    torch._dynamo.reset()
    monkeypatch.setenv("DSCOMPILE_LOWER", "eager")
    with pytest.raises(Exception, match="mode") as info:
        torch.compile(_Net(), backend="dscompile", mode="reduce-overhead")(*batch)
    assert "lower" in str(info.value)
    torch._dynamo.reset()
    torch.compile(_Net(), backend="dscompile", mode="default")(*batch)  # the default mode is fine everywhere


# ---------------------------------------------------------------------------------------------
# clear errors instead of tracebacks
# ---------------------------------------------------------------------------------------------
def test_a_model_without_parameters_gets_a_clear_error() -> None:
    with pytest.raises(DSCompileConfigError, match="no trainable parameters") as info:
        dscompile.initialize(model=nn.ReLU(), config={"optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert info.value.key == "model"
    with pytest.raises(DSCompileConfigError, match="no trainable parameters"):
        dscompile.initialize(model=nn.ReLU(), config={"zero_optimization": {"stage": 3}})
    with pytest.raises(DSCompileConfigError, match="model_parameters is empty"):
        dscompile.initialize(model=_Net(), model_parameters=[], config={"optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    from dscompile.engines.pipeline_parallel import PipelineEngine

    with pytest.raises(DSCompileConfigError, match="no trainable parameters"):
        PipelineEngine(nn.ReLU(), {"pipeline": {"stages": 1}})
    engine, *_ = dscompile.initialize(model=nn.ReLU(), config={"lower": "eager"})  # inference needs no parameters
    torch.testing.assert_close(engine(torch.tensor([-1.0, 2.0])), torch.tensor([0.0, 2.0]))


def test_pipeline_load_without_latest_warns_and_returns_none(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from dscompile.engines.pipeline_parallel import PipelineEngine

    engine = PipelineEngine(_Net(), {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "pipeline": {"stages": 1, "compile": False}}, example_batch=_batch(0))
    with caplog.at_level(logging.WARNING):
        assert engine.load_checkpoint(tmp_path) == (None, None)
    assert any("no 'latest' file" in r.getMessage() for r in caplog.records)
