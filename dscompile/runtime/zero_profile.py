"""Profile-guided ZeRO planning: DeepCompile's optimization cycle for ``zero_optimization.profile_steps``.

The first compile plans prefetch, bucketing and unsharding from the config alone. During the first
``profile_steps`` optimizer steps the ``zero_profile`` pass makes the compiled forward and backward
graphs run under ``ProfilingInterpreter``: op by op, timing each node (wall clock on CPU, CUDA events
on GPU) and the live memory after it. Each collective is waited for right after it starts, so its
time is the raw communication time, not what the schedule happened to hide.

At the end of the last profiled step the engine (through ``ZeroProfileExtension``, its engine
extension) calls ``ZeroProfiler.after_step``: every rank reduces
its measurements into one vector whose layout depends only on the collectives (hence on the
parameters, never on sequence lengths), the ranks check they saw the same collectives and take the
maximum of every time and memory figure (``all_reduce``), and ``plan_from_profile`` (a pure function
of the agreed numbers) gives the same new ``ZeroSchedule`` on every rank. The engine swaps it into its one
plan (``engine.plan``) and compiles once more; the new graphs' passes read it from there. A rank can never
issue a collective its peers do not. The plan before and after, and the
agreed profile, go to the log and to ``DUMP/zero_plan.json`` when a dump directory is set.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx

from dscompile.planner import ZeroSchedule
from dscompile.runtime.devices import collective_device
from dscompile.runtime.engine_core import EngineExtension

log = logging.getLogger("dscompile.runtime.zero_profile")

c10d = torch.ops._c10d_functional
_STARTS = {
    c10d.all_gather_into_tensor.default: "all_gather",
    c10d.reduce_scatter_tensor.default: "reduce_scatter",
}
_WAIT = c10d.wait_tensor.default
_KINDS = {"forward": 0, "backward": 1}

LATENCY_SHARE = 0.1
"""Bucketing target: the fixed latency of a collective is at most this share of a bucket's time."""
DEVICE_MEMORY_FRACTION = 0.9
"""On GPU, the share of device memory the plan may fill (DeepCompile keeps a margin likewise)."""


# ---------------------------------------------------------------------------------------------
# Measurements.
# ---------------------------------------------------------------------------------------------
@dataclass
class GraphRun:
    """One run of a compiled forward or backward graph under the profiler."""

    kind: str
    gathers: list[tuple[int, float]] = field(default_factory=list)
    """(elements, seconds) of each all-gather, in the order of their waits (= order of use)."""
    compute_between: list[float] = field(default_factory=list)
    """Compute seconds before the first gather's wait, then after each gather's wait (len = gathers + 1);
    waits stay at the parameter's use, so entry ``i`` is the compute that can hide gather ``i``."""
    scatters: list[tuple[int, float]] = field(default_factory=list)
    compute_s: float = 0.0
    peak_live_bytes: int = 0
    itemsize: int = 4


