"""``deepspeed.moe.utils``: its helpers only make sense with MoE layers, which are refused."""

from __future__ import annotations

from typing import Any

from torch import nn

from dscompile.errors import DSCompileNotSupportedError


def is_moe_param(param: nn.Parameter) -> bool:
    """No parameter belongs to an expert: MoE layers cannot be built here."""
    return False


def split_params_into_different_moe_groups_for_optimizer(param_groups: Any, max_group_size: int | None = None) -> Any:
    """Without MoE parameters there is nothing to split: the groups come back unchanged."""
    return param_groups


def split_params_grads_into_shared_and_expert_params(group: Any) -> Any:
    raise DSCompileNotSupportedError("deepspeed.moe.utils.split_params_grads_into_shared_and_expert_params", "Mixture-of-Experts layers")
