"""The compression schedule, advanced by the global step and independent of any engine.

DeepSpeed's engine owns a ``compression_scheduler`` and calls it around every optimizer step; here
the schedule is a small object any training loop (or the engine core) drives:

    scheduler = CompressionScheduler(model)       # after init_compression(model, config)
    for step in range(steps):
        scheduler.step(step)                      # before the forward of optimizer step `step` (0 first)
        loss = compiled(batch); loss.backward()
        scheduler.after_backward()                # gradients ready (snip_momentum scores)
        optimizer.step(); optimizer.zero_grad()

``step(n)`` puts every compressed layer in the state the forward of step ``n`` needs: switches on
each technique at its ``schedule_offset``, sets the scheduled bit width (and ``fp16_mixed_quantize``
ratio), and takes the snip_momentum mask decisions from the accumulated scores. All of it is
tensors the compiled graphs read, so no step recompiles. Skipped steps (fp16 overflow) are not
counted, as in DeepSpeed: pass the number of applied optimizer steps.

``init_compression`` leaves it at step 0. ``dscompile.initialize`` drives it for the user as
DeepSpeed's engine does: the engine core's ``compression`` extension
(``runtime/compression/extension.py``) calls ``step`` after every applied optimizer step, and keeps
the count in checkpoints. (DeepSpeed's layers switch on at its engine's first forward, or at the
first ``compression_scheduler.step``: the same as here once a script builds its engine before it
computes, as DeepSpeed's examples do.)
The model carries its scheduler (``attach_scheduler`` / ``scheduler_of``), so ``init_compression``,
the engine and ``redundancy_clean`` share one.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from dscompile.runtime.compression.state import CompressionState

SCHEDULER_ATTRIBUTE = "ds_compression_scheduler"


class CompressionScheduler:
    """Advances every ``CompressionState`` of a model with the global step (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.global_step = -1
        self.layers: list[tuple[nn.Module, CompressionState]] = []
        seen: set[int] = set()
        for module in model.modules():
            state = getattr(module, "ds_compression", None)
            if isinstance(state, CompressionState) and id(state) not in seen:
                seen.add(id(state))
                self.layers.append((module, state))

    def step(self, global_step: int) -> None:
        """Set the compression state for the forward of optimizer step ``global_step`` (0-based)."""
        if global_step < 0:
            raise ValueError(f"global_step must be >= 0, got {global_step}")
        self.global_step = global_step
        for module, state in self.layers:
            state.set_step(global_step, module.weight)

    def after_backward(self) -> None:
        """Accumulate snip_momentum scores from the gradients of the backward just finished."""
        for module, state in self.layers:
            state.accumulate_snip(module.weight, max(self.global_step, 0))

    def final_step(self) -> int:
        """The first step at which every technique is on and every schedule has finished."""
        last = 0
        for _module, state in self.layers:
            wq = state.weight_quant
            if wq is not None:
                drops = 0 if wq.in_forward else wq.start_bits - wq.target_bits
                last = max(last, wq.offset if drops == 0 else wq.offset + wq.drop_call(drops) - 1)  # the last drop's step
            if state.act_quant is not None:
                last = max(last, state.act_quant.offset)
            for spec in state.masks.values():
                last = max(last, spec.offset_end)
        return last

    def bits(self) -> dict[str, int | None]:
        """Each weight-quantized layer's current bit width (None while its quantization is off)."""
        result: dict[str, int | None] = {}
        for _module, state in self.layers:
            if state.weight_quant is not None:
                result[state.layer_name] = int(state.wq_bits) if state.enabled("weight_quant") else None
        return result

    def summary(self) -> dict[str, Any]:
        """What is switched on now, per layer (for logs and tests)."""
        layers = {}
        for _module, state in self.layers:
            entry: dict[str, Any] = {}
            if state.weight_quant is not None:
                entry["weight_bits"] = int(state.wq_bits) if state.enabled("weight_quant") else None
            if state.act_quant is not None:
                entry["activation_bits"] = state.act_quant.bits if state.enabled("act_quant") else None
            for technique in state.masks:
                entry[technique] = state.enabled(technique)
            layers[state.layer_name] = entry
        return {"global_step": self.global_step, "layers": layers}

    def state_dict(self) -> dict[str, Any]:
        """The schedule's own state (the layers' tensors are in the model's ``state_dict``)."""
        return {"global_step": self.global_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the step counter; the next ``step()`` call sets the layers for the next forward."""
        self.global_step = int(state["global_step"])


def attach_scheduler(model: nn.Module) -> CompressionScheduler:
    """Give a prepared model its scheduler, set for step 0 (kept outside ``_modules``: not a layer)."""
    scheduler = CompressionScheduler(model)
    scheduler.step(0)
    object.__setattr__(model, SCHEDULER_ATTRIBUTE, scheduler)
    return scheduler


def scheduler_of(model: nn.Module) -> CompressionScheduler | None:
    """The scheduler ``attach_scheduler`` gave ``model``, or None when it was never prepared."""
    scheduler = vars(model).get(SCHEDULER_ATTRIBUTE)
    return scheduler if isinstance(scheduler, CompressionScheduler) else None
