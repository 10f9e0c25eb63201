"""Goal 3: ZeRO-3 bf16 on one GPU: dscompile against FSDP2 eager and DeepSpeed ZeRO-3, step time and peak memory.

One rank over NCCL (gloo in the dry run). Peers, each from the same initial weights and batches:

- ``dscompile``: ``dscompile.initialize`` with ``zero_optimization.stage`` 3 and ``bf16``, the default lowering;
- ``fsdp2``: ``fully_shard`` on each block and the root (a 1-rank mesh), ``MixedPrecisionPolicy`` bf16 parameters and
  fp32 gradient reduction (fp32 master weights, as ZeRO's bf16), ``torch.optim.AdamW``;
- ``deepspeed``: ``deepspeed.initialize`` with the same config (``torch_adam``: no JIT-built FusedAdam), only where
  ``import deepspeed`` works (the GPU image has none: carry its wheel, docs/benchmarks.md).

Targets: dscompile / FSDP2 <= 1.0 and dscompile / DeepSpeed <= 0.7 in step time, each at <= the peer's peak
memory (resident after the first step plus the step's transient peak). Then one dscompile step of the zoo GPT
under the torch profiler: its Chrome trace goes to the trace directory, and the share of the collective
kernels' time that compute kernels overlap is printed.
"""

from __future__ import annotations

import gzip
import os
import shutil
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from gpucheck.common import Ctx, alternate, deepspeed_missing, free_memory, millions, overlap_fraction, per_round, timed_once

SECTION = "zero3 bf16"
LR = 1e-4


def _config(batch: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": batch,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}},
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": True},
    }


def _case(ctx: Ctx, name: str) -> Any:
    from dscompile.zoo import build

    if name == "gpt":
        return build("gpt", seed=0, batch_size=ctx.sizes.batch, **ctx.sizes.gpt)
    return build("hf_llama", seed=0, batch_size=ctx.sizes.batch, **ctx.sizes.llama)


def _blocks(model: torch.nn.Module) -> Any:
    return model.blocks if hasattr(model, "blocks") else model.model.model.layers


def _dscompile(ctx: Ctx, model: torch.nn.Module) -> Callable[[tuple], torch.Tensor]:
    import dscompile

    engine, *_ = dscompile.initialize(model=model.to(ctx.device), config=_config(ctx.sizes.batch) | ctx.dscompile_options())

    def step(batch: tuple) -> torch.Tensor:
        loss = engine(*batch)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return step


