"""ZeRO-Infinity parameter offload (``zero_optimization.offload_param``, ZeRO stage 3).

On real gloo ranks, training with the parameter shards on the host or in NVMe swap files (with and
without ``offload_optimizer``) gives bitwise the losses and final parameters of training without offload
(fp32 6 steps; bf16 and the Inductor lowering 4 steps; all distributed cases share one spawn of
two ranks); the files hold exactly each rank's shards while training and the shards' storage is
released between uses; the shards are read ahead in the graphs' order; a checkpoint taken with
offload resumes bit-exact; peak resident memory falls by >= 70% of the swap files' bytes; bad
paths and stages fail clearly.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_zero import assert_params_close, reference_run
from test_zero_offload import STEPS, TILE, _train

import dscompile
from dscompile.errors import DSCompileConfigError
from dscompile.planner import PlannedParameter, non_shard_device_bytes, plan_param_offload
from dscompile.runtime.offload import SwapError
from dscompile.runtime.offload.swap import align_up
from dscompile.testing.distributed import requires_backend, run_distributed_or_fail

CLIP = 0.05
FP32_STEPS = 6  # the fp32 placement matrix (bitwise against no offload, close to plain PyTorch)


def _engine(param: dict | None, optimizer: dict | None, precision: str = "fp32", stage: int = 3, lower: str = "eager") -> tuple[Any, Any]:
    from test_zero import _case, _config

    torch.manual_seed(0)
    case = _case("gpt")
    # Offloaded parameters are always gathered again in backward; the runs compared with them re-gather too (reuse
    # distance 0), so every run's graphs have the same shape and Inductor rounds them alike.
    zero: dict[str, Any] = {"sub_group_size": TILE, "stage3_max_reuse_distance": 0}
    if param is not None:
        zero["offload_param"] = param
    if optimizer is not None:
        zero["offload_optimizer"] = optimizer
    config = _config(stage, 1, CLIP, zero)
    config["lower"] = lower
    config["optimizer"]["params"]["foreach"] = False  # one implementation with and without offload_optimizer
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    engine, _, _, _ = dscompile.initialize(model=case.model, config=config)
    return engine, case


def _resident_shard_bytes(engine: Any) -> int:
    return sum(s.untyped_storage().nbytes() for s in engine.zero.shards)


def param_matrix_rank(rank: int, world: int, precision: str, root: str, lower: str, steps: int = STEPS, wanted: list[str] | None = None) -> dict[str, Any]:
    variants: dict[str, tuple[dict | None, dict | None]] = {
        "none": (None, None),
        "cpu": ({"device": "cpu", "pin_memory": True}, None),
        "nvme": ({"device": "nvme", "nvme_path": os.path.join(root, "p"), "buffer_count": 2}, None),
        "nvme+opt_nvme": ({"device": "nvme", "nvme_path": os.path.join(root, "po")}, {"device": "nvme", "nvme_path": os.path.join(root, "po")}),
        "cpu+opt_cpu": ({"device": "cpu"}, {"device": "cpu"}),
    }
    # fp32 runs every placement; bf16 (graphs cast the fp32 shards) one per device, to keep the test short
    if wanted is None:
        wanted = list(variants) if precision == "fp32" else ["none", "nvme+opt_nvme", "cpu+opt_cpu"]
    runs: dict[str, Any] = {}
    for name, (param, opt) in variants.items():
        if name not in wanted:
            continue
        for section in (param, opt):
            if section is not None and section["device"] == "nvme":
                os.makedirs(section["nvme_path"], exist_ok=True)
        engine, case = _engine(param, opt, precision, lower=lower)
        entry: dict[str, Any] = {}
        losses = _train(engine, case, rank, 2)
        ext = engine.extension("zero_offload_param")
        if ext is not None:
            store = ext.store
            entry["resident_between_steps"] = _resident_shard_bytes(engine)
            entry["file_bytes"] = store.file_bytes()
            entry["expected_file_bytes"] = store.expected_file_bytes()
            entry["shard_payload"] = sum(align_up(engine.zero.shards[i].numel() * 4) for i in store.indices)
            entry["offloaded"] = len(store.indices)
            # The files hold the current shard values (those the step just wrote back), byte for byte.
            entry["files_match"] = all(torch.equal(store.read_value(i), _shard_value(engine, store, i)) for i in store.indices)
        opt_ext = engine.extension("zero_offload")
        if opt_ext is not None and opt_ext.optimizer is not None and opt_ext.optimizer.swap is not None:
            opt = opt_ext.optimizer
            entry["optimizer_files"] = {
                "masters_in_files": opt.masters_in_files,
                "bytes": opt.swap_file_bytes(),
                "states_only": sum(2 * align_up(4 * p.numel) for p in opt.pieces),  # exp_avg + exp_avg_sq, no fp32 master
            }
        losses += _train(engine, case, rank, steps - 2)
        entry["losses"] = losses
        entry["steps"] = steps
        entry["params"] = engine.full_parameters()
        if ext is not None:
            entry["counters"] = ext.counters()
            entry["order"] = list(ext.store.order)
        runs[name] = entry
    return runs


def _shard_value(engine: Any, store: Any, i: int) -> torch.Tensor:
    with store.resident([i]):
        return engine.zero.shards[i].detach().clone()


def _assert_bitwise(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    assert a["losses"] == b["losses"], f"{what}: losses differ {a['losses']} vs {b['losses']}"
    for name in a["params"]:
        assert torch.equal(a["params"][name], b["params"][name]), f"{what}: parameter {name} differs"


def all_cases_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    """Every distributed case in one process group (one spawn, one gloo init): CI time."""
    out: dict[str, Any] = {}
    for key, args in {
        "fp32": ("fp32", "eager", FP32_STEPS, None),
        # bf16 (graphs cast the fp32 shards) one placement per device; 4 steps still run the read-ahead
        "bf16": ("bf16", "eager", 4, ["none", "nvme+opt_nvme", "cpu+opt_cpu"]),
        # the default lowering: host and NVMe loads (with the NVMe optimizer) through Inductor
        "inductor": ("fp32", "inductor", 4, ["none", "cpu", "nvme+opt_nvme"]),
    }.items():
        torch._dynamo.reset()
        sub = os.path.join(root, key)
        os.makedirs(sub, exist_ok=True)
        precision, lower, steps, wanted = args
        out[key] = param_matrix_rank(rank, world, precision, sub, lower, steps, wanted)
    torch._dynamo.reset()
    out["order"] = read_order_rank(root)
    torch._dynamo.reset()
    nvme = os.path.join(root, "ckpt_nvme")
    os.makedirs(nvme, exist_ok=True)
    out["checkpoint"] = checkpoint_rank(rank, world, nvme, os.path.join(root, "ckpt"), True)
    return out


def read_order_rank(root: str) -> dict[str, list[int]]:
    """A 3-layer GPT (every parameter sharded) whose gathers are prefetched one at a time, its shards on the host:
    the order the graphs read them in, eager against Inductor."""
    from dscompile.zoo import build, make_batch

    out: dict[str, list[int]] = {}
    for lower in ("eager", "inductor"):
        torch._dynamo.reset()
        case = build("gpt", seed=0, seq_len=8, batch_size=2, d_model=32, n_heads=2, n_layers=3, vocab_size=64)
        zero: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 32 * 96, "offload_param": {"device": "cpu"}}
        config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero, "lower": lower}
        engine, *_ = dscompile.initialize(model=case.model, config=config)
        engine.backward(engine(*make_batch(case, seed=1)))
        engine.step()
        out[lower] = list(engine.extension("zero_offload_param").store.order)
        engine.destroy()
    return out


def _is_subsequence(short: list[int], long: list[int]) -> bool:
    rest = iter(long)
    return all(any(x == y for y in rest) for x in short)


@pytest.fixture(scope="module")
def all_cases(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("offload_param")
    return run_distributed_or_fail(all_cases_rank, 2, str(root), timeout=600)


def _check_matrix(results: list[dict[str, Any]], precision: str, lower: str) -> None:
    for rank, runs in enumerate(results):
        for name in [n for n in runs if n != "none"]:
            _assert_bitwise(runs["none"], runs[name], f"rank {rank} {precision} {lower} offload_param {name}")
            got = runs[name]
            assert got["offloaded"] > 0
            assert got["resident_between_steps"] == 0, f"{name}: shard storage resident between steps"
            assert got["files_match"], f"{name}: stored shards differ from the values trained on"
            counters = got["counters"]
            # every offloaded shard is loaded before its forward gather (and again where backward needs its value),
            # the same loads every step; the order recorded at the first step is those loads, then (nvme) the step's reads
            assert sorted(set(got["order"])) == sorted(set(got["order"]))[:got["offloaded"]] and len(set(got["order"])) == got["offloaded"]
            loads = counters["param_loads"] // got["steps"]
            step_reads = len(got["order"]) - loads
            assert counters["param_loads"] == loads * got["steps"], counters
            assert got["offloaded"] < loads <= 2 * got["offloaded"]
            # (files_match above read each shard once more through ``resident``, outside the recorded order)
            assert counters["param_step_reads"] == step_reads * got["steps"] + (got["offloaded"] if step_reads else 0), counters
            if name.startswith("nvme"):
                assert step_reads >= got["offloaded"], counters  # each shard read for the step (per tile with the optimizer's offload)
        for name in [n for n in runs if n.startswith("nvme")]:
            got = runs[name]
            assert got["file_bytes"] == got["expected_file_bytes"] == got["shard_payload"] > 0
            if "optimizer_files" in got:  # each shard once on disk: its parameter file is the optimizer's fp32 master
                files = got["optimizer_files"]
                assert not files["masters_in_files"] and files["bytes"] == files["states_only"] > 0, files
            # after the first step the reads run ahead of the graphs and the step: nearly every read finds itself started
            hits = got["counters"]["param_prefetch_hits"] + got["counters"]["param_step_prefetch_hits"]
            assert hits >= len(got["order"]) * (got["steps"] - 2), got["counters"]
            # read buffers come back from the pool once free (bitwise equality above: never while still in use)
            assert got["counters"]["param_pool_reuses"] >= got["offloaded"], got["counters"]


@pytest.mark.distributed
@requires_backend("gloo")
def test_param_offload_is_bitwise_lossless(all_cases: list[dict[str, Any]]) -> None:
    results = [r["fp32"] for r in all_cases]
    _check_matrix(results, "fp32", "eager")
    # and equal to plain single-process PyTorch over both ranks' batches
    reference = reference_run("gpt", 2, 1, CLIP, steps=FP32_STEPS)
    mean = [(a + b) / 2 for a, b in zip(results[0]["nvme+opt_nvme"]["losses"], results[1]["nvme+opt_nvme"]["losses"], strict=True)]
    torch.testing.assert_close(torch.tensor(mean), torch.tensor(reference["losses"]), rtol=1e-6, atol=1e-7)
    for name, value in reference["params"].items():
        assert_params_close(results[0]["nvme+opt_nvme"]["params"][name], value, name, rel=1e-6)


@pytest.mark.distributed
@requires_backend("gloo")
def test_param_offload_bf16_is_bitwise_lossless(all_cases: list[dict[str, Any]]) -> None:
    _check_matrix([r["bf16"] for r in all_cases], "bf16", "eager")


@pytest.mark.distributed
@requires_backend("gloo")
def test_param_offload_under_inductor(all_cases: list[dict[str, Any]]) -> None:
    """The default lowering: the load op survives Inductor and stays bitwise, and the reads run where the gather
    schedule put them, as the eager lowering runs them: Inductor's reordering for peak memory would otherwise issue
    the reads of whole groups of layers first (every read buffer alive at once)."""
    _check_matrix([r["inductor"] for r in all_cases], "fp32", "inductor")
    for rank, runs in enumerate(all_cases):
        order = runs["order"]
        assert len(order["eager"]) > 40 + 12, order  # 40 shards read in forward, most again in backward
        # the same reads in the same order (Inductor drops a few backward reads whose value no gradient needs)
        assert len(order["inductor"]) > 40 and _is_subsequence(order["inductor"], order["eager"]), (rank, order)


# -- checkpoints -------------------------------------------------------------------------------------
def checkpoint_rank(rank: int, world: int, root: str, save_dir: str, with_optimizer: bool) -> dict[str, Any]:
    param = {"device": "nvme", "nvme_path": root}
    opt = {"device": "nvme", "nvme_path": root} if with_optimizer else None
    engine, case = _engine(param, opt)
    _train(engine, case, rank, 3)
    engine.save_checkpoint(save_dir, tag="s3")
    final = {"losses": _train(engine, case, rank, 4), "params": engine.full_parameters()}
    engine.destroy()
    del engine
    resumed, case = _engine(param, opt)
    _train(resumed, case, rank, 1)  # values the checkpoint must replace
    resumed.load_checkpoint(save_dir, tag="s3")
    again = {"losses": _train(resumed, case, rank, 4), "params": resumed.full_parameters()}
    plain, case = _engine(None, None)
    plain.load_checkpoint(save_dir, tag="s3")
    other = {"losses": _train(plain, case, rank, 4), "params": plain.full_parameters()}
    return {"final": final, "again": again, "plain": other}


@pytest.mark.distributed
@requires_backend("gloo")
def test_param_offload_checkpoint_resumes_bit_exact(all_cases: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(c["checkpoint"] for c in all_cases):
        _assert_bitwise(r["final"], r["again"], f"rank {rank} resumed with offload_param + offload_optimizer nvme")
        _assert_bitwise(r["final"], r["plain"], f"rank {rank} resumed without offload")


# -- resident memory ---------------------------------------------------------------------------------
RSS_SCRIPT = r"""
import json, sys, torch, dscompile
param, opt = json.loads(sys.argv[1]), json.loads(sys.argv[2])
torch.manual_seed(0)
width, depth = 1024, 16  # 16 shards: the one read ahead and the one in use are 1/8 of the files (8 shards left a margin under 1 MiB)
model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(depth)])
zero = {"stage": 3, "sub_group_size": 1 << 17, "stage3_param_persistence_threshold": 0}
if param:
    zero["offload_param"] = param
