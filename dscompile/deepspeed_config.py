"""DeepSpeed 0.19's config keys for capabilities dscompile does not build (or builds elsewhere).

A DeepSpeed ``ds_config.json`` written out in full (every section at its default) loads: each key
here is checked against DeepSpeed's schema (a misspelt key is an error with a close match) and
accepted while its capability is off; switching it on raises ``DSCompileNotSupportedError``
naming the key. Keys that only tune DeepSpeed's own implementation (its timers, buffer sizes,
the communication data type of sequence parallelism, which is not built) are accepted in any
valid value. Built capabilities register their own sections (``passes/zero.py``,
``passes/mixed_precision/``, ...); the registry (``dscompile.pipeline.BUILTIN_MODULES``) loads this module.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from dscompile.config import log_no_effect, log_no_effect_keys, register_section
from dscompile.errors import DSCompileConfigError, DSCompileNotSupportedError, suggest

Check = Callable[[str, Any], None]


def _expect_mapping(path: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise DSCompileConfigError(path, f"expected a JSON object, got {type(value).__name__}")
    return value


def _check_keys(path: str, value: Mapping[str, Any], known: tuple[str, ...]) -> None:
    for key in value:
        if key not in known:
            raise DSCompileConfigError(f"{path}.{key}", "unknown key", suggest(key, known) or f"valid keys here: {', '.join(known)}")


def _refuse_when(path: str, on: bool, capability: str) -> None:
    if on:
        raise DSCompileNotSupportedError(path, capability)


def _switched_section(key: str, capability: str, known: tuple[str, ...]) -> None:
    """A section whose ``enabled`` switches an unbuilt capability on (nested ``enabled`` too)."""

    def parse(value: Any, path: str) -> dict[str, Any]:
        section = _expect_mapping(path, value)
        _check_keys(path, section, ("enabled", *known))
        _refuse_when(f"{path}.enabled", _any_enabled(section), capability)
        return dict(section)

    register_section(key, parse, capability)


def _any_enabled(value: Any) -> bool:
    if isinstance(value, Mapping):
        return value.get("enabled") is True or any(_any_enabled(v) for v in value.values())
    return False


def _checked_section(key: str, capability: str, known: tuple[str, ...], check: Check | None) -> None:
    """A section without one switch: ``check(path, section)`` refuses the values that need ``capability``
    (None: every value is accepted, only the keys are checked)."""

    def parse(value: Any, path: str) -> dict[str, Any]:
        section = _expect_mapping(path, value)
        _check_keys(path, section, known)
        if check is not None:
            check(path, section)
        return dict(section)

    register_section(key, parse, capability)


def _scalar(key: str, capability: str, check: Check) -> None:
    """A top-level scalar key; ``check(path, value)`` validates it and refuses what is not built."""

    def parse(value: Any, path: str) -> Any:
        check(path, value)
        return value

    register_section(key, parse, capability)


# -- sections switched by "enabled" --------------------------------------------------------------
_switched_section(
    "flops_profiler",
    "the DeepSpeed flops profiler (the dump summary counts FLOPs per graph)",
    ("recompute_fwd_factor", "profile_step", "module_depth", "top_modules", "detailed", "output_file"),
)
_switched_section(
    "autotuning",
    "autotuning",
    (
        "fast", "results_dir", "exps_dir", "overwrite", "start_step", "end_step", "start_profile_step", "end_profile_step",
        "metric", "metric_path", "tuner_type", "tuner_early_stopping", "tuner_num_trials", "arg_mappings", "model_info",
        "model_info_path", "mp_size", "max_train_batch_size", "min_train_batch_size", "max_train_micro_batch_size_per_gpu",
        "min_train_micro_batch_size_per_gpu", "num_tuning_micro_batch_sizes",
    ),
)  # fmt: skip
_switched_section("comms_logger", "communication logging (use torch.profiler)", ("verbose", "prof_all", "debug", "prof_ops"))
_switched_section("tensorboard", "tensorboard monitoring", ("output_path", "job_name"))
_switched_section("csv_monitor", "csv monitoring", ("output_path", "job_name"))
_switched_section("wandb", "wandb monitoring", ("group", "team", "project"))
_switched_section(
    "comet", "comet monitoring", ("samples_log_interval", "project", "workspace", "api_key", "experiment_name", "experiment_key", "online", "mode")
)
_switched_section(
    "hybrid_engine",
    "the hybrid engine",
    ("max_out_tokens", "inference_tp_size", "release_inference_cache", "pin_parameters", "tp_gather_partition_size", "enable_cuda_graph"),
)
_switched_section("data_efficiency", "data efficiency (curriculum learning, data routing)", ("seed", "data_sampling", "data_routing"))
_switched_section("datastates", "DataStates asynchronous checkpointing", ("config",))
_switched_section(
    "expert_parallel",
    "expert parallelism (AutoEP)",
    (
        "autoep_size", "expert_tensor_parallel_size", "validate_folding_routing", "async_split_plan", "preset_model",
        "moe_layer_pattern", "expert_pattern", "router_pattern", "use_grouped_mm", "disable_triton_grouped_mm", "route_norm",
        "route_scale", "score_apply", "combine_impl", "row_weighting_impl", "gate_up_impl", "comm_backend", "comm_num_sm",
        "comm_qp_margin", "comm_max_tokens_per_rank", "num_expert_groups", "num_limited_groups", "score_func", "top_k",
        "load_balance_coeff", "routed_scaling_factor", "expert_w1", "expert_w2", "expert_w3", "num_experts_attr", "top_k_attr",
        "has_shared_experts", "shared_experts_pattern", "shared_experts_gate_pattern", "expert_activation",
    ),
)  # fmt: skip


# -- sections checked value by value ------------------------------------------------------------
# Read by NVMe offload (passes/offload.py: block_size, intra_op_parallelism/thread_count; use_gds refused there).
def _check_aio(path: str, section: Mapping[str, Any]) -> None:
    log_no_effect_keys(path, section, dict.fromkeys(("queue_depth", "single_submit", "overlap_events"), _AIO_WHY))


_AIO_WHY = "it tunes DeepSpeed's libaio submission; the NVMe swap here reads and writes whole tiles with threads (block_size, thread_count)"
_checked_section(
    "aio",
    "asynchronous NVMe I/O",
    ("block_size", "queue_depth", "intra_op_parallelism", "thread_count", "single_submit", "overlap_events", "use_gds"),
    _check_aio,
)

_TAG_VALIDATION = ("ignore", "warn", "fail")


def _check_checkpoint(path: str, section: Mapping[str, Any]) -> None:
    mode = section.get("tag_validation", "Warn")
    if not isinstance(mode, str) or mode.lower() not in _TAG_VALIDATION:
        raise DSCompileConfigError(f"{path}.tag_validation", f"{mode!r} is not a validation mode", "use Ignore, Warn or Fail")
    # read by the engines' save_checkpoint (runtime/checkpoint_io.check_tag_agreement)
    _refuse_when(f"{path}.load_universal", bool(section.get("load_universal", False)), "universal checkpoints")
    _refuse_when(f"{path}.use_node_local_storage", bool(section.get("use_node_local_storage", False)), "node-local checkpoint storage")
    parallel = _expect_mapping(f"{path}.parallel_write", section.get("parallel_write", {}))
    _check_keys(f"{path}.parallel_write", parallel, ("pipeline_stage",))
    _refuse_when(f"{path}.parallel_write.pipeline_stage", bool(parallel.get("pipeline_stage", False)), "parallel checkpoint writes")
    _refuse_when(f"{path}.writer", section.get("writer") is not None, "DeepSpeed's checkpoint writers")


_checked_section(
    "checkpoint",
    "checkpoint engine options",
    ("tag_validation", "load_universal", "use_node_local_storage", "parallel_write", "checkpoint_serialization", "writer"),
    _check_checkpoint,
)


def _check_data_types(path: str, section: Mapping[str, Any]) -> None:
    accum = section.get("grad_accum_dtype")
    if accum not in (None, "fp32", "fp16", "bf16"):
        raise DSCompileConfigError(f"{path}.grad_accum_dtype", f"{accum!r} is not a data type", "use fp32, fp16 or bf16")
    # gradients accumulate in the fp32 master weights' dtype
    _refuse_when(f"{path}.grad_accum_dtype", accum not in (None, "fp32"), "accumulating gradients in 16 bits")
    _refuse_when(f"{path}.param_dtype", section.get("param_dtype") is not None, "choosing the parameters' dtype apart from bf16/fp16")
    _refuse_when(f"{path}.buffer_dtype", section.get("buffer_dtype") is not None, "choosing the buffers' dtype")
    _refuse_when(f"{path}.keep_in_fp32_modules", section.get("keep_in_fp32_modules", "auto") != "auto", "listing modules kept in fp32")


_AUTOCAST_DTYPES = {
    "bf16": ("torch.bfloat16", "bf16", "bfloat16", "bfloat"),
    "fp16": ("torch.float16", "fp16", "float16", "half"),
}
"""DeepSpeed's ``DtypeEnum`` spellings of the two autocast dtypes."""


