"""Crash-safe checkpoints (``dscompile.runtime.checkpoint_io``): commit protocol, manifest checks, clear errors.

One process here (the distributed kill during a save is in ``test_fault_matrix.py``); a process
SIGKILLed in the middle of writing a file is a real subprocess.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import dscompile
from dscompile.cli import main as cli_main
from dscompile.runtime.checkpoint_io import (
    LATEST,
    MANIFEST,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointReader,
    CheckpointWriter,
    resolve_checkpoint_dir,
)


def _save(root: Path, tag: str, value: float, **kwargs: object) -> Path:
    with CheckpointWriter(root, tag, **kwargs) as ckpt:
        ckpt.save({"w": torch.full((64,), value), "step": value}, "model.pt")
        ckpt.save({"m": torch.arange(10.0) * value}, "optim.pt")
    return ckpt.directory


def test_commit_writes_manifest_then_latest_and_loads_verified(tmp_path: Path) -> None:
    directory = _save(tmp_path, "step1", 1.0)
    assert directory == tmp_path / "step1"
    assert sorted(p.name for p in directory.iterdir()) == [MANIFEST, "model.pt", "optim.pt"]
    assert (tmp_path / LATEST).read_text() == "step1"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging or temporary file left
    manifest = json.loads((directory / MANIFEST).read_text())
    assert manifest["tag"] == "step1" and manifest["world_size"] == 1
    assert manifest["files"]["model.pt"]["bytes"] == (directory / "model.pt").stat().st_size
    reader = CheckpointReader(resolve_checkpoint_dir(tmp_path, None))
    assert torch.equal(reader.load("model.pt")["w"], torch.full((64,), 1.0))
    assert reader.names() == ["model.pt", "optim.pt"]


def test_truncated_file_is_named(tmp_path: Path) -> None:
    directory = _save(tmp_path, "step1", 1.0)
    path = directory / "optim.pt"
    size = path.stat().st_size
    with open(path, "r+b") as handle:
        handle.truncate(size // 2)
    with pytest.raises(CheckpointCorruptError, match=rf"{path}.* is {size // 2} bytes, {size} when saved: it is truncated"):
        CheckpointReader(directory).load("optim.pt")
    CheckpointReader(directory).load("model.pt")  # the intact file still loads


def test_flipped_bytes_fail_the_checksum(tmp_path: Path) -> None:
    directory = _save(tmp_path, "step1", 1.0)
    path = directory / "model.pt"
    data = bytearray(path.read_bytes())
    start = data.find(torch.full((64,), 1.0).numpy().tobytes())  # inside the tensor's bytes: torch.load alone would not notice
    assert start > 0
    data[start + 5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match=rf"{path}.*does not match the checksum recorded when it was saved"):
        CheckpointReader(directory).load("model.pt")


def test_missing_file_and_missing_manifest(tmp_path: Path) -> None:
    directory = _save(tmp_path, "step1", 1.0)
    (directory / "optim.pt").unlink()
    with pytest.raises(CheckpointCorruptError, match=r"optim.pt is missing \(the manifest lists it"):
        CheckpointReader(directory).load("optim.pt")
    (directory / MANIFEST).unlink()
    with pytest.raises(CheckpointCorruptError, match="has no manifest.json: it was not completely saved"):
        CheckpointReader(directory)


def test_failure_on_a_rank_commits_nothing(tmp_path: Path) -> None:
    _save(tmp_path, "step1", 1.0)
    with pytest.raises(OSError, match="disk full"), CheckpointWriter(tmp_path, "step2") as ckpt:
        ckpt.save({"w": torch.zeros(3)}, "model.pt")
        raise OSError("disk full")
    assert (tmp_path / LATEST).read_text() == "step1" and not (tmp_path / "step2").exists()
    assert (tmp_path / ".step2.saving").is_dir()  # left for inspection, cleared by the next save of that tag
    _save(tmp_path, "step2", 2.0)
    assert not (tmp_path / ".step2.saving").exists() and (tmp_path / LATEST).read_text() == "step2"


def test_overwriting_a_tag_replaces_it_whole(tmp_path: Path) -> None:
    _save(tmp_path, "last", 1.0)
    with CheckpointWriter(tmp_path, "last") as ckpt:
        ckpt.save({"w": torch.full((64,), 2.0), "step": 2.0}, "model.pt")  # optim.pt not written this time
    reader = CheckpointReader(tmp_path / "last")
    assert reader.names() == ["model.pt"] and not (tmp_path / "last" / "optim.pt").exists()
    assert reader.load("model.pt")["step"] == 2.0


def test_save_latest_false_and_bad_tags(tmp_path: Path) -> None:
    _save(tmp_path, "a", 1.0)
    _save(tmp_path, "b", 2.0, save_latest=False)
    assert (tmp_path / LATEST).read_text() == "a"
    for tag in ("", "x/y", ".hidden", "latest"):
        with pytest.raises(CheckpointError, match="plain directory name"):
            CheckpointWriter(tmp_path, tag)
    with pytest.raises(CheckpointError, match=r"checkpoint .*/nope does not exist \(tags here: a, b\)"):
        resolve_checkpoint_dir(tmp_path, "nope")
    with pytest.raises(CheckpointError, match="has no 'latest' file"):
        resolve_checkpoint_dir(tmp_path / "a", None)


_KILLED_SAVE = textwrap.dedent(
    """
    import os, signal, sys, torch
    from dscompile.runtime import checkpoint_io

    root = sys.argv[1]
    with checkpoint_io.CheckpointWriter(root, "step1") as ckpt:
        ckpt.save({"w": torch.full((4096,), 1.0)}, "model.pt")
    written = 0
    real_write = checkpoint_io._ChecksumWriter.write

    def write(self, data):
        global written
        written += memoryview(data).nbytes
        if written > 8000:  # half of the tensor is on disk
            os.kill(os.getpid(), signal.SIGKILL)
        return real_write(self, data)

    checkpoint_io._ChecksumWriter.write = write
    with checkpoint_io.CheckpointWriter(root, "step2") as ckpt:
        ckpt.save({"w": torch.full((4096,), 2.0)}, "model.pt")
    """
)


def test_sigkill_while_writing_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", _KILLED_SAVE, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert (tmp_path / LATEST).read_text() == "step1" and not (tmp_path / "step2").exists()
    partial = [p for p in (tmp_path / ".step2.saving").iterdir()]
    assert partial and all(p.name.startswith(".model.pt.tmp") for p in partial)  # never under its final name
    state = CheckpointReader(resolve_checkpoint_dir(tmp_path, None)).load("model.pt")
    assert torch.equal(state["w"], torch.full((4096,), 1.0))


def test_zero_to_fp32_cli_messages(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["zero-to-fp32", str(tmp_path / "nowhere"), str(tmp_path / "out.pt")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli_main(["zero-to-fp32", str(tmp_path), str(tmp_path / "out.pt")]) == 2
    assert "nor a save directory with a 'latest' file" in capsys.readouterr().err
    _save(tmp_path, "step1", 1.0)
    assert cli_main(["zero-to-fp32", str(tmp_path), str(tmp_path / "out.pt")]) == 2
    assert "holds no model states file" in capsys.readouterr().err


def _engine(stage: int = 0) -> object:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, "lower": "eager"}
    if stage:
        config["zero_optimization"] = {"stage": stage}
    engine, *_ = dscompile.initialize(model=model, config=config)
    return engine


def _train(engine: object, steps: int) -> list[float]:
    losses = []
    for step in range(steps):
        generator = torch.Generator().manual_seed(step)
        x, y = torch.randn(2, 4, generator=generator), torch.randn(2, 1, generator=generator)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_engine_checkpoint_round_trip_and_corruption(tmp_path: Path) -> None:
    engine = _engine()
    _train(engine, 2)
    engine.save_checkpoint(tmp_path, client_state={"epoch": 7})
    expected = _train(engine, 2)
    resumed = _engine()
    path, client = resumed.load_checkpoint(tmp_path)
    assert path == str(tmp_path / "global_step2") and client == {"epoch": 7}
    assert _train(resumed, 2) == expected  # bit-exact continuation
    states = tmp_path / "global_step2" / "mp_rank_00_model_states.pt"
    with open(states, "r+b") as handle:
        handle.truncate(os.path.getsize(states) - 10)
    with pytest.raises(CheckpointCorruptError, match="mp_rank_00_model_states.pt is .* bytes, .* when saved: it is truncated"):
        _engine().load_checkpoint(tmp_path)


def test_stage0_checkpoint_loads_into_zero_and_back(tmp_path: Path) -> None:
    """A checkpoint saved without ZeRO restores into a ZeRO engine and back (one process: ZeRO-1; the other
    stages and world sizes are covered on two ranks by test_deepspeed_checkpoint.py)."""
    plain = _engine()
    _train(plain, 2)
    plain.save_checkpoint(tmp_path / "plain")
    expected = _train(plain, 2)
    for stage in (1,):
        zero = _engine(stage)
        zero.load_checkpoint(tmp_path / "plain")
        assert zero.global_steps == 2
        losses = _train(zero, 2)
        assert losses == pytest.approx(expected, rel=1e-6, abs=1e-7), stage
        zero.save_checkpoint(tmp_path / f"zero{stage}")
        back = _engine()
        back.load_checkpoint(tmp_path / f"zero{stage}")  # and a ZeRO checkpoint into an engine without ZeRO
        for name, value in zero.full_parameters().items():
            assert torch.equal(dict(back.module.named_parameters())[name].detach(), value), (stage, name)


def test_a_checkpoint_of_another_engine_is_named_with_its_stage(tmp_path: Path) -> None:
    from dscompile.engines.pipeline_parallel import PipelineEngine

    engine = _engine(1)
    _train(engine, 1)
    engine.save_checkpoint(tmp_path)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    pipe = PipelineEngine(
        _WithMSE(model),
        {"lower": "eager", "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, "pipeline": {"stages": 1, "micro_batches": 1, "compile": False}},
        example_batch=(torch.randn(2, 4), torch.randn(2, 1)),
    )
    with pytest.raises(CheckpointError, match=r"is a dscompile ZeRO-1 checkpoint saved by 1 rank\(s\), not a PipelineEngine checkpoint"):
        pipe.load_checkpoint(tmp_path)
    assert pipe.load_checkpoint(tmp_path / "empty") == (None, None)  # no 'latest': a warning, as DeepSpeed


class _WithMSE(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.model(x), y)
