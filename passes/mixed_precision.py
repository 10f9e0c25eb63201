"""Mixed precision as a graph pass (``amp``): bf16 or fp16 compute, fp32 master weights.

On the Dynamo graph (``pre_autograd``, the level where ``torch.autocast`` acts) a cast policy
gives every op a compute dtype: matmul-class ops (linear, matmul, bmm, convolution, attention)
run in the low precision; numerically sensitive ops (softmax, log-softmax, layer/RMS/group norm,
losses, large reductions, exp/log/pow...) in fp32; ops that combine tensors (cat, stack...) in
the widest input dtype; every other op runs in whatever dtype its inputs have, as under autocast.
A cast is inserted once per (value, dtype); parameters stay fp32 (the optimizer's master
weights) and the graph casts them, so AOTAutograd derives the backward casts and parameter
gradients arrive in fp32. Graph outputs keep their original dtype.

Then, on every graph it runs on (also AOTAutograd's forward and backward graphs), redundant
casts are folded: a cast to the dtype a value already has, and chains whose middle dtype holds
the source exactly (bf16 -> fp32 -> bf16 is the identity). Counts before/after are recorded.

Metadata left for later passes (``node.meta["dscompile"]``):
  ``dtype``            the torch.dtype a floating-point node computes in after this pass
  ``amp``              the policy class of an op: "low" | "fp32" | "promote" | "keep" | "cast"
  ``amp_cast``         on inserted casts: {"reason": low|fp32|promote|output|restore|gather|communication,
                       "source": name}
  ``amp_param_cast``   on a cast whose input is a parameter: the parameter's name.
  ``amp_gather_of``    on a ZeRO-3 gather of a low-precision shard: the fp32 gather it replaced.
  output node ``amp``  the cast counts of the graph (also in ``ctx.analysis["amp"][graph_name]``)

With ZeRO-3 the cast happens before the all-gather: each ``dscompile::zero_gather`` of an fp32
shard becomes a gather of the shard cast to the low precision (half the bytes travel), and ops
that want fp32 (norms, embeddings) read that gathered copy upcast, as DeepSpeed's 16-bit model
weights are read (``zero3_gather=low``, the default); ``zero3_gather=exact`` lowers only the gathers
whose every user computes in the low precision (autocast's values exactly, fewer bytes saved).

``communication_data_type`` (DeepSpeed's top-level key: ``fp32`` | ``fp16`` | ``bf16``, default the
training precision) is the dtype gradients are reduced in: the ``comm_dtype`` pass casts the input
of every in-graph ZeRO-2/3 gradient reduce-scatter to it and the result back to the gradient's
dtype; the engine does the same for ZeRO-1's and plain data parallelism's reductions. ZeRO-3's
parameter all-gathers move the compute-precision copy whatever this key says (as in DeepSpeed,
where the key only governs gradient reductions).

DeepSpeed's 16-bit convention (its module is cast to 16 bits, so scripts feed 16-bit inputs and read
16-bit outputs) is kept outside this pass, at the engine's boundary (``runtime/sixteen_bit.py``):
16-bit inputs are upcast exactly before the graph (which casts them back where the policy computes
in the low precision) and outputs are cast to the 16-bit module's dtypes after it. The graph itself
keeps fp32 master weights and its traced output dtypes, so ``torch.compile(..., backend="dscompile")``
used directly returns what the fp32 module returns.

The config keys are DeepSpeed's ``bf16`` and ``fp16`` sections; they also install the engine
extension ``MixedPrecision`` (``dscompile.runtime.loss_scaler``) in every engine, pipeline engines
included: the reduction dtype above and, for fp16, DeepSpeed's dynamic loss scaler, read as
``engine.loss_scaler.loss_scale``.
"""

from __future__ import annotations

import logging
import operator
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.fx
from torch.fx.node import map_arg

