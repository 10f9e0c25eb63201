"""DeepSpeed's import paths, engine surface and precision keys as DeepSpeed's example programs use them.

What refuses is checked to refuse by name; what maps to dscompile is checked against plain PyTorch (and
DeepSpeed's own class where it runs in-process without building a kernel).
"""

from __future__ import annotations

import importlib.util
import logging
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import dscompile
from dscompile.errors import DSCompileConfigError, DSCompileImportError, DSCompileNotSupportedError

HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


# -- import paths ------------------------------------------------------------------------------------
def _steps(optimizer_cls: type, steps: int = 3, **kwargs: object) -> torch.Tensor:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = optimizer_cls(model.parameters(), **kwargs)
    for i in range(steps):
        model(torch.randn(5, 4) + i).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_fused_and_cpu_adam_are_torch_adam_with_deepspeeds_signatures() -> None:
    from dscompile.ops.adam import DeepSpeedCPUAdam, FusedAdam

    hyper = {"lr": 0.05, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1}
    adamw, adam = _steps(torch.optim.AdamW, **hyper), _steps(torch.optim.Adam, **hyper)
    assert torch.equal(_steps(FusedAdam, **hyper), adamw)  # adam_w_mode=True: decoupled decay
    assert torch.equal(_steps(FusedAdam, adam_w_mode=False, **hyper), adam)  # L2 decay in the gradient
    assert torch.equal(_steps(DeepSpeedCPUAdam, **hyper), adamw)
    assert torch.equal(_steps(DeepSpeedCPUAdam, adamw_mode=False, **hyper), adam)
    with pytest.raises(DSCompileNotSupportedError, match="bias_correction"):
        FusedAdam(nn.Linear(2, 2).parameters(), bias_correction=False)
    with pytest.raises(DSCompileConfigError, match="amsgrad"):
        DeepSpeedCPUAdam(nn.Linear(2, 2).parameters(), amsgrad=True)


def test_fused_adam_steps_zero_shards() -> None:
    """ZeRO steps flat shards: FusedAdam is elementwise like torch's Adam, so it is accepted there."""
    from dscompile.ops.adam import FusedAdam

    model = nn.Linear(4, 2)
    engine, optimizer, _, _ = dscompile.initialize(
        model=model, optimizer=FusedAdam(model.parameters(), lr=0.01), config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}
    )
    assert isinstance(optimizer, FusedAdam)


@pytest.mark.parametrize(
    "statement,path",
    [
        ("from dscompile.ops.lamb import FusedLamb", "deepspeed.ops.lamb.FusedLamb"),
        ("from dscompile.ops.transformer import DeepSpeedTransformerLayer", "deepspeed.ops.transformer"),
        ("from dscompile import DeepSpeedTransformerLayer, DeepSpeedTransformerConfig", "deepspeed.DeepSpeedTransformerLayer"),
        ("from dscompile import DeepSpeedConfig", "deepspeed.DeepSpeedConfig"),
        ("from dscompile.ops.sparse_attention import SparseSelfAttention", "deepspeed.ops.sparse_attention.SparseSelfAttention"),
        ("from dscompile.runtime.data_pipeline.data_routing.helper import convert_to_random_ltd", "deepspeed.runtime.data_pipeline"),
        ("from dscompile.runtime.domino.transformer import DominoTransformer", "deepspeed.runtime.domino"),
        ("from dscompile.compile.passes import zero3_compile", "deepspeed.compile"),
        ("from dscompile.profiling.flops_profiler import get_model_profile", "deepspeed.profiling"),
    ],
)
def test_refused_paths_say_which_and_why(statement: str, path: str) -> None:
    with pytest.raises(ImportError) as info:
        exec(statement, {})
    assert isinstance(info.value, DSCompileImportError)
    assert f"DeepSpeed's '{path}' is not provided by dscompile: " in str(info.value)


def test_a_scripts_import_fallback_still_runs_and_unknown_names_stay_attribute_errors() -> None:
    try:
        from dscompile.ops.lamb import FusedLamb as Optimizer  # noqa: F401
    except ImportError:
        Optimizer = torch.optim.AdamW  # noqa: N806
    assert Optimizer is torch.optim.AdamW
    with pytest.raises(AttributeError):
        dscompile.not_a_deepspeed_name  # noqa: B018
    assert not hasattr(dscompile, "not_a_deepspeed_name")


