"""``deepspeed.utils.zero_to_fp32``: DeepSpeed's three functions over ``dscompile.runtime.checkpoint_formats.zero_to_fp32``
(which reads dscompile's and DeepSpeed's ZeRO checkpoints). Sharded or safetensors output and lazy loading are refused."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from dscompile.errors import DSCompileNotSupportedError
from dscompile.runtime.checkpoint_formats import zero_to_fp32

__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "get_fp32_state_dict_from_zero_checkpoint", "load_state_dict_from_zero_checkpoint"]


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | os.PathLike, tag: str | None = None, exclude_frozen_parameters: bool = False, lazy_mode: bool = False
) -> dict[str, torch.Tensor]:
    if exclude_frozen_parameters or lazy_mode:
        raise DSCompileNotSupportedError("get_fp32_state_dict_from_zero_checkpoint(exclude_frozen_parameters / lazy_mode)", "partial or lazy reads")
    return zero_to_fp32(checkpoint_dir, tag)


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    max_shard_size: Any = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> None:
    """Write ``output_dir/pytorch_model.bin`` (DeepSpeed's name for one unsharded file)."""
    if safe_serialization:
        raise DSCompileNotSupportedError("convert_zero_checkpoint_to_fp32_state_dict(safe_serialization=True)", "safetensors output")
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    os.makedirs(output_dir, exist_ok=True)
    torch.save(state, os.path.join(output_dir, "pytorch_model.bin"))


def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir: str | os.PathLike, tag: str | None = None) -> nn.Module:
    """Load the fp32 weights into ``model`` moved to the host, as DeepSpeed's does; returns it."""
    model = model.cpu()
    model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag), strict=False)
    return model
