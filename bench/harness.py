"""What the benchmarks share: resident memory, timed steady steps, peers alternated over rounds, ratios with spread.

One module so that every benchmark measures the same way: a ratio between two peers is a claim only with its
spread, and on a shared machine only when the peers ran alternated (A B A B ...), so that a change of load
hits both sides of each round alike. Every script under ``bench/`` that compares peers builds on this.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any


def resident_bytes() -> int:
    """This process's resident set size now (Linux ``/proc``)."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakSampler:
    """Samples this process's resident set size in a thread; ``peak`` is the highest seen."""

    def __init__(self, interval_s: float = 0.001) -> None:
        self.peak = 0
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, resident_bytes())
            time.sleep(self._interval_s)

    def __enter__(self) -> PeakSampler:
        self.peak = resident_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def timed_steps(
    step: Callable[[Any], float], batches: Sequence[Any], warmup: int, barrier: Callable[[], Any] | None = None
) -> tuple[list[float], list[float], int]:
    """Run ``step`` over ``batches``: the first ``warmup`` untimed (compilation happens there), the rest timed
    one by one after ``barrier`` (so distributed ranks start each step together). Returns (losses, seconds of
    each timed step, peak resident bytes sampled during the timed steps)."""
    losses = [step(batch) for batch in batches[:warmup]]
    seconds = []
    with PeakSampler() as sampler:
        for batch in batches[warmup:]:
            if barrier is not None:
                barrier()
            start = time.perf_counter()
            losses.append(step(batch))
            seconds.append(time.perf_counter() - start)
    return losses, seconds, sampler.peak


def median_spread(values: Iterable[float]) -> tuple[float, float]:
    """Median and relative spread ``(max - min) / median`` (0 for a single value)."""
    values = list(values)
    middle = statistics.median(values)
    return middle, ((max(values) - min(values)) / middle if middle else 0.0)


def alternate(peers: Sequence[str], rounds: int, run_peer: Callable[[str, int], dict[str, Any] | None]) -> dict[str, list[dict[str, Any]]]:
    """Run every peer once per round, in the same order each round (A B C A B C ...); ``run_peer(peer, round)``
    returns the run's measurements, or None when the peer cannot run here (it is then dropped from later rounds)."""
    runs: dict[str, list[dict[str, Any]]] = {}
    dropped: set[str] = set()
    for round_index in range(rounds):
        for peer in peers:
            if peer in dropped:
                continue
            result = run_peer(peer, round_index)
            if result is None:
                dropped.add(peer)
                continue
            runs.setdefault(peer, []).append(result)
    return runs


def ratio_cell(runs: Sequence[dict[str, Any]], base_runs: Sequence[dict[str, Any]] | None, key: str = "step_s") -> str:
    """``0.83x [0.79-0.90]``: the median of the per-round ratios ``runs[i][key] / base_runs[i][key]`` and their
    range (rounds pair up because the peers alternate); ``-`` when there is no base."""
    if not base_runs:
        return "-"
    ratios = [r[key] / b[key] for r, b in zip(runs, base_runs, strict=False) if b[key]]
    if not ratios:
        return "-"
    if len(ratios) == 1:
        return f"{ratios[0]:.2f}x"
    return f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]"
