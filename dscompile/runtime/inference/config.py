"""``init_inference``'s config: DeepSpeed-Inference's keys (``DeepSpeedInferenceConfig``) as typed dataclasses.

Every key DeepSpeed accepts is accepted here by name (aliases included: ``kernel_inject``, ``tp``,
``max_tokens``, ``min_tokens``, ``tm``, ``ckpt_config``, ``injection_dict``, ``args``), and either
implemented or refused with ``DSCompileNotSupportedError`` naming the key when set to anything but
its default. Built: ``dtype`` (fp32, fp16, bf16), ``replace_with_kernel_inject`` (the inference
fusion passes), ``max_out_tokens`` / ``min_out_tokens`` (the static KV cache), ``quant.weight``
(weight-only int8/int4, grouped, symmetric or asymmetric), ``tensor_parallel.tp_size`` (ranks per model;
with ``quant`` and ``replace_with_kernel_inject`` too, ``passes/inference_tensor_parallel.py``).
dscompile's own keys: ``lower`` (the lowering of the prefill/decode graphs) and ``dump``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from dscompile.config import LowerName, parse_dataclass, unbuilt
from dscompile.errors import DSCompileConfigError, DSCompileNotSupportedError

log = logging.getLogger("dscompile.engines.inference")

ALIASES = {
    "kernel_inject": "replace_with_kernel_inject",
    "tp": "tensor_parallel",
    "max_tokens": "max_out_tokens",
    "min_tokens": "min_out_tokens",
    "tm": "triangular_masking",
    "ckpt_config": "checkpoint_config",
    "injection_dict": "injection_policy",
    "args": "config",
    "expert_group": "ep_group",
    "expert_mp_group": "ep_mp_group",
}

_DTYPES: dict[str, torch.dtype] = {}
for _dtype, _names in {
    torch.float32: ("torch.float32", "fp32", "float32", "float"),
    torch.float16: ("torch.float16", "fp16", "float16", "half"),
    torch.bfloat16: ("torch.bfloat16", "bf16", "bfloat16", "bfloat"),
    torch.int8: ("torch.int8", "int8"),
}.items():
    for _name in _names:
        _DTYPES[_name] = _dtype

TP_GROUPS_NOT_BUILT = "user-made tensor-parallel groups (dscompile lays out the TP groups over the world itself)"


@dataclass
class TensorParallelConfig:
    """``tensor_parallel`` (alias ``tp``): ``tp_size`` ranks per model (``passes/inference_tensor_parallel.py``)."""

    enabled: bool = True
    tp_size: int = 1
    mpu: Any = unbuilt(None, TP_GROUPS_NOT_BUILT)
    tp_group: Any = unbuilt(None, TP_GROUPS_NOT_BUILT)

    def validate(self, path: str) -> None:
        if self.tp_size < 1:
            raise DSCompileConfigError(f"{path}.tp_size", f"must be >= 1, got {self.tp_size}")


@dataclass
class WeightQuantConfig:
    """``quant.weight``: weight-only quantization, DeepSpeed's ``num_bits``/``q_type``/``q_groups``.

    ``q_groups`` splits each weight (flattened as ``[out, in]``) into that many equal chunks, each
    with its own scale (and zero point when asymmetric). Not given: groups of 128 input columns of
    each row (DeepSpeed's default is one group per weight; see ``runtime/inference/weights.py``).
    ``quantize_embeddings`` (dscompile's own key): quantize the embeddings and the output head too; by
    default they stay in ``dtype``, as DeepSpeed's int8 kernel injection leaves them."""

    enabled: bool = True
    num_bits: int = 8
    q_type: Literal["symmetric", "asymmetric"] = "symmetric"
    q_groups: int | None = None
    quantize_embeddings: bool = False
    quantized_initialization: Any = unbuilt(None, "quantized checkpoint loading (quant.weight.quantized_initialization)")
    post_init_quant: Any = unbuilt(None, "per-module quantization policies (quant.weight.post_init_quant)")

    def validate(self, path: str) -> None:
        if self.num_bits not in (8, 4):
            raise DSCompileConfigError(f"{path}.num_bits", f"{self.num_bits} bits is not built", "use 8 or 4")
        if self.q_groups is not None and self.q_groups < 1:
            raise DSCompileConfigError(f"{path}.q_groups", f"must be >= 1, got {self.q_groups}")


@dataclass
class ActivationQuantConfig:
    """``quant.activation``: DeepSpeed's MoQ activation quantization; not built (weight-only here)."""

    enabled: bool = unbuilt(False, "activation quantization at inference (quant.activation)")
    num_bits: int = unbuilt(8, "activation quantization at inference (quant.activation)")
    q_type: str = unbuilt("symmetric", "activation quantization at inference (quant.activation)")
    q_groups: int = unbuilt(1, "activation quantization at inference (quant.activation)")


@dataclass
class QKVQuantConfig:
    """``quant.qkv``: whether the attention projections are quantized too (they are; only the default is built)."""

    enabled: bool = unbuilt(True, "leaving the QKV projections unquantized (quant.qkv.enabled: false)")


@dataclass
class QuantConfig:
    """``quant``. Off unless ``enabled`` is given true (DeepSpeed quantizes only for dtype int8)."""

    enabled: bool = False
    weight: WeightQuantConfig = field(default_factory=WeightQuantConfig)
    activation: ActivationQuantConfig = field(default_factory=ActivationQuantConfig)
    qkv: QKVQuantConfig = field(default_factory=QKVQuantConfig)

    @property
    def weight_bits(self) -> int | None:
        """Bits of the weight-only quantization, or None when the model stays in floating point."""
        return self.weight.num_bits if self.enabled and self.weight.enabled else None


@dataclass
class CheckpointConfig:
    """``checkpoint_config`` (alias ``ckpt_config``)."""

    checkpoint_dir: str | None = unbuilt(None, "loading DeepSpeed inference checkpoints")
    save_mp_checkpoint_path: str | None = unbuilt(None, "saving model-parallel inference checkpoints")
    base_dir: str | None = unbuilt(None, "loading DeepSpeed inference checkpoints")


_MOE = "mixture-of-experts inference"


@dataclass
class InferenceConfig:
    """The whole ``init_inference`` config (DeepSpeed's keys, then dscompile's own)."""

    replace_with_kernel_inject: bool = False
    dtype: Any = torch.float16  # DeepSpeed's default; a torch.dtype or one of its names
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    enable_cuda_graph: bool = unbuilt(False, "CUDA graphs for inference")
    use_triton: bool = unbuilt(False, "DeepSpeed's Triton inference kernels (dscompile lowers through 'lower' instead)")
    triton_autotune: bool = unbuilt(False, "Triton autotuning for inference")
    zero: Any = unbuilt(None, "ZeRO-Inference")
    triangular_masking: bool = unbuilt(True, "non-causal masking override (triangular_masking: false)")
    moe: Any = unbuilt(None, _MOE)
    quant: QuantConfig = field(default_factory=QuantConfig)
    checkpoint: Any = unbuilt(None, "loading DeepSpeed inference checkpoints")
    base_dir: str = unbuilt("", "loading DeepSpeed inference checkpoints")
    set_empty_params: bool = unbuilt(False, "empty-parameter inference modules")
    save_mp_checkpoint_path: str | None = unbuilt(None, "saving model-parallel inference checkpoints")
    checkpoint_config: CheckpointConfig = field(default_factory=CheckpointConfig)
    return_tuple: bool = unbuilt(True, "DeepSpeed's injected transformer layers' return type (the model's own outputs are returned)")
    training_mp_size: int = unbuilt(1, "loading checkpoints trained with model parallelism")
    replace_method: str = unbuilt("auto", "replace_method (deprecated in DeepSpeed; remove it)")
    injection_policy: Any = None  # {layer class: linear names}: checked, see validate and passes/inference_tensor_parallel.py
    injection_policy_tuple: Any = None  # the all-reduce linears' names, no class: injection_policy's check (engines/inference.py)
    config: Any = unbuilt(None, "a model config for kernel injection (dscompile reads the captured graph)")
    max_out_tokens: int = 1024
    min_out_tokens: int = 1
    transposed_mode: bool = unbuilt(False, "transposed weight mode")
    mpu: Any = unbuilt(None, TP_GROUPS_NOT_BUILT)
    ep_size: int = unbuilt(1, _MOE)
    ep_group: Any = unbuilt(None, _MOE)
    ep_mp_group: Any = unbuilt(None, _MOE)
    moe_experts: Any = unbuilt(None, _MOE)
    moe_type: str = unbuilt("standard", _MOE)
    tp_grain_size: int = unbuilt(64, "tensor-parallel grain sizes")
    # dscompile's own keys
    lower: LowerName | None = None
    dump: str | None = None

    def validate(self, path: str) -> None:
        self.dtype = parse_dtype(self.dtype)
        if self.dtype == torch.int8:
            raise DSCompileConfigError(
                "dtype",
                "torch.int8 (DeepSpeed's MoQ path) is not a compute dtype here",
                'keep a float dtype and set quant={"enabled": True, "weight": {"num_bits": 8}}',
            )
        if self.max_out_tokens < 1:
            raise DSCompileConfigError("max_out_tokens", f"must be >= 1, got {self.max_out_tokens}")
        if not 1 <= self.min_out_tokens <= self.max_out_tokens:
            raise DSCompileConfigError("min_out_tokens", f"must be between 1 and max_out_tokens ({self.max_out_tokens}), got {self.min_out_tokens}")
        self.injection_policy = parse_injection_policy(self.injection_policy)
        self.injection_policy_tuple = parse_linear_names(self.injection_policy_tuple)
        if self.injection_policy and self.injection_policy_tuple:
            raise DSCompileConfigError(
                "injection_policy_tuple", "given with injection_policy (DeepSpeed fills it in from injection_policy's values)", "drop injection_policy_tuple"
            )
        for key in ("injection_policy", "injection_policy_tuple"):
            if getattr(self, key) and self.replace_with_kernel_inject:
                raise DSCompileConfigError(key, "given with replace_with_kernel_inject (DeepSpeed uses one or the other)", "drop one of them")
        if not self.tensor_parallel.enabled and self.tensor_parallel.tp_size != 1:
            raise DSCompileConfigError("tensor_parallel.tp_size", "given with tensor_parallel.enabled false", "drop one of them")


def parse_injection_policy(value: Any) -> dict[type, tuple[str, ...]] | None:
    """DeepSpeed's ``injection_policy={LayerClass: ('attention.output.dense', 'output.dense')}``: per layer class, the
    linears whose outputs are all-reduced under tensor parallelism. A single string (``('output.dense')`` is one, as
    DeepSpeedExamples write it) is one name. What it means here: the tensor-parallel split must put its all-reduces
    after exactly those linears of those layers (checked at the first split); at tp_size 1 nothing is split."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or not value:
        raise DSCompileConfigError("injection_policy", f"expected a dict {{layer class: linear names}}, got {value!r}")
    policy: dict[type, tuple[str, ...]] = {}
    for cls, names in value.items():
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
            raise DSCompileConfigError("injection_policy", f"keys are layer classes (torch.nn.Module subclasses), got {cls!r}")
        names = (names,) if isinstance(names, str) else tuple(names)
        if not names or not all(isinstance(n, str) and n for n in names):
            raise DSCompileConfigError("injection_policy", f"{cls.__name__}: expected linear names (strings), got {value[cls]!r}")
        policy[cls] = names
    return policy


def parse_linear_names(value: Any) -> tuple[str, ...] | None:
    """DeepSpeed's ``injection_policy_tuple``: the names of the linears whose outputs are all-reduced (one value of
    ``injection_policy``, with no layer class); one string is one name."""
    if value is None:
        return None
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, (tuple, list)) or not names or not all(isinstance(n, str) and n for n in names):
        raise DSCompileConfigError(
            "injection_policy_tuple", f"expected linear names (a tuple of strings), got {value!r}", "e.g. ('self_attn.o_proj', 'mlp.down_proj')"
        )
    return tuple(names)


def parse_dtype(value: Any) -> torch.dtype:
    if isinstance(value, torch.dtype):
        if value not in _DTYPES.values():
            raise DSCompileConfigError("dtype", f"{value} is not one of float32, float16, bfloat16")
        return value
    if isinstance(value, str) and value in _DTYPES:
        return _DTYPES[value]
    raise DSCompileConfigError("dtype", f"{value!r} is not a dtype", "use torch.float32, torch.float16, torch.bfloat16 or their names ('fp16', ...)")


def _canonical(data: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = ALIASES.get(key, key)
        if name in out:
            raise DSCompileConfigError(key, f"given together with {name!r}", f"keep only {name!r}")
        out[name] = value
    return out


# DeepSpeed's defaults of unbuilt keys that are mutable ({} and [1]): given at those values they mean "off".
_EMPTY_DEFAULTS: dict[str, Any] = {"zero": {}, "moe": {}, "moe_experts": [1]}
_EMPTY_WEIGHT_DEFAULTS: dict[str, Any] = {"quantized_initialization": {}, "post_init_quant": {}}


def _drop_empty_defaults(data: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    for key, default in defaults.items():
        if key in data and data[key] == default:
            data.pop(key)
    return data


def _map_mp_size(data: dict[str, Any]) -> None:
    """``mp_size``: DeepSpeed's deprecated spelling of ``tensor_parallel.tp_size``, mapped as DeepSpeed maps it
    (a warning; refused together with an explicit ``tp_size``)."""
    if "mp_size" not in data:
        return
    mp_size = data.pop("mp_size")
    tp = data.get("tensor_parallel") or {}
    if not isinstance(tp, Mapping):
        raise DSCompileConfigError("tensor_parallel", f"expected a dict, got {type(tp).__name__}")
    if "tp_size" in tp:
        raise DSCompileConfigError("mp_size", "given together with tensor_parallel.tp_size", "keep only tensor_parallel.tp_size (mp_size is its old name)")
    log.warning("init_inference: mp_size is deprecated, as in DeepSpeed; read as tensor_parallel.tp_size=%s", mp_size)
    data["tensor_parallel"] = {**tp, "tp_size": mp_size}


def parse_inference_config(config: Any = None, **kwargs: Any) -> InferenceConfig:
    """``init_inference(model, config=..., **kwargs)``'s settings: keyword arguments override the dict."""
    if isinstance(config, InferenceConfig) and not kwargs:
        return config
    if config is None:
        data: dict[str, Any] = {}
    elif isinstance(config, Mapping):
        data = _canonical(config)
    else:
        raise DSCompileConfigError("config", f"expected a dict, got {type(config).__name__}")
    data.update(_canonical(kwargs))
    if isinstance(data.get("moe"), bool):
        if data["moe"]:
            raise DSCompileNotSupportedError("moe", _MOE)
        data.pop("moe")
    _drop_empty_defaults(data, _EMPTY_DEFAULTS)
    _map_mp_size(data)
    weight = data.get("quant", {}).get("weight") if isinstance(data.get("quant"), Mapping) else None
    if isinstance(weight, Mapping):
        data["quant"] = {**data["quant"], "weight": _drop_empty_defaults(dict(weight), _EMPTY_WEIGHT_DEFAULTS)}
    return parse_dataclass(InferenceConfig, data, "")