from dscompile.config import log_no_effect_keys, parse_dataclass, register_section
from dscompile.deepspeed_config import autocast_precision
from dscompile.errors import DSCompileConfigError, DSCompileNotSupportedError
from dscompile.graph import ds_meta, fake_mode_of, node_value, set_fake_value, tensor_values
from dscompile.pipeline import PassContext, PassInvocation, invocation, register_config_rule, register_pass
from dscompile.runtime import zero_ops
from dscompile.runtime.engine_core import register_engine_extension
from dscompile.runtime.loss_scaler import LowPrecisionMasters, MixedPrecision

log = logging.getLogger("dscompile.passes.amp")

aten = torch.ops.aten
prims = torch.ops.prims

LOW_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}
COMM_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, **LOW_DTYPES}

# --------------------------------------------------------------------------------------------
# config sections
# --------------------------------------------------------------------------------------------


@dataclass
class FP16Config:
    """``fp16``: DeepSpeed's keys and defaults; ``loss_scale: 0`` selects the dynamic scaler."""

    enabled: bool = False
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    auto_cast: bool = False
    fp16_master_weights_and_grads: bool = False

    def validate(self, path: str) -> None:
        if self.loss_scale < 0:
            raise DSCompileConfigError(f"{path}.loss_scale", f"must be >= 0 (0 means dynamic), got {self.loss_scale}")
        if not 0 <= self.initial_scale_power <= 63:
            raise DSCompileConfigError(f"{path}.initial_scale_power", f"must be in [0, 63], got {self.initial_scale_power}")
        if self.loss_scale_window < 1:
            raise DSCompileConfigError(f"{path}.loss_scale_window", f"must be >= 1, got {self.loss_scale_window}")
        if self.hysteresis < 1:
            raise DSCompileConfigError(f"{path}.hysteresis", f"must be >= 1, got {self.hysteresis}")
        if not self.min_loss_scale > 0:
            raise DSCompileConfigError(f"{path}.min_loss_scale", f"must be > 0, got {self.min_loss_scale}")
        if self.auto_cast:
            raise DSCompileNotSupportedError(
                f"{path}.auto_cast", "casting the model inputs to fp16 (the graph casts where the policy says)"
            )
        if self.fp16_master_weights_and_grads:
            raise DSCompileNotSupportedError(
                f"{path}.fp16_master_weights_and_grads", "fp16 master weights (master weights stay fp32)"
            )


@dataclass
class BF16Config:
    """``bf16``: bf16 needs no loss scaling. ``check_grad_overflow`` (DeepSpeed's default, on)
    skips a step whose gradients hold inf/NaN on any rank; ``immediate_grad_update`` only picks
    when DeepSpeed's bf16 optimizer copies gradients (the maths is the same).
    ``bf16_master_weights_and_grads`` with ``bf16_optimizer_states`` (ZeRO 1-3, as in DeepSpeed) keeps
    the master weights, gradients and optimizer states in bf16 (``LowPrecisionMasters``); bf16 masters
    with fp32 optimizer states (DeepSpeed: ZeRO-Offload's CPU Adam only) are not built."""

    enabled: bool = False
    immediate_grad_update: bool = False
    check_grad_overflow: bool = True
    bf16_master_weights_and_grads: bool = False
    bf16_optimizer_states: bool = False

    def validate(self, path: str) -> None:
        if self.bf16_optimizer_states and not self.bf16_master_weights_and_grads:
            raise DSCompileConfigError(
                f"{path}.bf16_optimizer_states", "needs bf16_master_weights_and_grads (as in DeepSpeed)", "set bf16_master_weights_and_grads to true"
            )
        if self.bf16_master_weights_and_grads and not self.bf16_optimizer_states:
            raise DSCompileNotSupportedError(
                f"{path}.bf16_master_weights_and_grads",
                "bf16 master weights with fp32 optimizer states (DeepSpeed's ZeRO-Offload CPU Adam)",
                "also set bf16_optimizer_states to true (bf16 moments), or drop bf16_master_weights_and_grads",
            )


register_section("fp16", lambda value, path: parse_dataclass(FP16Config, value, path), "fp16 mixed precision")
def _parse_bf16(value: Any, path: str) -> BF16Config:
    log_no_effect_keys(path, value, {"immediate_grad_update": "it picks when DeepSpeed's bf16 optimizer copies gradients; the maths is the same"})
    return parse_dataclass(BF16Config, value, path)


