"""How a compile finds the plan it runs under: ``PlannedConfig`` (an engine's ``torch.compile`` options: config and
plan), ``compiling_under`` (the backend sets the plan while the config rules build the pipeline), and
``zero_schedule_of`` / ``checkpointing_of`` (what the rules ask: the engine's plan's decision, else, under a plain
``torch.compile`` with no engine, the planner decides it from the config alone).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from dscompile.planner.checkpointing import CheckpointingPlan, plan_activation_checkpointing
from dscompile.planner.plan import ParallelPlan
from dscompile.planner.zero_schedule import ZeroSchedule, plan_zero_schedule


@dataclass(frozen=True)
class PlannedConfig:
    """``torch.compile``'s ``options`` from an engine: its config and the plan its graphs compile under.

    The backend (``frontend.dscompile_backend``) runs the config rules ``compiling_under(plan)``. Dynamo compares a
    backend's options to reuse a compile, so a re-planned engine's recompile (same config, new plan) is a new compile.
    """

    config: Any
    plan: ParallelPlan


_COMPILING_UNDER: ContextVar[ParallelPlan | None] = ContextVar("dscompile_compiling_under", default=None)


@contextmanager
def compiling_under(plan: ParallelPlan | None) -> Iterator[None]:
    """While the backend builds a pipeline from the config rules: the plan they read (None: no engine, no plan)."""
    token = _COMPILING_UNDER.set(plan)
    try:
        yield
    finally:
        _COMPILING_UNDER.reset(token)


def zero_schedule_of(config: Any) -> ZeroSchedule:
    """The ZeRO schedule of the graphs compiled now: the engine's plan's, else (a plain ``torch.compile``) the planner
    decides it from ``config``."""
    plan = _COMPILING_UNDER.get()
    return plan.zero_schedule if plan is not None else plan_zero_schedule(config)


def checkpointing_of(config: Any) -> CheckpointingPlan:
    """The activation-checkpointing plan of the graphs compiled now: the engine's, else decided from ``config``."""
    plan = _COMPILING_UNDER.get()
    return plan.checkpointing if plan is not None else plan_activation_checkpointing(config)
