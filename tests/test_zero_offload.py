"""ZeRO-Offload / ZeRO-Infinity for the optimizer (``zero_optimization.offload_optimizer``).

Swapping must be lossless: on real gloo ranks, training with the optimizer offloaded to the host or
to NVMe swap files gives bitwise the same losses, parameters and optimizer states as training without
offload (stages 1-3, fp32 and bf16, 10 steps); the swap files hold exactly the masters and both Adam
states of each rank's partition; the states are not resident between steps (peak and between-step RSS
measured in a subprocess); a checkpoint taken with NVMe offload resumes bit-exact; and bad paths, a
full disk and vanished or truncated files fail with errors naming the path.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_zero import _case, _config, _micro_batch, assert_params_close, reference_run

import dscompile
from dscompile.config import load_config
from dscompile.errors import DSCompileConfigError, DSCompileError
from dscompile.runtime.offload import NvmeOffloadedOptimizer, SwapDirectory, SwapError
from dscompile.runtime.offload.swap import ALIGN, align_up, aligned_buffer
from dscompile.testing.distributed import requires_backend, run_distributed_or_fail

STEPS = 10
TILE = 300  # elements per NVMe tile: the small test model spans many tiles, and pieces of parameters
CLIP = 0.05  # gradient clipping on: the offloaded step must read the clipped gradients


def _engine(
    stage: int,
    offload: dict[str, Any] | None,
    precision: str = "fp32",
    lower: str = "eager",
    extra: dict | None = None,
    memory: bool = False,
    clip: float = 0.0,
    schedule: bool = False,
) -> tuple[Any, Any]:
    torch.manual_seed(0)
    case = _case("gpt")
    zero = {"sub_group_size": TILE, **(extra or {})}
    if offload is not None:
        zero["offload_optimizer"] = offload
    config = _config(stage, 1, clip, zero)
    config["lower"] = lower
    # One implementation with and without offload (the loop): without offload ZeRO would pick torch's fused
    # AdamW, which rounds differently from the loop the tiled host step runs.
    config["optimizer"]["params"]["foreach"] = False
    if schedule:  # the learning rate changes every step: the host optimizer must follow it
        config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 5}}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    if memory:
        config["memory_breakdown"] = True
    engine, _, _, _ = dscompile.initialize(model=case.model, config=config)
    return engine, case


def _train(engine: Any, case: Any, rank: int, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        loss = engine(*_micro_batch(case, engine.global_steps, 0, rank))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _states(engine: Any) -> dict[int, dict[str, torch.Tensor]]:
    return {i: {k: v.clone() for k, v in entry.items()} for i, entry in engine.optimizer.state_dict()["state"].items()}


def offload_matrix_rank(rank: int, world: int, stage: int, precision: str, nvme_root: str, lower: str) -> dict[str, Any]:
    """Train without offload, with cpu offload and with nvme offload (twice: all states, and ratio 0.5 with one buffer)."""
    runs: dict[str, Any] = {}
    variants = {
        "none": None,
        "cpu": {"device": "cpu", "pin_memory": True},
        "nvme": {"device": "nvme", "nvme_path": os.path.join(nvme_root, "all")},
        "nvme_half": {
            "device": "nvme", "nvme_path": os.path.join(nvme_root, "half"), "ratio": 0.5, "buffer_count": 1, "pipeline_read": False, "fast_init": True,
        },
    }
    for name, offload in variants.items():
        if offload is not None and offload["device"] == "nvme":
            os.makedirs(offload["nvme_path"], exist_ok=True)
        engine, case = _engine(stage, offload, precision, lower, clip=CLIP)
        losses = _train(engine, case, rank, STEPS)
        entry: dict[str, Any] = {"losses": losses, "params": engine.full_parameters(), "states": _states(engine)}
        ext = engine.extension("zero_offload")
        if ext is not None:
            opt = engine.optimizer
            entry["counters"] = ext.counters()
            entry["file_bytes"] = opt.swap_file_bytes()
            entry["expected_file_bytes"] = opt.expected_swap_bytes()
            if isinstance(opt, NvmeOffloadedOptimizer):
                entry["masters_in_files"] = opt.masters_in_files
                entry["tile_payload"] = sum((3 if opt.masters_in_files else 2) * align_up(4 * p.numel) for p in opt.pieces)
            entry["pieces"] = len(opt.pieces)
            entry["offloaded_shard_elements"] = sum(opt.shards[i].numel() for i in opt.offloaded)
            entry["partition_elements"] = sum(s.numel() for s in engine.zero.shards)
            entry["resident_state_tensors"] = sum(
                v.numel() for p in opt.pieces for v in (opt.host_opt.state.get(p.master) or {}).values() if isinstance(v, torch.Tensor) and v.dim() > 0
            ) if opt.swap is not None else None
        runs[name] = entry
    return runs


def _assert_bitwise(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    assert a["losses"] == b["losses"], f"{what}: losses differ {a['losses']} vs {b['losses']}"
    for name in a["params"]:
        assert torch.equal(a["params"][name], b["params"][name]), f"{what}: parameter {name} differs"
    assert a["states"].keys() == b["states"].keys(), f"{what}: optimizer state entries differ"
    for i in a["states"]:
        for key, value in a["states"][i].items():
            assert torch.equal(value, b["states"][i][key]), f"{what}: optimizer state {i}.{key} differs"


@pytest.mark.slow
@pytest.mark.distributed
@requires_backend("gloo")
@pytest.mark.parametrize("stage,precision", [(1, "fp32"), (2, "fp32"), (3, "fp32"), (2, "bf16"), (3, "bf16")])
def test_offload_is_bitwise_lossless(tmp_path: Path, stage: int, precision: str) -> None:
    results = run_distributed_or_fail(offload_matrix_rank, 2, stage, precision, str(tmp_path), "eager", timeout=300)
    for rank, runs in enumerate(results):
        for name in ("cpu", "nvme", "nvme_half"):
            _assert_bitwise(runs["none"], runs[name], f"rank {rank} stage {stage} {precision} {name}")
        nvme = runs["nvme"]
        # The files hold each rank's partition: exp_avg + exp_avg_sq, 8 bytes an element (4 KiB-padded segments). The fp32
        # masters are the shards themselves on a CPU-only machine (host = device), so they are not in the files; where masters
        # are separate (an accelerator run) they are, 12 bytes an element (test_offloaded_optimizer_matches_plain_adamw).
        assert nvme["offloaded_shard_elements"] == nvme["partition_elements"]
        assert nvme["masters_in_files"] is False
        assert nvme["file_bytes"] == nvme["expected_file_bytes"] == nvme["tile_payload"]
        assert 8 * nvme["partition_elements"] <= nvme["file_bytes"] < 8 * nvme["partition_elements"] + 2 * ALIGN * nvme["pieces"]
        assert nvme["resident_state_tensors"] == 0, "element-wise states stayed in memory between steps"
        counters = nvme["counters"]
        assert counters["tiles"] > 1 and counters["bytes_read"] > 0 and counters["bytes_written"] > 0
        # The first buffer_count tiles (default 4) are read from each step's forward on; one without pipeline_read.
        assert counters["prefetched_tiles"] == STEPS * min(4, counters["tiles"])
        half = runs["nvme_half"]["counters"]
        assert half["prefetched_tiles"] == STEPS
        assert 0 < half["offloaded_elements"] <= 0.5 * runs["nvme_half"]["partition_elements"] < half["offloaded_elements"] + half["device_elements"]
    if precision == "fp32" and stage == 3:
        reference = reference_run("gpt", 2, 1, CLIP, steps=STEPS)  # plain single-process PyTorch over both ranks' batches
        mean = [(a + b) / 2 for a, b in zip(results[0]["nvme"]["losses"], results[1]["nvme"]["losses"], strict=True)]
        torch.testing.assert_close(torch.tensor(mean), torch.tensor(reference["losses"]), rtol=1e-6, atol=1e-7)
        for name, value in reference["params"].items():
            assert_params_close(results[0]["nvme"]["params"][name], value, name, rel=1e-6)


@pytest.mark.slow
@pytest.mark.distributed
@requires_backend("gloo")
def test_offload_under_inductor(tmp_path: Path) -> None:
    """The default lowering (Inductor on CPU): nvme and cpu offload still bitwise equal to no offload (ZeRO-2)."""
    results = run_distributed_or_fail(offload_matrix_rank, 2, 2, "fp32", str(tmp_path), "inductor", timeout=420)
    for rank, runs in enumerate(results):
        for name in ("cpu", "nvme"):
            _assert_bitwise(runs["none"], runs[name], f"rank {rank} inductor {name}")


# -- checkpoints -------------------------------------------------------------------------------------
def checkpoint_rank(rank: int, world: int, stage: int, nvme_root: str, save_dir: str) -> dict[str, Any]:
    nvme = {"device": "nvme", "nvme_path": nvme_root}
    engine, case = _engine(stage, nvme, schedule=True)
    _train(engine, case, rank, 3)
    engine.save_checkpoint(save_dir, tag="step3")
    after = _train(engine, case, rank, 4)
    final = {"losses": after, "params": engine.full_parameters(), "states": _states(engine), "lr": engine.get_lr()}
    del engine
    (Path(nvme_root) / f"rank_{rank}" / "tile_99999.swp").write_bytes(b"an earlier run's tile")
    resumed, case = _engine(stage, nvme, schedule=True)  # a fresh engine over the same swap directory: its files are rewritten at start
    assert not (Path(nvme_root) / f"rank_{rank}" / "tile_99999.swp").exists()
    assert resumed.optimizer.swap_file_bytes() == resumed.optimizer.expected_swap_bytes()
    _train(resumed, case, rank, 1)  # states that the checkpoint must replace
    resumed.load_checkpoint(save_dir, tag="step3")
    again = {"losses": _train(resumed, case, rank, 4), "params": resumed.full_parameters(), "states": _states(resumed), "lr": resumed.get_lr()}
    plain, case = _engine(stage, None, schedule=True)  # the same checkpoint into an engine without offload: same layout
    plain.load_checkpoint(save_dir, tag="step3")
    other = {"losses": _train(plain, case, rank, 4), "params": plain.full_parameters(), "states": _states(plain)}
    return {"final": final, "again": again, "plain": other}


@pytest.mark.slow
@pytest.mark.distributed
@requires_backend("gloo")
@pytest.mark.parametrize("stage", [1, 3])
def test_nvme_offload_checkpoint_resumes_bit_exact(tmp_path: Path, stage: int) -> None:
    (tmp_path / "nvme").mkdir()
    results = run_distributed_or_fail(checkpoint_rank, 2, stage, str(tmp_path / "nvme"), str(tmp_path / "ckpt"), timeout=300)
    for rank, r in enumerate(results):
        _assert_bitwise(r["final"], r["again"], f"rank {rank} resumed with nvme offload")
        assert r["final"]["lr"] == r["again"]["lr"]
        _assert_bitwise(r["final"], r["plain"], f"rank {rank} resumed without offload")


# -- resident memory -----------------------------------------------------------------------------------
RSS_SCRIPT = r"""
import json, sys, torch, dscompile
offload = json.loads(sys.argv[1])
torch.manual_seed(0)
width, depth = 1024, 8
model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(depth)])
zero = {"stage": 1, "sub_group_size": 1 << 17}
if offload:
    zero["offload_optimizer"] = offload
