"""Nothing silently ignored: every config key a dataclass accepts is read by some code, or refused.

The check walks every config dataclass reachable from ``DSConfig`` and the registered sections,
and looks for an attribute read of each field (``x.field``) anywhere in the package's source
outside the dataclass's own ``validate`` (validating a value is not using it). A field nobody
reads must either be refused when set to a non-default value (checked here by parsing it) or be
listed in ``ALLOWED_UNREAD`` with the reason it may be accepted and left alone. An entry that is
no longer needed fails too, so the list stays honest. The scan is by field name, so it catches
keys no code touches at all (the failure this guards against); it cannot tell which object a read
belongs to.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import typing
from pathlib import Path
from typing import Any

import pytest

from dscompile.config import _SECTIONS, DSConfig, load_config, parse_dataclass
from dscompile.errors import DSCompileConfigError

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("dscompile", "passes", "backends", "kernels")

ALLOWED_UNREAD: dict[tuple[str, str], str] = {
    ("ZeroConfig", "contiguous_gradients"): "DeepSpeed's contiguous gradient buffer: ZeRO-2/3 gradients here are the graph's own "
    "reduce-scatter outputs, already one buffer per bucket (same maths, documented in ZeroConfig)",
    ("ZeroConfig", "round_robin_gradients"): "DeepSpeed's order of copying gradients into its CPU-offload buffers; the offloaded "
    "step here reads each shard's gradient in place (same maths, documented)",
    ("ZeroConfig", "memory_efficient_linear"): "DeepSpeed's custom linear autograd function for ZeRO-3; the compiled graph "
    "releases gathered weights itself (same maths, documented)",
    ("ZeroConfig", "elastic_checkpoint"): "every dscompile ZeRO checkpoint loads on any world size (resharded), so both values "
    "behave as true (tests/test_zero_checkpoint.py); documented in ZeroConfig",
    ("ActivationCheckpointingConfig", "contiguous_memory_optimization"): "DeepSpeed copies checkpointed activations into one "
    "preallocated buffer against fragmentation; the compiled graph's allocator plans these buffers (same maths)",
    ("ZeroConfig", "use_multi_rank_bucket_allreduce"): "tunes DeepSpeed's own buffers, hooks or logs; the maths is the same (documented in ZeroConfig)",
    ("ZeroConfig", "compute_grad_norm"): "dscompile computes the global norm only where clipping needs it; get_global_grad_norm() reports it then (documented)",
    ("ZeroConfig", "stage3_module_granularity_threshold"): "DeepSpeed's hook granularity for ZeRO-3 leaf modules; the compiled graph places gathers per "
    "use (documented)",
    ("ZeroConfig", "stage3_use_all_reduce_for_fetch_params"): "tunes DeepSpeed's own buffers, hooks or logs; the maths is the same (documented in "
    "ZeroConfig)",
    ("ZeroConfig", "stage3_allgather_sequential"): "tunes DeepSpeed's own buffers, hooks or logs; the maths is the same (documented in ZeroConfig)",
    ("ZeroConfig", "legacy_stage1"): "tunes DeepSpeed's own buffers, hooks or logs; the maths is the same (documented in ZeroConfig)",
    ("ZeroConfig", "parameter_alignment"): "tunes DeepSpeed's own buffers, hooks or logs; the maths is the same (documented in ZeroConfig)",
    ("ZeroConfig", "log_trace_cache_warnings"): "tunes DeepSpeed's own buffers, hooks or logs; the maths is the same (documented in ZeroConfig)",
    ("ZeroConfig", "enable_sanity_checks"): "tunes DeepSpeed's own buffers, hooks or logs; the maths is the same (documented in ZeroConfig)",
    ("ZeroConfig", "save_muon_momentum_buffer_in_memory"): "tunes DeepSpeed's own buffers, hooks or logs; the maths is the same (documented in ZeroConfig)",
    ("ZeroConfig", "leaf_module"): "DeepSpeed's ZeRO-3 leaf-module hooks; the compiled graph sees through modules (documented)",
    ("BF16Config", "immediate_grad_update"): "when DeepSpeed's bf16 optimizer copies gradients; the maths is the same (documented in BF16Config)",
    ("OptimizerConfig", "legacy_fusion"): "DeepSpeed's fp16 optimizer implementation switch; the maths is the same",
    ("PipelineParallelConfig", "seed_layers"): "read by DeepSpeed's PipelineModule, not from the config (documented in PipelineParallelConfig)",
    ("PipelineParallelConfig", "pipe_partitioned"): "splits activations over a tensor-parallel group, which is not built: nothing to split, as in "
    "DeepSpeed without model parallelism",
    ("PipelineParallelConfig", "grad_partitioned"): "splits gradients over a tensor-parallel group, which is not built: nothing to split, as in DeepSpeed "
    "without model parallelism",
    ("PipelineParallelConfig", "use_reentrant"): "picks DeepSpeed's recomputation API; the gradients are the same",
    ("CompressionConfig", "weight_quantization"): "read by name: CompressionConfig.technique(name) is getattr over TECHNIQUES (tests/test_compression*.py)",
    ("CompressionConfig", "activation_quantization"): "read by name: CompressionConfig.technique(name) is getattr over TECHNIQUES (tests/test_compression*.py)",
    ("CompressionConfig", "sparse_pruning"): "read by name: CompressionConfig.technique(name) is getattr over TECHNIQUES (tests/test_compression*.py)",
    ("CompressionConfig", "row_pruning"): "read by name: CompressionConfig.technique(name) is getattr over TECHNIQUES (tests/test_compression*.py)",
    ("CompressionConfig", "head_pruning"): "read by name: CompressionConfig.technique(name) is getattr over TECHNIQUES (tests/test_compression*.py)",
    ("CompressionConfig", "channel_pruning"): "read by name: CompressionConfig.technique(name) is getattr over TECHNIQUES (tests/test_compression*.py)",
}

# Non-default values to try where flipping the default is not enough to reach the refusal.
NON_DEFAULT: dict[tuple[str, str], Any] = {
    ("ZeroConfig", "offload_optimizer"): {"device": "cpu"},
    ("ZeroConfig", "offload_param"): {"device": "nvme"},
    ("ZeroConfig", "cpu_offload_param"): True,
    ("ZeroConfig", "zenflow"): {"topk_ratio": 0.1},
}


def config_dataclasses() -> set[type]:
    """DSConfig, every dataclass a registered section parses into, and the dataclasses they nest."""
    load_config({})  # registers the capability sections
    found: set[type] = set()

    def collect(cls: type) -> None:
        if cls in found:
            return
        found.add(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            for arg in (hints[f.name], *typing.get_args(hints[f.name])):
                if dataclasses.is_dataclass(arg):
                    collect(arg)

    collect(DSConfig)
    for key, spec in _SECTIONS.items():
        if spec.parser is None:
            continue
        try:
            value = spec.parser({}, key)
        except DSCompileConfigError:
            continue
        if dataclasses.is_dataclass(value):
            collect(type(value))
    return found


def attribute_reads() -> dict[str, list[tuple[Path, int]]]:
    """Every ``x.name`` in the package's source, with where it is."""
    reads: dict[str, list[tuple[Path, int]]] = {}
    for folder in SOURCES:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                    reads.setdefault(node.attr, []).append((path.resolve(), node.lineno))
    return reads


