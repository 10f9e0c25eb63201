"""DeepSpeed 0.19's config schema: a config with every key at DeepSpeed's default loads; every key
whose capability is not built is refused by name when switched on; typos get a close match."""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dscompile
from dscompile.config import load_config
from dscompile.errors import DSCompileConfigError, DSCompileNotSupportedError

DEFAULTS = Path(__file__).parent / "data" / "deepspeed_0_19_defaults.json"
HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def _defaults() -> dict[str, Any]:
    return json.loads(DEFAULTS.read_text())


def test_every_key_at_deepspeeds_default_loads_and_trains():
    """The full default config is accepted, and an engine built from it trains like plain PyTorch
    (DeepSpeed's defaults: clipping at 1.0, bf16 off, ZeRO off, AdamW without weight decay)."""
    cfg = _defaults()
    cfg["lower"] = "eager"
    config = load_config(cfg)
    assert config.sections["zero_optimization"].override_module_apply is True
    assert "pipeline_parallel" not in config.sections  # "stages": "auto" without a PipelineModule asks for no pipeline
    torch.manual_seed(0)
    model, ref = nn.Linear(6, 3), nn.Linear(6, 3)
    ref.load_state_dict(model.state_dict())
    engine, _, _, _ = dscompile.initialize(model=model, config=cfg)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.0)  # its lr follows the engine's WarmupLR below
    for step in range(2):
        x = torch.randn(2, 6) * 10
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        ref_loss = ref(x).pow(2).mean()
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6, msg=f"step {step}")
        lr = engine.get_lr()[0]
        for group in opt.param_groups:
            group["lr"] = lr
        engine.step()
        opt.step()
        opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="deepspeed is not installed")
def test_deepspeed_itself_accepts_the_defaults_file():
    """The file is a real DeepSpeed config, not one that only dscompile reads."""
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    from deepspeed.runtime.config import DeepSpeedConfig

    parsed = DeepSpeedConfig(_defaults())
    assert parsed.gradient_clipping == 1.0 and parsed.zero_optimization_stage == 0


def _fields(model: Any) -> dict[str, Any]:
    """A DeepSpeed pydantic config model's keys (aliases as written in JSON) and their defaults."""
    out = {}
    for name, f in model.model_fields.items():
        extra = f.json_schema_extra or {}
        if f.is_required() or extra.get("deprecated"):
            continue
        default = f.get_default()
        out[f.alias or name] = default.value if hasattr(default, "value") else default
    return out


@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="deepspeed is not installed")
def test_every_deepspeed_field_is_known():
    """Read DeepSpeed's own config classes: every field (at its default) loads in dscompile."""
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    from deepspeed.compile.config import CompileConfig
    from deepspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig, DeepSpeedZeroOffloadParamConfig

    sections = {
        "fp16": _fields(DeepSpeedFP16Config),
        "bf16": _fields(DeepSpeedBF16Config),
        "compile": _fields(CompileConfig),
        "tensorboard": _fields(TensorBoardConfig),
        "wandb": _fields(WandbConfig),
        "csv_monitor": _fields(CSVConfig),
        "comet": _fields(CometConfig),
    }
    zero = {k: v for k, v in _fields(DeepSpeedZeroConfig).items() if k not in ("leaf_module",)}
    zero["offload_param"] = _fields(DeepSpeedZeroOffloadParamConfig)
    zero["offload_optimizer"] = _fields(DeepSpeedZeroOffloadOptimizerConfig)
    sections["zero_optimization"] = zero
    for key, section in sections.items():
        for field_name, default in section.items():
            load_config({key: {field_name: default}})  # raises on an unknown key or a refused default
    for field_name, default in _fields(DeepSpeedZeroConfig).items():  # the field names DeepSpeed also accepts
        if field_name.startswith("stage3_"):
            load_config({"zero_optimization": {field_name[len("stage3_") :]: default}})