def test_deepspeed_names_that_map() -> None:
    from dscompile.ops.sparse_attention import BigBirdSparsityConfig
    from dscompile.runtime.lr_schedules import WarmupLR
    from dscompile.runtime.utils import RepeatingLoader, see_memory_usage, set_random_seed
    from dscompile.utils import OnDevice

    assert dscompile.runtime.utils.set_random_seed is set_random_seed  # reached as an attribute, as the pipeline example does
    assert dscompile.OnDevice is OnDevice and dscompile.DeepSpeedEngine is dscompile.DSCompileEngine
    assert callable(see_memory_usage) and RepeatingLoader and WarmupLR and BigBirdSparsityConfig(num_heads=2).block == 16


def test_zero_to_fp32_functions_read_a_zero_checkpoint(tmp_path: Path) -> None:
    from dscompile.utils.zero_to_fp32 import (
        convert_zero_checkpoint_to_fp32_state_dict,
        get_fp32_state_dict_from_zero_checkpoint,
        load_state_dict_from_zero_checkpoint,
    )

    engine = _engine(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), zero_optimization={"stage": 2})
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()
    engine.save_checkpoint(tmp_path)
    trained = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    state = get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    assert all(torch.equal(state[n], v) for n, v in trained.items())
    fresh = load_state_dict_from_zero_checkpoint(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), tmp_path)
    assert all(torch.equal(p, trained[n]) for n, p in fresh.named_parameters())
    convert_zero_checkpoint_to_fp32_state_dict(tmp_path, tmp_path / "out")
    assert torch.load(tmp_path / "out" / "pytorch_model.bin").keys() == state.keys()
    assert dscompile.set_autotp_mode is dscompile.module_inject.layers.set_autotp_mode


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_on_device_builds_on_the_device_in_the_dtype(device: str) -> None:
    before = torch.get_default_dtype()
    with dscompile.OnDevice(dtype=torch.bfloat16, device=device):
        layer = nn.Linear(4, 4)
    assert (layer.weight.device.type, layer.weight.dtype) == (device, torch.bfloat16)
    assert torch.get_default_dtype() == before and nn.Linear(2, 2).weight.device.type == "cpu"
    with dscompile.OnDevice(dtype=torch.bfloat16, device=device, enabled=False):
        assert nn.Linear(2, 2).weight.dtype == before
    if HAVE_DEEPSPEED:
        from deepspeed import OnDevice

        with OnDevice(dtype=torch.bfloat16, device=device):
            theirs = nn.Linear(4, 4)
        assert (theirs.weight.device.type, theirs.weight.dtype) == (device, torch.bfloat16)


def test_see_memory_usage_logs_only_when_forced(caplog: pytest.LogCaptureFixture) -> None:
    from dscompile.runtime.utils import see_memory_usage

    with caplog.at_level(logging.INFO, logger="dscompile.engines.training"):
        see_memory_usage("quiet")
        see_memory_usage("loud", force=True)
    messages = [r.getMessage() for r in caplog.records]
    assert not any("quiet" in m for m in messages)
    assert any(m.startswith("loud | ") and "rss" in m and "GB" in m for m in messages), messages


# -- engine surface ----------------------------------------------------------------------------------
class Greeter(nn.Module):
    """A model with its own methods and attributes, some of which the engine also has."""

    config = "the model's config"

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.greeting = "hello"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)

    def greet(self, name: str) -> str:
        return f"{self.greeting} {name}"

    def train_batch_size(self) -> int:
        return -1


def _engine(model: nn.Module, **config: object) -> dscompile.DSCompileEngine:
    base = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
    engine, *_ = dscompile.initialize(model=model, config={**base, **config})
    return engine


def test_unknown_engine_attributes_are_the_models_as_in_deepspeed() -> None:
    """DeepSpeed's ``DeepSpeedEngine.__getattr__``: the engine's own attributes (and nn.Module's) win, then the
    wrapped model's; ``engine.config`` is the engine's config, as DeepSpeed's is its ds_config."""
    model = Greeter()
    engine = _engine(model)
    assert engine.greet("you") == "hello you" and engine.greeting == "hello"
    assert engine.train_batch_size() == 2  # the engine's method, not the model's
    assert isinstance(engine.config, dscompile.DSConfig)
    assert engine.fc is model.fc
    with pytest.raises(AttributeError, match="'DSCompileEngine' object has no attribute 'nothing'"):
        engine.nothing  # noqa: B018


def test_hugging_face_methods_reach_the_model_through_the_engine() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    engine = _engine(model)
    engine.gradient_checkpointing_enable()
    assert model.is_gradient_checkpointing and engine.num_parameters() == model.num_parameters()
    assert engine.generation_config is model.generation_config


