"""The engine core's ``compression`` extension: the compression schedule driven by the engine's steps.

DeepSpeed's engine, when its config has a ``compression_training`` section, builds a
``compression_scheduler`` over its module, sets step 0 before the first forward (its forward
prologue is a pre-hook of the module itself, so the first ``model(x)`` a script calls directly
counts too) and advances the schedule after every optimizer step it applies (a step skipped for an
fp16 overflow does not count). This extension does the same in every dscompile engine, setting
step 0 (again) when the engine is built:

- ``configure``: prepares the model (``init_compression``'s work, handed in by the factory in
  ``passes/compression.py``) when the script did not, and keeps the optimizer in step with the
  model: learned ``topk`` mask scores join its first parameter group, parameters of layers that
  layer reduction dropped leave it. It runs before ZeRO partitions the model (order 5 < 10), so
  ZeRO shards the prepared model and its optimizer. Combinations that would silently train
  something else are refused (below).
- ``before_forward`` (once, under ZeRO-2/3): the compiled graphs' parameters are ZeRO's shards,
  so each shard gets its full parameter's compression state, which is how the ``quantize`` and
  ``prune`` passes find the layers.
- ``before_optimizer_step``: ``snip_momentum`` block scores from the averaged, unscaled gradients.
- ``after_optimizer_step``: on an applied step, ``scheduler.step(applied)``; the bits, switches,
  ratios and l1 masks the next forward reads. They are tensors the compiled graphs take as inputs
  (``dscompile.graph.lift_tensor``), so a schedule change never recompiles and is never stale.
- ``state_dict``: the number of applied steps, so a resumed run continues the schedule (the
  layers' masks, scores and calibrated ranges are buffers and parameters of the model's own
  ``state_dict``).

Refused, naming the key: pipeline parallelism (the stage graphs are not wired to the schedule);
``topk`` pruning under ZeRO-2/3 (its scores are parameters ZeRO partitions, while the graph reads the
module's full copy, which then gets no gradient); ``snip_momentum`` under ZeRO (its scores need each
weight's full averaged gradient, which ZeRO reduces into shards); ``l1`` pruning under ZeRO-3 (masks
are taken from full weights, which ZeRO-3 frees).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dscompile.errors import DSCompileConfigError
from dscompile.runtime.compression.scheduler import CompressionScheduler, scheduler_of
from dscompile.runtime.compression.state import PREPARED
from dscompile.runtime.engine_core import EngineExtension
from dscompile.runtime.training_core import TrainingCore

log = logging.getLogger("dscompile.compression")

SECTION = "compression_training"


class CompressionExtension(EngineExtension):
    """Runs the compression schedule of the engine's model with the optimizer steps."""

    name = "compression"

    def __init__(self, prepare: Callable[[nn.Module], CompressionScheduler]) -> None:
        self.prepare = prepare
        self.scheduler: CompressionScheduler | None = None
        self.applied_steps = 0
        self.prepared_by_engine = False
        self._shards_linked = False

    # -- construction ----------------------------------------------------------------------------
    def configure(self, engine: TrainingCore) -> None:
        if engine.config.sections.get("pipeline_parallel") is not None:
            raise DSCompileConfigError(
                SECTION,
                "compression training is not wired into the pipeline engine (its stage graphs do not follow the schedule)",
                "train the compressed model without the 'pipeline' section, or drop 'compression_training'",
            )
        model = engine.module
        scheduler = scheduler_of(model)
        if scheduler is None:
            before = {id(p): p for p in model.parameters()}
            scheduler = self.prepare(model)
            self.prepared_by_engine = True
            self._follow_model(engine, before)
        self.scheduler = scheduler
        self._refuse_with_zero(engine.zero_optimization_stage())
        self.applied_steps = max(scheduler.global_step, 0)  # a script may have stepped it before initialize
        scheduler.step(self.applied_steps)

    def _follow_model(self, engine: TrainingCore, before: dict[int, nn.Parameter]) -> None:
        """Preparing changed the model's parameters: the optimizer (built over the old ones) follows."""
        model = engine.module
        now = {id(p): p for p in model.parameters()}
        added = [p for pid, p in now.items() if pid not in before and p.requires_grad]
        dropped = {pid for pid in before if pid not in now}
        if engine.world_size > 1 and added:
            with torch.no_grad():
                for p in added:  # learned scores start random: every rank starts from rank 0's
                    dist.broadcast(p.data, src=0)
        optimizer = engine.optimizer
        if optimizer is None or not (added or dropped):
            return
        if optimizer.state:
            raise DSCompileConfigError(
                SECTION,
                "the engine prepared the model for compression, but the optimizer already holds state for the old parameters",
                "call dscompile.compression.init_compression(model, config) before building the optimizer",
            )
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) not in dropped]
        optimizer.param_groups[0]["params"].extend(added)
        log.info(
            "compression: the optimizer trains %d new parameter(s) (learned mask scores) and drops %d of removed layers",
            len(added),
            len(dropped),
        )

    def _refuse_with_zero(self, stage: int) -> None:
        if stage == 0:
            return
        assert self.scheduler is not None
        for _module, state in self.scheduler.layers:
            for technique, spec in state.masks.items():
                key = f"{SECTION}.{technique}_pruning.shared_parameters.method"
                why = None
                if spec.method == "topk" and stage >= 2:
                    why = "topk's learned scores are parameters ZeRO-2/3 partitions, and the graph reads the module's full copy, which gets no gradient"
                elif spec.method == "snip_momentum":
                    why = "snip_momentum scores every weight with its full averaged gradient, which ZeRO reduces into shards"
                elif spec.method == "l1" and stage >= 3:
                    why = "l1 masks are taken from the full weights, which ZeRO-3 frees between uses"
                if why is not None:
                    raise DSCompileConfigError(
                        key,
                        f"{spec.method} pruning of {state.layer_name} under ZeRO stage {stage}: {why}",
                        "use weight/activation quantization or l1 masks at this stage, or a lower ZeRO stage",
                    )

    # -- hooks -------------------------------------------------------------------------------------
    def before_forward(self, engine: TrainingCore) -> None:
        if not self._shards_linked and engine.context.zero is not None and engine.context.zero.stage >= 2:
            for full, shard in zip(engine.context.zero.full_params, engine.context.zero.shards):
                if hasattr(full, "ds_compression"):
                    shard.ds_compression = full.ds_compression
                if getattr(full, PREPARED, False):
                    setattr(shard, PREPARED, True)
            self._shards_linked = True

    def before_optimizer_step(self, engine: TrainingCore, params: list[nn.Parameter]) -> None:
        assert self.scheduler is not None
        self.scheduler.after_backward()  # snip_momentum only; reads module.weight.grad (no ZeRO: refused)

    def after_optimizer_step(self, engine: TrainingCore, overflow: bool) -> None:
        if overflow:
            return  # DeepSpeed counts applied steps only
        assert self.scheduler is not None
        self.applied_steps += 1
        self.scheduler.step(self.applied_steps)

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"applied_steps": self.applied_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert self.scheduler is not None
        self.applied_steps = int(state["applied_steps"])
        self.scheduler.step(self.applied_steps)
