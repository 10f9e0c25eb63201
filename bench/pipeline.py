"""Pipeline-parallel step time: dscompile's PipelineEngine vs torch.distributed.pipelining.

    python bench/pipeline.py [--layers 8] [--d-model 128] [--steps 5]

Both sides run the same zoo GPT (untied head: torch's stages cannot share a weight), cut at the
same block boundaries, with the same schedule and micro-batch count, on gloo ranks spawned in
one run; the table prints the ratio torch / dscompile (> 1: dscompile is faster). dscompile's
``cost`` partition is timed as well, against its own split-point run. DeepSpeed is not
installed here, so its PipelineModule is not measured.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn

warnings.filterwarnings("ignore")


class _Chunk(nn.Module):
    """Blocks [a, b) of the GPT, with the embeddings in front (first) or the head after (last)."""

    def __init__(self, gpt: nn.Module, a: int, b: int, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe = gpt.wte, gpt.wpe
        self.blocks = nn.ModuleList(gpt.blocks[a:b])
        if last:
            self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x


def _bounds(layers: int, stages: int) -> list[int]:
    return [round(i * layers / stages) for i in range(stages + 1)]


def _time(fn, steps: int) -> float:
    fn()
    fn()  # warm-up (compiles, shape inference)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    dist.barrier()
    return (time.perf_counter() - start) / steps


def _bench_rank(rank: int, world: int, layers: int, d_model: int, micro_batches: list[int], schedules: list[str], steps: int) -> dict:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from dscompile.runtime.pipeline_engine import PipelineEngine
    from dscompile.zoo import build, make_batch
    from dscompile.zoo.case import cross_entropy

    results: dict = {}
    bounds = _bounds(layers, world)
    split_points = [f"blocks.{b}" for b in bounds[1:-1]]
    for m in micro_batches:
        for schedule in schedules:
            row = {}
            for label, method in (("ours", "split_points"), ("ours_cost", "cost")):
                case = build("gpt", n_layers=layers, d_model=d_model, tie_weights=False, seq_len=32, batch_size=2)
                pipe = {"stages": world, "schedule": schedule, "micro_batches": m, "compile": False}
                if method == "split_points":
                    pipe["split_points"] = split_points
                engine = PipelineEngine(case.model, {"optimizer": {"type": "SGD", "params": {"lr": 0.01}}, "pipeline": pipe})
                batches = [make_batch(case, i) for i in range(m)]
                row[label] = _time(lambda engine=engine, batches=batches: engine.train_batch(iter(batches)), steps)
                row[label + "_idle"] = engine.idle_fraction()
                if label == "ours_cost":
                    plan = engine.program.plan
                    row["cost_balance"] = max(plan.stage_flops) * world / sum(plan.stage_flops)
                else:
                    plan = engine.program.plan
                    row["split_balance"] = max(plan.stage_flops) * world / sum(plan.stage_flops)
            case = build("gpt", n_layers=layers, d_model=d_model, tie_weights=False, seq_len=32, batch_size=2)
            chunk = _Chunk(case.model, bounds[rank], bounds[rank + 1], rank == 0, rank == world - 1)
            opt = torch.optim.SGD(chunk.parameters(), lr=0.01)
            stage = PipelineStage(chunk, rank, world, torch.device("cpu"))
            cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
            sched = cls(stage, n_microbatches=m, loss_fn=cross_entropy)
            full = [make_batch(case, i) for i in range(m)]
            x = torch.cat([b[0] for b in full])
            y = torch.cat([b[1] for b in full])

            def torch_step(sched=sched, x=x, y=y, opt=opt) -> None:
                if rank == 0:
                    sched.step(x)
                elif rank == world - 1:
                    sched.step(target=y, losses=[])
                else:
                    sched.step()
                opt.step()
                opt.zero_grad()

            row["torch"] = _time(torch_step, steps)
            results[(m, schedule)] = row
    return results


def main() -> None:
    from dscompile.testing.distributed import run_distributed

    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"])
    args = parser.parse_args()
    print(f"GPT {args.layers} layers, d_model {args.d_model}, seq 32, micro-batch 2, gloo on CPU, {args.steps} timed steps")
    print(
        f"{'stages':>6} {'m':>3} {'schedule':>8} | {'torch ms':>9} {'ours ms':>8} {'torch/ours':>10} | {'ours idle':>9} |"
        f" {'cost ms':>8} {'split/cost':>10} {'bal split':>9} {'bal cost':>8}"
    )
    for stages in args.stages:
        out = run_distributed(_bench_rank, stages, args.layers, args.d_model, args.micro_batches, args.schedules, args.steps, timeout=590)
        for (m, schedule), row in out[0].items():
            slowest = {k: max(o[(m, schedule)][k] for o in out) for k in ("torch", "ours", "ours_cost")}
            print(
                f"{stages:>6} {m:>3} {schedule:>8} | {slowest['torch'] * 1e3:>9.1f} {slowest['ours'] * 1e3:>8.1f} {slowest['torch'] / slowest['ours']:>10.2f}"
                f" | {row['ours_idle']:>9.2f} | {slowest['ours_cost'] * 1e3:>8.1f} {slowest['ours'] / slowest['ours_cost']:>10.2f}"
                f" {row['split_balance']:>9.2f} {row['cost_balance']:>8.2f}"
            )


if __name__ == "__main__":
    main()
