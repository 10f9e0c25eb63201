"""Train the zoo GPT with pipeline parallelism.

    torchrun --nproc-per-node 2 examples/train_gpt_pipeline.py --config examples/pipeline.json

Every rank builds the same model and reads the same stream of micro-batches (ranks of one
pipeline must agree; with data parallelism, replica ``d`` reads its own stream).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from dscompile.config import load_config
from dscompile.runtime.pipeline_engine import PipelineEngine
from dscompile.zoo import build, make_batch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "pipeline.json"))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    with open(args.config) as handle:
        raw = json.load(handle)
    config = load_config(raw)
    stages = config.sections["pipeline_parallel"].stages
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    case = build("gpt", n_layers=args.layers, batch_size=config.train_micro_batch_size_per_gpu or 2)
    engine = PipelineEngine(case.model, config)
    dp_rank = rank // stages

    def batches():
        step = 0
        while True:
            yield make_batch(case, seed=step * world + dp_rank)
            step += 1

    data = batches()
    for step in range(args.steps):
        loss = engine.train_batch(data)
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}  ({engine.last_batch_seconds * 1e3:.0f} ms, idle {engine.idle_fraction():.2f})")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
