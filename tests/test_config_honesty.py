"""Nothing silently ignored, checked by effect: every key of DeepSpeed's config schema has a recorded classification.

DeepSpeed's schema is ``tests/data/deepspeed_0_19_defaults.json`` (every key DeepSpeed 0.19 reads, at its
default; ``test_deepspeed_config.py`` checks that DeepSpeed itself accepts it). Each leaf key is exactly one of:

- ``EFFECT``: it changes behaviour; the value names the test module that shows the difference (checked: the
  module exists and exercises the key). The keys this file implemented are shown here (``compute_grad_norm``,
  ``tag_validation``, the throughput timer, ``vocabulary_size``, ``log_level``); ``prescale_gradients`` /
  ``gradient_predivide_factor`` in ``test_gradient_predivide.py``.
- ``REFUSED``: a value that needs an unbuilt capability; the value is that config, and loading it must raise an
  error that names the key.
- ``NO_EFFECT``: accepted and changes nothing here; giving the key must log one warning that names it, says
  "has no effect" and why.
- ``OFF_SECTIONS``: keys of a section whose switch (``enabled``) is refused; they are inert while it is off.

A key DeepSpeed adds to the schema file fails ``test_every_deepspeed_key_is_classified`` until it is classified.
"""

from __future__ import annotations

import copy
import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dscompile
from dscompile import config as config_module
from dscompile.config import load_config
from dscompile.errors import DSCompileError
from dscompile.runtime.checkpoint_io import check_tag_agreement
from dscompile.testing.distributed import requires_backend, run_distributed_or_fail

TESTS = Path(__file__).resolve().parent
SCHEMA = TESTS / "data" / "deepspeed_0_19_defaults.json"

OFF_SECTIONS = (
    "comms_logger", "tensorboard", "wandb", "csv_monitor", "comet", "flops_profiler", "autotuning", "hybrid_engine",
    "data_efficiency", "datastates", "expert_parallel",
)  # fmt: skip