register_section("bf16", _parse_bf16, "bf16 mixed precision")


def precision_of(config: Any) -> str | None:
    """``"bf16"``, ``"fp16"`` or None for a config; both enabled is a contradiction."""
    fp16 = config.sections.get("fp16")
    bf16 = config.sections.get("bf16")
    fp16_on = bool(fp16 and fp16.enabled)
    bf16_on = bool(bf16 and bf16.enabled)
    if fp16_on and bf16_on:
        raise DSCompileConfigError(
            "bf16.enabled",
            "cannot be combined with fp16.enabled: choose one low precision",
            "set fp16.enabled or bf16.enabled to false",
        )
    precision = "fp16" if fp16_on else "bf16" if bf16_on else None
    _check_torch_autocast(config, precision)
    return precision


def _check_torch_autocast(config: Any, precision: str | None) -> None:
    """DeepSpeed's ``torch_autocast`` beside ``bf16``/``fp16`` runs the 16-bit module under torch.autocast; the ``amp`` pass
    is autocast's cast policy, so that is what dscompile runs anyway. Alone (an fp32 module under autocast) it is refused."""
    autocast = autocast_precision(config.sections.get("torch_autocast"))
    if autocast is None:
        return
    if precision is None:
        raise DSCompileNotSupportedError(
            "torch_autocast.enabled", "torch.autocast without the bf16/fp16 section", "enable bf16 (or fp16) instead: the graph casts"
        )
    if autocast not in ("default", precision):
        raise DSCompileConfigError("torch_autocast.dtype", f"is {autocast} while {precision} is enabled", f"use the {precision} dtype or drop the key")


def _parse_communication_data_type(value: Any, path: str) -> str | None:
    """DeepSpeed's ``communication_data_type``: null, "fp32", "fp16" or "bf16" (any letter case)."""
    if value is None:
        return None
    if not isinstance(value, str) or value.lower() not in COMM_DTYPES:
        raise DSCompileConfigError(
            path,
            f"{value!r} is not a communication data type",
            f"use one of {', '.join(map(repr, COMM_DTYPES))} (or null for the training precision)",
        )
    return value.lower()


register_section("communication_data_type", _parse_communication_data_type, "mixed-precision communication")


def communication_dtype(config: Any) -> str:
    """The dtype gradients are reduced in, as DeepSpeed picks it: the key, else the training precision."""
    explicit = config.sections.get("communication_data_type")
    return explicit or precision_of(config) or "fp32"


def _zero_stage(config: Any) -> int:
    section = config.sections.get("zero_optimization")
    return int(section.stage) if section is not None else 0


# Rule order 15: after the Dynamo-graph rewrites (10) and before sharding (20), so that ZeRO
# sees the parameter casts and can gather the low-precision copies, and ``comm_dtype`` sees the
# ZeRO-2/3 reduce-scatter ops before ``zero`` turns them into collectives.
@register_config_rule(15, "mixed_precision")
def _mixed_precision_rule(config: Any) -> list[PassInvocation]:
    precision = precision_of(config)
    items = [invocation("amp", dtype=precision)] if precision else []
    if _zero_stage(config) >= 2 and (precision or config.sections.get("communication_data_type")):
        items.append(invocation("comm_dtype", dtype=communication_dtype(config)))
    return items


def _bf16_masters(config: Any) -> bool:
    """Whether ``bf16.bf16_master_weights_and_grads`` is on; it needs ZeRO 1-3, as DeepSpeed asserts."""
    bf16 = config.sections.get("bf16")
    if not (bf16 is not None and bf16.enabled and bf16.bf16_master_weights_and_grads):
        return False
    if _zero_stage(config) == 0:
        raise DSCompileConfigError("bf16.bf16_master_weights_and_grads", "needs ZeRO stage 1, 2 or 3 (as in DeepSpeed)", "set zero_optimization.stage")
    return True


