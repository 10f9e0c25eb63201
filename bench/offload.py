"""ZeRO-Offload / ZeRO-Infinity: step time and peak resident memory with the optimizer on the host or NVMe.

A GPT-style model (default ~98M parameters), gloo ranks on CPU, world sizes 1 and 2, the same data
and AdamW for every peer; each peer runs in its own spawn of ranks (so memory is its own):

- ``dscompile-none`` / ``dscompile-cpu`` / ``dscompile-nvme``: ``dscompile.initialize`` with ZeRO
  (``--stage``, default 2) and ``offload_optimizer.device`` none / cpu / nvme (swap files under
  ``--nvme-path``, tiles of ``--tile`` elements, ``--buffers`` tile buffers).
- ``dscompile-param`` / ``dscompile-infinity`` (``--stage 3`` only): ``offload_param.device`` nvme (the ZeRO-3
  parameter shards in swap files, read ahead of their all-gather), alone / with ``offload_optimizer`` nvme too.
- ``fsdp2`` / ``fsdp2-cpuoffload``: ``fully_shard`` per block and the root, the second with
  ``CPUOffloadPolicy`` (FSDP2's ZeRO-Offload peer).
- ``deepspeed-cpu`` / ``deepspeed-nvme`` / ``deepspeed-infinity``: DeepSpeed's own offload (the last with
  ``offload_param`` nvme too, ``--stage 3``), only where ``deepspeed`` imports (else its rows say so).

On a CPU-only machine the host is the device, so ``cpu`` offload moves nothing (the shard is its own
master) and is there for its step time; ``nvme`` is what frees memory. Step time is the median of
the steady steps; peak memory the highest resident set size sampled every millisecond during them,
minus the resident size before the model was built. ``states MiB`` is the model-state memory a rank holds
at its fullest, right after backward (``engine.model_state_bytes()``: distinct storages of parameters and
shards, gradients and the optimizer states in memory; FSDP2's local shards likewise; not known for
DeepSpeed): what offload is meant to remove, without the activations, temporaries, compiled code and
allocator caches that the peak also holds. Both are honest and differ on purpose: with ``offload_param`` the
shards leave the states column entirely, while the peak still holds the gradients, the optimizer states and
the few parameters in use and read ahead or being written back. Every process runs with
``MALLOC_MMAP_THRESHOLD_=65536`` so freed buffers go back to the system at once (resident memory then
measures what a peer holds, not what glibc caches). Prints one table per world size with ratios to
``dscompile-none``, and each peer's losses (offload must not change them).

    python bench/offload.py [--d-model 768 --layers 12 --vocab 16384 --seq 128 --batch 2] [--worlds 1,2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import alternate, median_spread, ratio_cell, resident_bytes, timed_steps  # noqa: E402  (bench/harness.py)
from zero import _batches, _case  # noqa: E402  (bench/zero.py: the same model and data)

PEERS = [
    "dscompile-none", "dscompile-cpu", "dscompile-nvme", "dscompile-param", "dscompile-infinity",
    "fsdp2", "fsdp2-cpuoffload", "deepspeed-cpu", "deepspeed-nvme", "deepspeed-infinity",
]
LR = 1e-4


def _adamw() -> dict[str, Any]:
    return {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "torch_adam": True}}


def _offload_section(device: str, args: dict[str, Any], rank_dir: str) -> dict[str, Any]:
    if device == "none":
        return {"device": "none"}
    if device == "cpu":
        return {"device": "cpu", "pin_memory": True}
    return {"device": "nvme", "nvme_path": rank_dir, "buffer_count": args["buffers"]}


def _build(peer: str, case: Any, args: dict[str, Any], nvme_dir: str, states: list[int]) -> tuple[Any, Any]:
    """Return (step(batch) -> loss, swap_bytes() -> int) for one peer; ``step`` appends to ``states`` the model-state
    bytes resident after backward (parameters, gradients, optimizer states: distinct storages), where a peer knows them."""
    model = case.model
    family, device = peer.split("-", 1) if "-" in peer else (peer, "none")
    if family in ("dscompile", "deepspeed"):
        optimizer_device = {"param": "none", "infinity": "nvme"}.get(device, device)
        zero = {"stage": args["stage"], "sub_group_size": args["tile"], "offload_optimizer": _offload_section(optimizer_device, args, nvme_dir)}
        if args.get("reduce_bucket"):
            zero["reduce_bucket_size"] = args["reduce_bucket"]
        if args.get("overlap_comm") is not None:
            zero["overlap_comm"] = args["overlap_comm"]
        if device in ("param", "infinity"):
            zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_dir, "buffer_count": args["buffers"]}
        config = {"train_micro_batch_size_per_gpu": args["batch"], "optimizer": _adamw(), "zero_optimization": zero}
        if family == "dscompile":
            import dscompile

            config["lower"] = args["lower"]
            engine, _, _, _ = dscompile.initialize(model=model, config=config)
            extension = engine.extension("zero_offload")
            params_ext = engine.extension("zero_offload_param")

            def swap() -> int:
                optimizer_files = engine.optimizer.expected_swap_bytes() if extension is not None and extension.optimizer is not None else 0
                return optimizer_files + (params_ext.store.file_bytes() if params_ext is not None else 0)

            # cpu offload: host steps handed off (and started, finished) during backward, and the host step seconds
            swap.early = lambda: {k: v for k, v in (extension.counters() if extension is not None else {}).items()  # type: ignore[attr-defined]
                                  if k in ("early_host_steps", "early_host_step_seconds", "host_step_seconds")}
        else:
            import deepspeed

            deepspeed.init_distributed(dist_backend="gloo")
            engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
            swap = lambda: sum(p.stat().st_size for p in Path(nvme_dir).rglob("*") if p.is_file())  # noqa: E731

        def step(batch: tuple) -> float:
            loss = engine(*batch)
            engine.backward(loss)
            if family == "dscompile":
                states.append(engine.model_state_bytes())
            engine.step()
            return loss.item()

        return step, swap
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if device == "cpuoffload" else {}
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **policy)
    fully_shard(model, mesh=mesh, **policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)

    def fsdp_step(batch: tuple) -> float:
        loss = model(*batch)
        loss.backward()
        local = [t.to_local() if hasattr(t, "to_local") else t for p in model.parameters() for t in (p, p.grad) if t is not None]
        local += [v.to_local() if hasattr(v, "to_local") else v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
        from dscompile.runtime.zero_shard import state_bytes

        states.append(state_bytes(local))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return fsdp_step, lambda: 0


def peer_rank(rank: int, world: int, peer: str, args: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(args["threads"])
    import dscompile  # noqa: F401  (libraries loaded before the baseline: their code is not model memory)

    if peer.startswith("deepspeed"):
        import deepspeed  # noqa: F401
    baseline = resident_bytes()
    torch.manual_seed(0)
    case = _case(args)
    params = sum(p.numel() for p in case.model.parameters())
    batches = _batches(case, rank, args["warmup"] + args["steps"])
    nvme_dir = os.path.join(args["nvme_path"], f"{peer}-world{world}")
    os.makedirs(nvme_dir, exist_ok=True)
    states: list[int] = []
    step, swap_bytes = _build(peer, case, args, nvme_dir, states)
    losses, times, peak = timed_steps(step, batches, args["warmup"], barrier=dist.barrier)
    early = getattr(swap_bytes, "early", None)
    if rank == 0 and early is not None and early():
        print(f"world {world} {peer}: {early()}", flush=True)
    return {"step_s": statistics.median(times), "peak_bytes": peak - baseline, "losses": losses, "params": params, "swap_bytes": swap_bytes(),
            "state_bytes": max(states) if states else None}


def main() -> None:
    parser = argparse.ArgumentParser(description="Offload benchmark: dscompile none/cpu/nvme vs FSDP2 (CPUOffloadPolicy) vs DeepSpeed")
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--stage", type=int, default=2, choices=[1, 2, 3])
    parser.add_argument("--tile", type=int, default=1 << 21, help="NVMe tile (sub_group_size), elements")
    parser.add_argument("--buffers", type=int, default=4,
                        help="NVMe tile buffers (buffer_count; DeepSpeed's default 4: its swapper fails its second step with 3)")
    parser.add_argument("--nvme-path", default=None, help="swap directory (default: a new temporary directory)")
    parser.add_argument("--steps", type=int, default=3, help="measured steps")
    parser.add_argument("--warmup", type=int, default=2, help="steps before measuring (compilation happens here)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--reduce-bucket", type=int, default=0, help="zero_optimization.reduce_bucket_size, elements (0: the default)")
    parser.add_argument("--overlap-comm", default=None, choices=["true", "false"], help="zero_optimization.overlap_comm (unset: the default)")
    parser.add_argument("--lower", default="inductor", choices=["eager", "inductor"], help="dscompile's lowering")
    parser.add_argument("--worlds", default="1,2")
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--rounds", type=int, default=1, help="peers alternated A B A B ...: each peer runs this many times; median and spread")
    parser.add_argument("--timeout", type=float, default=1800)
    opts = parser.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # read by glibc in every spawned rank
    from dscompile.testing.distributed import DistributedRunError, run_distributed

    nvme_path = opts.nvme_path or tempfile.mkdtemp(prefix="dscompile-offload-bench-")
    args = {"d_model": opts.d_model, "heads": opts.heads, "layers": opts.layers, "vocab": opts.vocab, "seq": opts.seq, "batch": opts.batch,
            "steps": opts.steps, "warmup": opts.warmup, "lower": opts.lower, "stage": opts.stage, "tile": opts.tile, "buffers": opts.buffers,
            "nvme_path": nvme_path, "threads": opts.threads, "model": "gpt", "reduce_bucket": opts.reduce_bucket,
            "overlap_comm": None if opts.overlap_comm is None else opts.overlap_comm == "true"}
    for world in (int(w) for w in opts.worlds.split(",")):

        def run_peer(peer: str, round_index: int, world: int = world) -> dict[str, Any] | None:
            if peer in ("dscompile-param", "dscompile-infinity") and opts.stage != 3:
                print(f"world {world} {peer}: skipped: offload_param needs --stage 3", flush=True)
                return None
            if peer.startswith("deepspeed"):
                try:
                    import deepspeed  # noqa: F401
                except ImportError:
                    print(f"world {world} {peer}: skipped: deepspeed is not installed (pip install deepspeed)", flush=True)
                    return None
            torch._dynamo.reset()
            try:
                ranks = run_distributed(peer_rank, world, peer, args, timeout=opts.timeout)
            except DistributedRunError as exc:
                print(f"world {world} {peer}: failed: {str(exc).splitlines()[0][:300]}", flush=True)
                return None
            run = {
                "step_s": max(r["step_s"] for r in ranks),
                "peak_bytes": max(r["peak_bytes"] for r in ranks),
                "swap_bytes": max(r["swap_bytes"] for r in ranks),
                "state_bytes": None if ranks[0]["state_bytes"] is None else max(r["state_bytes"] for r in ranks),
                "losses": [sum(v) / len(ranks) for v in zip(*(r["losses"] for r in ranks), strict=True)],
                "params": ranks[0]["params"],
            }
            print(f"[round {round_index + 1}] world {world} {peer}: {run['step_s'] * 1e3:.0f} ms/step, peak {run['peak_bytes'] / 2**20:.0f} MiB", flush=True)
            return run

        results = alternate(opts.peers.split(","), opts.rounds, run_peer)
        if not results:
            continue
        params = next(iter(results.values()))[0]["params"]
        print(f"\nGPT {params / 1e6:.1f}M params, world {world} gloo, ZeRO-{opts.stage}, batch {opts.batch}x{opts.seq}/rank, lowering {opts.lower}, "
              f"NVMe tile {opts.tile} elements x {opts.buffers} buffers, swap under {nvme_path}")
        print(f"{opts.rounds} round(s), peers alternated; medians over rounds, spread = (max-min)/median; ratios: median of the per-round "
              "ratios [min-max]")
        base = results.get("dscompile-none")
        header = (f"{'peer':18} {'step ms':>9} {'spread':>7} {'vs none':>20} {'peak MiB':>9} {'vs none':>20} {'states MiB':>10} {'vs none':>8} "
                  f"{'swap MiB/rank':>14}  losses (last round)")
        print(header)
        print("-" * len(header))
        for peer, runs in results.items():
            step_s, spread = median_spread(r["step_s"] for r in runs)
            peak = statistics.median(r["peak_bytes"] for r in runs)
            losses = " ".join(f"{v:.4f}" for v in runs[-1]["losses"])
            states = runs[-1]["state_bytes"]
            base_states = base[-1]["state_bytes"] if base else None
            states_cell = "-" if states is None else f"{states / 2**20:.0f}"
            states_ratio = f"{states / base_states:.2f}x" if states is not None and base_states else "-"
            print(f"{peer:18} {step_s * 1e3:9.0f} {spread:6.0%} {ratio_cell(runs, base):>20} {peak / 2**20:9.0f} "
                  f"{ratio_cell(runs, base, 'peak_bytes'):>20} {states_cell:>10} {states_ratio:>8} {runs[-1]['swap_bytes'] / 2**20:14.0f}  {losses}")
        print()

if __name__ == "__main__":
    main()
