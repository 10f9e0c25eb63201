"""DeepSpeed's learning-rate schedules, step by step.

Every schedule type is traced from construction through many steps (the lr, and for OneCycle the
betas, the optimizer holds after construction and after each ``step()``), and compared with the
formulas written out below, independently of ``dscompile/runtime/schedulers.py``, following
DeepSpeed's documented semantics: iteration -1 (before the first step) is the starting value, each
``step()`` advances the iteration by one; log warm-ups divide by ``log(max(2, W))``. Where
``deepspeed`` is importable the traces must also equal DeepSpeed's own classes exactly.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import dscompile
from dscompile.config import SchedulerConfig
from dscompile.errors import DSCompileConfigError
from dscompile.runtime import schedulers
from dscompile.runtime.schedulers import build_scheduler

STEPS = 24


# ----------------------------------------------------------------------------- the formulas, written out


def warmup_fraction(i: int, w: int, kind: str) -> float:
    w = max(2, w)
    if i >= w:
        return 1.0
    return math.log(i + 1) / math.log(w) if kind == "log" else i / w


def warmup_lr(i: int, p: dict[str, Any], lr: float) -> float:
    low, high = p.get("warmup_min_lr", 0.0), p.get("warmup_max_lr", lr)
    if i < 0:
        return low
    return low + (high - low) * warmup_fraction(i, p.get("warmup_num_steps", 1000), p.get("warmup_type", "log"))


def warmup_decay_lr(i: int, p: dict[str, Any], lr: float) -> float:
    low, high = p.get("warmup_min_lr", 0.0), p.get("warmup_max_lr", 0.001)
    w, total = max(2, p.get("warmup_num_steps", 1000)), p["total_num_steps"]
    if i < 0:
        return low
    if i < w:
        return low + (high - low) * warmup_fraction(i, w, p.get("warmup_type", "log"))
    return low + (high - low) * max(0.0, (total - i) / max(1, total - w))


def warmup_cosine_lr(i: int, p: dict[str, Any], lr: float) -> float:
    w, total = max(2, p.get("warmup_num_steps", 1000)), p["total_num_steps"]
    start, floor = p.get("warmup_min_ratio", 0.0), p.get("cos_min_ratio", 0.0001)
    if i < 0:
        return 0.0
    if i < w:
        return lr * (start + (1 - start) * warmup_fraction(i, w, p.get("warmup_type", "log")))
    progress = min(1.0, (i - w + 1) / max(1, total - w))
    return lr * max(0.0, floor + (1 - floor) * (1 + math.cos(math.pi * progress)) / 2)


def one_cycle_scale(i: int, p: dict[str, Any]) -> float:
    """0 at the cycle's minimum lr, 1 at its maximum, for the batch after iteration ``i``."""
    first = p.get("cycle_first_step_size", 2000)
    second = p.get("cycle_second_step_size")
    second = first if second is None else second
    offset = (i + 1) % (first + second)
    up = p.get("cycle_first_stair_count", 0)
    down = p.get("cycle_second_stair_count")
    down = up if down is None else down
    if offset <= first:
        return math.floor(offset * up / first) / up if up > 0 else offset / first
    rest = first + second - offset
    return math.floor(rest * down / second) / down if down > 0 else rest / second


def one_cycle(i: int, p: dict[str, Any]) -> tuple[float, float | None]:
    """(lr, first beta) at iteration ``i``."""
    first = p.get("cycle_first_step_size", 2000)
    second = p.get("cycle_second_step_size")
    total = first + (first if second is None else second)
    low, high = p["cycle_min_lr"], p["cycle_max_lr"]
    mom_low, mom_high = p.get("cycle_min_mom", 0.8), p.get("cycle_max_mom", 0.9)
    if i < 0:
        return low, mom_low  # construction sets both minima (the first step then moves the beta to its maximum)
    if i < total:
        scale = one_cycle_scale(i, p)
        return low + (high - low) * scale, mom_high - (mom_high - mom_low) * scale
    k, size = i - total + 1, p.get("decay_step_size", 0)
    lr_rate, mom_rate = p.get("decay_lr_rate", 0.0), p.get("decay_mom_rate", 0.0)
    lr = low if size == 0 or lr_rate == 0 else low / (1 + lr_rate * k / size)
    mom = mom_high if size == 0 or mom_rate == 0 else mom_high * (1 + mom_rate * k / size)
    return lr, mom


