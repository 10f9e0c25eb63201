"""The engine core: what every dscompile engine shares, training or inference.

``EngineCore`` holds the engine's parsed config (``_config``), its place in the world (``world_size``,
``global_rank``, ``local_rank``), the one parallel plan (``plan``, from ``dscompile/planner/``), the extensions
(``runtime/engine_extension.py``) with their ``configure`` / ``counters`` / ``destroy`` hooks, the state they share
(``context``, an ``EngineContext`` from ``runtime/engine_context.py``), the communication
counters (``comm_stats``, ``communication_stats()``), ``destroy()`` and the plan's dump. ``TrainingCore``
(``runtime/training_core.py``) adds the optimizer step for ``DSCompileEngine`` and ``PipelineEngine``;
``InferenceEngine`` stands on this base alone. Which engine uses which part: docs/architecture.md.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from dscompile.planner import ParallelPlan, write_plan
from dscompile.runtime.comm_stats import CommStats
from dscompile.runtime.engine_context import EngineContext
from dscompile.runtime.engine_extension import (  # noqa: F401  (extensions import them from here too)
    INFERENCE,
    TRAINING,
    EngineExtension,
    ExtensionFactory,
    engine_extension_factories,
    register_engine_extension,
    registered_engine_extensions,
)
from dscompile.runtime.process_exit import init_process_group


def world_info() -> tuple[int, int]:
    """``(world_size, global_rank)``; ``(1, 0)`` without an initialised process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def init_from_launcher(required: bool | None = None, port: int | None = None) -> None:
    """The default process group from the launcher's environment (torchrun's ``WORLD_SIZE``, ``RANK``, ...), as
    DeepSpeed's engines make it: only when none exists and the launch names more than one process (or ``required``);
    ``required=False`` (DeepSpeed's ``dist_init_required``) never makes one. NCCL on a GPU, else gloo."""
    if not dist.is_available() or dist.is_initialized() or required is False:
        return
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 and not required:
        return
    if port is not None:
        os.environ.setdefault("MASTER_PORT", str(port))
    init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")  # destroyed again at exit


class EngineCore:
    """The base of every engine (see the module docstring). An engine sets ``module`` and calls ``init_engine``
    (a training engine: ``TrainingCore.init_core``), then ``configure_extensions``."""

    module: nn.Module
    # which registered extension factories configure_extensions builds (engine_extension.TRAINING or INFERENCE)
    extension_kind: ClassVar[str] = TRAINING

    def init_engine(self, config: Any, plan: ParallelPlan, *, timed_collectives: bool = False) -> None:
        """``config``: the engine's parsed config (a ``DSConfig``, an ``InferenceConfig``); ``plan``: the planner's plan
        for it on this world; ``timed_collectives``: synchronize to time collectives (``wall_clock_breakdown``)."""
        self._config = config  # DeepSpeed's name in both its engines (``DeepSpeedEngine._config``, ``InferenceEngine._config``)
        self.world_size, self.global_rank = world_info()
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))  # as DeepSpeed reads it from the launcher
        self.plan: ParallelPlan = plan  # the one plan (DESIGN.md): every layout decision the engine and its passes read
        self.context = EngineContext()  # what extensions share: they write and read it, never attributes of the engine
        self.extensions: list[EngineExtension] = []
        self.comm_stats = CommStats(synchronize=timed_collectives)
        self.destroyed = False

    @property
    def rank(self) -> int:
        return self.global_rank

    def replan(self, plan: ParallelPlan) -> None:
        """Swap in a plan an extension extended (offload placements) or re-decided (ZeRO profiling's schedule)."""
        self.plan = plan

    # -- extensions ----------------------------------------------------------------------------
    def configure_extensions(self, config: Any | None = None) -> None:
        """Build every registered extension of this engine's kind that applies to ``config`` (the engine's own when
        None), let each configure this engine, then dump the plan (with what the extensions added to it)."""
        for _order, _name, factory in engine_extension_factories(self.extension_kind):
            extension = factory(config if config is not None else self._config)
            if extension is not None:
                self.add_extension(extension)
        if self.global_rank == 0 and self._config.dump:  # DUMP/plan.txt, with the offload plans the extensions made
            write_plan(self.plan, self._config.dump)

    def add_extension(self, extension: EngineExtension) -> EngineExtension:
        if self.extension(extension.name) is not None:
            raise ValueError(f"engine extension {extension.name!r} is already installed")
        self.extensions.append(extension)
        extension.configure(self)
        return extension

    def extension(self, name: str) -> EngineExtension | None:
        return next((e for e in self.extensions if e.name == name), None)

    def _hook(self, hook: str, *args: Any) -> None:
        for extension in self.extensions:
            getattr(extension, hook)(self, *args)

    # -- what users read -------------------------------------------------------------------------
    def communication_stats(self) -> dict[str, Any]:
        """Collectives since construction: ``{source: {op: {"calls", "bytes"[, "seconds"]}}}``, plus extension counters."""
        out: dict[str, Any] = self.comm_stats.summary()
        counters = {e.name: e.counters() for e in self.extensions if e.counters()}
        if counters:
            out["extensions"] = counters
        return out

    def destroy(self) -> None:
        """Release compiled graphs, hooks and extension buffers (DeepSpeed's ``destroy``); idempotent.

        The engine cannot run afterwards; its module (and a training engine's optimizer) stay usable in plain PyTorch.
        """
        if self.destroyed:
            return
        self.destroyed = True
        for extension in self.extensions:
            extension.destroy(self)
        self.release_compiled()

    def release_compiled(self) -> None:
        """Drop what the engine compiled (each engine knows its own)."""


def wrapped_module_attribute(engine: Any, name: str) -> Any:
    """DeepSpeed's ``DeepSpeedEngine.__getattr__`` fallback: an attribute the engine lacks is the wrapped model's
    (``engine.gradient_checkpointing_enable()``, ``engine.generation_config``); the engine's own always win."""
    module = engine.__dict__.get("module")
    if module is None:
        module = engine.__dict__.get("_modules", {}).get("module")  # an nn.Module engine registers it as a submodule
    if module is not None:
        try:
            return getattr(module, name)
        except AttributeError:
            pass
    raise AttributeError(f"'{type(engine).__name__}' object has no attribute '{name}'")