def _validate_lines(cls: type) -> tuple[Path, range] | None:
    validate = cls.__dict__.get("validate")
    if validate is None:
        return None
    lines, start = inspect.getsourcelines(validate)
    return Path(inspect.getsourcefile(validate) or "").resolve(), range(start, start + len(lines))


def unread_fields() -> set[tuple[str, str]]:
    reads = attribute_reads()
    unread = set()
    for cls in config_dataclasses():
        skip = _validate_lines(cls)
        for f in dataclasses.fields(cls):
            if f.name in ("sections", "raw"):
                continue
            places = [(p, line) for p, line in reads.get(f.name, []) if skip is None or not (p == skip[0] and line in skip[1])]
            if not places:
                unread.add((cls.__name__, f.name))
    return unread


def _non_default(cls: type, f: dataclasses.Field) -> Any:
    if (cls.__name__, f.name) in NON_DEFAULT:
        return NON_DEFAULT[(cls.__name__, f.name)]
    default = f.default if f.default is not dataclasses.MISSING else None
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default + 2
    return None


def _refused(cls: type, f: dataclasses.Field) -> bool:
    value = _non_default(cls, f)
    if value is None:
        return False
    try:
        parse_dataclass(cls, {f.name: value}, "section")
    except DSCompileConfigError as exc:
        return f.name in str(exc)
    return False


def test_every_config_key_is_read_or_refused() -> None:
    classes = {cls.__name__: cls for cls in config_dataclasses()}
    assert {"DSConfig", "ZeroConfig", "FP16Config", "BF16Config", "PipelineParallelConfig"} <= set(classes)
    unread = unread_fields()
    silent = []
    for name, field_name in sorted(unread - set(ALLOWED_UNREAD)):
        cls = classes[name]
        f = next(f for f in dataclasses.fields(cls) if f.name == field_name)
        if not _refused(cls, f):
            silent.append(f"{name}.{field_name}")
    assert not silent, f"config keys accepted but neither read by any code nor refused when set: {silent}"
    stale = sorted(f"{a}.{b}" for a, b in set(ALLOWED_UNREAD) - unread)
    assert not stale, f"ALLOWED_UNREAD lists keys that code now reads: {stale}; remove them from the list"


def test_the_check_catches_an_unread_key() -> None:
    """A key no code reads, added to a config dataclass, is reported (the check can fail)."""

    @dataclasses.dataclass
    class Probe:
        stage: int = 0
        a_key_nobody_reads_7f3a: bool = False

    reads = attribute_reads()
    assert "stage" in reads and "a_key_nobody_reads_7f3a" not in reads
    f = dataclasses.fields(Probe)[1]
    assert not _refused(Probe, f)


@pytest.mark.parametrize(
    "section,key",
    [
        ("zero_optimization", "load_from_fp32_weights"),
        ("fp16", "auto_cast"),
        ("fp16", "fp16_master_weights_and_grads"),
    ],
)
def test_refused_keys_name_themselves(section: str, key: str) -> None:
    value = {"load_from_fp32_weights": False}.get(key, True)
    with pytest.raises(DSCompileConfigError, match=key) as info:
        load_config({section: {"stage": 1, key: value} if section == "zero_optimization" else {"enabled": True, key: value}})
    assert info.value.key == f"{section}.{key}"
    load_config({section: {"stage": 1, key: not value} if section == "zero_optimization" else {"enabled": True, key: not value}})
