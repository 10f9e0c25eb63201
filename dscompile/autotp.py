"""``deepspeed.tp_model_init``: AutoTP training scripts (and Hugging Face's Trainer) record their TP intent here.

DeepSpeed's ``tp_model_init(model, tp_size, dtype, config=None, tp_group=...)`` only records its
arguments; ``initialize`` merges them with the config's ``tensor_parallel`` section (the config
wins, missing fields are filled, a mismatch is an error). dscompile does the same, and its split
then comes from the graph at the first batch. The record lives on the model, so two engines in one
process do not share it. When torch.distributed is up the TP × DP groups are laid out here, so
``deepspeed.utils.groups.get_tensor_model_parallel_group()`` answers right after, as DeepSpeed's does.
A ``tp_group`` the script made must be the TP-innermost one dscompile lays out.

``initialize(mpu=...)`` together with ``tensor_parallel`` (DeepSpeed's AutoTP example passes both)
is the same intent: the unit's groups are checked against the layout and the graph split uses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dscompile.errors import DSCompileConfigError, DSCompileNotSupportedError
from dscompile.module_inject.layers import set_autotp_mode
from dscompile.runtime.process_groups import process_groups_for

_RECORD = "_dscompile_tp_model_init"


@dataclass(frozen=True)
class TpModelInit:
    tp_size: int
    dtype: torch.dtype | None


def tp_model_init(model: nn.Module, tp_size: int, dtype: torch.dtype | None = None, config: Any = None, **kwargs: Any) -> nn.Module:
    """Record ``model``'s tensor-parallel size and dtype for ``initialize``; returns ``model`` itself (unsplit:
    the graph pass splits it at the first batch)."""
    unknown = sorted(set(kwargs) - {"tp_group"})
    if unknown:
        raise DSCompileNotSupportedError(f"tp_model_init({unknown[0]}=...)", "only tp_size, dtype, config and tp_group are taken")
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise DSCompileConfigError("tp_model_init(tp_size)", f"{tp_size!r} is not a positive integer", "pass the tensor-parallel size, e.g. tp_size=2")
    if config is not None:
        from dscompile.config import load_config

        merge_into_config(load_config(config), TpModelInit(tp_size, dtype), "tp_model_init(config=...)")
    if dist.is_available() and dist.is_initialized():
        groups = process_groups_for(tp_size)
        _check_user_group(kwargs.get("tp_group"), groups.tp_ranks or [dist.get_rank()])
    elif kwargs.get("tp_group") is not None:
        raise DSCompileConfigError("tp_model_init(tp_group)", "a process group given before torch.distributed is initialized", "initialize it first")
    setattr(model, _RECORD, TpModelInit(tp_size, dtype))
    set_autotp_mode(training=True)
    return model


def _check_user_group(group: Any, expected: list[int]) -> None:
    if group is None:
        return
    ranks = sorted(dist.get_process_group_ranks(group))
    if ranks != sorted(expected):
        raise DSCompileNotSupportedError(
            "tp_model_init(tp_group)", f"a tensor-parallel group of ranks {ranks}; dscompile lays TP out innermost (this rank's group: {expected})"
        )


def recorded(model: nn.Module) -> TpModelInit | None:
    """What ``tp_model_init`` recorded on ``model`` (or on a module inside it)."""
    for module in model.modules():
        record = getattr(module, _RECORD, None)
        if record is not None:
            return record
    return None


def _config_dtype(cfg: Any) -> torch.dtype:
    for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        section = cfg.sections.get(key)
        if section is not None and section.enabled:
            return dtype
    return torch.float32


def merge_into_config(cfg: Any, record: TpModelInit, source: str = "tp_model_init") -> Any:
    """The config's ``tensor_parallel`` section filled from ``record`` where absent; a mismatch is an error."""
    from dscompile.passes.tensor_parallel import SECTION, parse_tensor_parallel

    section = cfg.sections.get(SECTION)
    if section is not None and section.enabled and section.autotp_size != record.tp_size:
        raise DSCompileConfigError(
            "tensor_parallel.autotp_size",
            f"{section.autotp_size} in the config, but {source} was given tp_size={record.tp_size}",
            "make them agree (the config is the one DeepSpeed keeps)",
        )
    if record.dtype is not None and record.dtype != _config_dtype(cfg):
        raise DSCompileConfigError(
            "bf16" if record.dtype == torch.bfloat16 else "fp16" if record.dtype == torch.float16 else "tensor_parallel",
            f"{source} was given dtype={record.dtype}, but the config trains in {_config_dtype(cfg)}",
            "enable the matching bf16/fp16 section, or pass the dtype the config trains in",
        )
    if section is None or not section.enabled:
        cfg.sections[SECTION] = parse_tensor_parallel({"autotp_size": record.tp_size}, SECTION)
    return cfg


def merge_autotp_intent(model: nn.Module, cfg: Any, mpu: Any) -> tuple[Any, Any]:
    """At ``initialize``: ``tp_model_init``'s record merged into the config, and an ``mpu`` given with
    ``tensor_parallel`` checked against the layout and then left to the graph split (returned as None)."""
    from dscompile.passes.tensor_parallel import SECTION

    record = recorded(model)
    if record is not None:
        cfg = merge_into_config(cfg, record)
    section = cfg.sections.get(SECTION)
    if mpu is None or section is None or not section.enabled:
        return cfg, mpu
    from dscompile.runtime.model_parallel_unit import process_groups_from_mpu

    groups = process_groups_from_mpu(mpu, cfg)  # checked against the TP-innermost layout
    if groups.tp_size != section.autotp_size:
        raise DSCompileConfigError(
            "mpu", f"its tensor-parallel group has {groups.tp_size} ranks, tensor_parallel.autotp_size is {section.autotp_size}", "make them agree"
        )
    return cfg, None