def test_throughput_timer_counts_as_deepspeeds() -> None:
    """``tput_timer``: every optimizer step counted, the first two untimed (DeepSpeed's start_step)."""
    engine = _engine(nn.Linear(4, 2), gradient_accumulation_steps=2)
    timer = engine.tput_timer
    assert timer.batch_size == engine.train_batch_size() == 4
    for micro in range(8):
        engine.backward(engine(torch.randn(2, 4)).sum())
        engine.step()
        if micro == 3:
            assert timer.global_step_count == 2 and timer.avg_samples_per_sec() == -math.inf
    assert timer.global_step_count == 4 and timer.micro_step_count == 8
    assert 0 < timer.avg_samples_per_sec() < math.inf
    off = _engine(nn.Linear(4, 2), timers={"throughput": {"enabled": False}})
    off.backward(off(torch.randn(2, 4)).sum())
    off.step()
    assert off.tput_timer.global_step_count == 0


def test_inference_engine_config_is_the_models() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    engine = dscompile.init_inference(model, dtype=torch.float32, max_tokens=16)
    assert engine.config is model.config and engine._config.max_out_tokens == 16


# -- precision keys ----------------------------------------------------------------------------------
def test_bf16_state_dict_is_16_bit_and_checkpoints_keep_the_masters(tmp_path: Path) -> None:
    """Under bf16 DeepSpeed's module is the 16-bit copy: ``engine.module.state_dict()`` and the checkpoint's
    ``module`` are bf16; dscompile keeps its fp32 masters and resumes from them exactly."""
    torch.manual_seed(0)
    engine = _engine(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2)), bf16={"enabled": True})
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 4).bfloat16()).float().sum())
        engine.step()
    assert {v.dtype for v in engine.module.state_dict().values()} == {torch.bfloat16}
    assert {p.dtype for p in engine.module.parameters()} == {torch.float32}
    masters = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.save_checkpoint(tmp_path, tag="t")
    saved = torch.load(tmp_path / "t" / "mp_rank_00_model_states.pt", weights_only=False)
    assert {v.dtype for v in saved["module"].values()} == {torch.bfloat16}
    torch.manual_seed(1)
    fresh = _engine(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2)), bf16={"enabled": True})
    fresh.load_checkpoint(tmp_path, tag="t")
    assert all(torch.equal(p, masters[n]) for n, p in fresh.module.named_parameters())
    fresh.destroy()
    assert {v.dtype for v in fresh.module.state_dict().values()} == {torch.float32}  # the hook leaves with the engine


def test_bf16_master_weights_and_grads_are_bf16_under_zero() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    bf16 = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    engine = _engine(model, bf16=bf16, zero_optimization={"stage": 1})
    engine.backward(engine(torch.randn(2, 4).bfloat16()).float().sum())
    engine.step()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    moments = [s["exp_avg"] for s in engine.optimizer.state.values()]
    assert moments and {m.dtype for m in moments} == {torch.bfloat16}


@pytest.mark.parametrize(
    "config,error,key",
    [
        ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}, DSCompileNotSupportedError, "bf16.bf16_master_weights_and_grads"),
        ({"bf16": {"enabled": True, "bf16_optimizer_states": True}}, DSCompileConfigError, "bf16.bf16_optimizer_states"),
        (
            {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}},
            DSCompileConfigError,
            "bf16.bf16_master_weights_and_grads",
        ),  # ZeRO off: DeepSpeed asserts stage 1-3 too
        ({"torch_autocast": {"enabled": True}}, DSCompileNotSupportedError, "torch_autocast.enabled"),
        ({"bf16": {"enabled": True}, "torch_autocast": {"enabled": True, "dtype": "torch.float16"}}, DSCompileConfigError, "torch_autocast.dtype"),
    ],
)
def test_precision_keys_refused_as_deepspeed_does_or_not_built(config: dict, error: type, key: str) -> None:
    with pytest.raises(error) as info:
        _engine(nn.Linear(4, 2), **config)
    assert info.value.key == key


def test_torch_autocast_beside_bf16_is_the_amp_policy() -> None:
    torch.manual_seed(0)
    plain = _engine(nn.Linear(4, 2), bf16={"enabled": True})
    torch.manual_seed(0)
    autocast = _engine(nn.Linear(4, 2), bf16={"enabled": True}, torch_autocast={"enabled": True, "dtype": "torch.bfloat16"})
    x = torch.randn(2, 4).bfloat16()
    assert torch.equal(plain(x), autocast(x))
