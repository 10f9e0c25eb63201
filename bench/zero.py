"""ZeRO-1/2/3 step time and per-rank peak memory: dscompile against DeepSpeed and FSDP2.

World size 2 on gloo (CPU), a GPT-style model (default ~55M parameters), the same data and
AdamW for every peer. Each peer runs in its own spawn of ranks (so memory is its own):

- ``dscompile-z1/2/3``: ``dscompile.initialize`` with ``zero_optimization.stage`` 1/2/3.
- ``dscompile-z3-profiled``: ZeRO-3 with ``profile_steps`` (``--profile-steps``, in the warm-up): the
  plan is measured, agreed across ranks and recompiled once before the steady steps.
- ``deepspeed-z1/2/3``: DeepSpeed 0.19.8's engine (``pip install deepspeed``), gloo, torch AdamW.
- ``fsdp2``, ``fsdp2-compiled``: ``fully_shard`` per block and the root, eager and torch.compile.

Step time is the median of the steady steps (after warm-up, which includes compilation); peak
memory is the highest resident set size sampled every millisecond during the steady steps,
minus the resident size before the model was built. Prints one table with ratios to
DeepSpeed ZeRO-3 and to FSDP2, and each peer's losses (they must agree).

    python bench/zero.py [--d-model 768 --layers 6 --vocab 16384 --seq 128 --batch 2] [--steps 4]
    python bench/zero.py --peers dscompile-z3,dscompile-z3-profiled --profile-steps 1 --warmup 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

PEERS = ["dscompile-z1", "dscompile-z2", "dscompile-z3", "dscompile-z3-profiled", "deepspeed-z1", "deepspeed-z2", "deepspeed-z3", "fsdp2", "fsdp2-compiled"]
LR = 1e-4


def _rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakSampler:
    """Samples this process's resident set size in a thread; ``peak`` is the highest seen."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.001)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def _case(args: dict[str, int]) -> Any:
    from dscompile.zoo import build

    return build(
        "gpt", seed=0, batch_size=args["batch"], seq_len=args["seq"], d_model=args["d_model"], n_heads=args["heads"], n_layers=args["layers"],
        vocab_size=args["vocab"],
    )


def _batches(case: Any, rank: int, count: int) -> list[tuple[torch.Tensor, ...]]:
    from dscompile.zoo import make_batch

    return [make_batch(case, seed=1000 * i + rank) for i in range(count)]


def _adamw_section() -> dict[str, Any]:
    return {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "torch_adam": True}}


