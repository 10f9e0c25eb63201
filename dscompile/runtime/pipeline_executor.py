"""Runs one rank's schedule: receive inputs, run the stage, send outputs, record a timeline.

The executor knows only the stage wiring (``StageSpec.inputs``/``consumers``/tensor specs) and a
runner per local stage with ``forward(mb, inputs) -> outputs`` and ``backward(mb, output_grads)
-> input_grads``, so the same code drives compiled graph stages and the timing tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from dscompile.runtime.pipeline_p2p import ACTIVATION, GRADIENT, P2P, message_tag
from dscompile.runtime.pipeline_schedules import Action


class StageRunner(Protocol):
    def forward(self, micro_batch: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]: ...

    def backward(self, micro_batch: int, output_grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]: ...


@dataclass
class TimelineEntry:
    action: Action
    wait_start: float
    start: float
    end: float


@dataclass
class Timeline:
    """What one rank did in one batch; times from ``time.perf_counter`` (shared by the host's processes)."""

    entries: list[TimelineEntry] = field(default_factory=list)
    begin: float = 0.0
    finish: float = 0.0

    def order(self) -> list[Action]:
        return [e.action for e in self.entries]

    def busy(self) -> float:
        return sum(e.end - e.start for e in self.entries)

    def idle_fraction(self, begin: float | None = None, finish: float | None = None) -> float:
        span = (finish or self.finish) - (begin or self.begin)
        return 1.0 - self.busy() / span if span > 0 else 0.0


def run_actions(
    actions: Sequence[Action],
    specs: Sequence[Any],
    runners: dict[int, StageRunner],
    p2p: P2P,
    rank_of_stage: Callable[[int], int],
    batches: Sequence[Sequence[Any]] | None,
    loss: tuple[int, int],
    loss_scale: float,
) -> tuple[dict[int, torch.Tensor], Timeline]:
    """Execute ``actions`` in order; returns the detached loss of every micro-batch (last stage only)."""
    timeline = Timeline(begin=time.perf_counter())
    losses: dict[int, torch.Tensor] = {}
    for action in actions:
        spec = specs[action.stage]
        mb = action.micro_batch
        wait_start = time.perf_counter()
        if action.kind == "F":
            inputs: list[torch.Tensor] = []
            for ref, tspec in zip(spec.inputs, spec.input_specs):
                if ref.kind == "input":
                    if batches is None:
                        raise RuntimeError(f"stage {spec.index} reads input {ref.index}, but this rank got no data iterator")
                    inputs.append(batches[mb][ref.index])
                else:
                    tag = message_tag(ACTIVATION, ref.stage, spec.index, ref.index, mb)
                    value = p2p.recv(tspec.shape, tspec.dtype, rank_of_stage(ref.stage), tag)
                    inputs.append(value.requires_grad_(tspec.requires_grad))
            start = time.perf_counter()
            outputs = runners[spec.index].forward(mb, inputs)
            for index, consumers in spec.consumers.items():
                for dst in consumers:
                    p2p.send(outputs[index], rank_of_stage(dst), message_tag(ACTIVATION, spec.index, dst, index, mb))
            if spec.index == loss[0]:
                losses[mb] = outputs[loss[1]].detach()
        else:
            grads: list[torch.Tensor | None] = []
            for index, ospec in enumerate(spec.output_specs):
                if (spec.index, index) == loss:
                    grads.append(torch.full(ospec.shape, loss_scale, dtype=ospec.dtype, device=p2p.device))
                    continue
                if ospec is None or not ospec.requires_grad or index not in spec.consumers:
                    grads.append(None)
                    continue
                total = None
                for dst in spec.consumers[index]:
                    tag = message_tag(GRADIENT, spec.index, dst, index, mb)
                    g = p2p.recv(ospec.shape, ospec.dtype, rank_of_stage(dst), tag)
                    total = g if total is None else total + g
                grads.append(total)
            start = time.perf_counter()
            in_grads = runners[spec.index].backward(mb, grads)
            for ref, tspec, grad in zip(spec.inputs, spec.input_specs, in_grads):
                if ref.kind != "stage" or tspec is None or not tspec.requires_grad:
                    continue
                if grad is None:
                    grad = torch.zeros(tspec.shape, dtype=tspec.dtype, device=p2p.device)
                p2p.send(grad, rank_of_stage(ref.stage), message_tag(GRADIENT, ref.stage, spec.index, ref.index, mb))
        timeline.entries.append(TimelineEntry(action, wait_start, start, time.perf_counter()))
    p2p.wait_all()
    timeline.finish = time.perf_counter()
    return losses, timeline


def run_forward_only(
    specs: Sequence[Any],
    stages: Sequence[int],
    runners: dict[int, StageRunner],
    p2p: P2P,
    rank_of_stage: Callable[[int], int],
    batches: Sequence[Sequence[Any]] | None,
    loss: tuple[int, int],
    micro_batches: int,
) -> dict[int, torch.Tensor]:
    """Evaluation: every local stage's forwards in pipeline order (micro-batch-major per stage)."""
    actions = [Action("F", s, mb) for mb in range(micro_batches) for s in stages]
    with torch.no_grad():
        losses, _ = run_actions(actions, specs, runners, p2p, rank_of_stage, batches, loss, 1.0)
    return losses