config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "foreach": False}},
          "zero_optimization": zero, "lower": "eager"}
engine, *_ = dscompile.initialize(model=model, config=config)
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
x = torch.randn(4, width)
losses, between = [], []
for step in range(3):
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
    between.append(rss())
state_numel = sum(p.numel() for p in model.parameters())
def peak():  # VmHWM: this process image's high-water mark (ru_maxrss would carry over the forking parent's, e.g. pytest's)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
print(json.dumps({"peak": peak(), "between": between[-1], "losses": losses,
                  "state_bytes": 8 * state_numel}))
"""


def _rss_run(offload: dict[str, Any] | None) -> dict[str, Any]:
    # Both runs with a fixed mmap threshold: glibc then returns every freed block over 64 KiB to the system at
    # once, so resident memory measures what the process holds rather than what the C allocator caches.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, json.dumps(offload)], capture_output=True, text=True, timeout=300, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_nvme_offload_frees_resident_memory(tmp_path: Path) -> None:
    """Adam's two states (8 bytes an element, 64 MiB here) leave RAM: the peak falls by >= 70% of them."""
    base = _rss_run(None)
    nvme = _rss_run({"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 2})
    # NVMe tiles step Adam a tile at a time: the vectorized kernels' tails fall elsewhere, an ulp apart on some CPUs
    # (8e-8 relative seen on CI); a step not taken changes the loss several-fold
    assert nvme["losses"] == pytest.approx(base["losses"], rel=1e-6)
    saved_peak = base["peak"] - nvme["peak"]
    saved_between = base["between"] - nvme["between"]
    assert saved_peak >= 0.7 * base["state_bytes"], (base, nvme)
    assert saved_between >= 0.7 * base["state_bytes"], (base, nvme)


# -- one process, an HF model ------------------------------------------------------------------------------
HF_SCRIPT = r"""
import json, sys, torch, dscompile
from dscompile.zoo import make_batch
from dscompile.zoo.hf import build_hf_gpt2
offload = json.loads(sys.argv[1])
case = build_hf_gpt2(seed=1)
zero = {"stage": 2, "sub_group_size": 4096}
if offload:
    zero["offload_optimizer"] = offload
config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "foreach": False}}, "zero_optimization": zero}
engine, *_ = dscompile.initialize(model=case.model, config=config)
losses = []
for step in range(3):
    loss = engine(*make_batch(case, seed=step))
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
full = engine.full_parameters()
print(json.dumps({"losses": losses, "params": {k: v.double().sum().item() for k, v in full.items()},
                  "bits": {k: int(v.view(torch.int32).long().sum()) for k, v in full.items()}}))
"""


def test_hf_gpt2_nvme_offload_matches(tmp_path: Path) -> None:
    """A Hugging Face GPT-2 from a config (ZeRO-2, the default lowering): nvme offload bitwise equal to none.

    Run in a subprocess outside the repository: its top-level ``kernels/`` folder would shadow the
    ``kernels`` package transformers imports."""
    pytest.importorskip("transformers")

    def run(offload: dict[str, Any] | None) -> dict[str, Any]:
        out = subprocess.run([sys.executable, "-c", HF_SCRIPT, json.dumps(offload)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    (tmp_path / "nvme").mkdir()
    base = run(None)
    got = run({"device": "nvme", "nvme_path": str(tmp_path / "nvme")})
    assert got == base


# -- bad input -------------------------------------------------------------------------------------------
def _single_engine(nvme_path: str, **offload: Any) -> tuple[Any, Any]:
    return _engine(1, {"device": "nvme", "nvme_path": nvme_path, **offload})


@contextlib.contextmanager
def _tmpfs(path: Path, size: str, read_only: bool = False) -> Iterator[bool]:
    """A tiny tmpfs at ``path`` when this process may mount one (root), else False."""
    path.mkdir()
    options = f"size={size}" + (",ro" if read_only else "")
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", str(path)], check=False)


def test_missing_nvme_path_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "not_there"
    with pytest.raises(SwapError, match=str(missing)):
        _single_engine(str(missing))


def test_unwritable_nvme_path_names_it(tmp_path: Path) -> None:
    target = tmp_path / "ro"
    with _tmpfs(target, "64k", read_only=True) as mounted:
        if not mounted:
            if os.geteuid() == 0:
                pytest.skip("root without mount: no way to make a directory unwritable here")
            target.chmod(0o500)
        with pytest.raises(SwapError, match=f"{target}.*(permission|read-only|Read-only)"):
            _single_engine(str(target))


def test_full_disk_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "tiny"
    with _tmpfs(target, "16k") as mounted:
        if not mounted:  # no tmpfs: inject the ENOSPC a full disk gives
            real = os.pwritev

            def full(fd: int, buffers: Any, offset: int) -> int:
                if offset >= 8192:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                return real(fd, buffers, offset)

            monkeypatch.setattr(os, "pwritev", full)
        with pytest.raises(SwapError, match=f"{target}/rank_0/tile_\\d+\\.swp failed: the disk under nvme_path is full"):
            _single_engine(str(target))


def test_vanished_and_truncated_swap_files_name_the_file(tmp_path: Path) -> None:
    engine, case = _single_engine(str(tmp_path))
    _train(engine, case, 0, 1)
    victim = tmp_path / "rank_0" / "tile_00002.swp"
    victim.unlink()
    with pytest.raises(SwapError, match=f"{victim}.*gone"):
        _train(engine, case, 0, 1)
    engine, case = _single_engine(str(tmp_path))
    _train(engine, case, 0, 1)
    victim = tmp_path / "rank_0" / "tile_00001.swp"
    os.truncate(victim, ALIGN)
    with pytest.raises(SwapError, match=f"{victim} holds {ALIGN} bytes"):
        _train(engine, case, 0, 1)


def _flip_one_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_debug_mode_checks_swap_files_on_read_back(tmp_path: Path) -> None:
    """Bytes changed on disk between a write and its read: debug mode names the file; without it the size check alone cannot see it."""
    for verify in (True, False):
        (tmp_path / str(verify)).mkdir()
        swap = SwapDirectory(tmp_path / str(verify), rank=0, block_size=ALIGN, verify=verify)
        try:
            data = aligned_buffer(2 * ALIGN)
            data.copy_(torch.randint(0, 255, (2 * ALIGN,), dtype=torch.uint8))
            swap.wait(swap.write("x.swp", data))
            back = aligned_buffer(2 * ALIGN)
            swap.wait(swap.read("x.swp", back))  # untouched: reads back cleanly either way
            assert torch.equal(back, data)
            _flip_one_byte(swap.path("x.swp"), ALIGN + 7)
            if verify:
                with pytest.raises(SwapError, match=f"{swap.path('x.swp')} changed on disk.*CRC-32"):
                    swap.wait(swap.read("x.swp", back))
            else:
                swap.wait(swap.read("x.swp", back))
                assert not torch.equal(back, data)
        finally:
            swap.close()


def test_debug_config_verifies_the_engines_swap_files(tmp_path: Path) -> None:
    torch.manual_seed(0)
    case = _case("gpt")
    config = _config(1, 1, 0.0, {"sub_group_size": TILE, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}})
    config.update(lower="eager", debug=True)
    engine, _, _, _ = dscompile.initialize(model=case.model, config=config)
    assert engine.optimizer.swap.verify
    _train(engine, case, 0, 2)
    victim = sorted((tmp_path / "rank_0").glob("tile_*.swp"))[0]
    _flip_one_byte(victim, 100)
    with pytest.raises(SwapError, match=f"{victim} changed on disk"):
        _train(engine, case, 0, 1)


@pytest.mark.parametrize("refuse_direct", [False, True])
def test_swap_directory_roundtrip_direct_and_buffered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refuse_direct: bool) -> None:
    """Where the file system refuses O_DIRECT (EINVAL, as older tmpfs and some network file systems do), buffered I/O carries the same bytes."""
    if refuse_direct:
        real_open = os.open

        def no_direct(path: Any, flags: int, mode: int = 0o777) -> int:
            if flags & getattr(os, "O_DIRECT", 0):
                raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
            return real_open(path, flags, mode)

        monkeypatch.setattr(os, "open", no_direct)
    swap = SwapDirectory(tmp_path, rank=0, block_size=ALIGN, threads=2)
    try:
        if refuse_direct:
            assert not swap.direct
        data = aligned_buffer(3 * ALIGN)
        data.copy_(torch.randint(0, 255, (3 * ALIGN,), dtype=torch.uint8))
        swap.wait(swap.write("x.swp", data))
        back = aligned_buffer(3 * ALIGN)
        swap.wait(swap.read("x.swp", back))
        assert torch.equal(back, data) and swap.bytes_read == swap.bytes_written == 3 * ALIGN
        assert swap.file_bytes() == {"x.swp": 3 * ALIGN}
    finally:
        swap.close()


@pytest.mark.parametrize(
    "zero,key",
    [
        ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, "zero_optimization.offload_optimizer"),
        ({"stage": 2, "offload_optimizer": {"device": "nvme"}}, "zero_optimization.offload_optimizer.nvme_path"),
        ({"stage": 2, "offload_optimizer": {"device": "gpu"}}, "zero_optimization.offload_optimizer.device"),
        ({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0}}, "zero_optimization.offload_optimizer.ratio"),
        ({"stage": 2, "offload_optimizer": {"device": "cpu", "buffer_count": 0}}, "zero_optimization.offload_optimizer.buffer_count"),
        ({"stage": 2, "offload_optimizer": {"device": "cpu", "super_offload": True}}, "zero_optimization.offload_optimizer.super_offload"),
        ({"stage": 2, "offload_optimizer": {"device": "cpu", "ratios": 0.5}}, "zero_optimization.offload_optimizer.ratios"),
        ({"stage": 3, "offload_param": {"device": "nvme"}}, "zero_optimization.offload_param"),
        ({"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}, "zero_optimization.cpu_offload"),
    ],
)
def test_bad_offload_config_names_the_key(zero: dict[str, Any], key: str) -> None:
    with pytest.raises(DSCompileConfigError, match=key.replace(".", r"\.")):
        load_config({"zero_optimization": zero})


def test_legacy_spellings_and_aio() -> None:
    zc = load_config({"zero_optimization": {"stage": 2, "cpu_offload": True, "cpu_offload_use_pin_memory": True}}).sections["zero_optimization"]
    assert zc.offload_optimizer.device == "cpu" and zc.cpu_offload_use_pin_memory
    torch.manual_seed(0)
    case = _case("gpt")
    config = _config(2, 1, 0.0, {"offload_optimizer": {"device": "cpu"}})
    config["aio"] = {"use_gds": True}
    with pytest.raises(DSCompileError, match="aio.use_gds"):
        dscompile.initialize(model=case.model, config=config)


# -- the planner -------------------------------------------------------------------------------------------
def planner_rank(rank: int, world: int, stage: int, nvme_root: str) -> dict[str, Any]:
    """No limit, a limit that fits everything, and one half-way between parameters+gradients and all model states."""

    def run(limit: int | None) -> tuple[Any, dict[str, Any]]:
        offload = None if limit is None else {"device": "nvme", "nvme_path": nvme_root}
        engine, case = _engine(stage, offload, extra={"offload_memory_limit": limit or 0}, memory=True, schedule=True)
        losses = _train(engine, case, rank, 4)
        peak = max(snapshot["model_state_bytes"] for snapshot in engine.step_memory().values())
        return engine, {"losses": losses, "params": engine.full_parameters(), "states": _states(engine), "peak": peak}

    base_engine, base = run(None)
    roomy_engine, roomy = run(base["peak"])
    roomy_plan = roomy_engine.extension("zero_offload").plan
    limit = roomy_plan.fixed_bytes + (base["peak"] - roomy_plan.fixed_bytes) // 2
    tight_engine, tight = run(limit)
    plan = tight_engine.extension("zero_offload").plan
    return {
        "base": base,
        "roomy": roomy,
        "tight": tight,
        "limit": limit,
        "roomy_wrapped": type(roomy_engine.optimizer).__name__,
        "roomy_offloaded": roomy_plan.offloaded_names,
        "roomy_predicted": roomy_plan.device_bytes,
        "predicted": plan.device_bytes,
        "excess": plan.fixed_bytes + sum(r.state_bytes for r in plan.rows) - limit,
        "offloaded_rows": [r.state_bytes for r in plan.rows if r.placement != "device"],
        "table": plan.table(),
    }


@pytest.mark.slow
@pytest.mark.distributed
@requires_backend("gloo")
def test_planner_offloads_only_what_does_not_fit(tmp_path: Path) -> None:
    results = run_distributed_or_fail(planner_rank, 2, 3, str(tmp_path), timeout=300)
    for rank, r in enumerate(results):
        # A limit that holds every model state: nothing is offloaded, the optimizer is not even wrapped.
        assert r["roomy_offloaded"] == [] and r["roomy_wrapped"] == "AdamW"
        assert r["roomy_predicted"] == r["base"]["peak"]
        # Half-way: just enough (in parameter order) to fit, the measured peak of model states under the limit.
        rows = r["offloaded_rows"]
        assert sum(rows) >= r["excess"] > sum(rows) - rows[-1]
        assert r["tight"]["peak"] == r["predicted"] <= r["limit"] < r["base"]["peak"]
        assert "nvme" in r["table"] and "device" in r["table"]
        for name in ("roomy", "tight"):
            _assert_bitwise(r["base"], r[name], f"rank {rank} planner {name}")


def test_plan_is_written_to_the_dump(tmp_path: Path) -> None:
    engine, _ = _engine(2, {"device": "nvme", "nvme_path": str(tmp_path)}, extra={"offload_memory_limit": 1 << 40})
    assert type(engine.optimizer).__name__ == "AdamW"  # everything fits: nothing offloaded, not even wrapped
    dump = tmp_path / "dump"
    torch.manual_seed(0)
    case = _case("gpt")
    config = _config(2, 1, 0.0, {"offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}, dump=str(dump))
    dscompile.initialize(model=case.model, config=config)
    table = (dump / "offload_plan.txt").read_text()
    assert "offload plan: ZeRO-2, world 1" in table and "wte.weight" in table and " nvme " in table
    assert "NVMe tiles: 1048576 elements (planned: sub_group_size not given), 4 tile buffers" in table


def test_planner_sizes_nvme_tiles_where_sub_group_size_is_not_given(tmp_path: Path) -> None:
    """DeepSpeed's default sub_group_size (1e9) is one tile for any model under a billion parameters: all states in
    memory at the step, no overlap. Not given, the planner keeps the buffers alive at the step under 1/8 of the states."""
    from dscompile.planner import TILE_MAX_ELEMENTS, TILE_MIN_ELEMENTS, nvme_tile_elements

    assert nvme_tile_elements(98_000_000, 4, None) == 3_062_500  # 4 buffers x 3.06M elements = 1/8 of 98M
    assert nvme_tile_elements(98_000_000, 4, 1_000_000_000) == 1_000_000_000  # given: DeepSpeed's meaning
    assert nvme_tile_elements(50_000, 4, None) == TILE_MIN_ELEMENTS  # small models: one tile, I/O calls stay large
    assert nvme_tile_elements(10**11, 4, None) == TILE_MAX_ELEMENTS
    assert load_config({"zero_optimization": {"stage": 2}}).sections["zero_optimization"].sub_group_size is None
    # The engine steps the planner's tiles: a tiny planned tile through a monkeypatched floor gives many tiles.
    import dscompile.planner.offload as planner_offload

    floor = planner_offload.TILE_MIN_ELEMENTS
    planner_offload.TILE_MIN_ELEMENTS = 64
    try:
        torch.manual_seed(0)
        case = _case("gpt")
        config = _config(2, 1, 0.0, {"offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}})
        engine, _, _, _ = dscompile.initialize(model=case.model, config=config)
    finally:
        planner_offload.TILE_MIN_ELEMENTS = floor
    plan = engine.extension("zero_offload").plan
    elements = sum(s.numel() for s in engine.zero.shards)
    assert plan.tile_planned and plan.tile_elements == max(64, -(-elements // 32))
    assert len(engine.optimizer.tiles) >= 32 and all(sum(p.numel for p in t.pieces) <= plan.tile_elements for t in engine.optimizer.tiles)


def test_limit_needs_an_offload_device() -> None:
    with pytest.raises(DSCompileConfigError, match="offload_memory_limit"):
        load_config({"zero_optimization": {"stage": 2, "offload_memory_limit": 1 << 20}})


def test_cli_plan_prints_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dscompile.cli import main

    config = tmp_path / "ds.json"
    zero = {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}
    config.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero}))
    assert main(["plan", "dscompile.zoo.targets:mlp", "--config", str(config), "--world", "2"]) == 0
    out = capsys.readouterr().out
    assert "ZeRO-2, world 2" in out and "nvme" in out and "predicted model states per rank" in out
    rows = [line for line in out.splitlines() if " nvme " in line]
    assert rows and all(int(line.split()[1]) % 8 == 0 for line in rows)  # Adam: 8 bytes of state per shard element
    # A limit that holds every model state: nothing offloaded.
    zero["offload_memory_limit"] = 1 << 40
    config.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero}))
    assert main(["plan", "dscompile.zoo.targets:mlp", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert " nvme " not in out and "optimizer states offloaded 0.00 MiB" in out
    # Without offload the parallel plan alone (this printed "nothing to plan" before the one plan, issue 34)
    config.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    assert main(["plan", "dscompile.zoo.targets:mlp", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "ZeRO stage 2, carried out by the ZeRO partition" in out and "offload: optimizer states none, parameters none" in out
    assert "offload plan" not in out


# -- the optimizer alone -------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_offloaded_optimizer_alone_matches_and_round_trips(tmp_path: Path, device: str) -> None:
    """The copy path an accelerator takes (separate host masters, gradients copied into host buffers, parameters
    copied back), unused parameters, a changed learning rate, a parameter changed outside the optimizer, and
    state_dict/load_state_dict into a fresh offloaded optimizer: all bitwise equal to plain AdamW."""
    from dscompile.runtime.offload import OffloadSettings, build_offloaded_optimizer

    torch.manual_seed(0)
    init = [torch.randn(n) for n in (700, 33, 1000)]
    plain = [torch.nn.Parameter(t.clone()) for t in init]
    mine = [torch.nn.Parameter(t.clone()) for t in init]
    ref = torch.optim.AdamW(plain, lr=1e-2, weight_decay=0.1)
    settings = OffloadSettings(device=device, nvme_path=str(tmp_path), tile_elements=256, buffer_count=2, separate_master=True)
    opt = build_offloaded_optimizer(torch.optim.AdamW(mine, lr=1e-2, weight_decay=0.1), mine, settings)

    def step(k: int) -> None:
        for i, (a, b) in enumerate(zip(plain, mine, strict=True)):
            g = None if (i == 1 and k % 2) else torch.randn(a.shape, generator=torch.Generator().manual_seed(100 * k + i))
            a.grad, b.grad = g, None if g is None else g.clone()
        ref.step()
        opt.step()

    for k in range(4):
        step(k)
    if device == "nvme":  # separate masters (what an accelerator run has) are in the files, beside exp_avg and exp_avg_sq
        assert opt.masters_in_files and opt.swap_file_bytes() == sum(3 * align_up(4 * p.numel) for p in opt.pieces)
    ref.param_groups[0]["lr"] = opt.param_groups[0]["lr"] = 3e-3
    for k in range(4, 6):
        step(k)
    with torch.no_grad():  # changed outside the optimizer (a checkpoint load does this): the master must follow
        plain[2].mul_(0.5)
        mine[2].mul_(0.5)
    step(6)
    assert all(torch.equal(a, b) for a, b in zip(plain, mine, strict=True))
    saved = opt.state_dict()
    want = ref.state_dict()
    assert saved["state"].keys() == want["state"].keys()
    for i in want["state"]:
        for key, value in want["state"][i].items():
            assert torch.equal(saved["state"][i][key], value), (i, key)
    fresh = [torch.nn.Parameter(p.detach().clone()) for p in mine]
    settings2 = OffloadSettings(device=device, nvme_path=str(tmp_path / "again"), tile_elements=256, separate_master=True)
    (tmp_path / "again").mkdir()
    again = build_offloaded_optimizer(torch.optim.AdamW(fresh, lr=1e-2, weight_decay=0.1), fresh, settings2)
    again.load_state_dict(saved)
    mine[:] = fresh
    opt = again
    step(7)
    assert all(torch.equal(a, b) for a, b in zip(plain, mine, strict=True))


def test_offload_refuses_a_one_bit_optimizer(tmp_path) -> None:
    """1-bit optimizers exchange their momentum themselves: offloading their states is refused, not half-done."""
    config = {
        "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 2}},
        "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
        "lower": "eager",
    }
    with pytest.raises(DSCompileConfigError, match="offload_optimizer"):
        dscompile.initialize(model=torch.nn.Linear(4, 2), config=config)


@pytest.mark.parametrize("clip", [0.0, CLIP])
def test_gradients_go_to_the_host_during_backward(clip: float) -> None:
    """With host masters separate from the shards (what an accelerator run has; offload_param forces it here), each
    shard's gradient is copied to the host during backward (from the backward graph where the host step starts there,
    tests/test_zero_offload_overlap.py; from its post-accumulate-grad hook otherwise, as with clipping). The step copies only
    what changed since: nothing in fp32 without clipping, every gradient after clipping scaled them in place. Bitwise
    the same training as without offload either way."""
    runs = {}
    for name, extra in {
        "none": {},
        "offload": {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
    }.items():
        torch.manual_seed(0)
        case = _case("gpt")
        config = _config(3, 1, clip, {"sub_group_size": TILE, **extra})
        config["lower"] = "eager"
        config["optimizer"]["params"]["foreach"] = False
        engine, _, _, _ = dscompile.initialize(model=case.model, config=config)
        copies = []
        for _ in range(3):
            loss = engine(*_micro_batch(case, engine.global_steps, 0, 0))
            engine.backward(loss)
            if name == "offload":
                copies.append(dict(engine.optimizer.gradient_copies))  # before the step: only backward's copies
            engine.step()
        runs[name] = {"params": engine.full_parameters(), "copies": copies}
        if name == "offload":
            runs[name]["after"] = dict(engine.optimizer.gradient_copies)
            runs[name]["host_mastered"] = len(engine.optimizer._host_grads)
    shards = runs["offload"]["host_mastered"]
    assert shards > 3
    assert [c["during_backward"] for c in runs["offload"]["copies"]] == [shards, 2 * shards, 3 * shards]
    assert runs["offload"]["after"]["at_step"] == (3 * shards if clip else 0)
    for name, value in runs["none"]["params"].items():
        assert torch.equal(runs["offload"]["params"][name], value), name


def test_offloaded_host_steps_keep_the_fused_kernel(tmp_path: Path) -> None:
    """Adam/AdamW with no implementation chosen: ZeRO steps its shards with torch's fused kernel, and cpu offload
    (whole shards, stepped on the host) and nvme offload (tiles cut at vector-aligned positions within each shard)
    keep it (the fast CPU step), bitwise equal to no offload: the fused kernel rounds by the position in a vector."""
    runs = {}
    for name, offload in {"none": None, "cpu": {"device": "cpu"}, "nvme": {"device": "nvme", "nvme_path": None}}.items():
        torch.manual_seed(0)
        case = _case("gpt")
        zero: dict[str, Any] = {"sub_group_size": TILE}
        if offload is not None:
            if offload["device"] == "nvme":
                offload["nvme_path"] = str(tmp_path)
            zero["offload_optimizer"] = offload
        config = _config(2, 1, 0.0, zero)
        config["lower"] = "eager"
        engine, _, _, _ = dscompile.initialize(model=case.model, config=config)
        inner = engine.optimizer.host_opt if offload is not None else engine.optimizer
        runs[name] = {"fused": [g.get("fused") for g in inner.param_groups], "losses": _train(engine, case, 0, 3), "params": engine.full_parameters()}
    assert set(runs["none"]["fused"]) == set(runs["cpu"]["fused"]) == set(runs["nvme"]["fused"]) == {True}
    for name in ("cpu", "nvme"):
        assert runs[name]["losses"] == runs["none"]["losses"], name
        for key, value in runs["none"]["params"].items():
            assert torch.equal(runs[name]["params"][key], value), (name, key)