# Order 9: before ZeRO (10) partitions the parameters, so that its shards are the bf16 masters.
@register_engine_extension(9, "low_precision_masters")
def _low_precision_masters_extension(config: Any) -> LowPrecisionMasters | None:
    return LowPrecisionMasters(torch.bfloat16) if _bf16_masters(config) else None


@register_engine_extension(40, "mixed_precision")
def _mixed_precision_extension(config: Any) -> MixedPrecision | None:
    """Every engine: fp16 gets DeepSpeed's loss scaler, bf16 a scale of 1 that skips steps with inf/NaN
    gradients (``bf16.check_grad_overflow``, DeepSpeed's default); the graph does the casts. The
    reductions done outside graphs (ZeRO-1, data parallelism, pipeline replicas) use
    ``communication_data_type``."""
    from dscompile.runtime.loss_scaler import StaticLossScaler, build_loss_scaler

    precision = precision_of(config)
    explicit = config.sections.get("communication_data_type")
    if precision is None and not explicit:
        return None
    scaler = None
    if precision == "fp16":
        scaler = build_loss_scaler(config.sections["fp16"])
    elif precision == "bf16" and config.sections["bf16"].check_grad_overflow:
        scaler = StaticLossScaler(1.0)
    return MixedPrecision(
        precision,
        LOW_DTYPES[precision] if precision else None,
        COMM_DTYPES[communication_dtype(config)],
        scaler,
        torch.bfloat16 if _bf16_masters(config) else torch.float32,
    )


# --------------------------------------------------------------------------------------------
# cast policy
# --------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------
# cast recognition and folding (any graph kind)
# --------------------------------------------------------------------------------------------

_METHOD_CASTS = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64}

# dtype -> the dtypes it represents exactly (a round trip through it loses nothing).
_HOLDS_EXACTLY = {
    torch.float64: {torch.float64, torch.float32, torch.bfloat16, torch.float16},
    torch.float32: {torch.float32, torch.bfloat16, torch.float16},
    torch.bfloat16: {torch.bfloat16},
    torch.float16: {torch.float16},
}


def _same_place(node: torch.fx.Node, src: torch.fx.Node) -> bool:
    """A ``_to_copy`` that changes nothing but the dtype (same device, strided, format kept)."""
    extra = set(node.kwargs) - {"dtype", "layout", "device"}
    if extra or node.kwargs.get("layout", torch.strided) != torch.strided:
        return False
    value = node_value(src)
    device = node.kwargs.get("device")
    return device is None or (isinstance(value, torch.Tensor) and torch.device(device) == value.device)


def cast_source(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.dtype] | None:
    """``(input, dtype)`` when ``node`` is a pure dtype conversion, else None."""
    args, kwargs = node.args, node.kwargs
    if not args or not isinstance(args[0], torch.fx.Node):
        return None
    if node.op == "call_function":
        if node.target is aten._to_copy.default and len(args) == 1 and "dtype" in kwargs and _same_place(node, args[0]):
            return args[0], kwargs["dtype"]
        if node.target is prims.convert_element_type.default and len(args) == 2:
            return args[0], args[1]
    if node.op == "call_method":
        if node.target in _METHOD_CASTS and len(args) == 1 and not kwargs:
            return args[0], _METHOD_CASTS[node.target]
        if node.target == "to" and len(args) == 2 and isinstance(args[1], torch.dtype) and not kwargs:
            return args[0], args[1]
    return None


def _dtype(node: torch.fx.Node) -> torch.dtype | None:
    value = node_value(node)
    return value.dtype if isinstance(value, torch.Tensor) else None


def _is_mutated(node: torch.fx.Node) -> bool:
    for user in node.users:
        if user.op == "call_method" and str(user.target).endswith("_") and user.args and user.args[0] is node:
            return True
        if user.op == "call_function" and isinstance(user.target, torch._ops.OpOverload) and user.target._schema.is_mutable:
            return True
    return False


def count_casts(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if cast_source(n) is not None)