if opt:
    zero["offload_optimizer"] = opt
config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "foreach": False}},
          "zero_optimization": zero, "lower": "eager"}
engine, *_ = dscompile.initialize(model=model, config=config)
x = torch.randn(4, width)
losses = []
for step in range(3):
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
files = 0
if engine.extension("zero_offload") is not None:
    files += engine.optimizer.expected_swap_bytes()
if engine.extension("zero_offload_param") is not None:
    files += engine.extension("zero_offload_param").store.file_bytes()
with open("/proc/self/status") as f:
    peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
print(json.dumps({"peak": peak, "losses": losses, "files": files}))
"""


def _rss_start(param: dict | None, opt: dict | None) -> subprocess.Popen:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    args = [sys.executable, "-c", RSS_SCRIPT, json.dumps(param), json.dumps(opt)]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _rss_result(proc: subprocess.Popen) -> dict[str, Any]:
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_param_nvme_offload_frees_resident_memory(tmp_path: Path) -> None:
    """The parameter shards in files (4 bytes an element): the peak falls by >= 70% of the files' bytes."""
    # two processes side by side (each measures its own peak): CI time
    runs = [_rss_start(None, None), _rss_start({"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 1}, None)]  # one shard read ahead
    base, got = [_rss_result(p) for p in runs]
    assert got["losses"] == base["losses"]
    assert got["files"] >= 4 * 8 * 1024 * 1024
    assert base["peak"] - got["peak"] >= 0.7 * got["files"], (base, got)


# -- config and bad input ------------------------------------------------------------------------------
def test_offload_param_below_stage_3_is_ignored_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """DeepSpeed reads offload_param only at stage 3; below, it trains as if the key were absent: a warning names it."""
    from dscompile.config import load_config

    for stage in (0, 1, 2):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dscompile.passes.zero"):
            config = load_config({"zero_optimization": {"stage": stage, "offload_param": {"device": "cpu"}}})
        assert config.sections["zero_optimization"].offload_param is None
        assert any("zero_optimization.offload_param is ignored at ZeRO stage" in r.getMessage() for r in caplog.records), caplog.text
    with pytest.raises(DSCompileConfigError, match=r"offload_param.nvme_path"):
        load_config({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})
    with pytest.raises(DSCompileConfigError, match=r"offload_param.buffer_sise"):
        load_config({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "buffer_sise": 1}}})


def test_missing_param_nvme_path_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "not_there"
    with pytest.raises(SwapError, match=f"{missing}.*offload_param.nvme_path"):
        _engine({"device": "nvme", "nvme_path": str(missing)}, None)


def test_vanished_param_file_names_it(tmp_path: Path) -> None:
    engine, case = _engine({"device": "nvme", "nvme_path": str(tmp_path)}, None)
    _train(engine, case, 0, 1)
    victim = sorted((tmp_path / "rank_0").glob("param_*.swp"))[-1]
    victim.unlink()
    with pytest.raises(SwapError, match=f"{victim}.*the offloaded parameter shards in it are lost"):
        _train(engine, case, 0, 1)


def test_planner_places_shards_and_sizes_read_ahead() -> None:
    params = [PlannedParameter("a", 1000, 500, False), PlannedParameter("b", 10, 5, True), PlannedParameter("c", 400, 200, False)]
    plan = plan_param_offload(params, world=2, device="nvme", buffer_count=5, buffer_size=1000, max_in_cpu=10**9)
    assert [r.placement for r in plan.rows] == ["nvme", "device", "nvme"]
    assert plan.offloaded_bytes == 4 * 700 and plan.prefetch_distance == 2
    assert plan_param_offload(params, 2, "nvme", buffer_count=5, buffer_size=1000, max_in_cpu=600).prefetch_distance == 1
    assert plan_param_offload(params, 2, "cpu", buffer_count=1).prefetch_distance == 1
    assert "read ahead 2 shard(s)" in plan.table() and "nvme" in plan.table()


def test_cli_plan_and_dump_list_the_parameter_shards(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dscompile.cli import main

    config = tmp_path / "ds.json"
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 3}}
    config.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero}))
    assert main(["plan", "dscompile.zoo.targets:mlp", "--config", str(config), "--world", "2"]) == 0
    out = capsys.readouterr().out
    assert "parameter offload plan: ZeRO-3, world 2, offload_param.device=nvme, read ahead" in out
    rows = [line for line in out.splitlines() if " nvme " in line]
    assert rows and all("read ahead of its all-gather" in line for line in rows)
    zero["offload_optimizer"] = {"device": "cpu"}
    config.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero}))
    assert main(["plan", "dscompile.zoo.targets:mlp", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "parameter offload plan" in out and "offload plan: ZeRO-3" in out
    from test_zero import _case, _config

    torch.manual_seed(0)
    dump = tmp_path / "dump"
    cfg = _config(3, 1, 0.0, {"offload_param": {"device": "cpu"}}, dump=str(dump))
    dscompile.initialize(model=_case("gpt").model, config=cfg)
    table = (dump / "param_offload_plan.txt").read_text()
    assert "offload_param.device=cpu" in table and "wte.weight" in table and " host " in table


def test_planner_offloads_only_the_shards_that_do_not_fit() -> None:
    """Under offload_memory_limit the shards stay on the device in parameter order while they fit beside the other
    model states; the rest move. A limit that holds everything moves nothing; none moves to a host that is the device."""
    params = [PlannedParameter("a", 1000, 500, False), PlannedParameter("b", 10, 5, True), PlannedParameter("c", 400, 200, False)]
    other = non_shard_device_bytes(params, 4, None, 8)
    # gradients (4 B/elt of every shard) + the kept-whole parameter and its shard + Adam's states (8 B/elt of every shard)
    assert other == 4 * 705 + 4 * (10 + 5) + 8 * 705
    everything = other + 4 * 700
    roomy = plan_param_offload(params, 2, "nvme", limit=everything, other_device_bytes=other)
    assert roomy.offloaded_names == [] and roomy.device_bytes == everything
    tight = plan_param_offload(params, 2, "nvme", limit=everything - 1, other_device_bytes=other)
    assert tight.offloaded_names == ["c"] and tight.device_bytes <= tight.limit
    tighter = plan_param_offload(params, 2, "nvme", limit=other + 4 * 200, other_device_bytes=other)
    assert tighter.offloaded_names == ["a"] and tighter.device_bytes == tighter.limit  # "a" does not fit; "c" still does
    assert plan_param_offload(params, 2, "nvme").offloaded_names == ["a", "c"]  # no limit: every partitioned shard
    assert plan_param_offload(params, 2, "cpu", limit=1, other_device_bytes=other, host_is_device=True).offloaded_names == []
    assert "WARNING" in plan_param_offload(params, 2, "nvme", limit=1, other_device_bytes=other).table()


def test_engine_offloads_only_the_shards_over_the_limit(tmp_path: Path) -> None:
    """One process, ZeRO-3, parameters to NVMe under a limit: with room for everything nothing is written; with room
    for all but about a third of the shards, just those go to files; training is bitwise the same in every case."""
    from test_zero import _case, _config

    runs = {}
    base, case = _engine(None, None)
    runs["none"] = _train(base, case, 0, 3), base.full_parameters()
    layouts = [PlannedParameter(lay.name, lay.numel, lay.shard_numel, lay.persistent) for lay in base.zero.layouts]
    other = non_shard_device_bytes(layouts, 4, None, 8)
    shard_bytes = [4 * p.shard_numel for p in layouts if not p.full_copy]
    limits = {"roomy": other + sum(shard_bytes), "tight": other + (2 * sum(shard_bytes)) // 3}
    offloaded = {}
    for name, limit in limits.items():
        root = tmp_path / name
        root.mkdir()
        torch.manual_seed(0)
        case = _case("gpt")
        zero = {"sub_group_size": TILE, "offload_param": {"device": "nvme", "nvme_path": str(root)}, "offload_memory_limit": limit}
        config = _config(3, 1, CLIP, zero)
        config["lower"] = "eager"
        config["optimizer"]["params"]["foreach"] = False
        engine, _, _, _ = dscompile.initialize(model=case.model, config=config)
        ext = engine.extension("zero_offload_param")
        offloaded[name] = (ext.plan.offloaded_names, len(ext.store.indices), sorted(p.name for p in (root / "rank_0").glob("param_*.swp")))
        assert ext.plan.device_bytes <= limit
        runs[name] = _train(engine, case, 0, 3), engine.full_parameters()
    assert offloaded["roomy"] == ([], 0, [])
    names, count, files = offloaded["tight"]
    assert 0 < count == len(names) == len(files) < len(shard_bytes)
    for name in limits:
        assert runs[name][0] == runs["none"][0], name
        for key, value in runs["none"][1].items():
            assert torch.equal(runs[name][1][key], value), (name, key)


# -- the step's I/O: reads ahead, writes behind, and a world-1 read used in place -------------------------------------
def test_param_writes_stay_in_flight_and_reads_wait_only_for_their_shard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ParamStore alone, writes held back by a gate: the step's writes are left in flight (the step returns without
    them), every later read of a shard waits for that shard's own write, a read started before a shard's write (read
    ahead into the next forward) is dropped, and every value read is bitwise the last one written."""
    import threading

    from torch import nn

    from dscompile.runtime.offload import params as params_mod
    from dscompile.runtime.offload import swap as swap_mod

    torch.manual_seed(0)
    shards = [nn.Parameter(torch.randn(1000 + 1500 * k)) for k in range(4)]
    expected = [s.detach().clone() for s in shards]
    settings = params_mod.ParamOffloadSettings(device="nvme", nvme_path=str(tmp_path), prefetch_distance=2, write_behind=4, io_threads=2)
    store = params_mod.ParamStore(shards, [0, 1, 2, 3], settings)
    gate = threading.Event()
    gate.set()
    write = swap_mod.SwapDirectory._write

    def gated_write(self: Any, name: str, buffer: torch.Tensor) -> None:
        assert gate.wait(30), "a write was never let through"
        write(self, name, buffer)

    monkeypatch.setattr(swap_mod.SwapDirectory, "_write", gated_write)
    try:
        for cycle in range(4):
            # forward in the reverse of the step's order: reads ahead at the step's end reach shards not yet stepped
            for i in (3, 2, 1, 0):
                assert torch.equal(store.load(i, shards[i]), expected[i]), (cycle, i)
            gate.clear()
            for i in range(4):
                with store.resident([i]):
                    shards[i].data.add_(float(cycle + 1))
                expected[i] = expected[i] + float(cycle + 1)
                assert store.shards[i].untyped_storage().nbytes() == 0
            assert sum(not fut.done() for _, fut in store.writes.values()) == 4  # the step did not wait for its writes
            store.end_step()
            threading.Timer(0.2, gate.set).start()
        for i in range(4):
            assert torch.equal(store.read_value(i), expected[i]), i
        counters = store.counters()
        assert counters["param_reads_after_write"] >= 3, counters  # reads queued behind their shard's write
        assert counters["param_step_prefetch_hits"] >= 3 * 3, counters  # from the second step on the step's reads were ahead
        assert counters["param_write_waits"] == 0, counters
    finally:
        gate.set()
        store.close()


def world_one_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    """World 1 (a real process group), Inductor: a tiny ZeRO-3 MLP with and without parameter shards on NVMe."""
    out: dict[str, Any] = {}
    for name in ("none", "nvme"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(128, 128, bias=False) for _ in range(4)])
        zero: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}  # same graphs both ways
        if name == "nvme":
            zero["offload_param"] = {"device": "nvme", "nvme_path": root}
        config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "foreach": False}},
                  "zero_optimization": zero, "lower": "inductor"}
        engine, *_ = dscompile.initialize(model=model, config=config)
        losses = []
        for step in range(4):
            x = torch.randn(4, 128, generator=torch.Generator().manual_seed(step))
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        ext = engine.extension("zero_offload_param")
        out[name] = {"losses": losses, "params": engine.full_parameters(), "steps": 4}
        if ext is not None:
            out[name]["counters"] = ext.counters()
            out[name]["order"] = list(ext.store.order)
            out[name]["offloaded"] = len(ext.store.indices)
        engine.destroy()
    return out


@pytest.mark.distributed
@requires_backend("gloo")
def test_param_offload_world_one_reads_in_place_ahead_of_use(tmp_path: Path) -> None:
    """At world 1 each read shard is the parameter itself (no all-gather copy): training stays bitwise equal to no
    offload under Inductor, the reads run in the graphs' order (forward up the layers, backward down them, then the
    optimizer step's, which are read ahead from the end of backward like the graphs' loads)."""
    (run,) = run_distributed_or_fail(world_one_rank, 1, str(tmp_path), timeout=300)
    _assert_bitwise(run["none"], run["nvme"], "world 1 nvme")
    got = run["nvme"]
    n = got["offloaded"]
    assert n == 4
    # forward 0..3; backward 3..1 (the first layer's input needs no gradient); the step 0..3
    assert got["order"] == [0, 1, 2, 3, 3, 2, 1, 0, 1, 2, 3], got["order"]
    counters = got["counters"]
    assert counters["param_loads"] == 7 * got["steps"]
    assert counters["param_step_reads"] == n * got["steps"]
    assert counters["param_prefetch_hits"] >= 7 * (got["steps"] - 2), counters
    assert counters["param_step_prefetch_hits"] >= n * (got["steps"] - 1), counters