_Z = "zero_optimization"
EFFECT: dict[str, str] = {
    "train_batch_size": "test_engine_api.py",
    "train_micro_batch_size_per_gpu": "test_engine_api.py",
    "gradient_accumulation_steps": "test_engine_core.py",
    "steps_per_print": "test_engine_core.py",
    "communication_data_type": "test_mixed_precision_zero.py",
    "prescale_gradients": "test_gradient_predivide.py",
    "gradient_predivide_factor": "test_gradient_predivide.py",
    "gradient_clipping": "test_engine_core.py",
    "zero_allow_untested_optimizer": "test_engine_core.py",
    "wall_clock_breakdown": "test_engine_core.py",
    "memory_breakdown": "test_engine_core.py",
    "dataloader_drop_last": "test_engine_api.py",
    "log_level": "test_config_honesty.py",
    "vocabulary_size": "test_config_honesty.py",
    "sequence_parallel_size": "test_distributed_attention.py",
    "optimizer.type": "test_mixed_precision.py",
    "optimizer.params.lr": "test_engine_api.py",
    "optimizer.params.weight_decay": "test_mixed_precision.py",
    "scheduler.type": "test_schedulers.py",
    "scheduler.params.warmup_min_lr": "test_schedulers.py",
    "scheduler.params.warmup_max_lr": "test_schedulers.py",
    "scheduler.params.warmup_num_steps": "test_schedulers.py",
    "fp16.enabled": "test_mixed_precision.py",
    "fp16.loss_scale": "test_engine_api.py",
    "fp16.initial_scale_power": "test_loss_scaler.py",
    "fp16.loss_scale_window": "test_loss_scaler.py",
    "fp16.hysteresis": "test_loss_scaler.py",
    "fp16.consecutive_hysteresis": "test_loss_scaler.py",
    "fp16.min_loss_scale": "test_loss_scaler.py",
    "bf16.enabled": "test_mixed_precision.py",
    "bf16.bf16_master_weights_and_grads": "test_deepspeed_surface.py",
    "bf16.bf16_optimizer_states": "test_deepspeed_surface.py",
    "torch_autocast.enabled": "test_mixed_precision.py",
    "torch_autocast.dtype": "test_mixed_precision.py",
    "data_types.param_dtype": "test_deepspeed_scripts_lm.py",
    f"{_Z}.stage": "test_zero.py",
    f"{_Z}.reduce_bucket_size": "test_zero_profile.py",
    f"{_Z}.allgather_partitions": "test_engine_core_distributed.py",
    f"{_Z}.allgather_bucket_size": "test_zero_profile.py",
    f"{_Z}.overlap_comm": "test_zero_overlap.py",
    f"{_Z}.compute_grad_norm": "test_config_honesty.py",
    f"{_Z}.offload_param.device": "test_zero_offload_param.py",
    f"{_Z}.offload_param.nvme_path": "test_zero_offload_param.py",
    f"{_Z}.offload_param.buffer_count": "test_zero_offload.py",
    f"{_Z}.offload_param.buffer_size": "test_zero_offload_param.py",
    f"{_Z}.offload_param.max_in_cpu": "test_zero_offload_param.py",
    f"{_Z}.offload_param.pin_memory": "test_zero_offload_param.py",
    f"{_Z}.offload_optimizer.device": "test_zero_offload.py",
    f"{_Z}.offload_optimizer.nvme_path": "test_zero_offload.py",
    f"{_Z}.offload_optimizer.buffer_count": "test_zero_offload.py",
    f"{_Z}.offload_optimizer.pin_memory": "test_zero_offload.py",
    f"{_Z}.offload_optimizer.pipeline_read": "test_zero_offload.py",
    f"{_Z}.offload_optimizer.fast_init": "test_zero_offload.py",
    f"{_Z}.offload_optimizer.ratio": "test_gpu_check.py",
    f"{_Z}.sub_group_size": "test_zero_offload.py",
    f"{_Z}.stage3_prefetch_bucket_size": "test_zero_profile.py",
    f"{_Z}.stage3_param_persistence_threshold": "test_engine_core.py",
    f"{_Z}.stage3_model_persistence_threshold": "test_engine_core.py",
    f"{_Z}.stage3_max_live_parameters": "test_zero_features.py",
    f"{_Z}.stage3_max_reuse_distance": "test_zero.py",
    f"{_Z}.stage3_gather_16bit_weights_on_model_save": "test_engine_core.py",
    f"{_Z}.ignore_unused_parameters": "test_engine_core.py",
    "activation_checkpointing.partition_activations": "test_checkpointing_distributed.py",
    "activation_checkpointing.cpu_checkpointing": "test_checkpointing.py",
    "activation_checkpointing.number_checkpoints": "test_checkpointing.py",
    "activation_checkpointing.synchronize_checkpoint_boundary": "test_checkpointing.py",
    "activation_checkpointing.profile": "test_zero_profile.py",
    "pipeline.stages": "test_engine_core.py",
    "pipeline.activation_checkpoint_interval": "test_pipeline_parallel_distributed.py",
    "checkpoint.tag_validation": "test_config_honesty.py",
    "aio.block_size": "test_zero_offload.py",
    "aio.use_gds": "test_zero_offload.py",  # refused when the NVMe-offloaded engine is built, not at load
    "timers.throughput.enabled": "test_config_honesty.py",
    "timers.throughput.synchronized": "test_config_honesty.py",
    "tensor_parallel.autotp_size": "test_tensor_parallel_pipeline_layouts.py",
    "tensor_parallel.tp.tp_size": "test_tensor_parallel_plan.py",
    "tensor_parallel.tp.tp_grain_size": "test_tensor_parallel_plan.py",
}

# Read by the code but with no test of their effect yet (a gap, listed so it stays visible): key -> the source that reads it.
READ_UNTESTED: dict[str, str] = {
    f"{_Z}.offload_optimizer.pipeline_write": "dscompile/runtime/offload/nvme.py",
    f"{_Z}.offload_optimizer.cpuadam_cores_perc": "dscompile/runtime/offload/host.py",
    f"{_Z}.override_module_apply": "dscompile/runtime/zero_init.py",
    "aio.intra_op_parallelism": "dscompile/runtime/offload/swap.py",
    "bf16.check_grad_overflow": "passes/mixed_precision/extension.py",
}

