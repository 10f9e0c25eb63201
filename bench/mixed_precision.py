"""Mixed precision side by side: fp32, bf16 and fp16 under dscompile vs torch.autocast + torch.compile.

    python bench/mixed_precision.py [--steps 10] [--model gpt] [--deepspeed]

Per configuration: median training-step time (forward, backward, optimizer step), bytes saved
for backward (activation memory, counted with saved-tensor hooks so it works on CPU), peak CUDA
memory when on a GPU, and gradient bytes a data-parallel all-reduce would send per step.
Ratios are against ``torch.compile`` + ``torch.autocast`` at the same precision (fp32: plain
``torch.compile``). DeepSpeed's engine is an optional column (``--deepspeed``, needs a process
group; its fp16/bf16 optimizers may need CUDA).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch

from dscompile.zoo import build, make_batch

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _saved_bytes(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int]:
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn()
    return loss, total


def _case(args: argparse.Namespace, device: str):  # noqa: ANN202
    case = build(args.model, seq_len=args.seq_len, d_model=args.d_model, n_layers=args.n_layers, n_heads=4, batch_size=args.batch)
    return case.to(device)


def _run(label: str, step: Callable[[tuple], tuple[torch.Tensor, int]], case, args: argparse.Namespace) -> dict:  # noqa: ANN001
    times, saved = [], 0
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    for i in range(args.warmup + args.steps):
        batch = make_batch(case, seed=i)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss, saved = step(batch)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    grad_bytes = sum(p.numel() * 4 for p in case.model.parameters() if p.requires_grad)
    return {"label": label, "ms": 1e3 * statistics.median(times), "saved": saved, "peak": peak, "comm": grad_bytes, "loss": float(loss)}


def _torch_step(case, precision: str | None):  # noqa: ANN001, ANN202
    model = torch.compile(case.model)
    opt = torch.optim.AdamW(case.model.parameters(), lr=1e-3)
    device = case.device.type
    scaler = torch.amp.GradScaler(device, enabled=precision == "fp16")

    def step(batch: tuple) -> tuple[torch.Tensor, int]:
        ctx = torch.autocast(device, dtype=LOW[precision]) if precision else nullcontext()
        with ctx:
            loss, saved = _saved_bytes(lambda: model(*batch))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return loss.detach(), saved

    return step


def _dscompile_step(case, precision: str | None):  # noqa: ANN001, ANN202
    import dscompile

    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "lower": "inductor"}
    if precision:
        config[precision] = {"enabled": True}
    engine, _, _, _ = dscompile.initialize(model=case.model, config=config)

    def step(batch: tuple) -> tuple[torch.Tensor, int]:
        loss, saved = _saved_bytes(lambda: engine(*batch))
        engine.backward(loss)
        engine.step()
        return loss.detach(), saved

    return step


def _deepspeed_step(case, precision: str | None):  # noqa: ANN001, ANN202
    import os

    for key, value in {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533"}.items():
        os.environ.setdefault(key, value)
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": case.targets.shape[0]}
    if precision:
        config[precision] = {"enabled": True}
    opt = torch.optim.AdamW(case.model.parameters(), lr=1e-3)  # a client optimizer: no JIT-built kernels
    engine, _, _, _ = deepspeed.initialize(model=case.model, optimizer=opt, config=config)

    def step(batch: tuple) -> tuple[torch.Tensor, int]:
        loss, saved = _saved_bytes(lambda: engine(*batch))
        engine.backward(loss)
        engine.step()
        return loss.detach(), saved

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--deepspeed", action="store_true")
    parser.add_argument("--only", default="", help="comma-separated label prefixes to run (e.g. deepspeed)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for precision in (None, "bf16", "fp16"):
        name = precision or "fp32"
        runners = [("torch.compile" + (f"+autocast {name}" if precision else " fp32"), _torch_step), (f"dscompile {name}", _dscompile_step)]
        if args.deepspeed:
            runners.append((f"deepspeed {name}", _deepspeed_step))
        base = None
        for label, make in runners:
            if args.only and not any(label.startswith(p) for p in args.only.split(",")):
                continue
            torch._dynamo.reset()
            case = _case(args, device)
            try:
                row = _run(label, make(case, precision), case, args)
            except Exception as exc:  # a peer that cannot run here is reported, not fatal
                print(f"{label}: skipped ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
                continue
            base = base or row
            row["ratio"] = row["ms"] / base["ms"]
            row["saved_ratio"] = row["saved"] / max(base["saved"], 1)
            rows.append(row)
    print(f"\n{args.model} d_model={args.d_model} layers={args.n_layers} seq={args.seq_len} batch={args.batch} on {device}")
    print(f"{'config':32s} {'step ms':>9s} {'x base':>7s} {'saved MiB':>10s} {'x base':>7s} {'peak MiB':>9s} {'DP comm MiB':>11s} {'loss':>7s}")
    for r in rows:
        peak = f"{r['peak'] / 2**20:9.1f}" if r["peak"] is not None else f"{'n/a':>9s}"
        print(
            f"{r['label']:32s} {r['ms']:9.1f} {r['ratio']:7.2f} {r['saved'] / 2**20:10.2f} {r['saved_ratio']:7.2f} "
            f"{peak} {r['comm'] / 2**20:11.2f} {r['loss']:7.3f}"
        )


if __name__ == "__main__":
    main()
