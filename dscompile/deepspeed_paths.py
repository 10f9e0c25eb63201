"""DeepSpeed import paths dscompile refuses, each with the reason, so ``import dscompile as deepspeed`` fails clearly.

A script ported by its imports may reach a DeepSpeed module or name that maps to no dscompile capability
(hand-written CUDA kernels, the hybrid engine, data efficiency, ...). Without this table it would get
Python's bare ``No module named 'dscompile.ops.transformer'``; with it, a ``DSCompileImportError`` (an
``ImportError``) that names DeepSpeed's path and says why. ``RefusedModuleFinder`` answers for the modules,
``refused_name`` for single names that modules' ``__getattr__`` do not have. docs/deepspeed-migration.md
lists the same table for users.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any

from dscompile.errors import DSCompileImportError

_KERNELS = "a DeepSpeed hand-written CUDA/C++ kernel; dscompile generates its kernels from the model's own PyTorch code in the compiled graph"

REFUSED_MODULES: dict[str, tuple[str, str | None]] = {
    # deepspeed.ops.*
    "ops.transformer": (_KERNELS + " (DeepSpeedTransformerLayer, inference kernels)", "keep the model's PyTorch layers; init_inference fuses them"),
    "ops.op_builder": ("DeepSpeed's C++/CUDA extension builders; dscompile builds no extensions", None),
    "ops.aio": ("DeepSpeed's async I/O op", "NVMe offload is configured with zero_optimization.offload_* and the aio section"),
    "ops.quantizer": (_KERNELS, "quantization is configured with compression_training or init_inference(quant=...)"),
    "ops.fp_quantizer": (_KERNELS, None),
    "ops.evoformer_attn": (_KERNELS + " (DeepSpeed4Science's Evoformer attention)", None),
    "ops.deepspeed4science": (_KERNELS + " (DeepSpeed4Science)", None),
    "ops.random_ltd": ("random layer-token drop (data efficiency) is not built", None),
    "ops.spatial": (_KERNELS, None),
    "ops.lion": ("the Lion optimizer is not built", "use Adam/AdamW"),
    "ops.adagrad": ("DeepSpeed's CPU Adagrad kernel has not been checked against torch.optim.Adagrad", 'use optimizer type "Adagrad" in the config'),
    "ops.muon": ("the Muon optimizer is not built", None),
    # deepspeed.runtime.*
    "runtime.domino": ("DeepSpeed-Domino (tensor-parallel communication overlap) is not built", None),
    "runtime.data_pipeline": ("data efficiency (curriculum learning, random-LTD, variable batch size) is not built", None),
    "runtime.hybrid_engine": ("the hybrid engine (RLHF's train/generate switch) is not built", None),
    "runtime.superoffload": ("SuperOffload is not built", "use zero_optimization.offload_optimizer"),
    "runtime.zenflow": ("ZenFlow is not built", "use zero_optimization.offload_optimizer"),
    "runtime.eigenvalue": ("eigenvalue-based adaptive quantization is not built", None),
    "runtime.progressive_layer_drop": ("progressive layer drop is not built", None),
    # elsewhere
    "compile": ("DeepCompile's own passes: dscompile is the compiler", "write a dscompile 'pipeline' in the config instead"),
    "autotuning": ("autotuning is not built", None),
    "elasticity": ("elastic training is not built", None),
    "monitor": ("DeepSpeed's monitors (TensorBoard, W&B, CSV, Comet) are not built", "log from the script"),
    "profiling": ("DeepSpeed's flops profiler is not built", "use torch.profiler, or wall_clock_breakdown for step timings"),
    "nvme": ("DeepSpeed's NVMe benchmarking tools are not built", None),
    "launcher": ("DeepSpeed's launcher is not provided", "launch with torchrun (same environment variables)"),
}
"""DeepSpeed module (relative to ``deepspeed.``) -> (why it is refused, what to use instead)."""

REFUSED_NAMES: dict[str, tuple[str, str | None]] = {
    "DeepSpeedTransformerLayer": REFUSED_MODULES["ops.transformer"],
    "DeepSpeedTransformerConfig": REFUSED_MODULES["ops.transformer"],
    "replace_transformer_layer": ("kernel injection of DeepSpeed's CUDA transformer kernels", "use deepspeed.init_inference"),
    "DeepSpeedHybridEngine": REFUSED_MODULES["runtime.hybrid_engine"],
    "DeepSpeedConfig": (
        "DeepSpeed's config object (several of its attributes changed between releases)",
        "use dscompile.load_config(path): a DSConfig with train_batch_size, train_micro_batch_size_per_gpu, ...",
    ),
    "DualPipeVEngine": ("the DualPipeV schedule is not built", "use PipelineModule with the 1F1B schedule"),
    "DualPipeVModule": ("the DualPipeV schedule is not built", "use PipelineModule with the 1F1B schedule"),
    "FusedLamb": ("the LAMB optimizer is not built (the config's optimizer type Lamb is refused too)", "use Adam/AdamW, or OneBitLamb's config type"),
    "SparseSelfAttention": (
        "the hand-placed sparse attention modules are not built; dscompile applies sparse attention as a graph pass",
        "add a sparse_attention section to the config and keep the model's own attention",
    ),
    "BertSparseSelfAttention": (
        "the hand-placed sparse attention modules are not built; dscompile applies sparse attention as a graph pass",
        "add a sparse_attention section to the config and keep the model's own attention",
    ),
    "SparseAttentionUtils": (
        "the hand-placed sparse attention modules are not built; dscompile applies sparse attention as a graph pass",
        "add a sparse_attention section to the config and keep the model's own attention",
    ),
}
"""A single DeepSpeed name (in whichever module scripts import it from) -> (why, what instead)."""


def refused_name(module: str, name: str) -> AttributeError:
    """What a compat module's ``__getattr__`` raises for ``name``: the refusal when the table has it, else an AttributeError."""
    path = f"deepspeed{module.removeprefix('dscompile')}.{name}"
    if name in REFUSED_NAMES:
        reason, fix = REFUSED_NAMES[name]
        raise DSCompileImportError(path, reason, fix)
    return AttributeError(f"module '{module}' has no attribute '{name}'")


class RefusedModuleFinder(importlib.abc.MetaPathFinder):
    """Answers imports of the refused DeepSpeed modules under ``dscompile.`` with the reason."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        relative = fullname.removeprefix("dscompile.")
        if relative == fullname:
            return None
        for module, (reason, fix) in REFUSED_MODULES.items():
            if relative == module or relative.startswith(module + "."):
                raise DSCompileImportError(f"deepspeed.{relative}", reason, fix)
        return None


def install_finder() -> None:
    """Put the finder at the end of ``sys.meta_path`` (the real modules are found first); idempotent."""
    if not any(isinstance(finder, RefusedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(RefusedModuleFinder())
