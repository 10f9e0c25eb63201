"""Pipeline schedules as per-rank action lists, and a simulator that checks and times them.

An action is ``Action("F" | "B", stage, micro_batch)``. Model stage ``s`` lives on pipeline rank
``s % ranks`` (with ``chunks`` model stages per rank for the interleaved schedule).

- GPipe: every forward, then every backward (micro-batches in order).
- 1F1B: ``ranks - rank - 1`` warm-up forwards, then one forward / one backward alternately,
  then the remaining backwards; at most ``ranks - rank`` micro-batches in flight per rank.
- Interleaved 1F1B (virtual stages): micro-batches go through the rank's chunks in groups of
  ``ranks``; warm-up ``2 * (ranks - rank - 1) + (chunks - 1) * ranks`` forwards, then 1F1B
  over (chunk, micro-batch) pairs, backwards visiting the chunks in reverse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class Action(NamedTuple):
    kind: str  # "F" or "B"
    stage: int
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}.{self.micro_batch}"


def gpipe(rank: int, ranks: int, micro_batches: int) -> list[Action]:
    return [Action("F", rank, i) for i in range(micro_batches)] + [Action("B", rank, i) for i in range(micro_batches)]


def one_f_one_b(rank: int, ranks: int, micro_batches: int) -> list[Action]:
    warmup = min(ranks - rank - 1, micro_batches)
    actions = [Action("F", rank, i) for i in range(warmup)]
    for i in range(micro_batches - warmup):
        actions += [Action("F", rank, warmup + i), Action("B", rank, i)]
    actions += [Action("B", rank, i) for i in range(micro_batches - warmup, micro_batches)]
    return actions


def interleaved_one_f_one_b(rank: int, ranks: int, micro_batches: int, chunks: int) -> list[Action]:
    if micro_batches % ranks:
        raise ValueError(f"interleaved 1F1B needs micro_batches ({micro_batches}) divisible by the pipeline stages ({ranks})")
    total = micro_batches * chunks

    def unit(k: int, forward: bool) -> tuple[int, int]:
        group, within = divmod(k, ranks * chunks)
        chunk = within // ranks
        if not forward:
            chunk = chunks - 1 - chunk
        return chunk * ranks + rank, group * ranks + within % ranks

    warmup = min(2 * (ranks - rank - 1) + (chunks - 1) * ranks, total)
    actions = [Action("F", *unit(k, True)) for k in range(warmup)]
    for k in range(total - warmup):
        actions += [Action("F", *unit(warmup + k, True)), Action("B", *unit(k, False))]
    actions += [Action("B", *unit(k, False)) for k in range(total - warmup, total)]
    return actions


def build_schedule(name: str, rank: int, ranks: int, micro_batches: int, chunks: int = 1) -> list[Action]:
    """The action list of pipeline rank ``rank`` for schedule ``name``."""
    if name == "gpipe":
        return gpipe(rank, ranks, micro_batches)
    if name == "1f1b":
        return one_f_one_b(rank, ranks, micro_batches)
    if name == "interleaved_1f1b":
        return interleaved_one_f_one_b(rank, ranks, micro_batches, chunks)
    raise ValueError(f"unknown pipeline schedule {name!r}; use gpipe, 1f1b or interleaved_1f1b")


@dataclass
class Simulation:
    makespan: float
    busy: list[float]
    starts: dict[Action, float]

    def idle_fraction(self, rank: int) -> float:
        return 1.0 - self.busy[rank] / self.makespan


def simulate(schedules: list[list[Action]], num_stages: int, forward_time: float = 1.0, backward_time: float = 2.0) -> Simulation:
    """Run the per-rank lists against the data dependencies; raise if they deadlock.

    F(s, i) needs F(s-1, i); B(s, i) needs F(s, i) and B(s+1, i). Sends never block.
    """
    done: dict[Action, float] = {}
    starts: dict[Action, float] = {}
    cursor = [0] * len(schedules)
    free = [0.0] * len(schedules)
    busy = [0.0] * len(schedules)
    remaining = sum(len(s) for s in schedules)
    while remaining:
        progressed = False
        for r, actions in enumerate(schedules):
            while cursor[r] < len(actions):
                a = actions[cursor[r]]
                deps = [Action("F", a.stage - 1, a.micro_batch)] if a.kind == "F" and a.stage > 0 else []
                if a.kind == "B":
                    deps.append(Action("F", a.stage, a.micro_batch))
                    if a.stage < num_stages - 1:
                        deps.append(Action("B", a.stage + 1, a.micro_batch))
                if any(d not in done for d in deps):
                    break
                start = max([free[r]] + [done[d] for d in deps])
                length = forward_time if a.kind == "F" else backward_time
                starts[a], done[a] = start, start + length
                free[r] = start + length
                busy[r] += length
                cursor[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(acts[cursor[r]]) for r, acts in enumerate(schedules) if cursor[r] < len(acts)}
            raise RuntimeError(f"pipeline schedule deadlocks; ranks wait at {stuck}")
    return Simulation(max(done.values()), busy, starts)


def bubble_fraction(ranks: int, micro_batches: int) -> float:
    """GPipe's and 1F1B's idle fraction with equal stages: (p - 1) / (m + p - 1)."""
    return (ranks - 1) / (micro_batches + ranks - 1)
