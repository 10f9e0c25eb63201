"""Pipeline schedules: per-rank order against their definitions, deadlock freedom, bubbles."""

from __future__ import annotations

import pytest

from dscompile.runtime.pipeline_schedules import Action, bubble_fraction, build_schedule, simulate


def _names(actions: list[Action]) -> list[str]:
    return [str(a) for a in actions]


def test_gpipe_is_all_forwards_then_all_backwards():
    assert _names(build_schedule("gpipe", 1, 2, 3)) == ["F1.0", "F1.1", "F1.2", "B1.0", "B1.1", "B1.2"]


def test_1f1b_order_by_hand():
    # p=3, m=4: rank 0 warms up with 2 forwards, rank 1 with 1, the last rank alternates at once.
    assert _names(build_schedule("1f1b", 0, 3, 4)) == ["F0.0", "F0.1", "F0.2", "B0.0", "F0.3", "B0.1", "B0.2", "B0.3"]
    assert _names(build_schedule("1f1b", 1, 3, 4)) == ["F1.0", "F1.1", "B1.0", "F1.2", "B1.1", "F1.3", "B1.2", "B1.3"]
    assert _names(build_schedule("1f1b", 2, 3, 4)) == ["F2.0", "B2.0", "F2.1", "B2.1", "F2.2", "B2.2", "F2.3", "B2.3"]


def test_1f1b_bounds_micro_batches_in_flight():
    p, m = 4, 8
    for rank in range(p):
        in_flight, peak = 0, 0
        for a in build_schedule("1f1b", rank, p, m):
            in_flight += 1 if a.kind == "F" else -1
            peak = max(peak, in_flight)
        assert peak == p - rank  # GPipe would hold all m


def test_interleaved_order_by_hand():
    # p=2, v=2, m=2: rank 0 holds stages 0 and 2; warm-up 2*(2-0-1) + (2-1)*2 = 4 forwards.
    assert _names(build_schedule("interleaved_1f1b", 0, 2, 2, 2)) == ["F0.0", "F0.1", "F2.0", "F2.1", "B2.0", "B2.1", "B0.0", "B0.1"]
    # rank 1 holds stages 1 and 3; warm-up 2 forwards, then 1F1B, backwards visit chunk 1 first.
    assert _names(build_schedule("interleaved_1f1b", 1, 2, 2, 2)) == ["F1.0", "F1.1", "F3.0", "B3.0", "F3.1", "B3.1", "B1.0", "B1.1"]


@pytest.mark.parametrize("name,chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3)])
@pytest.mark.parametrize("p,m", [(2, 2), (2, 6), (4, 4), (4, 8)])
def test_every_action_once_and_no_deadlock(name, chunks, p, m):
    schedules = [build_schedule(name, r, p, m, chunks) for r in range(p)]
    stages = p * chunks
    for r, actions in enumerate(schedules):
        expected = {(k, s, i) for k in "FB" for s in range(stages) if s % p == r for i in range(m)}
        assert sorted(tuple(a) for a in actions) == sorted(expected)
    sim = simulate(schedules, stages)
    if name != "interleaved_1f1b":
        for r in range(p):
            assert sim.idle_fraction(r) == pytest.approx(bubble_fraction(p, m))
    else:
        # virtual stages shrink the bubble by the number of chunks
        assert sim.idle_fraction(0) == pytest.approx((p - 1) / (chunks * m + p - 1))


def test_simulator_detects_a_deadlock():
    bad = [[Action("B", 0, 0), Action("F", 0, 0)], [Action("F", 1, 0), Action("B", 1, 0)]]
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(bad, 2)


def test_interleaved_needs_divisible_micro_batches():
    with pytest.raises(ValueError, match="divisible"):
        build_schedule("interleaved_1f1b", 0, 2, 3, 2)
