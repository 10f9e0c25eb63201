"""Run the first steps of ZeRO graphs under the profiler (``zero_optimization.profile_steps``).

This pass changes no node: it asks the frontend to wrap the lowered forward/backward graph so
that, while the engine's ``ZeroProfiler`` (``dscompile.runtime.zero_profile``) is collecting,
the graph runs op by op with timings and live memory; afterwards it runs the lowered code
untouched. The engine agrees on the measurements across ranks, plans prefetch, bucketing and
unsharding again and recompiles once (without this pass). With no engine profiler (the
torch-native path, or ``profile_steps`` 0) it logs why and does nothing.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.fx

from dscompile.pipeline import PassContext, register_pass
from dscompile.planner import plan_zero_schedule
from dscompile.runtime.engine_core import register_engine_extension
from dscompile.runtime.zero_profile import ZeroProfileExtension, profiler_for

log = logging.getLogger("dscompile.passes.zero_profile")


@register_pass("zero_profile", graphs=("forward", "backward"), requires=("zero",))
def zero_profile(gm: torch.fx.GraphModule, ctx: PassContext, options: None) -> torch.fx.GraphModule:
    """Profile this graph's first steps (op time, live memory) for the engine's re-planning."""
    if ctx.is_inference:
        return gm  # no optimizer step follows an inference graph: nothing to plan from it
    profiler = profiler_for(ctx.config)
    if profiler is None or not profiler.active:
        log.info("%s: no engine profiler for this config (profile_steps needs dscompile.initialize); not profiled", ctx.graph_name)
        return gm
    ctx.analysis.setdefault("wrap_lowered", {})[ctx.graph_name] = profiler.wrap(ctx.graph_kind)
    return gm


@register_engine_extension(90, "zero_profile")
def _zero_profile_extension(config: Any) -> ZeroProfileExtension | None:
    """Engines profile their first ``profile_steps`` steps and re-plan ZeRO once."""
    return ZeroProfileExtension() if plan_zero_schedule(config).profile_steps > 0 else None