def _check_torch_autocast(path: str, section: Mapping[str, Any]) -> None:
    """``torch_autocast``: with the bf16/fp16 section on (checked by passes/mixed_precision/config.py), the ``amp`` pass is
    torch.autocast's cast policy; here only the values."""
    if not isinstance(section.get("enabled", False), bool):
        raise DSCompileConfigError(f"{path}.enabled", f"expected true or false, got {section['enabled']!r}")
    dtype = section.get("dtype")
    if dtype is not None and not any(str(dtype) in names for names in _AUTOCAST_DTYPES.values()):
        raise DSCompileConfigError(f"{path}.dtype", f"{dtype!r} is not an autocast dtype", "use torch.bfloat16 or torch.float16")
    _refuse_when(
        f"{path}.lower_precision_safe_modules",
        bool(section.get("lower_precision_safe_modules")),  # DeepSpeed's default, [], chooses none
        "choosing which modules' gradients are reduced in the autocast dtype",
    )


def autocast_precision(section: Mapping[str, Any] | None) -> str | None:
    """``"bf16"``/``"fp16"`` when ``torch_autocast`` is enabled (its dtype, or None when not given), else None."""
    if not section or not section.get("enabled", False):
        return None
    dtype = section.get("dtype")
    return next((name for name, spellings in _AUTOCAST_DTYPES.items() if str(dtype) in spellings), "default")