def lr_range_test(i: int, p: dict[str, Any], lr: float) -> float:
    low = p.get("lr_range_test_min_lr", 1e-3)
    intervals = (i + 1) / p.get("lr_range_test_step_size", 2000)
    if p.get("lr_range_test_staircase", False):
        intervals = math.floor(intervals)
    return low * (1 + p.get("lr_range_test_step_rate", 1.0) * intervals)


FORMULAS = {"WarmupLR": warmup_lr, "WarmupDecayLR": warmup_decay_lr, "WarmupCosineLR": warmup_cosine_lr, "LRRangeTest": lr_range_test}

CASES: list[tuple[str, dict[str, Any]]] = []
for _w in (1, 2, 5, 7):
    for _kind in ("log", "linear"):
        CASES += [
            ("WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.5, "warmup_num_steps": _w, "warmup_type": _kind}),
            ("WarmupLR", {"warmup_num_steps": _w, "warmup_type": _kind}),  # max lr: the optimizer's
            ("WarmupDecayLR", {"total_num_steps": 12, "warmup_min_lr": 0.01, "warmup_max_lr": 0.5, "warmup_num_steps": _w, "warmup_type": _kind}),
            ("WarmupCosineLR", {"total_num_steps": 12, "warmup_min_ratio": 0.1, "warmup_num_steps": _w, "cos_min_ratio": 0.01, "warmup_type": _kind}),
        ]
CASES += [
    ("WarmupDecayLR", {"total_num_steps": 1000}),  # every default
    ("WarmupCosineLR", {"total_num_steps": 3, "warmup_num_steps": 5}),  # decay window shorter than the warm-up
    ("LRRangeTest", {}),
    ("LRRangeTest", {"lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 3, "lr_range_test_step_rate": 0.5}),
    ("LRRangeTest", {"lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 3, "lr_range_test_staircase": True}),
]
ONE_CYCLE = [
    {"cycle_min_lr": 0.01, "cycle_max_lr": 0.2, "cycle_first_step_size": 4},
    {"cycle_min_lr": 0.01, "cycle_max_lr": 0.2, "cycle_first_step_size": 3, "cycle_second_step_size": 5, "decay_step_size": 2,
     "decay_lr_rate": 0.5, "decay_mom_rate": 0.3},
    {"cycle_min_lr": 0.01, "cycle_max_lr": 0.2, "cycle_first_step_size": 4, "cycle_second_step_size": 2, "cycle_first_stair_count": 2,
     "cycle_second_stair_count": 1, "decay_step_size": 3, "decay_lr_rate": 0.2},
    {"cycle_min_lr": 0.01, "cycle_max_lr": 0.2, "cycle_first_step_size": 4, "cycle_first_stair_count": 2, "cycle_min_mom": 0.85,
     "cycle_max_mom": 0.95},
]


def _optimizer(kind: str = "sgd", groups: int = 1) -> torch.optim.Optimizer:
    params = [{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in range(groups)]
    return torch.optim.Adam(params, lr=0.1) if kind == "adam" else torch.optim.SGD(params, lr=0.1)


def _trace(cls: type, params: dict[str, Any], kind: str = "sgd", groups: int = 1) -> list[tuple[list[Any], list[Any]]]:
    """(lrs, betas) of every group after construction and after each of STEPS steps, then the state dict."""
    opt = _optimizer(kind, groups)
    sched = cls(opt, **params)
    snap = lambda: ([g["lr"] for g in opt.param_groups], [g.get("betas") for g in opt.param_groups])  # noqa: E731
    trace = [snap()]
    for _ in range(STEPS):
        sched.step()
        trace.append(snap())
    trace.append(sched.state_dict())
    return trace


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize(("name", "params"), CASES, ids=[f"{n}-{i}" for i, (n, _p) in enumerate(CASES)])
def test_values_follow_the_formulas_step_by_step(name: str, params: dict[str, Any]) -> None:
    trace = _trace(schedulers.SCHEDULERS[name], params)
    expected = [FORMULAS[name](i, params, 0.1) for i in range(-1, STEPS)]
    assert [lrs[0] for lrs, _betas in trace[:-1]] == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert trace[-1] == {"last_batch_iteration": STEPS - 1}


@pytest.mark.parametrize("params", ONE_CYCLE)
def test_one_cycle_follows_the_formulas_with_momentum(params: dict[str, Any]) -> None:
    trace = _trace(schedulers.OneCycle, params, kind="adam")
    for i, (lrs, betas) in zip(range(-1, STEPS), trace[:-1]):
        lr, beta1 = one_cycle(i, params)
        assert lrs[0] == pytest.approx(lr, rel=1e-12), i
        assert betas[0] == pytest.approx((beta1, 0.99), rel=1e-12), i
    # the optimizer's betas are only touched through momentum cycling; SGD has none, so none are cycled
    sgd = _trace(schedulers.OneCycle, params, kind="sgd")
    assert all(betas == [None] for _lrs, betas in sgd[:-1])
    assert [lrs[0] for lrs, _b in sgd[:-1]] == pytest.approx([one_cycle(i, params)[0] for i in range(-1, STEPS)], rel=1e-12)


def test_log_warmup_reaches_the_maximum_at_the_last_warmup_step() -> None:
    """The issue's case: W=5, log warm-up: iteration 4 is at the maximum (DeepSpeed divides by log(5), not log(6))."""
    opt = _optimizer()
    sched = schedulers.WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=5)
    seen = [opt.param_groups[0]["lr"]]
    for _ in range(6):
        sched.step()
        seen.append(opt.param_groups[0]["lr"])
    assert seen[0] == 0.0 and seen[1] == 0.0  # before the first step, and iteration 0
    assert seen[5] == pytest.approx(1.0) and seen[6] == 1.0
    assert seen[4] == pytest.approx(math.log(4) / math.log(5))


def test_per_group_values_and_tensor_lrs() -> None:
    opt = _optimizer(groups=2)
    opt.param_groups[1]["lr"] = torch.tensor(0.1)
    lr_tensor = opt.param_groups[1]["lr"]
    sched = schedulers.WarmupLR(opt, warmup_min_lr=[0.0, 0.01], warmup_max_lr=[1.0, 0.2], warmup_num_steps=4, warmup_type="linear")
    sched.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.25)
    assert opt.param_groups[1]["lr"] is lr_tensor and float(lr_tensor) == pytest.approx(0.01 + 0.19 * 0.25)
    assert sched.get_last_lr()[0] == pytest.approx(0.25)
    with pytest.raises(DSCompileConfigError, match="warmup_min_lr"):
        schedulers.WarmupLR(opt, warmup_min_lr=[0.0, 0.0, 0.0])


def test_state_dict_resumes_where_it_stopped() -> None:
    params = {"warmup_min_lr": 0.0, "warmup_max_lr": 1.0, "warmup_num_steps": 10, "total_num_steps": 20}
    opt = _optimizer()
    sched = schedulers.WarmupDecayLR(opt, **params)
    for _ in range(7):
        sched.step()
    state = sched.state_dict()
    assert state == {"last_batch_iteration": 6}
    rest = []
    for _ in range(5):
        sched.step()
        rest.append(opt.param_groups[0]["lr"])
    # a fresh schedule loading the state continues the same way; construction with an iteration leaves the lr alone
    opt2 = _optimizer()
    resumed = schedulers.WarmupDecayLR(opt2, **params, last_batch_iteration=6)
    assert opt2.param_groups[0]["lr"] == 0.1
    fresh = schedulers.WarmupDecayLR(_optimizer(), **params)
    fresh.load_state_dict(state)
    for sched2 in (resumed, fresh):
        values = []
        for _ in range(5):
            sched2.step()
            values.append(sched2.get_last_lr()[0])
        assert values == rest
    with pytest.raises(ValueError, match="last_batch_iteration"):
        fresh.load_state_dict({"last_epoch": 3})
    with pytest.raises(RuntimeError, match="step"):
        schedulers.OneCycle(_optimizer(), 0.01, 0.1).get_last_lr()


def test_engine_steps_with_the_value_of_the_previous_iteration() -> None:
    """DeepSpeed's engine steps the schedule after each optimizer step: optimizer step k runs with
    iteration k-1's lr (the construction value for k=0). A zero warm-up start leaves the first step a no-op."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    config = {"optimizer": {"type": "SGD", "params": {"lr": 0.5}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.5, "warmup_num_steps": 3,
                                                           "warmup_type": "linear"}},
              "lower": "eager"}
    engine, opt, _, sched = dscompile.initialize(model=model, config=config)
    before = [p.detach().clone() for p in model.parameters()]
    used = []
    x = torch.randn(4, 3)
    for _ in range(5):
        used.append(opt.param_groups[0]["lr"])
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        if len(used) == 1:
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # lr 0 at step 0
    assert used == pytest.approx([0.0, 0.0, 0.5 / 3, 1.0 / 3, 0.5])
    assert sched.state_dict() == {"last_batch_iteration": 4}


@pytest.mark.parametrize(
    ("section", "key"),
    [
        (SchedulerConfig("WarmupLRR", {}), "scheduler.type"),
        (SchedulerConfig("WarmupLR", {"warmup_num_stepz": 3}), "scheduler.params.warmup_num_stepz"),
        (SchedulerConfig("WarmupLR", {"warmup_type": "cosine"}), "scheduler.params.warmup_type"),
        (SchedulerConfig("WarmupLR", {"warmup_num_steps": 0}), "scheduler.params.warmup_num_steps"),
        (SchedulerConfig("WarmupDecayLR", {}), "scheduler.params.total_num_steps"),
        (SchedulerConfig("OneCycle", {"cycle_min_lr": 0.1}), "scheduler.params.cycle_max_lr"),
        (SchedulerConfig("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_first_step_size": 0}),
         "scheduler.params.cycle_first_step_size"),
        (SchedulerConfig("LRRangeTest", {"lr_range_test_step_size": 2.5}), "scheduler.params.lr_range_test_step_size"),
    ],
)
def test_bad_config_names_the_key(section: SchedulerConfig, key: str) -> None:
    with pytest.raises(DSCompileConfigError) as info:
        build_scheduler(section, _optimizer())
    assert info.value.key == key


@pytest.mark.parametrize("name", sorted(schedulers.SCHEDULERS))
def test_every_type_builds_from_a_config(name: str) -> None:
    params = {"WarmupDecayLR": {"total_num_steps": 10}, "WarmupCosineLR": {"total_num_steps": 10},
              "OneCycle": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1}}.get(name, {})
    sched = build_scheduler(SchedulerConfig(name, params), _optimizer("adam"))
    assert isinstance(sched, schedulers.SCHEDULERS[name]) and sched.last_batch_iteration == -1


def _deepspeed_schedules() -> Any:
    try:
        from deepspeed.runtime import lr_schedules
    except Exception:  # not installed, or installed without what its import needs here
        pytest.skip("deepspeed is not importable")
    return lr_schedules


@pytest.mark.parametrize(("name", "params"), CASES + [("OneCycle", p) for p in ONE_CYCLE])
def test_values_equal_deepspeeds_own_classes(name: str, params: dict[str, Any]) -> None:
    deepspeed = _deepspeed_schedules()
    for kind in ("sgd", "adam"):
        for groups in (1, 2):
            assert _trace(schedulers.SCHEDULERS[name], params, kind, groups) == _trace(getattr(deepspeed, name), params, kind, groups)