def _build(peer: str, case: Any, args: dict[str, Any]) -> Any:
    """Return step(batch) -> loss for one peer."""
    model = case.model
    if peer.startswith("dscompile"):
        import dscompile

        stage = int(peer.split("-")[1][1:])
        profile_steps = args["profile_steps"] if peer.endswith("-profiled") else 0  # DeepCompile-style re-planning
        config = {
            "train_micro_batch_size_per_gpu": args["batch"],
            "optimizer": _adamw_section(),
            "zero_optimization": {"stage": stage, "overlap_comm": True, "stage3_param_persistence_threshold": 1e4, "profile_steps": profile_steps},
            "lower": args["lower"],
        }
        engine, _, _, _ = dscompile.initialize(model=model, config=config)

        def step(batch: tuple) -> float:
            loss = engine(*batch)
            engine.backward(loss)
            engine.step()
            return loss.item()

        return step
    if peer.startswith("deepspeed"):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        stage = int(peer[-1])
        config = {
            "train_micro_batch_size_per_gpu": args["batch"],
            "optimizer": _adamw_section(),
            "zero_optimization": {"stage": stage, "overlap_comm": False, "stage3_param_persistence_threshold": 1e4},
        }
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

        def step(batch: tuple) -> float:
            loss = engine(*batch)
            engine.backward(loss)
            engine.step()
            return loss.item()

        return step
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    runner = torch.compile(model) if peer == "fsdp2-compiled" else model

    def step(batch: tuple) -> float:
        loss = runner(*batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


def peer_rank(rank: int, world: int, peer: str, args: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    import dscompile  # noqa: F401  (libraries loaded before the baseline: their code is not model memory)

    if peer.startswith("deepspeed"):
        import deepspeed  # noqa: F401
    baseline = _rss()
    torch.manual_seed(0)
    case = _case(args)
    params = sum(p.numel() for p in case.model.parameters())
    batches = _batches(case, rank, args["warmup"] + args["steps"])
    step = _build(peer, case, args)
    losses = []
    for batch in batches[: args["warmup"]]:
        losses.append(step(batch))
    times = []
    with PeakSampler() as sampler:
        for batch in batches[args["warmup"] :]:
            dist.barrier()
            start = time.perf_counter()
            losses.append(step(batch))
            times.append(time.perf_counter() - start)
    return {"step_s": statistics.median(times), "peak_bytes": sampler.peak - baseline, "losses": losses, "params": params}


def main() -> None:
    parser = argparse.ArgumentParser(description="ZeRO benchmark: dscompile vs DeepSpeed vs FSDP2 (world 2, gloo)")
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="measured steps")
    parser.add_argument("--warmup", type=int, default=2, help="steps before measuring (compilation happens here)")
    parser.add_argument("--lower", default="inductor", choices=["eager", "inductor"], help="dscompile's lowering")
    parser.add_argument("--profile-steps", type=int, default=1, help="dscompile-z3-profiled: steps profiled before re-planning (in warm-up)")
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--timeout", type=float, default=1200)
    opts = parser.parse_args()
    if opts.profile_steps < 1 or opts.warmup <= opts.profile_steps:
        parser.error("need 1 <= --profile-steps < --warmup: the profiled steps and the recompile after them are not steady steps")
    from dscompile.testing.distributed import DistributedRunError, run_distributed

    args = {"d_model": opts.d_model, "heads": opts.heads, "layers": opts.layers, "vocab": opts.vocab, "seq": opts.seq, "batch": opts.batch,
            "steps": opts.steps, "warmup": opts.warmup, "lower": opts.lower, "profile_steps": opts.profile_steps}
    results: dict[str, dict[str, Any]] = {}
    for peer in opts.peers.split(","):
        torch._dynamo.reset()
        try:
            ranks = run_distributed(peer_rank, 2, peer, args, timeout=opts.timeout)
        except (DistributedRunError, ImportError) as exc:
            print(f"{peer}: failed: {str(exc).splitlines()[0]}", flush=True)
            continue
        results[peer] = {
            "step_s": max(r["step_s"] for r in ranks),
            "peak_bytes": max(r["peak_bytes"] for r in ranks),
            "losses": [sum(v) / len(ranks) for v in zip(*(r["losses"] for r in ranks), strict=True)],
            "params": ranks[0]["params"],
        }
        print(f"{peer}: {results[peer]['step_s'] * 1e3:.0f} ms/step, peak {results[peer]['peak_bytes'] / 2**20:.0f} MiB", flush=True)
    if not results:
        return
    params = next(iter(results.values()))["params"]
    print(
        f"\nGPT {params / 1e6:.1f}M params, world 2 gloo, batch {opts.batch}x{opts.seq}/rank, dscompile lowering {opts.lower}, "
        f"dscompile-z3-profiled re-plans after {opts.profile_steps} profiled step(s)"
    )
    ref_time = results.get("deepspeed-z3", {}).get("step_s")
    fsdp_time = results.get("fsdp2", {}).get("step_s")
    header = f"{'peer':22} {'step ms':>9} {'vs DS-z3':>9} {'vs FSDP2':>9} {'peak MiB':>9}  losses"
    print(header)
    print("-" * len(header))
    for peer, r in results.items():
        vs_ds = f"{r['step_s'] / ref_time:.2f}x" if ref_time else "-"
        vs_fsdp = f"{r['step_s'] / fsdp_time:.2f}x" if fsdp_time else "-"
        losses = " ".join(f"{v:.4f}" for v in r["losses"])
        print(f"{peer:22} {r['step_s'] * 1e3:9.0f} {vs_ds:>9} {vs_fsdp:>9} {r['peak_bytes'] / 2**20:9.0f}  {losses}")


if __name__ == "__main__":
    main()