def _fsdp2(ctx: Ctx, model: torch.nn.Module) -> Callable[[tuple], torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model.to(ctx.device)
    mesh = init_device_mesh(ctx.device.type, (1,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in _blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(batch: tuple) -> torch.Tensor:
        loss = model(*batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _deepspeed(ctx: Ctx, model: torch.nn.Module) -> Callable[[tuple], torch.Tensor]:
    import deepspeed

    deepspeed.init_distributed(dist_backend=dist.get_backend())
    engine, *_ = deepspeed.initialize(model=model.to(ctx.device), model_parameters=model.parameters(), config=_config(ctx.sizes.batch))

    def step(batch: tuple) -> torch.Tensor:
        loss = engine(*batch)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return step


BUILDERS = {"dscompile": _dscompile, "fsdp2": _fsdp2, "deepspeed": _deepspeed}


def _allocated(ctx: Ctx) -> float:
    return torch.cuda.memory_allocated(ctx.device) / 2**20 if ctx.cuda else 0.0


def _model_rows(ctx: Ctx, name: str, peers: list[str]) -> None:
    from dscompile.zoo import make_batch

    case = _case(ctx, name)
    params = sum(p.numel() for p in case.model.parameters())
    label = f"{name} ({millions(params)})"
    batches = [tuple(t.to(ctx.device) for t in make_batch(case, seed=i)) for i in range(2)]
    state = {k: v.clone() for k, v in case.model.state_dict().items()}
    steps: dict[str, Callable[[], Any]] = {}
    resident: dict[str, float] = {}
    for peer in peers:
        model = _case(ctx, name).model
        model.load_state_dict(state)
        base = _allocated(ctx)
        try:
            step = BUILDERS[peer](ctx, model)
            loss, first = timed_once(lambda step=step: step(batches[0]), ctx)
        except Exception as exc:
            ctx.table.add(SECTION, f"{label}: {peer}", "ERROR", f"{type(exc).__name__}: {str(exc)[:140]}")
            continue
        resident[peer] = _allocated(ctx) - base
        ctx.table.add(SECTION, f"{label}: {peer} first step", f"{first:.1f} s", f"loss {float(loss):.4f}")
        steps[peer] = lambda step=step: step(batches[1])
    times = alternate(steps, ctx, steps=max(1, ctx.sizes.steps // 2))
    peaks: dict[str, float] = {}
    for peer, fn in steps.items():
        ms = sorted(times[peer])[len(times[peer]) // 2]
        note = ""
        if ctx.cuda:
            torch.cuda.reset_peak_memory_stats(ctx.device)
            before = _allocated(ctx)
            fn()
            ctx.sync()
            peaks[peer] = resident[peer] + torch.cuda.max_memory_allocated(ctx.device) / 2**20 - before
            note = f"peak {peaks[peer]:.0f} MiB (resident {resident[peer]:.0f} + step transient)"
        ctx.table.add(SECTION, f"{label}: {peer}", f"{ms:.2f} ms/step", note)
    for peer, target in (("fsdp2", "<= 1.0"), ("deepspeed", "<= 0.7")):
        if "dscompile" in times and peer in times:
            ctx.table.ratio(SECTION, f"{label}: dscompile / {peer} step time", per_round(times["dscompile"], times[peer]), target, "goal 3")
            if peer in peaks:
                ctx.table.ratio(SECTION, f"{label}: dscompile / {peer} peak memory", [peaks["dscompile"] / peaks[peer]], "<= 1.0", "goal 3")
    if name == "gpt" and "dscompile" in steps:
        _trace(ctx, steps["dscompile"])
    del steps
    free_memory(ctx)


COMM_MARKERS = ("nccl", "gloo", "c10d", "all_gather", "allgather", "reduce_scatter", "reducescatter", "broadcast", "all_to_all")
CPU_COMPUTE = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_dot_product")


def _trace(ctx: Ctx, step: Callable[[], Any]) -> None:
    """One profiled dscompile step: the Chrome trace, and how much of the collectives' time compute overlaps."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    with profile(activities=activities) as prof:
        step()
        ctx.sync()
    path = ctx.trace_dir / "zero3_dscompile_trace.json"
    prof.export_chrome_trace(str(path))
    if path.stat().st_size > 12 * 2**20:  # the device tool brings back files up to 16 MiB; Perfetto reads .json.gz
        with path.open("rb") as raw, gzip.open(path.with_suffix(".json.gz"), "wb") as packed:
            shutil.copyfileobj(raw, packed)
        path.unlink()
        path = path.with_suffix(".json.gz")
    events = prof.events()
    if ctx.cuda:
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        comm = [e for e in kernels if any(m in e.name.lower() for m in COMM_MARKERS)]
        compute = [e for e in kernels if e not in comm]
    else:
        comm = [e for e in events if any(m in e.name.lower() for m in COMM_MARKERS)]
        compute = [e for e in events if e.name.startswith(CPU_COMPUTE)]
    interval = lambda e: (e.time_range.start, e.time_range.end)
    share = overlap_fraction([interval(e) for e in comm], [interval(e) for e in compute])
    value = "no collectives" if share is None else f"{share:.0%} overlapped"
    ctx.table.add(SECTION, "gpt: dscompile step trace", value,
                  f"{len(comm)} collective {'kernels' if ctx.cuda else 'ops'}, {sum(e.time_range.elapsed_us() for e in comm) / 1000:.2f} ms; "
                  f"{path.name} ({path.stat().st_size / 2**20:.1f} MiB)")


def _init_group(ctx: Ctx) -> None:
    from dscompile.testing.distributed import free_port

    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        os.environ.setdefault(key, value)
    backend = "nccl" if ctx.cuda else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1, **({"device_id": ctx.device} if ctx.cuda else {}))


def run(ctx: Ctx) -> None:
    missing = deepspeed_missing(ctx)
    peers = ["dscompile", "fsdp2"] + ([] if missing else ["deepspeed"])
    if missing:
        ctx.table.add(SECTION, "deepspeed peer", "not run", missing)
    _init_group(ctx)
    try:
        for name in ("gpt", "llama"):
            if ctx.left() < 0:
                ctx.table.add(SECTION, name, "skipped", "section time spent")
                continue
            torch._dynamo.reset()
            _model_rows(ctx, name, peers)
    finally:
        dist.destroy_process_group()
