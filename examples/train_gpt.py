"""Train a small GPT-style (or Llama-style) model with dscompile ZeRO, DeepSpeed style.

    torchrun --nproc-per-node 2 examples/train_gpt.py --config examples/zero3.json
    torchrun --nproc-per-node 4 examples/train_gpt.py --config examples/zero2.json --model llama
    torchrun --nproc-per-node 2 examples/train_gpt.py --config examples/pipeline.json

CPU runs on gloo, GPUs on NCCL (one GPU per process, chosen by LOCAL_RANK). The config is a
DeepSpeed ds_config.json; ``--save DIR`` writes a checkpoint at the end, ``--load DIR`` resumes
from one. A ZeRO checkpoint consolidates with ``dscompile zero-to-fp32 DIR full.pt``.

A config with a ``pipeline`` section makes ``dscompile.initialize`` return a ``PipelineEngine``
(as DeepSpeed does for a ``PipelineModule``): the ranks form ``world / pipeline.stages``
data-parallel replicas of a ``stages``-deep pipeline, and each optimizer step is one
``engine.train_batch(data_iter)`` over ``gradient_accumulation_steps`` (or
``pipeline.micro_batches``) micro-batches. Every rank of a pipeline reads the same micro-batch
stream; each data-parallel replica reads its own.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

import dscompile
from dscompile.engines.pipeline_parallel import PipelineEngine
from dscompile.zoo import ZooCase, build, make_batch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="ds_config.json (e.g. examples/zero3.json)")
    parser.add_argument("--model", default="gpt", choices=["gpt", "llama"])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--lower", default=None, choices=[None, "eager", "inductor", "triton"], help="override the lowering")
    parser.add_argument("--save", default=None, help="write a checkpoint here at the end")
    parser.add_argument("--load", default=None, help="resume from a checkpoint here")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if torch.cuda.is_available() and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    import json

    with open(args.config) as handle:
        config = json.load(handle)
    if args.lower:
        config["lower"] = args.lower
    micro = config.get("train_micro_batch_size_per_gpu", 4)
    torch.manual_seed(0)  # every rank builds the same initial weights
    case = build(args.model, seed=0, batch_size=micro, seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers, vocab_size=args.vocab)
    case = case.to(device)
    n_params = sum(p.numel() for p in case.model.parameters())  # before ZeRO-3 frees the full copies
    engine, _, _, _ = dscompile.initialize(model=case.model, config=config)
    if isinstance(engine, PipelineEngine):
        train_pipeline(engine, case, args, device)
        return
    rank, world = engine.rank, engine.world_size
    if args.load:
        engine.load_checkpoint(args.load)
    if rank == 0:
        stage = engine.zero_optimization_stage()
        print(f"{args.model}: {n_params / 1e6:.2f}M parameters, ZeRO stage {stage}, {world} rank(s), {device}")
    gas = engine.gradient_accumulation_steps()
    start = time.perf_counter()
    while engine.global_steps < args.steps:
        step = engine.global_steps
        total = torch.zeros((), device=device)
        for micro_step in range(gas):
            batch = make_batch(case, seed=100_000 * step + 100 * micro_step + rank, device=device)
            loss = engine(*batch)
            engine.backward(loss)
            engine.step()
            total += loss.detach() / gas
        if world > 1:
            dist.all_reduce(total)
        if rank == 0 and (engine.global_steps % 5 == 0 or engine.global_steps == args.steps):
            print(f"step {engine.global_steps:4d}  loss {float(total) / world:.4f}  lr {engine.get_lr()[0]:.2e}  "
                  f"model states {engine.model_state_bytes() / 2**20:.2f} MiB/rank")
    if rank == 0:
        print(f"{args.steps} steps in {time.perf_counter() - start:.1f}s")
    _save_and_finish(engine, args, rank)


def _save_and_finish(engine: Any, args: argparse.Namespace, rank: int) -> None:
    """Write the checkpoint if asked (every rank its own shard or stage), then leave the process group."""
    if args.save:
        path = engine.save_checkpoint(args.save)
        if rank == 0:
            print(f"checkpoint: {path}")
    if dist.is_initialized():
        dist.destroy_process_group()


def train_pipeline(engine: PipelineEngine, case: ZooCase, args: argparse.Namespace, device: torch.device) -> None:
    """The pipeline-parallel loop: one ``train_batch`` per optimizer step, checkpoints per stage."""
    rank, stages, m = engine.global_rank, engine.num_stages, engine.micro_batches
    n_params = sum(p.numel() for p in case.model.parameters())  # before partitioning frees the other stages' weights
    if args.load:
        engine.prepare(make_batch(case, seed=0, device=device))  # partition now, so the load restores the step count
        engine.load_checkpoint(args.load)
    if rank == 0:
        print(
            f"{args.model}: {n_params / 1e6:.2f}M parameters, pipeline {stages} stages x {engine.dp_size} data-parallel, "
            f"schedule {engine.pcfg.schedule}, {m} micro-batches, partition '{engine.pcfg.partition_method}', {device}"
        )

    def micro_batches() -> Iterator[tuple[torch.Tensor, ...]]:  # step s, micro-batch i of data-parallel replica d: the same seed rule as the ZeRO loop
        while True:
            step = engine.global_steps
            for i in range(m):
                yield make_batch(case, seed=100_000 * step + 100 * i + engine.dp_id, device=device)

    data = micro_batches()
    start = time.perf_counter()
    while engine.global_steps < args.steps:
        loss = engine.train_batch(data)  # the mean over micro-batches and replicas, the same on every rank
        if rank == 0 and (engine.global_steps % 5 == 0 or engine.global_steps == args.steps or engine.global_steps == 1):
            print(f"step {engine.global_steps:4d}  loss {float(loss):.4f}  lr {engine.get_lr()[0]:.2e}  "
                  f"{engine.last_batch_seconds * 1e3:.0f} ms  idle {engine.idle_fraction():.2f}")
    if rank == 0:
        print(f"{args.steps} steps in {time.perf_counter() - start:.1f}s; stage costs:")
        plan = engine.program.plan
        for s, (flops, params) in enumerate(zip(plan.stage_flops, plan.stage_params, strict=True)):
            print(f"  stage {s}: {flops / 1e6:.1f} MFLOP, {params} parameters")
    _save_and_finish(engine, args, rank)


if __name__ == "__main__":
    main()
