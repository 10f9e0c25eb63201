"""The cast policy: which ops compute in the low precision, which in fp32, which in the widest input dtype.

``classify`` gives a node its rule from the op name ``op_key`` reads; the tables follow torch.autocast's lists, so
the ``amp`` pass computes what autocast would. Custom ops and subgraphs are opaque: their dtype contract is their own.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.fx

Rule = Literal["low", "fp32", "promote", "keep", "opaque"]

# Ops torch.autocast runs in the low precision (CUDA and CPU lists; einsum decomposes to bmm).
_LOW_COMMON = {
    "linear",
    "matmul",
    "mm",
    "bmm",
    "addmm",
    "baddbmm",
    "addbmm",
    "einsum",
    "linalg_vecdot",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "convolution",
    "_convolution",
    "conv_tbc",
    "prelu",
    "scaled_dot_product_attention",
}
_LOW_CUDA_ONLY = {"addmv", "addr", "mv", "chain_matmul", "linalg_multi_dot", "multi_dot"}

_LOSSES = {
    "cross_entropy",
    "cross_entropy_loss",  # the ATen spelling (a graph captured by torch.export, as tensor parallelism's)
    "nll_loss_nd",
    "nll_loss_forward",
    "nll_loss",
    "nll_loss2d",
    "mse_loss",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "kl_div",
    "binary_cross_entropy",
    "binary_cross_entropy_with_logits",
    "poisson_nll_loss",
    "gaussian_nll_loss",
    "cosine_embedding_loss",
    "hinge_embedding_loss",
    "margin_ranking_loss",
    "multilabel_margin_loss",
    "multilabel_soft_margin_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
    "ctc_loss",
}
# Numerically sensitive ops kept in fp32 (torch.autocast's CUDA list, plus all norms and
# mean/var/std as large reductions).
_FP32_DEFAULT = _LOSSES | {
    "acos",
    "asin",
    "cosh",
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log10",
    "log2",
    "log1p",
    "reciprocal",
    "rsqrt",
    "sinh",
    "tan",
    "pow",
    "softplus",
    "layer_norm",
    "native_layer_norm",
    "group_norm",
    "rms_norm",
    "batch_norm",
    "instance_norm",
    "norm",
    "frobenius_norm",
    "nuclear_norm",
    "linalg_vector_norm",
    "linalg_matrix_norm",
    "vector_norm",
    "matrix_norm",
    "cosine_similarity",
    "normalize",
    "softmax",
    "log_softmax",
    "_softmax",
    "_log_softmax",
    "softmin",
    "logsumexp",
    "sum",
    "prod",
    "cumsum",
    "cumprod",
    "mean",
    "var",
    "std",
    "var_mean",
    "std_mean",
    "dist",
    "pdist",
    "cdist",
    "renorm",
}
# torch.autocast's CPU fp32 list (the ops the "autocast" policy keeps in fp32 on CPU).
_FP32_CPU_AUTOCAST = _LOSSES | {
    "avg_pool3d",
    "grid_sampler",
    "polar",
    "prod",
    "quantile",
    "nanquantile",
    "stft",
    "cdist",
    "trace",
    "cholesky",
    "cholesky_inverse",
    "cholesky_solve",
    "inverse",
    "lu_solve",
    "orgqr",
    "ormqr",
    "pinverse",
    "max_pool3d",
    "max_unpool2d",
    "max_unpool3d",
    "adaptive_avg_pool3d",
}
_PROMOTE = {
    "cat",
    "concat",
    "concatenate",
    "stack",
    "index_copy",
    "addcmul",
    "addcdiv",
    "atan2",
    "cross",
    "dot",
    "vdot",
    "tensordot",
    "index_put",
    "scatter_add",
    "bilinear",
}

_OPERATOR_NAMES: dict[Callable[..., Any], str] = {operator.matmul: "matmul", operator.pow: "pow"}
_ZERO_GATHER = "dscompile::zero_gather"  # ZeRO-3's parameter gather (dscompile.runtime.zero_ops)


def is_zero_gather(node: torch.fx.Node) -> bool:
    """A ZeRO-3 parameter gather, spelt as Dynamo records it (op packet) or as AOTAutograd does (overload)."""
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.name() == _ZERO_GATHER
    return isinstance(target, torch._ops.OpOverloadPacket) and target._qualified_op_name == _ZERO_GATHER


@dataclass(frozen=True)
class CastPolicy:
    """Which op names run in the low precision and which in fp32."""

    low: frozenset[str]
    fp32: frozenset[str]
    promote: frozenset[str] = field(default=frozenset(_PROMOTE))


POLICIES: dict[str, Callable[[torch.device], CastPolicy]] = {
    # The policy on every device: CUDA autocast's lists (norms, softmax... in fp32).
    "default": lambda device: CastPolicy(frozenset(_LOW_COMMON | _LOW_CUDA_ONLY), frozenset(_FP32_DEFAULT)),
    # Exactly torch.autocast's lists for the device the graph runs on.
    "autocast": lambda device: (
        CastPolicy(frozenset(_LOW_COMMON), frozenset(_FP32_CPU_AUTOCAST))
        if device.type == "cpu"
        else CastPolicy(
            frozenset(_LOW_COMMON | _LOW_CUDA_ONLY),
            frozenset(
                _FP32_DEFAULT
                - {
                    "mean",
                    "var",
                    "std",
                    "var_mean",
                    "std_mean",
                    "rms_norm",
                    "batch_norm",
                    "instance_norm",
                    "normalize",
                    "softmin",
                }
            ),
        )
    ),
}


def op_key(node: torch.fx.Node) -> str | None:
    """The op name the policy tables use, for the spellings a Dynamo graph contains."""
    if node.op == "call_method":
        return str(node.target)
    if node.op != "call_function":
        return None
    target = node.target
    if target in _OPERATOR_NAMES:
        return _OPERATOR_NAMES[target]
    if isinstance(target, torch._ops.OpOverload):
        return target._opname if target.namespace in ("aten", "prims") else None
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__name__", None)
    if name and module.startswith("torch") and not isinstance(target, torch._ops.HigherOrderOperator):
        return name
    return None


def classify(node: torch.fx.Node, policy: CastPolicy) -> Rule:
    if node.op == "call_module" or (node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator)):
        return "opaque"
    if (
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and node.target.namespace not in ("aten", "prims")
    ):
        return "opaque"  # custom kernels (dscompile::..., user ops): their dtype contract is their own
    key = op_key(node)
    if key is None:
        return "keep"
    if key in policy.low:
        return "low"
    if key in policy.fp32:
        return "fp32"
    if key in policy.promote:
        return "promote"
    return "keep"