def fold_casts(gm: torch.fx.GraphModule) -> int:
    """Remove casts to a value's own dtype and shortcut lossless cast chains; returns casts removed."""
    graph = gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    before = count_casts(gm)
    for node in list(graph.nodes):
        found = cast_source(node)
        if found is None:
            continue
        src, dtype = found
        # Walk back through casts that held their input exactly: cast(cast(x, a), b) == cast(x, b).
        while (inner := cast_source(src)) is not None and _dtype(inner[0]) in _HOLDS_EXACTLY.get(inner[1], ()):
            src = inner[0]
        if output in node.users or _is_mutated(node) or _is_mutated(src):
            continue  # outputs keep their identity (aliasing was recorded); mutations need copies
        if _dtype(src) == dtype:
            node.replace_all_uses_with(src)
            graph.erase_node(node)
        elif src is not node.args[0]:
            node.args = (src, *node.args[1:])
    for node in reversed(list(graph.nodes)):
        if cast_source(node) is not None and not node.users:
            graph.erase_node(node)
    return before - count_casts(gm)


# --------------------------------------------------------------------------------------------
# cast insertion (the Dynamo graph)
# --------------------------------------------------------------------------------------------


def _fetch_attr(gm: torch.fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _signature(value: Any) -> tuple:
    return tuple((t.dtype, tuple(t.shape)) for t in tensor_values(value))


class _CastInserter:
    """Walks the graph once, giving each op its compute dtype and re-deriving fake values."""

    def __init__(
        self, gm: torch.fx.GraphModule, ctx: PassContext, low: torch.dtype, policy_name: str, zero3_gather: str = "low"
    ) -> None:
        self.gm, self.graph, self.ctx, self.low = gm, gm.graph, ctx, low
        self.fake_mode = fake_mode_of(gm)
        self.placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        self.param_of = {self.placeholders[i]: name for i, name in ctx.param_names.items() if i < len(self.placeholders)}
        device = next(
            (v.device for n in self.placeholders for v in tensor_values(node_value(n)) if v.is_floating_point()),
            torch.device("cpu"),
        )
        self.policy = POLICIES[policy_name](device)
        self.env: dict[torch.fx.Node, Any] = {}
        self.casts: dict[tuple[torch.fx.Node, torch.dtype], torch.fx.Node] = {}
        self.rules: Counter[str] = Counter()
        self.requests = 0
        self.low_gathers = self._lower_gathers(zero3_gather)
        self.original = {n: node_value(n) for n in self.graph.nodes}

    # -- helpers ---------------------------------------------------------------------------
    def cast(self, src: torch.fx.Node, dtype: torch.dtype, reason: str) -> torch.fx.Node:
        key = (src, dtype)
        if key in self.casts:
            return self.casts[key]
        anchor = self.placeholders[-1] if src.op in ("placeholder", "get_attr") else src
        with self.graph.inserting_after(anchor):
            node = self.graph.call_function(aten._to_copy.default, (src,), {"dtype": dtype})
        self.env[node] = set_fake_value(node, self.fake_mode)
        meta = ds_meta(node)
        meta.update(dtype=dtype, amp="cast", amp_cast={"reason": reason, "source": src.name})
        if src in self.param_of:
            meta["amp_param_cast"] = self.param_of[src]
        for key_ in ("stack_trace", "nn_module_stack"):
            if key_ in src.meta:
                node.meta[key_] = src.meta[key_]
        self.casts[key] = node
        return node

    def _lower_gathers(self, mode: str) -> list[torch.fx.Node]:
        """ZeRO-3: gather ``cast(shard, low)`` instead of the fp32 shard, so half the bytes travel.

        The fp32 gather is replaced by ``cast(low_gather, fp32)``; a low-precision user's cast of
        that folds back to ``low_gather`` in the clean-up, fp32 users (norms, embeddings) read the
        upcast copy. ``mode="exact"`` only lowers gathers that have low-precision users alone.
        """
        lowered = []
        for gather in [n for n in self.graph.nodes if is_zero_gather(n)]:
            shard = gather.args[0]
            value = node_value(shard)
            if not gather.users or not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
                continue
            if mode == "exact" and not all(classify(user, self.policy) == "low" for user in gather.users):
                continue
            low_shard = self.cast(shard, self.low, "gather")
            with self.graph.inserting_after(gather):
                low_gather = self.graph.call_function(gather.target, (low_shard, *gather.args[1:]), dict(gather.kwargs))
            set_fake_value(low_gather, self.fake_mode)
            ds_meta(low_gather).update(dtype=self.low, amp="low", amp_gather_of=gather.name)
            with self.graph.inserting_after(low_gather):
                upcast = self.graph.call_function(aten._to_copy.default, (low_gather,), {"dtype": torch.float32})
            set_fake_value(upcast, self.fake_mode)
            ds_meta(upcast).update(dtype=torch.float32, amp="cast", amp_cast={"reason": "gather", "source": low_gather.name})
            for key in ("stack_trace", "nn_module_stack"):
                if key in gather.meta:
                    low_gather.meta.setdefault(key, gather.meta[key])
            gather.replace_all_uses_with(upcast)
            self.graph.erase_node(gather)
            lowered.append(low_gather)
        return lowered

    def _float(self, arg: torch.fx.Node) -> torch.Tensor | None:
        value = self.env.get(arg)
        return value if isinstance(value, torch.Tensor) and value.is_floating_point() else None

    def _target(self, rule: Rule, value: torch.Tensor, widest: torch.dtype | None) -> torch.dtype | None:
        if value.dtype == torch.float64 and rule != "promote":
            return None  # autocast never touches fp64
        if rule == "low":
            return self.low
        if rule == "fp32":
            return torch.float32 if value.dtype in (torch.float16, torch.bfloat16) else None
        if rule == "promote":
            return widest
        return None

    def _evaluate(self, node: torch.fx.Node) -> Any:
        args = map_arg(node.args, lambda n: self.env[n])
        kwargs = map_arg(node.kwargs, lambda n: self.env[n])
        with self.fake_mode:
            if node.op == "call_method":
                return getattr(args[0], node.target)(*args[1:], **kwargs)
            return node.target(*args, **kwargs)

    def _set_value(self, node: torch.fx.Node, value: Any) -> None:
        self.env[node] = value
        node.meta["val"] = value
        if "example_value" in node.meta:
            node.meta["example_value"] = value

    def _restore(self, node: torch.fx.Node, reason: str) -> None:
        """Give ``node`` back the input dtypes it was traced with."""

        def back(arg: torch.fx.Node) -> torch.fx.Node:
            old = self.original.get(arg)
            now = self._float(arg)
            if now is not None and isinstance(old, torch.Tensor) and old.dtype != now.dtype:
                return self.cast(arg, old.dtype, reason)
            return arg

        node.args = map_arg(node.args, back)
        node.kwargs = map_arg(node.kwargs, back)

    def _changed(self, node: torch.fx.Node) -> bool:
        return any(_signature(self.env[a]) != _signature(self.original.get(a)) for a in node.all_input_nodes)

    # -- the walk --------------------------------------------------------------------------
    def run(self) -> int:
        """Give every op its dtype; returns the casts inserted (ZeRO-3 gather upcasts included)."""
        for node in list(self.graph.nodes):
            if node.op in ("placeholder", "get_attr"):
                value = node_value(node)
                if value is None and node.op == "get_attr":
                    attr = _fetch_attr(self.gm, str(node.target))
                    # a subgraph (an autograd.Function's forward/backward bodies, e.g. tensor parallelism's
                    # collectives) is no value: the op using it is opaque to the policy
                    value = self.fake_mode.from_tensor(attr) if isinstance(attr, torch.Tensor) else None
                    self.original[node] = value
                self.env[node] = value
                continue
            if node.op == "output":
                self._outputs(node)
                continue
            self._visit(node)
        return len(self.casts) + len(self.low_gathers)

    def _visit(self, node: torch.fx.Node) -> None:
        rule = classify(node, self.policy)
        if rule == "opaque":
            if self._changed(node):
                log.info(
                    "%s: '%s' (%s) is opaque to the cast policy; its inputs keep their traced dtypes",
                    self.ctx.graph_name,
                    node.name,
                    node.target,
                )
                self._restore(node, "restore")
            self.env[node] = self.original[node]
            self.rules[rule] += 1
            return
        floats = [self._float(a) for a in node.all_input_nodes]
        widest = None
        if rule == "promote":
            kinds = [v.dtype for v in floats if v is not None]
            widest = kinds[0] if kinds else None
            for d in kinds[1:]:
                widest = torch.promote_types(widest, d)

        def rewrite(arg: torch.fx.Node) -> torch.fx.Node:
            value = self._float(arg)
            if value is None:
                return arg
            target = self._target(rule, value, widest)
            if target is None or target == value.dtype:
                return arg
            self.requests += 1
            return self.cast(arg, target, rule)

        node.args = map_arg(node.args, rewrite)
        node.kwargs = map_arg(node.kwargs, rewrite)
        self.rules[rule] += 1
        if not self._changed(node):
            self.env[node] = self.original[node]
        else:
            try:
                self._set_value(node, self._evaluate(node))
            except Exception as exc:  # an op that cannot take the new dtypes: give it the old ones
                log.info(
                    "%s: '%s' cannot run on the new input dtypes (%s); casting its inputs back",
                    self.ctx.graph_name,
                    node.name,
                    exc,
                )
                self._restore(node, "restore")
                self._set_value(node, self._evaluate(node))
        value = self.env[node]
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            ds_meta(node).update(dtype=value.dtype, amp=rule)

    def _outputs(self, node: torch.fx.Node) -> None:
        def back(arg: torch.fx.Node) -> torch.fx.Node:
            old, now = self.original.get(arg), self._float(arg)
            if now is not None and isinstance(old, torch.Tensor) and old.dtype != now.dtype:
                with self.graph.inserting_before(node):
                    return self.cast(arg, old.dtype, "output")
            return arg

        node.args = map_arg(node.args, back)


# --------------------------------------------------------------------------------------------
# the pass
# --------------------------------------------------------------------------------------------


@dataclass
class AmpOptions:
    dtype: Literal["bf16", "fp16"] = field(default="bf16", metadata={"help": "low precision: bf16 | fp16"})
    policy: Literal["default", "autocast"] = field(
        default="default",
        metadata={"help": "default: norms/softmax/losses in fp32 everywhere; autocast: torch.autocast's lists for the device"},
    )
    cleanup: bool = field(default=True, metadata={"help": "fold redundant casts"})
    zero3_gather: Literal["low", "exact"] = field(
        default="low",
        metadata={
            "help": "ZeRO-3 all-gathers: low moves every parameter's low-precision copy (half the bytes, fp32 users read it "
            "upcast); exact lowers only gathers whose users all compute in the low precision"
        },
    )


def _has_user_autocast(gm: torch.fx.GraphModule) -> bool:
    names = {"_enter_autocast", "_exit_autocast"}
    return any(n.op == "call_function" and getattr(n.target, "__name__", "") in names for n in gm.graph.nodes)


def _annotate_aot_graph(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    params = {placeholders[i]: name for i, name in ctx.param_names.items() if i < len(placeholders)}
    for node in gm.graph.nodes:
        dtype = _dtype(node)
        if dtype is not None and dtype.is_floating_point and node.op != "output":
            ds_meta(node)["dtype"] = dtype
        found = cast_source(node)
        if found is not None:
            ds_meta(node)["amp"] = "cast"
            if found[0] in params:
                ds_meta(node)["amp_param_cast"] = params[found[0]]


@register_pass("amp", graphs=("pre_autograd", "forward", "backward"), options=AmpOptions)
def amp_pass(gm: torch.fx.GraphModule, ctx: PassContext, options: AmpOptions) -> torch.fx.GraphModule:
    """Give each op its compute dtype (low precision for matmuls, fp32 for sensitive ops) and fold redundant casts."""
    low = LOW_DTYPES[options.dtype]
    stats: dict[str, Any] = {"dtype": options.dtype, "policy": options.policy, "casts_inserted": 0}
    stats["casts_in_input"] = count_casts(gm)
    if ctx.graph_kind == "pre_autograd":
        if fake_mode_of(gm) is None:
            log.warning("%s: graph has no fake values; left unchanged (amp needs a Dynamo-captured graph)", ctx.graph_name)
            return gm
        if _has_user_autocast(gm):
            log.warning("%s: the model already uses torch.autocast; amp leaves this graph unchanged", ctx.graph_name)
            return gm
        inserter = _CastInserter(gm, ctx, low, options.policy, options.zero3_gather)
        stats["zero3_gathers_lowered"] = len(inserter.low_gathers)
        stats["casts_inserted"] = inserter.run()
        stats["casts_requested"] = inserter.requests
        stats["ops_by_rule"] = dict(inserter.rules)
    else:
        _annotate_aot_graph(gm, ctx)
    stats["casts_before_cleanup"] = count_casts(gm)
    removed = fold_casts(gm) if options.cleanup else 0
    stats["casts_removed"] = removed
    stats["casts_after_cleanup"] = count_casts(gm)
    ctx.analysis.setdefault("amp", {})[ctx.graph_name] = stats
    output = next(n for n in gm.graph.nodes if n.op == "output")
    ds_meta(output)["amp"] = {k: v for k, v in stats.items() if k != "ops_by_rule"}
    log.info("%s: %s casts before cleanup, %s after", ctx.graph_name, stats["casts_before_cleanup"], stats["casts_after_cleanup"])
    gm.recompile()
    return gm


# --------------------------------------------------------------------------------------------
# communication_data_type: the dtype of the ZeRO-2/3 gradient reduce-scatters
# --------------------------------------------------------------------------------------------


@dataclass
class CommDtypeOptions:
    dtype: Literal["fp32", "fp16", "bf16"] = field(default="fp32", metadata={"help": "dtype gradients are reduced in"})


@register_pass("comm_dtype", graphs=("backward",), options=CommDtypeOptions)
def comm_dtype_pass(gm: torch.fx.GraphModule, ctx: PassContext, options: CommDtypeOptions) -> torch.fx.GraphModule:
    """Reduce-scatter every ZeRO gradient in ``dtype``: cast the gradient before, the averaged shard back after.

    Runs before ``zero`` (which turns ``dscompile::zero_reduce_scatter`` into functional collectives),
    so the collective inherits the dtype and bucketing groups gradients of one dtype together.
    """
    comm = COMM_DTYPES[options.dtype]
    graph = gm.graph
    stats = {"dtype": options.dtype, "reduce_scatters": 0, "recast": 0}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not zero_ops.REDUCE_SCATTER:
            continue
        stats["reduce_scatters"] += 1
        grad = node.args[0]
        dtype = _dtype(grad) if isinstance(grad, torch.fx.Node) else None
        if dtype is None or not dtype.is_floating_point or dtype == comm:
            continue
        with graph.inserting_before(node):
            down = graph.call_function(aten._to_copy.default, (grad,), {"dtype": comm})
        set_fake_value(down)
        ds_meta(down).update(dtype=comm, amp="cast", amp_cast={"reason": "communication", "source": grad.name})
        node.args = (down, *node.args[1:])
        set_fake_value(node)
        ds_meta(node)["dtype"] = comm
        with graph.inserting_after(node):
            back = graph.call_function(aten._to_copy.default, (node,), {"dtype": dtype})
        node.replace_all_uses_with(back, delete_user_cb=lambda user, keep=back: user is not keep)
        set_fake_value(back)
        ds_meta(back).update(dtype=dtype, amp="cast", amp_cast={"reason": "communication", "source": node.name})
        stats["recast"] += 1
    if stats["reduce_scatters"] == 0 and any(
        n.op == "call_function" and n.target is torch.ops._c10d_functional.reduce_scatter_tensor.default for n in graph.nodes
    ):
        log.warning("%s: comm_dtype found only functional reduce-scatters: put it before 'zero' in the pipeline", ctx.graph_name)
    ctx.analysis.setdefault("comm_dtype", {})[ctx.graph_name] = stats
    gm.recompile()
    return gm