REFUSED: dict[str, dict[str, Any]] = {
    "managed_gradient_accumulation": {"managed_gradient_accumulation": False},  # DeepSpeed's default is true
    "dump_state": {"dump_state": True},
    "disable_python_gc": {"disable_python_gc": True},
    "disable_allgather": {"disable_allgather": True},
    "seq_parallel_communication_data_type": {"seq_parallel_communication_data_type": "fp16"},
    "gradient_allreduce_op": {"gradient_allreduce_op": "sum"},
    "fp16.auto_cast": {"fp16": {"enabled": True, "auto_cast": True}},
    "fp16.fp16_master_weights_and_grads": {"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
    "torch_autocast.lower_precision_safe_modules": {"torch_autocast": {"enabled": True, "lower_precision_safe_modules": ["x"]}},
    "data_types.grad_accum_dtype": {"data_types": {"grad_accum_dtype": "bf16"}},
    "data_types.buffer_dtype": {"data_types": {"buffer_dtype": "bf16"}},
    "data_types.keep_in_fp32_modules": {"data_types": {"keep_in_fp32_modules": ["norm"]}},
    f"{_Z}.load_from_fp32_weights": {_Z: {"stage": 1, "load_from_fp32_weights": False}},
    f"{_Z}.offload_optimizer.super_offload": {_Z: {"stage": 2, "offload_optimizer": {"device": "cpu", "super_offload": True}}},
    f"{_Z}.zenflow": {_Z: {"stage": 2, "zenflow": {"topk_ratio": 0.1}}},
    f"{_Z}.zero_hpz_partition_size": {_Z: {"stage": 3, "zero_hpz_partition_size": 2}},
    f"{_Z}.zero_quantized_weights": {_Z: {"stage": 3, "zero_quantized_weights": True}},
    f"{_Z}.zero_quantized_nontrainable_weights": {_Z: {"stage": 3, "zero_quantized_nontrainable_weights": True}},
    f"{_Z}.zero_quantized_gradients": {_Z: {"stage": 3, "zero_quantized_gradients": True}},
    f"{_Z}.pipeline_loading_checkpoint": {_Z: {"stage": 3, "pipeline_loading_checkpoint": True}},
    "checkpoint.load_universal": {"checkpoint": {"load_universal": True}},
    "checkpoint.use_node_local_storage": {"checkpoint": {"use_node_local_storage": True}},
    "checkpoint.parallel_write.pipeline_stage": {"checkpoint": {"parallel_write": {"pipeline_stage": True}}},
    "activation_checkpointing.contiguous_memory_optimization": {"activation_checkpointing": {"contiguous_memory_optimization": True}},
    "compile.autoep_non_moe": {"compile": {"autoep_non_moe": True}},
    "compile.offload_activation": {"compile": {"offload_activation": True}},
    "compile.offload_opt_states": {"compile": {"offload_opt_states": True}},
    "compile.offload_parameters": {"compile": {"offload_parameters": True}},
    "compile.passes": {"compile": {"passes": ["x"]}},
}

NO_EFFECT: set[str] = {
    "zero_force_ds_cpu_optimizer",
    "use_data_before_expert_parallelism",
    "optimizer.legacy_fusion",
    "bf16.immediate_grad_update",
    *(
        f"{_Z}.{k}"
        for k in (
            "contiguous_gradients", "reduce_scatter", "use_multi_rank_bucket_allreduce", "elastic_checkpoint",
            "stage3_module_granularity_threshold", "stage3_use_all_reduce_for_fetch_params", "stage3_allgather_sequential",
            "legacy_stage1", "round_robin_gradients", "parameter_alignment", "memory_efficient_linear",
            "log_trace_cache_warnings", "enable_sanity_checks", "save_muon_momentum_buffer_in_memory",
        )
    ),
    "pipeline.partition",
    "pipeline.seed_layers",
    "pipeline.pipe_partitioned",
    "pipeline.grad_partitioned",
    "aio.queue_depth",
    "aio.single_submit",
    "aio.overlap_events",
    "compile.deepcompile",
    *(
        f"compile.{k}"
        for k in (
            "free_activation", "free_activation_threshold", "offload_activation_pin_memory", "double_buffer", "symmetric_memory",
            "debug_log", "sync_before_reduce", "sync_after_reduce", "sync_before_allgather", "sync_after_allgather",
            "keep_int_input_tensors", "keep_all_input_tensors",
        )
    ),
}  # fmt: skip
NO_EFFECT_VALUES: dict[str, Any] = {f"{_Z}.reduce_scatter": False}  # the value that is logged (true is what dscompile does)


def schema() -> dict[str, Any]:
    return json.loads(SCHEMA.read_text())


def schema_keys() -> list[str]:
    """Every leaf of DeepSpeed's schema as a dotted path."""
    keys: list[str] = []

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else key, inner)
        else:
            keys.append(prefix)

    walk("", schema())
    return keys