def _live_bytes(values: Sequence[Any]) -> int:
    seen: dict[int, int] = {}
    for value in values:
        if isinstance(value, torch.Tensor) and not value.is_meta and value.numel() > 0:
            storage = value.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class ProfilingInterpreter(torch.fx.Interpreter):
    """Runs a graph node by node, timing each one and tracking the bytes of live values."""

    def __init__(self, gm: torch.fx.GraphModule, kind: str) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.kind = kind
        self.cuda = any(isinstance(v, torch.Tensor) and v.is_cuda for v in self._example_values(gm))
        starts = {n for n in gm.graph.nodes if n.op == "call_function" and n.target in _STARTS}
        self.info = {n: n.meta.get("dscompile", {}).get("zero", {}) for n in starts}

    @staticmethod
    def _example_values(gm: torch.fx.GraphModule) -> list[Any]:
        return [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]

    def profile(self, args: Sequence[Any]) -> tuple[Any, GraphRun]:
        self.record = GraphRun(self.kind, compute_between=[0.0])
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        out = self.run(*args)
        if self.cuda:
            self.record.peak_live_bytes = int(torch.cuda.max_memory_allocated())
        return out, self.record

    def _timed(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        if self.cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            value = fn()
            end.record()
            end.synchronize()
            return value, begin.elapsed_time(end) / 1e3
        begin_s = time.perf_counter()
        value = fn()
        return value, time.perf_counter() - begin_s

    def run_node(self, n: torch.fx.Node) -> Any:
        record = self.record
        if n.op == "call_function" and n.target in _STARTS:
            # Wait at once: the time is the collective's own, whatever the schedule would hide.
            value, seconds = self._timed(lambda: _WAIT(super(ProfilingInterpreter, self).run_node(n)))
            elements = int(self.info[n].get("elements", value.numel() * (self.info[n].get("world", 1) if _STARTS[n.target] == "reduce_scatter" else 1)))
            if _STARTS[n.target] == "all_gather":
                record.gathers.append((elements, seconds))
                record.itemsize = value.element_size()
            else:
                record.scatters.append((elements, seconds))
            return value
        if n.op == "call_function" and n.target is _WAIT:
            source = n.args[0]
            if isinstance(source, torch.fx.Node) and _STARTS.get(source.target) == "all_gather":
                record.compute_between.append(0.0)  # the parameter is used from here on
            return self.env[source]  # already complete (waited at its start)
        value, seconds = self._timed(lambda: super(ProfilingInterpreter, self).run_node(n))
        if n.op == "call_function":
            record.compute_s += seconds
            record.compute_between[-1] += seconds
            if not self.cuda:
                record.peak_live_bytes = max(record.peak_live_bytes, _live_bytes([*self.env.values(), value]))
        return value


# ---------------------------------------------------------------------------------------------
# Agreement across ranks.
# ---------------------------------------------------------------------------------------------
@dataclass
class AgreedProfile:
    """The per-step profile every rank holds after agreement (max over ranks)."""

    runs: list[GraphRun]
    memory_limit_bytes: int | None

    def to_dict(self) -> dict[str, Any]:
        return {"memory_limit_bytes": self.memory_limit_bytes, "graphs": [dataclasses.asdict(r) for r in self.runs]}


def _structure(runs: Sequence[GraphRun]) -> list[int]:
    out: list[int] = [len(runs)]
    for run in runs:
        out += [_KINDS[run.kind], run.itemsize, len(run.gathers), len(run.scatters)]
        out += [e for e, _ in run.gathers] + [e for e, _ in run.scatters]
    return out


def _values(runs: Sequence[GraphRun], memory_limit: int | None) -> list[float]:
    out: list[float] = [-(memory_limit if memory_limit is not None else math.inf)]  # max of -limit = min limit
    for run in runs:
        out += [s for _, s in run.gathers] + [s for _, s in run.scatters] + list(run.compute_between)
        out += [run.compute_s, float(run.peak_live_bytes)]
    return out


def agree(runs: list[GraphRun], memory_limit: int | None, group: dist.ProcessGroup | None = None) -> AgreedProfile | None:
    """Max of every measurement over the ranks; None on every rank when their collectives differ."""
    device = collective_device(group)  # NCCL: the GPU; gloo: the CPU
    structure = torch.tensor(_structure(runs), dtype=torch.int64, device=device)
    values = torch.tensor(_values(runs, memory_limit), dtype=torch.float64, device=device)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return _unpack(runs, values)
    sizes = torch.tensor([structure.numel(), values.numel(), -structure.numel(), -values.numel()], dtype=torch.int64, device=device)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=group)
    if int(sizes[0]) != -int(sizes[2]) or int(sizes[1]) != -int(sizes[3]):
        return None  # every rank sees the mismatch in the same all_reduce result
    both = torch.cat([structure, -structure])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(both[: structure.numel()], -both[structure.numel() :]):
        return None
    return _unpack(runs, values)


def _unpack(runs: list[GraphRun], values: torch.Tensor) -> AgreedProfile:
    flat = values.tolist()
    limit = None if math.isinf(flat[0]) else int(-flat[0])
    pos = 1
    agreed = []
    for run in runs:
        g, s, c = len(run.gathers), len(run.scatters), len(run.compute_between)
        times = flat[pos : pos + g + s]
        compute = flat[pos + g + s : pos + g + s + c]
        total, peak = flat[pos + g + s + c], flat[pos + g + s + c + 1]
        pos += g + s + c + 2
        agreed.append(
            GraphRun(
                run.kind,
                [(e, t) for (e, _), t in zip(run.gathers, times[:g], strict=True)],
                compute,
                [(e, t) for (e, _), t in zip(run.scatters, times[g:], strict=True)],
                total,
                int(peak),
                run.itemsize,
            )
        )
    return AgreedProfile(agreed, limit)


# ---------------------------------------------------------------------------------------------
# Planning: a pure function of the agreed profile and the planned schedule.
# ---------------------------------------------------------------------------------------------
PLAN_KEYS = {
    "allgather_bucket_size": "allgather_bucket_elements",
    "reduce_bucket_size": "reduce_bucket_elements",
    "stage3_prefetch_bucket_size": "prefetch_elements",
    "unshard_budget": "unshard_budget",
}
"""What profiling re-plans: the config key each part of the ``ZeroSchedule`` comes from (the report names them so)."""


