"""dscompile: DeepSpeed's training and inference optimizations as a torch.compile backend.

``torch.compile(model, backend="dscompile", options=config)`` or, DeepSpeed style,
``engine, optimizer, _, _ = dscompile.initialize(model=model, config="ds_config.json")``.
"""

from __future__ import annotations

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
from dscompile.runtime.pipeline_markers import pipeline_split

__version__ = "0.1.0"

__all__ = [
    "DSCompileConfigError",
    "DSCompileEngine",
    "DSCompileError",
    "DSCompileNotSupportedError",
    "DSCompilePassError",
    "DSCompilePipelineError",
    "DSConfig",
    "dscompile_backend",
    "initialize",
    "load_config",
    "pipeline_split",
]