@pytest.mark.parametrize(
    "config,key",
    [
        ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}, "bf16.bf16_master_weights_and_grads"),
        ({"fp16": {"enabled": True, "auto_cast": True}}, "fp16.auto_cast"),
        ({"fp16": {"fp16_master_weights_and_grads": True}}, "fp16.fp16_master_weights_and_grads"),
        ({"data_types": {"grad_accum_dtype": "bf16"}}, "data_types.grad_accum_dtype"),
        ({"data_types": {"param_dtype": "bf16"}}, "data_types.param_dtype"),
        ({"data_types": {"keep_in_fp32_modules": ["norm"]}}, "data_types.keep_in_fp32_modules"),
        ({"zero_optimization": {"stage": 3, "cpu_offload_param": True}}, "zero_optimization.cpu_offload_param"),
        ({"zero_optimization": {"stage": 3, "zenflow": {"topk_ratio": 0.1}}}, "zero_optimization.zenflow"),
        ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}, "zero_optimization.zero_hpz_partition_size"),
        ({"zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True}}, "zero_optimization.zero_quantized_nontrainable_weights"),
        ({"zero_optimization": {"stage": 3, "pipeline_loading_checkpoint": True}}, "zero_optimization.pipeline_loading_checkpoint"),
        ({"checkpoint": {"load_universal": True}}, "checkpoint.load_universal"),
        ({"checkpoint": {"use_node_local_storage": True}}, "checkpoint.use_node_local_storage"),
        ({"checkpoint": {"parallel_write": {"pipeline_stage": True}}}, "checkpoint.parallel_write.pipeline_stage"),
        ({"flops_profiler": {"enabled": True, "profile_step": 3}}, "flops_profiler.enabled"),
        ({"autotuning": {"enabled": True}}, "autotuning.enabled"),
        ({"comms_logger": {"enabled": True}}, "comms_logger.enabled"),
        ({"tensorboard": {"enabled": True, "output_path": "x"}}, "tensorboard.enabled"),
        ({"wandb": {"enabled": True}}, "wandb.enabled"),
        ({"csv_monitor": {"enabled": True}}, "csv_monitor.enabled"),
        ({"comet": {"enabled": True}}, "comet.enabled"),
        ({"hybrid_engine": {"enabled": True}}, "hybrid_engine.enabled"),
        ({"data_efficiency": {"data_sampling": {"curriculum_learning": {"enabled": True}}}}, "data_efficiency.enabled"),
        ({"datastates": {"enabled": True}}, "datastates.enabled"),
        ({"expert_parallel": {"enabled": True}}, "expert_parallel.enabled"),
        ({"compile": {"offload_activation": True}}, "compile.offload_activation"),
        ({"compile": {"offload_opt_states": True}}, "compile.offload_opt_states"),
        ({"gradient_allreduce_op": "sum"}, "gradient_allreduce_op"),
        ({"managed_gradient_accumulation": False}, "managed_gradient_accumulation"),
        ({"disable_python_gc": True}, "disable_python_gc"),
        ({"disable_allgather": True}, "disable_allgather"),
        ({"sequence_parallel_size": 2, "seq_parallel_communication_data_type": "bf16"}, "seq_parallel_communication_data_type"),
        ({"dump_state": True}, "dump_state"),
        ({"activation_checkpointing": {"contiguous_memory_optimization": True}}, "activation_checkpointing.contiguous_memory_optimization"),
    ],
)
def test_each_refusal_names_the_key(config, key):
    with pytest.raises(DSCompileNotSupportedError) as info:
        load_config(config)
    assert info.value.key == key
    assert "not supported yet" in str(info.value)


@pytest.mark.parametrize(
    "config,key,hint",
    [
        ({"flops_profiler": {"profile_stepp": 1}}, "flops_profiler.profile_stepp", "profile_step"),
        ({"zero_optimization": {"offload_param": {"devise": "none"}}}, "zero_optimization.offload_param.devise", "device"),
        ({"bf16": {"check_overflow": True}}, "bf16.check_overflow", "check_grad_overflow"),
        ({"checkpoint": {"tag_validation": "sometimes"}}, "checkpoint.tag_validation", "Warn"),
        ({"timers": {"throughput": {"enable": True}}}, "timers.throughput.enable", "enabled"),
        ({"log_level": "loud"}, "log_level", "info"),
        ({"bf16": {"bf16_optimizer_states": True}}, "bf16.bf16_optimizer_states", "bf16_master_weights_and_grads"),
        ({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}}, "bfloat16", "bf16"),
        ({"zero_optimization": {"prefetch_bucket_size": 1, "stage3_prefetch_bucket_size": 2}}, "zero_optimization.prefetch_bucket_size", "keep one"),
    ],
)
def test_bad_keys_and_values_are_errors_naming_the_key(config, key, hint):
    with pytest.raises(DSCompileConfigError) as info:
        load_config(config)
    assert info.value.key == key and hint in str(info.value)


def test_deepspeed_spellings_and_aliases():
    assert load_config({"bfloat16": {"enabled": True}}).sections["bf16"].enabled
    zc = load_config({"zero_optimization": {"stage": 3, "param_persistence_threshold": 7, "max_live_parameters": 9}}).sections["zero_optimization"]
    assert (zc.stage3_param_persistence_threshold, zc.stage3_max_live_parameters) == (7, 9)
    for deprecated in ({"cpu_offload": None}, {"cpu_offload_use_pin_memory": True}, {"stage3_gather_fp16_weights_on_model_save": False}):
        load_config({"zero_optimization": {"stage": 2, **deprecated}})
    pipe = load_config({"pipeline": {"stages": 2, "partition": "best", "seed_layers": False, "pipe_partitioned": True, "use_reentrant": False}})
    assert pipe.sections["pipeline_parallel"].stages == 2
    assert load_config({"optimizer": {"type": "AdamW", "params": {}, "legacy_fusion": False}}).optimizer.legacy_fusion is False


def test_log_level_sets_dscompiles_logger():
    logger = logging.getLogger("dscompile")
    before = logger.level
    try:
        load_config({"log_level": "error"})
        assert logger.level == logging.ERROR
    finally:
        logger.setLevel(before)


@pytest.mark.parametrize("check", [True, False])
def test_bf16_check_grad_overflow_skips_the_step(check):
    """DeepSpeed's bf16 default: a step whose gradients hold inf/NaN is skipped, the weights kept."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "bf16": {"enabled": True, "check_grad_overflow": check},
        "lower": "eager",
    }
    engine, _, _, _ = dscompile.initialize(model=model, config=cfg)
    loss = engine(torch.full((2, 4), 3e38)).float().pow(2).sum()  # overflows: inf loss, non-finite gradients
    engine.backward(loss)
    engine.step()
    unchanged = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert unchanged == check
    assert engine.skipped_steps == (1 if check else 0)