def _nested(path: str, value: Any) -> dict[str, Any]:
    """``{"a": {"b": value}}`` for ``a.b``; ZeRO keys get a stage (1, or 3 where the key is ZeRO-3's), pipeline keys stages "auto"."""
    head, *rest = path.split(".")
    out: dict[str, Any] = {head: value} if not rest else {head: _nested(".".join(rest), value)}
    if head == _Z:
        out[head].setdefault("stage", 3 if "stage3" in path else 1)
    if head == "optimizer":
        out[head].setdefault("type", "SGD")
    if head == "pipeline":
        out[head].setdefault("stages", "auto")
    return out


def _default(path: str) -> Any:
    value: Any = schema()
    for part in path.split("."):
        value = value[part]
    return value


# -- the classification is complete and consistent ----------------------------------------------
def test_every_deepspeed_key_is_classified() -> None:
    keys = set(schema_keys())
    off = {k for k in keys if k.split(".")[0] in OFF_SECTIONS}
    groups = {"EFFECT": set(EFFECT), "READ_UNTESTED": set(READ_UNTESTED), "REFUSED": set(REFUSED), "NO_EFFECT": NO_EFFECT, "OFF": off}
    names = list(groups)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert not groups[a] & groups[b], f"classified twice ({a} and {b}): {sorted(groups[a] & groups[b])}"
    classified = set().union(*groups.values())
    assert not keys - classified, f"DeepSpeed keys with no classification: {sorted(keys - classified)}"
    assert not classified - keys, f"classified keys not in DeepSpeed's schema: {sorted(classified - keys)}"


@pytest.mark.parametrize("key", sorted(EFFECT))
def test_effect_keys_name_a_test_that_exercises_them(key: str) -> None:
    text = (TESTS / EFFECT[key]).read_text()
    leaf = key.split(".")[-1]
    assert leaf in text, f"{EFFECT[key]} does not exercise {key}"


@pytest.mark.parametrize("key", sorted(READ_UNTESTED))
def test_untested_keys_are_read_where_recorded(key: str) -> None:
    assert key.split(".")[-1] in (TESTS.parent / READ_UNTESTED[key]).read_text()


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_refused_keys_name_themselves(key: str) -> None:
    with pytest.raises(DSCompileError) as info:
        load_config(copy.deepcopy(REFUSED[key]))
    assert key in str(info.value), f"the error does not name {key}: {info.value}"


@pytest.mark.parametrize("section", OFF_SECTIONS)
def test_off_sections_are_refused_when_switched_on(section: str) -> None:
    with pytest.raises(DSCompileError, match=section):
        load_config({section: {"enabled": True}})
    load_config({section: {"enabled": False}})


@pytest.mark.parametrize("key", sorted(NO_EFFECT))
def test_no_effect_keys_log_why(key: str, caplog: pytest.LogCaptureFixture) -> None:
    config_module._NO_EFFECT_LOGGED.discard(key)
    value = NO_EFFECT_VALUES.get(key, _default(key))
    with caplog.at_level(logging.WARNING, logger="dscompile"):
        load_config(_nested(key, value))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"{key} has no effect")]
    assert len(lines) == 1, f"{key}: expected one 'has no effect' warning, got {[r.getMessage() for r in caplog.records]}"
    assert len(lines[0].split(": ", 1)[1]) > 30, f"{key}: the warning must say why: {lines[0]!r}"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dscompile"):
        load_config(_nested(key, value))
    assert not any(r.getMessage().startswith(key) for r in caplog.records), f"{key}: logged more than once per process"


