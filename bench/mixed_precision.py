"""Mixed precision side by side: fp32, bf16 and fp16 under dscompile vs torch.autocast + torch.compile.

    python bench/mixed_precision.py [--steps 10] [--model gpt] [--deepspeed]

Per configuration: median training-step time (forward, backward, optimizer step), bytes saved
for backward (activation memory, counted with saved-tensor hooks so it works on CPU), peak CUDA
memory when on a GPU, and gradient bytes a data-parallel all-reduce would send per step.
Ratios are against ``torch.compile`` + ``torch.autocast`` at the same precision (fp32: plain
``torch.compile``). DeepSpeed's engine is an optional column (``--deepspeed``, needs a process
group; its fp16/bf16 optimizers may need CUDA).

Then ZeRO-3 on 2 gloo ranks (``--zero3-steps 0`` skips it): bytes communicated per step and rank
for fp32, bf16 and fp16, for dscompile and DeepSpeed's ZeRO-3 engine. A collective counts the
bytes of the whole buffer it works on (an all-gather its gathered output, a reduce-scatter its
input, an all-reduce its tensor). dscompile's in-graph collectives are read from the compiled
forward and backward graphs (each runs once per step), the rest (both peers) is counted at the
``torch.distributed`` calls during the timed steps. The target: bf16/fp16 half of fp32.
dscompile ZeRO-3 gathers every parameter in forward and again in backward (``unshard_budget`` 0);
DeepSpeed keeps gathered parameters for backward when ``stage3_max_reuse_distance`` allows (its
default does, for models this small), so its fp32 row moves fewer bytes than dscompile's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist

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
    grad_bytes = sum(p.numel() * 4 for p in case.model.parameters() if p.requires_grad)  # fp32 gradients
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


# ---------------------------------------------------------------------------------------------
# ZeRO-3 on 2 ranks: bytes communicated
# ---------------------------------------------------------------------------------------------

_PY_COLLECTIVES = {
    # name -> which argument holds the buffer whose bytes count
    "all_gather_into_tensor": 0,
    "_all_gather_base": 0,
    "reduce_scatter_tensor": 1,
    "_reduce_scatter_base": 1,
    "all_reduce": 0,
    "broadcast": 0,
    "all_gather": 0,
    "reduce_scatter": 1,
}


def _count_python_collectives(counter: dict[str, int]) -> None:
    """Wrap the torch.distributed collectives (before a peer binds them) to add their bytes to ``counter``."""
    import torch.distributed.distributed_c10d as c10d

    def size(value: Any) -> int:
        if isinstance(value, torch.Tensor):
            return value.numel() * value.element_size()
        return sum(size(v) for v in value) if isinstance(value, (list, tuple)) else 0

    for name, index in _PY_COLLECTIVES.items():
        original = getattr(c10d, name, None)
        if original is None:
            continue

        def wrapped(*args: Any, _original: Any = original, _index: int = index, _name: str = name, **kwargs: Any) -> Any:
            if counter.get("on"):
                buffer = args[_index] if len(args) > _index else next(iter(kwargs.values()))
                counter[_name] = counter.get(_name, 0) + size(buffer)
            return _original(*args, **kwargs)

        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is original:
            setattr(dist, name, wrapped)


def _record_graph_collectives() -> list[tuple[str, str, int]]:
    """(graph kind, collective, bytes of its buffer) of every final forward/backward graph compiled here."""
    from dscompile.graph import node_value
    from dscompile.pipeline import PassManager

    found: list[tuple[str, str, int]] = []
    original = PassManager.run

    def run(self: PassManager, gm: torch.fx.GraphModule, ctx: Any) -> torch.fx.GraphModule:
        gm = original(self, gm, ctx)
        if ctx.graph_kind in ("forward", "backward"):
            for node in gm.graph.nodes:
                target = node.target
                if node.op == "call_function" and getattr(target, "namespace", None) == "_c10d_functional":
                    value = node_value(node.args[0])
                    nbytes = value.numel() * value.element_size()
                    if target._opname == "all_gather_into_tensor":
                        found.append((ctx.graph_kind, "all_gather", nbytes * int(node.args[1])))
                    elif target._opname in ("reduce_scatter_tensor", "all_reduce"):
                        found.append((ctx.graph_kind, target._opname.split("_tensor")[0], nbytes))
        return gm

    PassManager.run = run  # type: ignore[method-assign]  # inside a bench rank process only
    return found


def zero3_rank(rank: int, world: int, peer: str, precision: str | None, args: dict[str, Any]) -> dict[str, Any]:
    """One rank of a ZeRO-3 run: median step time, bytes per step (in graphs and through torch.distributed)."""
    torch.set_num_threads(1)
    counter: dict[str, int] = {}
    _count_python_collectives(counter)
    graph_collectives = _record_graph_collectives()
    torch.manual_seed(0)
    case = build(args["model"], seq_len=args["seq_len"], d_model=args["d_model"], n_layers=args["n_layers"], n_heads=4, batch_size=args["batch"])
    params = sum(p.numel() for p in case.model.parameters())  # before sharding empties the model's tensors
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if peer == "dscompile":
        import dscompile

        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": args["batch"],
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
            "zero_optimization": zero,
            "lower": "eager",
        }
        if precision:
            config[precision] = {"enabled": True}
        engine, _, _, _ = dscompile.initialize(model=case.model, config=config)
    else:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        config = {
            "train_micro_batch_size_per_gpu": args["batch"],
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
            "zero_optimization": {**zero, "overlap_comm": False},
        }
        if precision:
            config[precision] = {"enabled": True}
        engine, _, _, _ = deepspeed.initialize(model=case.model, model_parameters=case.model.parameters(), config=config)
    times, losses = [], []
    for i in range(args["warmup"] + args["steps"]):
        batch = make_batch(case, seed=1000 * i + rank)
        counter["on"] = i >= args["warmup"]
        start = time.perf_counter()
        loss = engine(*batch)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if i >= args["warmup"]:
            times.append(time.perf_counter() - start)
    counter.pop("on", None)
    python_bytes = sum(counter.values()) / args["steps"]
    graph_bytes = sum(nbytes for _, _, nbytes in graph_collectives)
    gathered = sum(nbytes for _, kind, nbytes in graph_collectives if kind == "all_gather")
    return {
        "ms": 1e3 * statistics.median(times),
        "bytes": graph_bytes + python_bytes,
        "gather_bytes": gathered,
        "python_bytes": python_bytes,
        "params": params,
        "loss": losses[-1],
    }


def zero3_table(args: argparse.Namespace) -> None:
    """Runs ZeRO-3 on 2 gloo ranks per (peer, precision) and prints bytes per step next to fp32's."""
    from dscompile.testing.distributed import run_distributed

    settings = {k: getattr(args, k) for k in ("model", "seq_len", "d_model", "n_layers", "batch")}
    settings.update(steps=args.zero3_steps, warmup=2)
    peers = ["dscompile"] + (["deepspeed"] if args.deepspeed else [])
    rows = []
    for peer in peers:
        base = None
        for precision in (None, "bf16", "fp16"):
            label = f"{peer} z3 {precision or 'fp32'}"
            try:
                ranks = run_distributed(zero3_rank, 2, peer, precision, settings, timeout=1200, env={"DS_ACCELERATOR": "cpu"})
            except Exception as exc:  # a peer that cannot run here is reported, not fatal
                print(f"{label}: skipped ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})")
                continue
            row = {"label": label, **ranks[0], "ms": max(r["ms"] for r in ranks)}
            base = base or (row if precision is None else None)
            row["vs_fp32"] = row["bytes"] / base["bytes"] if base else float("nan")
            rows.append(row)
            print(f"{label}: {row['ms']:.0f} ms/step, {row['bytes'] / 2**20:.2f} MiB/step", flush=True)
    print(f"\nZeRO-3, 2 gloo ranks, {args.model} d_model={args.d_model} layers={args.n_layers} ({rows[0]['params'] / 1e6:.2f}M params)" if rows else "")
    print(f"{'config':24s} {'step ms':>9s} {'MiB/step':>9s} {'x fp32':>7s} {'gathers MiB':>12s} {'outside MiB':>12s} {'loss':>7s}")
    for r in rows:
        print(
            f"{r['label']:24s} {r['ms']:9.0f} {r['bytes'] / 2**20:9.2f} {r['vs_fp32']:7.2f} {r['gather_bytes'] / 2**20:12.2f} "
            f"{r['python_bytes'] / 2**20:12.2f} {r['loss']:7.3f}"
        )


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
    parser.add_argument("--zero3-steps", type=int, default=3, help="timed steps of the 2-rank ZeRO-3 bytes table (0: skip it)")
    parser.add_argument("--no-single", action="store_true", help="skip the single-process table")
    args = parser.parse_args()
    if not args.no_single:
        single_process_table(args)
    if args.zero3_steps > 0:
        zero3_table(args)


def single_process_table(args: argparse.Namespace) -> None:
    """Step time and activation memory, one process, against torch.compile + autocast (and DeepSpeed)."""
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
                if precision and not label.startswith("torch"):
                    row["comm"] //= 2  # dscompile and DeepSpeed reduce in the training precision (communication_data_type)
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