def plan_of(schedule: ZeroSchedule) -> dict[str, int]:
    """The re-planned part of ``schedule`` under the config's names (``DUMP/zero_plan.json``'s ``before``/``after``)."""
    return {key: int(getattr(schedule, attribute)) for key, attribute in PLAN_KEYS.items()}


def fit_latency(samples: Sequence[tuple[int, float]]) -> tuple[float, float] | None:
    """Least-squares ``seconds = alpha + beta * elements``; None without two distinct sizes or a positive slope."""
    if len({e for e, _ in samples}) < 2:
        return None
    n = len(samples)
    mean_e = sum(e for e, _ in samples) / n
    mean_t = sum(t for _, t in samples) / n
    var = sum((e - mean_e) ** 2 for e, _ in samples)
    beta = sum((e - mean_e) * (t - mean_t) for e, t in samples) / var
    alpha = mean_t - beta * mean_e
    if beta <= 0:
        return None
    return max(alpha, 0.0), beta


def prefetch_window(gathers: Sequence[tuple[int, float]], compute_between: Sequence[float]) -> int:
    """Elements that must be in flight so each gather's time is covered by the compute before its use.

    Gather ``i`` is hidden when issued after the wait of gather ``j-1`` such that the compute from
    that wait to gather ``i``'s wait covers its time; the prefetch window is then gathers ``j..i``.
    """
    widest = 0
    for i, (size_i, seconds) in enumerate(gathers):
        j, covered, window = i, compute_between[i], size_i  # issued right after gather i-1's wait
        while covered < seconds and j > 0:
            j -= 1
            covered += compute_between[j]
            window += gathers[j][0]
        widest = max(widest, window)
    return widest