# -- the keys implemented here: each test fails when the key does nothing ------------------------
def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _one_step(config: dict[str, Any], x: torch.Tensor) -> Any:
    engine, _, _, _ = dscompile.initialize(model=_net(), config={"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, **config})
    engine.backward(engine(x).pow(2).sum())
    engine.step()
    return engine


def test_compute_grad_norm_reports_the_true_global_norm() -> None:
    """ZeRO computes the global norm every step, clipping or not (DeepSpeed's default); false leaves None."""
    x = torch.randn(3, 4)
    ref = _net()
    ref(x).pow(2).sum().backward()
    expected = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), math.inf))
    engine = _one_step({_Z: {"stage": 2}}, x)  # default lowering (Inductor), no clipping
    assert engine.get_global_grad_norm() == pytest.approx(expected, rel=1e-5)
    engine = _one_step({_Z: {"stage": 1, "compute_grad_norm": False}, "lower": "eager"}, x)
    assert engine.get_global_grad_norm() is None
    with pytest.raises(DSCompileError, match="compute_grad_norm"):
        _one_step({_Z: {"stage": 1, "compute_grad_norm": False}, "gradient_clipping": 1.0, "lower": "eager"}, x)
    with pytest.raises(DSCompileError, match="compute_grad_norm"):
        load_config({_Z: {"stage": 3, "compute_grad_norm": False}})


@pytest.mark.parametrize("enabled", [True, False])
def test_throughput_timer_enabled(enabled: bool) -> None:
    """``timers.throughput``: on, the engine's tput_timer counts optimizer steps and samples per second; off, nothing."""
    timers = {"throughput": {"enabled": enabled, "synchronized": False}}
    engine, _, _, _ = dscompile.initialize(
        model=_net(), config={"optimizer": {"type": "SGD", "params": {"lr": 0.01}}, "train_batch_size": 3, "timers": timers, "lower": "eager"}
    )
    assert engine.tput_timer.synchronized is False
    for _ in range(4):
        engine.backward(engine(torch.randn(3, 4)).sum())
        engine.step()
    if enabled:
        assert engine.tput_timer.global_step_count == 4 and engine.tput_timer.avg_samples_per_sec() > 0
    else:
        assert engine.tput_timer.global_step_count == 0 and engine.tput_timer.avg_samples_per_sec() == float("-inf")


def test_vocabulary_size_warns_when_not_a_multiple_of_8(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="dscompile"):
        load_config({"vocabulary_size": 50304})
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="dscompile"):
        load_config({"vocabulary_size": 50257})
    assert any("vocabulary_size 50257 is not a multiple of 8" in r.getMessage() for r in caplog.records)


def test_log_level_sets_dscompiles_logger() -> None:
    logger = logging.getLogger("dscompile")
    before = logger.level
    try:
        load_config({"log_level": "error"})
        assert logger.level == logging.ERROR
        load_config({"log_level": "debug"})
        assert logger.level == logging.DEBUG
    finally:
        logger.setLevel(before)


def tag_rank(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Each rank saves under its own tag (DeepSpeed's example of what the check is for), under each mode."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("dscompile.checkpoint").addHandler(handler)
    out: dict[str, Any] = {}
    for mode in ("Ignore", "Warn"):
        records.clear()
        check_tag_agreement(f"step1-rank{rank}", mode)
        out[mode] = list(records)
    records.clear()
    check_tag_agreement("step1", "Fail")  # the same tag: quiet under every mode
    out["same"] = list(records)
    engine, _, _, _ = dscompile.initialize(
        model=_net(), config={"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "lower": "eager", "checkpoint": {"tag_validation": "Fail"}}
    )
    try:
        engine.save_checkpoint(tmp, tag=f"step0-rank{rank}")
        out["fail"] = None
    except DSCompileError as exc:
        out["fail"] = str(exc)
    return out


@requires_backend("gloo")
@pytest.mark.distributed
def test_tag_validation_checks_the_ranks_tags(tmp_path: Path) -> None:
    results = run_distributed_or_fail(tag_rank, 2, str(tmp_path), timeout=180)
    for rank, r in enumerate(results):
        assert r["Ignore"] == [] and r["same"] == []
        assert len(r["Warn"]) == 1 and f"step1-rank{rank}" in r["Warn"][0] and "tag_validation" in r["Warn"][0]
        assert r["fail"] is not None and "tag_validation" in r["fail"], "Fail: save_checkpoint raises before writing"
    assert not any(tmp_path.iterdir()), "nothing was written under Fail"
