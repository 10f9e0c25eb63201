"""The ``pipeline`` config section (registered as ``pipeline_parallel``): DeepSpeed's keys and dscompile's own.

DeepSpeed's keys keep DeepSpeed's meaning; those that change nothing here are logged as having no effect, with why.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from dscompile.config import log_no_effect, log_no_effect_keys, parse_dataclass, register_section
from dscompile.errors import DSCompileConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


@dataclass
class PipelineParallelConfig:
    """DeepSpeed's ``pipeline`` section, plus dscompile's own keys below ``split_points``.

    ``stages`` is the pipeline-parallel degree (ranks per pipeline); with ``interleaved_1f1b``
    each rank holds ``virtual_stages`` model chunks. ``micro_batches`` defaults to
    ``gradient_accumulation_steps``. ``compile`` compiles every stage with the dscompile backend.

    DeepSpeed's own keys are accepted with DeepSpeed's meaning: ``"stages": "auto"`` (its default)
    takes the stage count from a ``dscompile.pipe.PipelineModule``, and for any other model the
    section then asks for no pipeline (DeepSpeed ignores it too); ``partition`` and
    ``seed_layers`` are read by DeepSpeed's ``PipelineModule``, not from the config, so they change
    nothing; ``pipe_partitioned`` / ``grad_partitioned`` split activations over a tensor-parallel
    group, which dscompile does not build, so there is nothing for them to split (as in DeepSpeed
    without model parallelism); ``use_reentrant`` picks DeepSpeed's recomputation API (the
    gradients are the same).
    """

    stages: int = 1
    partition_method: str = "cost"
    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"
    micro_batches: int | None = None
    activation_checkpoint_interval: int = 0
    split_points: list[str] = field(default_factory=list)
    virtual_stages: int | None = None
    compile: bool = True
    cost_memory_weight: float = 0.1
    cost_flops_per_byte: float = 1.0
    partition: str = "best"
    seed_layers: bool = False
    pipe_partitioned: bool = True
    grad_partitioned: bool = True
    use_reentrant: bool | None = None

    def validate(self, path: str) -> None:
        where = path or "pipeline"
        if self.stages < 1:
            raise DSCompileConfigError(f"{where}.stages", f"must be >= 1, got {self.stages}")
        if self.micro_batches is not None and self.micro_batches < 1:
            raise DSCompileConfigError(f"{where}.micro_batches", f"must be >= 1, got {self.micro_batches}")
        if self.activation_checkpoint_interval < 0:
            raise DSCompileConfigError(f"{where}.activation_checkpoint_interval", "must be >= 0 (0 turns it off)")
        method = self.partition_method
        if method.lower().startswith("type:"):
            try:
                re.compile(method[5:], re.IGNORECASE)
            except re.error as exc:
                raise DSCompileConfigError(f"{where}.partition_method", f"bad regular expression in {method!r}: {exc}") from None
        elif method not in ("parameters", "uniform", "cost"):
            raise DSCompileConfigError(
                f"{where}.partition_method", f"{method!r} is not a partition method", "use parameters, uniform, type:REGEX or cost"
            )
        if self.virtual_stages is None:
            self.virtual_stages = 2 if self.schedule == "interleaved_1f1b" else 1
        if self.virtual_stages < 1:
            raise DSCompileConfigError(f"{where}.virtual_stages", f"must be >= 1, got {self.virtual_stages}")
        if self.virtual_stages > 1 and self.schedule != "interleaved_1f1b":
            raise DSCompileConfigError(f"{where}.virtual_stages", f"only interleaved_1f1b uses virtual stages, schedule is {self.schedule!r}")
        if self.split_points and len(self.split_points) != self.num_model_stages - 1:
            raise DSCompileConfigError(
                f"{where}.split_points",
                f"{len(self.split_points)} split points make {len(self.split_points) + 1} stages, "
                f"but stages * virtual_stages = {self.num_model_stages}",
                f"give {self.num_model_stages - 1} split points",
            )
        if self.cost_memory_weight < 0 or self.cost_flops_per_byte < 0:
            raise DSCompileConfigError(f"{where}.cost_memory_weight", "cost weights must be >= 0")

    @property
    def num_model_stages(self) -> int:
        """How many pieces the graph is cut into: ranks per pipeline times chunks per rank."""
        return self.stages * (self.virtual_stages or 1)


_TP_GROUP = "it splits over a tensor-parallel group that the pipeline engine does not build: nothing to split, as in DeepSpeed without one"
_NO_EFFECT = {
    "pipe_partitioned": _TP_GROUP,
    "grad_partitioned": _TP_GROUP,
    "use_reentrant": "it picks DeepSpeed's recomputation API; the gradients are the same",
}
_PIPELINE_MODULE_KEYS = {
    "partition": "pipeline.partition_method (or dscompile.pipe.PipelineModule(partition_method=...)) chooses the cut",
    "seed_layers": "dscompile.pipe.PipelineModule(seed_layers=...) seeds the layers",
}


def _parse_section(value: Any, path: str) -> PipelineParallelConfig | None:
    """None for DeepSpeed's ``"stages": "auto"``: the stage count comes from a PipelineModule."""
    log_no_effect_keys(path, value, _NO_EFFECT)
    if isinstance(value, Mapping):
        for key in ("partition", "seed_layers"):
            if key in value:
                log_no_effect(
                    f"{path}.{key}", f"DeepSpeed reads it from PipelineModule(...) arguments, never from the config; here {_PIPELINE_MODULE_KEYS[key]}"
                )
    if isinstance(value, dict) and value.get("stages") == "auto":
        parse_dataclass(PipelineParallelConfig, {k: v for k, v in value.items() if k != "stages"}, path)  # check the other keys
        return None
    return parse_dataclass(PipelineParallelConfig, value, path)


register_section("pipeline_parallel", _parse_section, "pipeline parallelism")
