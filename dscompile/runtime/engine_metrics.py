"""``wall_clock_breakdown`` and ``memory_breakdown``: per-step timers and memory, as DeepSpeed reports them.

``StepTimers`` sums the wall time of each phase (``forward``, ``backward``, ``step``) over the
micro-steps of one optimizer step; the engine closes the step (``end_step``) and, every
``steps_per_print`` optimizer steps, logs the mean per optimizer step over that interval (logger
``dscompile.engines.training``; rank 0, or under pipeline parallelism the first replica of every stage).
On CUDA the device is synchronised at each phase boundary while timing, so the times are the device's, not the launch's.

``MemoryBreakdown`` takes a snapshot after each phase: on CPU the process resident set (RSS, and
the peak RSS of the process so far), on CUDA ``torch.cuda``'s allocated/reserved bytes and their
peaks within the phase (peaks are reset when a phase begins), and on both the bytes of model states
(parameters, gradients, optimizer states) this rank holds.

Both cost nothing when their config key is false.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

log = logging.getLogger("dscompile.engines.training")

PHASES = ("forward", "backward", "step")


def _cuda_active() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


class StepTimers:
    """Wall time per phase, summed per optimizer step."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._current: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._interval: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._interval_steps = 0
        self.last: dict[str, float] = {}

    @contextlib.contextmanager
    def time(self, phase: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        if _cuda_active():
            torch.cuda.synchronize()
        begin = time.perf_counter()
        try:
            yield
        finally:
            if _cuda_active():
                torch.cuda.synchronize()
            self.add(phase, time.perf_counter() - begin)

    def add(self, phase: str, seconds: float) -> None:
        if self.enabled:
            self._current[phase] = self._current.get(phase, 0.0) + seconds

    def end_step(self) -> None:
        """Close one optimizer step: its totals become ``last`` and join the print interval."""
        if not self.enabled:
            return
        self.last = dict(self._current)
        for phase, seconds in self._current.items():
            self._interval[phase] = self._interval.get(phase, 0.0) + seconds
        self._interval_steps += 1
        self._current = dict.fromkeys(PHASES, 0.0)

    def last_ms(self) -> dict[str, float]:
        return {phase: seconds * 1e3 for phase, seconds in self.last.items()}

    def interval_ms(self, reset: bool = True) -> dict[str, float]:
        """Mean milliseconds per optimizer step since the last call."""
        steps = max(1, self._interval_steps)
        means = {phase: seconds * 1e3 / steps for phase, seconds in self._interval.items()}
        if reset:
            self._interval = dict.fromkeys(PHASES, 0.0)
            self._interval_steps = 0
        return means


def format_times(step: int, rank: int, means: dict[str, float]) -> str:
    parts = " | ".join(f"{phase}: {ms:.2f}" for phase, ms in means.items())
    return f"step {step} rank {rank} time (ms, mean per optimizer step) | {parts}"


def process_memory() -> dict[str, int]:
    """This process's resident set and its peak so far, in bytes (what the OS reports)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/statm") as f:
            out["rss_bytes"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out["peak_rss_bytes"] = int(peak if sys.platform == "darwin" else peak * 1024)
    except (ImportError, OSError):
        pass
    return out


def device_memory() -> dict[str, int]:
    """``torch.cuda`` allocator statistics for the current device (empty without CUDA in use)."""
    if not _cuda_active():
        return {}
    return {
        "allocated_bytes": int(torch.cuda.memory_allocated()),
        "max_allocated_bytes": int(torch.cuda.max_memory_allocated()),
        "reserved_bytes": int(torch.cuda.memory_reserved()),
        "max_reserved_bytes": int(torch.cuda.max_memory_reserved()),
    }


class MemoryBreakdown:
    """A memory snapshot after each phase of the last step."""

    def __init__(self, enabled: bool, model_state_bytes: Callable[[], int]) -> None:
        self.enabled = enabled
        self.model_state_bytes = model_state_bytes
        self.last: dict[str, dict[str, int]] = {}

    def begin(self, phase: str) -> None:
        if self.enabled and _cuda_active():
            torch.cuda.reset_peak_memory_stats()

    def sample(self, phase: str) -> None:
        if not self.enabled:
            return
        snapshot: dict[str, int] = {**process_memory(), **device_memory(), "model_state_bytes": int(self.model_state_bytes())}
        self.last[phase] = snapshot

    @contextlib.contextmanager
    def phase(self, phase: str) -> Iterator[None]:
        self.begin(phase)
        try:
            yield
        finally:
            self.sample(phase)


def format_memory(step: int, rank: int, last: dict[str, dict[str, int]]) -> str:
    gib = float(1 << 30)
    parts = []
    for phase, snap in last.items():
        items = [f"{key.removesuffix('_bytes')} {value / gib:.3f}" for key, value in snap.items()]
        parts.append(f"after {phase}: " + ", ".join(items))
    return f"step {step} rank {rank} memory (GiB) | " + " | ".join(parts)


def log_every(
    logger: logging.Logger, step: int, steps_per_print: int, rank: int, timers: StepTimers, memory: MemoryBreakdown, *, speak: bool
) -> dict[str, Any]:
    """At the print interval, log the timers and memory (where ``speak``); returns what was due."""
    logged: dict[str, Any] = {}
    if step % steps_per_print:
        return logged
    if timers.enabled:
        means = timers.interval_ms()
        logged["times_ms"] = means
        if speak:
            logger.info(format_times(step, rank, means))
    if memory.enabled:
        logged["memory"] = dict(memory.last)
        if speak:
            logger.info(format_memory(step, rank, memory.last))
    return logged


def see_memory_usage(message: str, force: bool = False) -> None:
    """DeepSpeed's ``see_memory_usage``: with ``force``, log ``message`` with this process's memory (rank 0 only).

    On CPU the resident set and its peak (``process_memory``), on CUDA also the allocator's counters; the CUDA
    peaks are reset afterwards, as DeepSpeed does.
    """
    if not force:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    gib = 1 << 30
    parts = [f"{key.removesuffix('_bytes')} {value / gib:.2f} GB" for key, value in {**device_memory(), **process_memory()}.items()]
    log.info("%s | %s", message, ", ".join(parts))
    if _cuda_active():
        torch.cuda.reset_peak_memory_stats()


class ThroughputTimer:
    """DeepSpeed's ``engine.tput_timer``: samples per second over optimizer steps, as DeepSpeed counts them.

    The engine calls ``start()`` before each forward and ``stop(global_step=<accumulation boundary>)`` in
    ``step()``; steps before ``start_step`` (2, DeepSpeed's) are warm-up and not timed. ``avg_samples_per_sec()``
    is ``batch_size`` (the global batch) over the mean time of a timed optimizer step, ``-inf`` before any step.
    Off with ``timers.throughput.enabled: false``; ``synchronized`` waits for the device before reading the clock.
    """

    def __init__(
        self, batch_size: int | None, steps_per_output: int | None = None, start_step: int = 2, enabled: bool = True, synchronized: bool = True
    ) -> None:
        self.batch_size = 1 if batch_size is None else batch_size
        self.steps_per_output = steps_per_output
        self.start_step = start_step
        self.enabled = enabled
        self.synchronized = synchronized
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.step_elapsed_time = 0.0
        self.start_time = 0.0
        self.end_time = 0.0
        self.started = False
        self.initialized = False

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def _now(self) -> float:
        if self.synchronized and _cuda_active():
            torch.cuda.synchronize()
        return time.time()

    def start(self) -> None:
        if not self.enabled:
            return
        self.initialized = True
        self.started = True
        if self.global_step_count >= self.start_step:
            self.start_time = self._now()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        if not self.enabled or not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time > 0:
            self.end_time = self._now()
            duration = self.end_time - self.start_time
            self.total_elapsed_time += duration
            self.step_elapsed_time += duration
            if global_step:
                if report_speed and self.steps_per_output and self.global_step_count % self.steps_per_output == 0:
                    log.info(
                        "epoch=%d/micro_step=%d/global_step=%d, RunningAvgSamplesPerSec=%s, CurrSamplesPerSec=%s",
                        self.epoch_count, self.micro_step_count, self.global_step_count, self.avg_samples_per_sec(),
                        self.batch_size / (self.step_elapsed_time + 1e-8),
                    )  # fmt: skip
                self.step_elapsed_time = 0.0

    def avg_samples_per_sec(self) -> float:
        timed_steps = self.global_step_count - self.start_step
        if self.global_step_count > 0 and timed_steps > 0 and self.total_elapsed_time > 0:
            return self.batch_size / (self.total_elapsed_time / timed_steps)
        return float("-inf")
