"""The ``tensor_parallel`` config section: DeepSpeed's AutoTP keys parsed into ``TensorParallelConfig``.

What is accepted, what is refused (with the key and the fix), and what the split graph compiles under once the split
is applied (``split_graph_sections``). Parsed here, apart from the graph work, so the section registers on import.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dscompile.config import parse_dataclass, register_section, unbuilt
from dscompile.errors import DSCompileConfigError, DSCompileNotSupportedError
from dscompile.passes.tensor_parallel.graph_facts import SECTION


@dataclass
class LayerSpec:
    """DeepSpeed's ``TPLayerSpec``. The graph decides the split; a spec overrides which blocks split (``skip``,
    ``use_default_specs``), and what it states (role, ``shape`` of a fused weight's parts, ``partition_dim``,
    ``grad_allreduce``) is checked against what the graph shows: a disagreement is an error naming the pattern."""

    patterns: list[str] = field(default_factory=list)
    partition_type: str = "column"
    shape: list[Any] | None = None  # a fused weight's parts along partition_dim: [3, -1] equal parts, [[q, k, v], -1] unequal
    partition_dim: int | None = None  # default: 0 for column, 1 for row (an nn.Linear weight)
    model_types: list[str] | None = None  # the spec applies only to models whose config.model_type is listed
    gather_output: bool = unbuilt(False, "a column-parallel linear with gathered output (split an LM head with vocab_parallel_lm_head)")
    grad_allreduce: bool = False  # skip specs: a replicated weight whose gradient each rank computes a part of (summed over TP)

    def validate(self, path: str) -> None:
        if self.partition_type not in ("column", "row", "skip"):
            raise DSCompileConfigError(f"{path}.partition_type", f"{self.partition_type!r} is not a partition type", "use column, row or skip")
        if self.grad_allreduce and self.partition_type != "skip":
            raise DSCompileConfigError(f"{path}.grad_allreduce", "applies to skip specs only (a split weight's gradient is already its own)", "remove it")
        if isinstance(self.shape, (list, tuple)):  # a Python config writes DeepSpeed's shapes as tuples: ((q, k, v), -1)
            self.shape = [list(x) if isinstance(x, tuple) else x for x in self.shape]
        if self.shape is not None:
            if len(self.shape) != 2:
                raise DSCompileNotSupportedError(f"{path}.shape", f"views of a weight as {len(self.shape)}-D sub-parameters (shape {self.shape})")
            dim = self.partition_dim if self.partition_dim is not None else (0 if self.partition_type == "column" else 1)
            parts = self.shape[dim] if 0 <= dim < 2 else None
            whole = self.shape[1 - dim] if 0 <= dim < 2 else None
            if whole != -1 or not (
                (isinstance(parts, int) and parts > 0) or (isinstance(parts, list) and parts and all(isinstance(x, int) and x > 0 for x in parts))
            ):
                fix = "give the parts at partition_dim (a count, or a list of sizes) and -1 at the other dim"
                raise DSCompileConfigError(f"{path}.shape", f"{self.shape} with partition_dim {dim}", fix)
        for pattern in self.patterns:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise DSCompileConfigError(f"{path}.patterns", f"{pattern!r} is not a regular expression ({exc})") from None


@dataclass
class PartitionConfig:
    use_default_specs: bool = True
    layer_specs: list[LayerSpec] = field(default_factory=list)


@dataclass
class TensorParallelConfig:
    autotp_size: int = 1
    tp_overlap_comm: bool = False
    vocab_parallel_lm_head: bool = False  # split the LM head (and an embedding tied to it) by vocabulary rows
    sequence_parallel: bool = False  # Megatron's: the residual stream between blocks sharded along the sequence
    partition_config: PartitionConfig = field(default_factory=PartitionConfig)

    @property
    def enabled(self) -> bool:
        return self.autotp_size > 1


_REFUSED_WHEN_SET = {
    "injection_policy_tuple": (
        "a training injection_policy_tuple (DeepSpeed's training AutoTP overwrites it with its own parse; the pass finds the blocks "
        "from the graph; init_inference takes it, checked against the split)"
    ),
    "preset_model": "DeepSpeed's per-architecture presets (the pass finds the blocks from the graph)",
    "keep_module_on_host": "keeping the partitioned module on the host",
    "kernel_inject": "DeepSpeed's inference kernels",
    "replace_with_kernel_inject": "DeepSpeed's inference kernels",
}


def parse_tensor_parallel(value: Any, path: str) -> TensorParallelConfig:
    if not isinstance(value, Mapping):
        raise DSCompileConfigError(path, f"expected a JSON object, got {type(value).__name__}")
    section = dict(value)
    if section.pop("vocab_parallel_ce_backend", "torch") not in ("torch", None):  # DeepSpeed's default is this pass's own (torch ops)
        raise DSCompileNotSupportedError(f"{path}.vocab_parallel_ce_backend", "a vocabulary-parallel cross-entropy other than torch's (liger)")
    for key, capability in _REFUSED_WHEN_SET.items():
        if section.pop(key, None) not in (None, False, "", [], {}):
            raise DSCompileNotSupportedError(f"{path}.{key}", capability)
    dtype = section.pop("dtype", None)
    if dtype is not None:
        raise DSCompileConfigError(f"{path}.dtype", "the parameters' dtype is set by bf16/fp16 here", f"remove {path}.dtype; use the bf16 or fp16 section")
    tp = section.pop("tp", None) or {}
    if not isinstance(tp, Mapping):
        raise DSCompileConfigError(f"{path}.tp", f"expected a JSON object, got {type(tp).__name__}")
    for key in tp:
        if key not in ("tp_size", "tp_grain_size", "mpu", "tp_group"):
            raise DSCompileConfigError(f"{path}.tp.{key}", "unknown key", "valid keys here: tp_size, tp_grain_size, mpu, tp_group")
    if tp.get("mpu") is not None or tp.get("tp_group") is not None:
        raise DSCompileNotSupportedError(f"{path}.tp.mpu", "user-made tensor-parallel groups (dscompile lays out TP × DP itself)")
    if (tp.get("tp_grain_size") or 1) != 1:
        raise DSCompileNotSupportedError(f"{path}.tp.tp_grain_size", "tensor-parallel grains other than 1")
    if section.get("autotp_size") in (None, 0):
        section["autotp_size"] = 1
    tp_size = tp.get("tp_size") or 1
    if tp_size > 1 and section["autotp_size"] not in (1, tp_size):
        raise DSCompileConfigError(f"{path}.tp.tp_size", f"{tp_size} contradicts autotp_size {section['autotp_size']}", "set one of them")
    if tp_size > 1:
        section["autotp_size"] = tp_size
    config = parse_dataclass(TensorParallelConfig, section, path)
    if config.autotp_size < 1:
        raise DSCompileConfigError(f"{path}.autotp_size", f"expected a positive integer, got {config.autotp_size}")
    if config.sequence_parallel and not config.enabled:
        raise DSCompileConfigError(
            f"{path}.sequence_parallel",
            "Megatron's sequence parallelism shards over the tensor-parallel group, and autotp_size is 1",
            "set autotp_size > 1, or drop sequence_parallel",
        )
    return config


register_section(SECTION, parse_tensor_parallel, "tensor parallelism")


def split_graph_sections(sections: Mapping[str, Any]) -> dict[str, Any]:
    """The config sections the split graph compiles under: tensor parallelism is already applied, so its section
    goes, except that with ``tp_overlap_comm`` it stays at ``autotp_size`` 1 (nothing more to split) for the
    ``tp_overlap`` pass (``passes/tensor_parallel/overlap.py``) to read."""
    out = {k: v for k, v in sections.items() if k != SECTION}
    tc = sections.get(SECTION)
    if tc is not None and tc.tp_overlap_comm:
        out[SECTION] = dataclasses.replace(tc, autotp_size=1)
    return out


def tensor_parallel_config(config: Any) -> TensorParallelConfig | None:
    section = config.sections.get(SECTION) if hasattr(config, "sections") else None
    return section if section is not None and section.enabled else None
