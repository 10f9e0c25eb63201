"""Fault matrix: a rank SIGKILLed during forward, backward, the optimizer step or a checkpoint save.

For plain data parallelism, ZeRO-3 and a two-stage pipeline on 2 gloo ranks: the surviving rank
must end with an error that says a peer died (not a bare gloo message, not a hang) within 60 s,
and the last complete checkpoint must still resume bit-exact. Every run trains step 1, saves
``step1``, then the victim dies at the chosen point of step 2. The save-phase runs also record
step 2's loss and parameters on every rank before the fatal save of ``step2``: resuming ``step1``
and training step 2 again must reproduce them bit for bit. The other runs' ``step1`` checkpoints
must hold the same tensors (so they resume the same). 13 spawns in all, tiny model, eager lowering.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dscompile
from dscompile.runtime import checkpoint_io
from dscompile.runtime.checkpoint_io import LATEST, CheckpointReader
from dscompile.testing.distributed import RankDied, requires_backend, run_distributed_or_fail

pytestmark = [pytest.mark.slow, pytest.mark.distributed, requires_backend("gloo")]

CONFIGS = ("dp", "zero3", "pipeline")
PHASES = ("forward", "backward", "step")
SURVIVOR_DEADLINE_S = 60.0
_ARMED: dict[str, str | None] = {"phase": None}


def _die_if_armed(phase: str) -> None:
    if _ARMED["phase"] == phase:
        os.kill(os.getpid(), signal.SIGKILL)


@torch.library.custom_op("dscompile_faults::point", mutates_args=())
def fault_point(x: torch.Tensor) -> torch.Tensor:
    """Identity that kills its process in forward when armed (an opaque op, so it runs inside compiled graphs)."""
    _die_if_armed("forward")
    return x.clone()


@fault_point.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("dscompile_faults::point_backward", mutates_args=())
def fault_point_backward(grad: torch.Tensor) -> torch.Tensor:
    _die_if_armed("backward")
    return grad.clone()


@fault_point_backward.register_fake
def _(grad: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(grad)


fault_point.register_autograd(lambda ctx, grad: fault_point_backward(grad))


class FaultyNet(nn.Module):
    """Two blocks, each with a fault point, so either pipeline stage holds one."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.mid = nn.Linear(16, 16)
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = fault_point(torch.relu(self.inp(x)))
        h = fault_point(torch.relu(self.mid(h)))
        return torch.nn.functional.mse_loss(self.out(h), y)


