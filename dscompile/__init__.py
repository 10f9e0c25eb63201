"""dscompile: DeepSpeed's training and inference optimizations as a torch.compile backend.

``torch.compile(model, backend="dscompile", options=config)`` or, DeepSpeed style,
``engine, optimizer, _, _ = dscompile.initialize(model=model, config="ds_config.json")``.
"""

from __future__ import annotations

# DeepSpeed's public names, so that `import dscompile as deepspeed` keeps a script working
from dscompile import accelerator, checkpointing, comm, module_inject, moe, pipe, sequence, utils, zero  # noqa: E402, I001
from dscompile.accelerator import get_accelerator  # noqa: E402
from dscompile.arguments import add_config_arguments  # noqa: E402
from dscompile.autotp import tp_model_init  # noqa: E402
from dscompile.comm import init_distributed  # noqa: E402
from dscompile.config import DSConfig, load_config
from dscompile.engine import DSCompileEngine, initialize
from dscompile.errors import (
    DSCompileConfigError,
    DSCompileError,
    DSCompileNotSupportedError,
    DSCompilePassError,
    DSCompilePipelineError,
)
from dscompile.frontend import dscompile_backend
from dscompile.inference import InferenceEngine, init_inference
from dscompile.pipe import PipelineModule  # noqa: E402
from dscompile.runtime.pipeline_engine import PipelineEngine  # noqa: E402
from dscompile.runtime.pipeline_markers import pipeline_split

__version__ = "0.1.0"

__all__ = [
    "PipelineEngine",
    "PipelineModule",
    "accelerator",
    "add_config_arguments",
    "checkpointing",
    "comm",
    "get_accelerator",
    "init_distributed",
    "module_inject",
    "moe",
    "pipe",
    "sequence",
    "tp_model_init",
    "utils",
    "zero",
    "DSCompileConfigError",
    "DSCompileEngine",
    "DSCompileError",
    "DSCompileNotSupportedError",
    "DSCompilePassError",
    "DSCompilePipelineError",
    "DSConfig",
    "dscompile_backend",
    "initialize",
    "init_inference",
    "InferenceEngine",
    "load_config",
    "pipeline_split",
]