def plan_from_profile(schedule: ZeroSchedule, profile: AgreedProfile) -> tuple[ZeroSchedule, dict[str, str]]:
    """The new schedule (``schedule`` with the parts ``PLAN_KEYS`` names re-planned; the others kept, profiling off)
    and, per key, why it is what it is. ``schedule``'s sizes are upper bounds."""
    plan = plan_of(schedule)
    why: dict[str, str] = {}
    for key, kind in (("allgather_bucket_size", "gathers"), ("reduce_bucket_size", "scatters")):
        samples = [s for run in profile.runs for s in getattr(run, kind)]
        fit = fit_latency(samples)
        if fit is None:
            why[key] = f"kept: {len(samples)} measured collectives give no latency/bandwidth fit"
            continue
        alpha, beta = fit
        wanted = max(1, math.ceil((1 - LATENCY_SHARE) / LATENCY_SHARE * alpha / beta))
        plan[key] = min(plan[key], wanted)
        why[key] = (
            f"latency {alpha * 1e6:.1f} us + {beta * 1e9:.3f} ns/element: buckets of {wanted} elements keep latency "
            f"<= {LATENCY_SHARE:.0%}, capped by the config"
        )
    if schedule.stage == 3:
        windows = [prefetch_window(run.gathers, run.compute_between) for run in profile.runs if run.gathers]
        if windows:
            need = max(windows)
            cap = schedule.max_live_parameters
            if profile.memory_limit_bytes is not None:
                peak = max(run.peak_live_bytes for run in profile.runs)
                itemsize = profile.runs[0].itemsize
                cap = min(cap, max(0, (profile.memory_limit_bytes - peak) // itemsize + max(e for run in profile.runs for e, _ in run.gathers)))
            plan["stage3_prefetch_bucket_size"] = max(1, min(need, cap))
            why["stage3_prefetch_bucket_size"] = f"{need} elements in flight hide every measured gather behind compute; live-parameter/memory cap {cap}"
        if profile.memory_limit_bytes is not None:
            peak = max(run.peak_live_bytes for run in profile.runs)
            itemsize = profile.runs[0].itemsize
            room = max(0, profile.memory_limit_bytes - peak) // itemsize
            plan["unshard_budget"] = min(room, schedule.unshard_budget) if schedule.unshard_budget > 0 else room
            why["unshard_budget"] = f"measured peak {peak} B of a {profile.memory_limit_bytes} B limit leaves {room} elements to keep gathered"
        else:
            why["unshard_budget"] = "kept: no device memory limit on CPU, so the configured budget stands"
    new = dataclasses.replace(schedule, profile_steps=0, **{PLAN_KEYS[key]: value for key, value in plan.items()})
    return new, why


def device_memory_limit() -> int | None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        _free, total = torch.cuda.mem_get_info()
        return int(total * DEVICE_MEMORY_FRACTION)
    return None


# ---------------------------------------------------------------------------------------------
# The profiler the engine owns; the ``zero_profile`` pass finds it through the config.
# ---------------------------------------------------------------------------------------------
_PROFILERS: dict[int, ZeroProfiler] = {}


def profiler_for(config: Any) -> ZeroProfiler | None:
    return _PROFILERS.get(id(config))


class ZeroProfiler:
    """Collects graph runs for ``steps`` optimizer steps, then agrees on a new schedule and hands it to ``replan``."""

    def __init__(
        self, config: Any, schedule: ZeroSchedule, steps: int, replan: Callable[[ZeroSchedule], None], group: dist.ProcessGroup | None = None
    ) -> None:
        self.config = config
        self.schedule = schedule
        self.steps = steps
        self.replan = replan
        self.group = group
        self.replanned = False
        self.active = True
        self.current: list[GraphRun] = []
        self.last_step: list[GraphRun] = []
        self.steps_seen = 0
        self.report: dict[str, Any] | None = None
        _PROFILERS[id(config)] = self

    def wrap(self, kind: str) -> Callable[[torch.fx.GraphModule, Callable[..., Any]], Callable[..., Any]]:
        """For the frontend: wrap a lowered graph so it runs under the profiler while profiling lasts."""

        def wrapper(gm: torch.fx.GraphModule, lowered: Callable[..., Any]) -> Callable[..., Any]:
            boxed = getattr(lowered, "_boxed_call", False)

            def run(args: list[Any]) -> Any:
                if not self.active:
                    return lowered(args) if boxed else lowered(*args)
                out, record = ProfilingInterpreter(gm, kind).profile(list(args))
                args.clear()
                self.current.append(record)
                return out

            run._boxed_call = True  # type: ignore[attr-defined]
            return run

        return wrapper

    def after_step(self) -> bool:
        """Call at every optimizer step (same step on every rank); re-plans once, at the last profiled step."""
        if not self.active:
            return False
        self.steps_seen += 1
        if self.current:
            self.last_step, self.current = self.current, []
        if self.steps_seen < self.steps:
            return False
        self.active = False
        _PROFILERS.pop(id(self.config), None)
        before = plan_of(self.schedule)
        profile = agree(self.last_step, device_memory_limit(), self.group)
        if profile is None or not profile.runs:
            reason = "ranks measured different collectives" if profile is None else "no ZeRO graph ran while profiling"
            log.warning("ZeRO profile: %s; keeping the plan from the config", reason)
            self.report = {"before": before, "after": before, "why": {"all": reason}, "profile": None}
            self._write()
            return False
        schedule, why = plan_from_profile(self.schedule, profile)
        after = plan_of(schedule)
        self.report = {"before": before, "after": after, "why": why, "profile": profile.to_dict(), "steps": self.steps}
        log.info("ZeRO plan from %d profiled step(s): before %s, after %s", self.steps, before, after)
        self._write()
        self.replan(schedule)
        self.replanned = True
        return True

    def _write(self) -> None:
        if self.config.dump:
            root = Path(self.config.dump)
            root.mkdir(parents=True, exist_ok=True)
            (root / "zero_plan.json").write_text(json.dumps(self.report, indent=2))


def replan_engine(engine: Any, schedule: ZeroSchedule) -> None:
    """Swap ``schedule`` into the engine's one plan and compile once more: the new graphs' passes read it."""
    engine.replan(dataclasses.replace(engine.plan, zero_schedule=schedule))
    engine.recompile(engine.config)


class ZeroProfileExtension(EngineExtension):
    """The engine's side of ``profile_steps``: owns the profiler, re-plans after the profiled steps."""

    name = "zero_profile"

    def __init__(self) -> None:
        self.profiler: ZeroProfiler | None = None

    def configure(self, engine: Any) -> None:
        engine.context.zero_profiler = None
        schedule = engine.plan.zero_schedule
        if not schedule.in_graphs:
            log.info("zero_optimization.profile_steps: ZeRO-1 has no collectives in the graphs to plan; not profiling")
            return
        if not engine.context.compiles_model:
            log.info("zero_optimization.profile_steps: this engine does not compile its model; not profiling")
            return
        self.profiler = ZeroProfiler(engine.config, schedule, schedule.profile_steps, lambda new: replan_engine(engine, new))
        engine.context.zero_profiler = self.profiler

    def after_optimizer_step(self, engine: Any, overflow: bool) -> None:
        if self.profiler is not None:
            self.profiler.after_step()  # at the same step on every rank: agrees, re-plans, recompiles once