def _batch(step: int, rank: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(4, 8, generator=generator), torch.randn(4, 1, generator=generator)


class Trainer:
    """One of the three set-ups behind a common step / save / load / state interface."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        torch.manual_seed(0)
        model = FaultyNet()
        optimizer = {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}}
        self.rank = dist.get_rank()
        if kind == "pipeline":
            from dscompile.engines.pipeline_parallel import PipelineEngine

            config = {"lower": "eager", "optimizer": optimizer, "pipeline": {"stages": 2, "micro_batches": 2, "compile": False}}
            self.engine = PipelineEngine(model, config, example_batch=_batch(0, 0))
        else:
            config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 4, "optimizer": optimizer, "lower": "eager"}
            if kind == "zero3":
                config["zero_optimization"] = {"stage": 3, "stage3_param_persistence_threshold": 0}
            self.engine, *_ = dscompile.initialize(model=model, config=config)

    def step(self, step: int) -> float:
        if self.kind == "pipeline":
            return float(self.engine.train_batch(iter([_batch(step, 0, 0), _batch(step, 0, 1)])))
        loss = self.engine(*_batch(step, self.rank))
        self.engine.backward(loss)
        self.engine.step()
        return loss.item()

    def parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter this rank can vouch for (a collective under ZeRO-3)."""
        if self.kind == "pipeline":
            return self.engine.stage_parameters()
        return self.engine.full_parameters()


def _arm(trainer: Trainer, phase: str) -> None:
    if phase in ("forward", "backward"):
        _ARMED["phase"] = phase
    elif phase == "step":
        trainer.engine.optimizer.step = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    elif phase == "save":
        real_write = checkpoint_io._ChecksumWriter.write
        state = {"bytes": 0}

        def write(self: Any, data: Any) -> int:
            state["bytes"] += memoryview(data).nbytes
            if state["bytes"] > 600:  # part of a file is on disk, under its temporary name
                os.kill(os.getpid(), signal.SIGKILL)
            return real_write(self, data)

        checkpoint_io._ChecksumWriter.write = write


def victim_of(kind: str, phase: str) -> int:
    """Rank 1 dies, except in a plain data-parallel save, where only rank 0 writes files."""
    return 0 if (kind, phase) == ("dp", "save") else 1


def fault_rank(rank: int, world: int, kind: str, phase: str, save_dir: str) -> dict[str, Any]:
    trainer = Trainer(kind)
    trainer.step(1)
    trainer.engine.save_checkpoint(save_dir, tag="step1")
    victim = victim_of(kind, phase) == rank
    start = time.monotonic()
    try:
        if phase == "save":
            loss = trainer.step(2)
            record = {"loss": loss, "params": trainer.parameters()}
            torch.save(record, Path(save_dir) / f"record_rank{rank}.pt")  # step 2 uninterrupted: the resume's reference
            dist.barrier()
            if victim:
                _arm(trainer, phase)
            start = time.monotonic()
            trainer.engine.save_checkpoint(save_dir, tag="step2")
        else:
            if victim:
                _arm(trainer, phase)
            for step in range(2, 6):
                trainer.step(step)
    except Exception as exc:  # the survivor's error is the result under test
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def resume_rank(rank: int, world: int, dirs: dict[str, str]) -> dict[str, Any]:
    """Resume each set-up from its last complete checkpoint and train step 2 again."""
    out = {}
    for kind, save_dir in dirs.items():
        trainer = Trainer(kind)
        trainer.engine.load_checkpoint(save_dir)
        assert trainer.engine.global_steps == 1
        loss = trainer.step(2)
        out[kind] = {"loss": loss, "params": trainer.parameters()}
        torch._dynamo.reset()
    return out


def _check_survivor(results: list[Any], kind: str, phase: str) -> None:
    victim = victim_of(kind, phase)
    assert isinstance(results[victim], RankDied) and results[victim].signal == "SIGKILL", results
    survivor = results[1 - victim]
    error = survivor["error"]
    assert error is not None, f"{kind}/{phase}: the survivor trained on without noticing the dead rank"
    clear = "another rank died" in error or "lost contact with another rank during save_checkpoint" in error
    assert clear and error.startswith(("DSCompileError", "CheckpointError")), f"{kind}/{phase}: unclear error: {error}"
    assert survivor["seconds"] < SURVIVOR_DEADLINE_S, f"{kind}/{phase}: survivor needed {survivor['seconds']:.1f} s"


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for k in sorted(value, key=str) for t in _tensors(value[k])]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _same_checkpoint(a: Path, b: Path) -> None:
    """Two checkpoints hold the same files with the same tensors (both verified against their manifests)."""
    ra, rb = CheckpointReader(a), CheckpointReader(b)
    assert ra.names() == rb.names()
    for name in ra.names():
        ta, tb = _tensors(ra.load(name)), _tensors(rb.load(name))
        assert len(ta) == len(tb) and all(torch.equal(x, y) for x, y in zip(ta, tb, strict=True)), name


@pytest.fixture(scope="module")
def save_faults(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[Any]]]:
    """The kill-during-save run of every set-up: its save directory and the ranks' results."""
    runs = {}
    for kind in CONFIGS:
        save_dir = tmp_path_factory.mktemp(f"save-{kind}")
        results = run_distributed_or_fail(fault_rank, 2, kind, "save", str(save_dir), timeout=240, may_die=[victim_of(kind, "save")])
        runs[kind] = (save_dir, results)
    return runs


def test_kill_during_save_keeps_the_last_checkpoint_and_it_resumes_bit_exact(save_faults: dict[str, tuple[Path, list[Any]]]) -> None:
    for kind, (save_dir, results) in save_faults.items():
        _check_survivor(results, kind, "save")
        assert (save_dir / LATEST).read_text() == "step1", kind
        assert not (save_dir / "step2").exists(), kind  # the interrupted save left nothing under its tag
        staged = sorted(p.name for p in (save_dir / ".step2.saving").iterdir())
        assert any(".tmp" in name for name in staged), (kind, staged)  # the victim's half-written file, never renamed
    resumed = run_distributed_or_fail(resume_rank, 2, {kind: str(d) for kind, (d, _) in save_faults.items()}, timeout=300)
    for kind, (save_dir, _) in save_faults.items():
        for rank in range(2):
            expected = torch.load(save_dir / f"record_rank{rank}.pt")
            got = resumed[rank][kind]
            assert got["loss"] == expected["loss"], (kind, rank)
            assert got["params"].keys() == expected["params"].keys()
            for name, value in expected["params"].items():
                assert torch.equal(got["params"][name], value), (kind, rank, name)


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("kind", CONFIGS)
def test_kill_during_training(kind: str, phase: str, tmp_path: Path, save_faults: dict[str, tuple[Path, list[Any]]]) -> None:
    results = run_distributed_or_fail(fault_rank, 2, kind, phase, str(tmp_path), timeout=240, may_die=[victim_of(kind, phase)])
    _check_survivor(results, kind, phase)
    assert (tmp_path / LATEST).read_text() == "step1"
    _same_checkpoint(tmp_path / "step1", save_faults[kind][0] / "step1")  # the checkpoint resumed bit-exact above