_checked_section(
    "torch_autocast", "torch.autocast (the amp pass's policy, with bf16/fp16 on)", ("enabled", "dtype", "lower_precision_safe_modules"), _check_torch_autocast
)


_checked_section("data_types", "mixed-precision data types", ("grad_accum_dtype", "param_dtype", "buffer_dtype", "keep_in_fp32_modules"), _check_data_types)


_DEEPCOMPILE_TUNING = (
    "free_activation", "free_activation_threshold", "offload_activation_pin_memory", "double_buffer", "symmetric_memory", "debug_log",
    "sync_before_reduce", "sync_after_reduce", "sync_before_allgather", "sync_after_allgather", "keep_int_input_tensors",
    "keep_all_input_tensors",
)  # fmt: skip


def _check_compile(path: str, section: Mapping[str, Any]) -> None:
    """``deepcompile`` is DeepSpeed's compiler for ZeRO; dscompile always compiles and its ZeRO passes are that
    compiler's, so both values mean the same here (logged). The sync/debug/buffer switches only schedule
    DeepCompile's own kernels."""
    if "deepcompile" in section:
        log_no_effect(f"{path}.deepcompile", "dscompile always compiles, and its ZeRO passes do DeepCompile's work: true and false mean the same")
    log_no_effect_keys(path, section, dict.fromkeys(_DEEPCOMPILE_TUNING, "it schedules DeepCompile's own kernels and buffers; dscompile's passes plan these"))
    for key, capability in (
        ("offload_activation", "offloading activations to the host"),
        ("offload_opt_states", "offloading optimizer states to the host"),
        ("offload_parameters", "offloading parameters to the host"),
        ("autoep_non_moe", "expert parallelism (AutoEP)"),
    ):
        _refuse_when(f"{path}.{key}", bool(section.get(key, False)), capability)
    _refuse_when(f"{path}.passes", section.get("passes") is not None, "DeepCompile's own pass list (write a dscompile 'pipeline' instead)")


_checked_section(
    "compile",
    "DeepSpeed's own compile section (dscompile is the compiler)",
    (
        "deepcompile", "autoep_non_moe", "free_activation", "free_activation_threshold", "offload_activation",
        "offload_activation_pin_memory", "offload_opt_states", "double_buffer", "symmetric_memory", "debug_log",
        "offload_parameters", "sync_before_reduce", "sync_after_reduce", "sync_before_allgather", "sync_after_allgather",
        "keep_int_input_tensors", "keep_all_input_tensors", "passes",
    ),
    _check_compile,
)  # fmt: skip


def _check_timers(path: str, section: Mapping[str, Any]) -> None:
    """DeepSpeed's throughput timer prints samples/s every ``steps_per_print``; a report only."""
    throughput = _expect_mapping(f"{path}.throughput", section.get("throughput", {}))
    _check_keys(f"{path}.throughput", throughput, ("enabled", "synchronized"))


_checked_section("timers", "DeepSpeed's throughput timer", ("throughput",), _check_timers)


