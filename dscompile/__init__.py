"""dscompile: DeepSpeed's training and inference optimizations as a torch.compile backend.

``torch.compile(model, backend="dscompile", options=config)`` or, DeepSpeed style,
``engine, optimizer, _, _ = dscompile.initialize(model=model, config="ds_config.json")``.
"""

from __future__ import annotations

# DeepSpeed's public names, so that `import dscompile as deepspeed` keeps a script working
from dscompile import accelerator, checkpointing, comm, deepspeed_paths, module_inject, moe, ops, pipe, sequence, utils, zero  # noqa: E402, I001
from dscompile.accelerator import get_accelerator  # noqa: E402
from dscompile.arguments import add_config_arguments  # noqa: E402
from dscompile.autotp import tp_model_init  # noqa: E402
from dscompile.comm import init_distributed  # noqa: E402
from dscompile.config import DSConfig, load_config
from dscompile.engines.inference import InferenceEngine, init_inference
from dscompile.engines.pipeline_parallel import PipelineEngine  # noqa: E402
from dscompile.engines.training import DSCompileEngine, initialize
from dscompile.errors import (
    DSCompileConfigError,
    DSCompileError,
    DSCompileNotSupportedError,
    DSCompilePassError,
    DSCompilePipelineError,
)
from dscompile.frontend import dscompile_backend
from dscompile.module_inject.layers import set_autotp_mode
from dscompile.pipe import PipelineModule  # noqa: E402
from dscompile.runtime import lr_schedules as _lr_schedules  # noqa: F401  (scripts use deepspeed.runtime.lr_schedules.X unimported)
from dscompile.runtime import utils as _runtime_utils  # noqa: F401  (and deepspeed.runtime.utils.X)
from dscompile.runtime.pipeline_markers import pipeline_split
from dscompile.runtime.zero import partition_parameters as _partition_parameters  # noqa: F401  (and deepspeed.runtime.zero.partition_parameters.X)
from dscompile.utils import OnDevice, log_dist, logger

deepspeed_paths.install_finder()  # DeepSpeed modules dscompile refuses fail with the reason, not "No module named"
DeepSpeedEngine = DSCompileEngine  # DeepSpeed's name, for isinstance checks in scripts

__version__ = "0.1.0"

__all__ = [
    "DeepSpeedEngine",
    "OnDevice",
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
    "set_autotp_mode",
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
    "log_dist",
    "logger",
    "ops",
    "pipeline_split",
]


def __getattr__(name: str) -> object:
    raise deepspeed_paths.refused_name(__name__, name)
