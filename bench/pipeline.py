"""Pipeline-parallel step time: dscompile's PipelineEngine vs torch.distributed.pipelining and DeepSpeed.

    python bench/pipeline.py [--layers 8] [--d-model 128] [--steps 5] [--stages 2 4] [--micro-batches 4 8]

All sides run the same zoo GPT (untied head: torch's stages cannot share a weight), cut at the
same block boundaries, with the same schedule and micro-batch count, on gloo ranks spawned in
one run; the table prints the ratios peer / dscompile (> 1: dscompile is faster). dscompile's
``cost`` partition is timed as well, against its own split-point run.

DeepSpeed's ``PipelineModule`` (``pip install deepspeed``; 0.19.8 runs it on CPU over gloo) is the
third column: the same layers (embeddings, blocks, head) partitioned with ``type:Block``, which
gives the same block boundaries (checked), and DeepSpeed's own schedule, which is 1F1B; so it is
timed on the ``1f1b`` rows only. Its first use on a machine JIT-builds DeepSpeed's shared-memory
comm op (minutes). ``--no-deepspeed`` skips it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
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


class _Embed(nn.Module):
    """DeepSpeed layer 0: token + position embeddings."""

    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe = gpt.wte, gpt.wpe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wte(x) + self.wpe(torch.arange(x.shape[1]))


class _Head(nn.Module):
    """DeepSpeed's last layer: final norm and LM head."""

    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def _deepspeed_step(rank: int, world: int, layers: int, d_model: int, m: int, bounds: list[int]):  # noqa: ANN202
    """One DeepSpeed PipelineEngine.train_batch over m micro-batches, or None when DeepSpeed is missing."""
    try:
        import deepspeed
        from deepspeed.pipe import PipelineModule
    except ImportError:
        return None
    from dscompile.zoo import build, make_batch
    from dscompile.zoo.case import cross_entropy

    deepspeed.init_distributed(dist_backend="gloo")
    case = build("gpt", n_layers=layers, d_model=d_model, tie_weights=False, seq_len=32, batch_size=2)
    gpt = case.model
    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed prints its partition; the check below covers it
        module = PipelineModule(
            layers=[_Embed(gpt), *gpt.blocks, _Head(gpt)], num_stages=world, loss_fn=cross_entropy, partition_method=f"type:{type(gpt.blocks[0]).__name__}"
        )
    expected = [0] + [b + 1 for b in bounds[1:-1]] + [layers + 2]  # layer 0 is the embedding, the head is last
    if list(module.parts) != expected:
        raise RuntimeError(f"DeepSpeed partitioned the layers as {module.parts}, not at the same blocks {expected}")
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": m, "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
              "steps_per_print": 10**9}  # fmt: skip
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=[p for p in module.parameters() if p.requires_grad], config=config)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    batches = [make_batch(case, i) for i in range(m)]
    return lambda: engine.train_batch(iter(batches))


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


def _bench_rank(
    rank: int, world: int, layers: int, d_model: int, micro_batches: list[int], schedules: list[str], steps: int, deepspeed: bool
) -> dict:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from dscompile.engines.pipeline_parallel import PipelineEngine
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
            ds_step = _deepspeed_step(rank, world, layers, d_model, m, bounds) if deepspeed and schedule == "1f1b" else None
            row["deepspeed"] = _time(ds_step, steps) if ds_step is not None else None
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
    parser.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed's PipelineModule")
    args = parser.parse_args()
    print(f"GPT {args.layers} layers, d_model {args.d_model}, seq 32, micro-batch 2, gloo on CPU, {args.steps} timed steps")
    print(
        f"{'stages':>6} {'m':>3} {'schedule':>8} | {'torch ms':>9} {'ours ms':>8} {'torch/ours':>10} | {'ds ms':>7} {'ds/ours':>7} | {'ours idle':>9} |"
        f" {'cost ms':>8} {'split/cost':>10} {'bal split':>9} {'bal cost':>8}"
    )
    for stages in args.stages:
        out = run_distributed(
            _bench_rank, stages, args.layers, args.d_model, args.micro_batches, args.schedules, args.steps, not args.no_deepspeed, timeout=1800
        )
        for (m, schedule), row in out[0].items():
            slowest = {k: max(o[(m, schedule)][k] for o in out) for k in ("torch", "ours", "ours_cost")}
            ds = max(o[(m, schedule)]["deepspeed"] for o in out) if row["deepspeed"] is not None else None
            ds_cols = f"{ds * 1e3:>7.1f} {ds / slowest['ours']:>7.2f}" if ds is not None else f"{'-':>7} {'-':>7}"
            print(
                f"{stages:>6} {m:>3} {schedule:>8} | {slowest['torch'] * 1e3:>9.1f} {slowest['ours'] * 1e3:>8.1f} {slowest['torch'] / slowest['ours']:>10.2f}"
                f" | {ds_cols} | {row['ours_idle']:>9.2f} | {slowest['ours_cost'] * 1e3:>8.1f} {slowest['ours'] / slowest['ours_cost']:>10.2f}"
                f" {row['split_balance']:>9.2f} {row['cost_balance']:>8.2f}"
            )


if __name__ == "__main__":
    main()