# -- top-level scalars --------------------------------------------------------------------------
def _bool(path: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise DSCompileConfigError(path, f"expected true or false, got {value!r}")


def _bool_refused_when(on: bool, capability: str) -> Check:
    def check(path: str, value: Any) -> None:
        _bool(path, value)
        _refuse_when(path, value == on, capability)

    return check


def _accepted_bool(path: str, value: Any) -> None:
    _bool(path, value)


def _optional_int(path: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise DSCompileConfigError(path, f"expected a positive integer, got {value!r}")


def _check_allreduce_op(path: str, value: Any) -> None:
    if value not in ("mean", "sum"):
        raise DSCompileConfigError(path, f"{value!r} is not a reduction", "use 'mean' or 'sum'")
    _refuse_when(path, value == "sum", "summed (not averaged) gradients across ranks")


def _check_sp_dtype(path: str, value: Any) -> None:
    if value is not None and (not isinstance(value, str) or value.lower() not in ("fp32", "fp16", "bf16")):
        raise DSCompileConfigError(path, f"{value!r} is not a communication data type", "use fp32, fp16 or bf16")
    # gradients of the sequence group are averaged with the data-parallel ones, in the gradients' own dtype
    _refuse_when(path, value is not None and value.lower() != "fp32", "reducing sequence-parallel gradients in another dtype than fp32")


def _check_sequence_parallel_size(path: str, value: Any) -> None:
    """Ulysses sequence parallelism (passes/sequence_parallel.py): engines only; the frontend refuses it."""
    _optional_int(path, value)


_LOG_LEVELS = {name: getattr(logging, name.upper()) for name in ("debug", "info", "warning", "error", "critical")} | {"warn": logging.WARNING}


def _check_log_level(path: str, value: Any) -> None:
    """DeepSpeed sets its logger's level from this; dscompile sets its own ("dscompile") logger's."""
    if value is None:
        return
    if not isinstance(value, str) or value.lower() not in _LOG_LEVELS:
        raise DSCompileConfigError(path, f"{value!r} is not a log level", f"use one of {', '.join(_LOG_LEVELS)}")
    logging.getLogger("dscompile").setLevel(_LOG_LEVELS[value.lower()])


for _key, _on, _capability in (
    ("managed_gradient_accumulation", False, "accumulation boundaries managed by the script"),
    ("disable_python_gc", True, "turning off Python's garbage collector"),
    ("disable_allgather", True, "DeepSpeed's all-reduce in place of all-gather"),
):
    _scalar(_key, _capability, _bool_refused_when(_on, _capability))
_scalar("gradient_allreduce_op", "summed gradients", _check_allreduce_op)
def _check_force_ds_cpu_optimizer(path: str, value: Any) -> None:
    _bool(path, value)
    log_no_effect(
        path,
        "DeepSpeed refuses a client optimizer under ZeRO-Offload unless it is DeepSpeedCPUAdam; dscompile's offloaded step runs "
        "the configured optimizer's own CPU implementation, so there is nothing to force",
    )


def _check_vocabulary_size(path: str, value: Any) -> None:
    """DeepSpeed's only use: a warning when the vocabulary is not a multiple of 8 (tensor cores)."""
    _optional_int(path, value)
    if value is not None and value % 8:
        logging.getLogger("dscompile.config").warning("%s %d is not a multiple of 8: matmuls over it may not use tensor cores fully", path, value)


_scalar("zero_force_ds_cpu_optimizer", "ZeRO-Offload's CPU optimizer", _check_force_ds_cpu_optimizer)
def _check_data_before_ep(path: str, value: Any) -> None:
    _bool(path, value)
    log_no_effect(path, "DeepSpeed reads it only with expert parallelism (MoE), which is not built")


_scalar("use_data_before_expert_parallelism", "expert parallelism (only read with MoE, which is refused)", _check_data_before_ep)
_scalar("seq_parallel_communication_data_type", "sequence parallelism's all-to-all data type", _check_sp_dtype)
_scalar("sequence_parallel_size", "Ulysses sequence parallelism", _check_sequence_parallel_size)
_scalar("data_parallel_size", "a device mesh (DeepSpeed reads it only with sequence_parallel_size)", _optional_int)
_scalar("vocabulary_size", "DeepSpeed's vocabulary alignment warning", _check_vocabulary_size)
_scalar("log_level", "the log level", _check_log_level)
_scalar("dataloader_drop_last", "the DeepSpeed dataloader's last partial batch", _accepted_bool)
