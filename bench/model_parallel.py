"""Tensor parallelism, TP=2 on gloo: dscompile's graph-found TP against DTensor ``parallelize_module``.

The same zoo Llama (separate q/k/v, SwiGLU MLP), the same weights and batches, SGD, on 2 spawned gloo
ranks per variant:

- ``dscompile``: ``tensor_parallel.autotp_size: 2``; the pass finds the blocks and splits them; default
  lowering (Inductor).
- ``dscompile vocab``: the same with ``vocab_parallel_lm_head: true`` (the LM head split by vocabulary,
  parallel cross-entropy).
- ``dscompile overlap``: the same with ``tp_overlap_comm: true`` (each TP all-reduce started before the
  computation that does not need it, the weight-gradient matmuls in backward, and waited for after).
- ``dtensor eager`` / ``dtensor compiled``: ``parallelize_module`` with the hand-written plan
  (``wq/wk/wv/w_gate/w_up`` ``ColwiseParallel``, ``wo/w_down`` ``RowwiseParallel``; the attention's head
  counts halved by hand, as torchtitan does), eager and under ``torch.compile`` (Inductor).
- ``deepspeed autotp``: DeepSpeed's AutoTP training (``tensor_parallel.autotp_size: 2``, the same split named by
  ``partition_config.layer_specs``: wq/wk/wv/w_gate/w_up column, wo/w_down row; AutoTP divides the attention's
  ``n_heads`` itself, ``n_kv_heads`` is halved by hand), run when DeepSpeed is installed (``DS_ACCELERATOR=cpu``).

Printed per variant: the median step time (forward, backward, optimizer step), the parameter bytes each
rank holds against the ideal split (replicated layers whole + split layers / TP), and the peak resident
memory a training step adds (VmHWM after a reset, minus the RSS before); then the ratios against
``dtensor compiled`` (median of the per-round ratios, with their range).

Measured 2026-12-05 on the shared 2-core machine (load average 3-5 from one other job), default sizes (d_model 256,
4 layers, seq 128, batch 4, vocabulary 512), ``--steps 6 --rounds 3``, DeepSpeed 0.19.8:

    variant              step ms  spread            x dt-comp  param MiB/rank  vs ideal  peak+ MiB  last loss
    dscompile              158.3    51%    0.89x [0.78-1.27]            8.51     1.000        5.4     6.2870
    dscompile overlap      147.8    52%    0.83x [0.78-1.26]            8.51     1.000        3.8     6.2870
    dscompile vocab        209.3    76%    1.29x [1.15-2.25]            8.26     1.000        6.1     6.2870
    dtensor eager          316.3    47%    1.77x [1.24-2.15]            8.51     1.000        6.3     6.2870
    dtensor compiled       162.1    10%    1.00x [1.00-1.00]            8.51     1.000        4.4     6.2870
    deepspeed autotp       187.6     7%    1.10x [1.07-1.16]            8.51     1.000        9.9     6.2874

dscompile's median step is 0.89x DTensor compiled's and 0.84x DeepSpeed AutoTP's, but its spread over the three
rounds crosses 1 (one round 1.27x): on this machine the target (no slower than DTensor compiled) holds for the
median, not for every round. Each rank holds exactly the ideal split's parameter bytes. The vocabulary split is
slower at this size (its parallel cross-entropy adds three all-reduces of per-token vectors to save a 512-word
head). Earlier runs on a more loaded machine: 0.53x (load 9-10, 3 rounds, spread 83%), 1.20x (load 17-25, one run).
``tp_overlap_comm`` (``dscompile overlap``) is within the noise of the flag off here.

    python bench/model_parallel.py [--steps 5] [--d-model 256] [--layers 4] [--seq 128] [--batch 4] [--rounds 3] [--variants a,b]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import alternate, median_spread, ratio_cell  # noqa: E402  (bench/harness.py)


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM back to the current RSS
    except OSError:
        pass


def _dtensor_model(model: Any, tp: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (tp,))
    for block in model.blocks:
        plan = {
            "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(), "attn.wo": RowwiseParallel(),
            "mlp.w_gate": ColwiseParallel(), "mlp.w_up": ColwiseParallel(), "mlp.w_down": RowwiseParallel(),
        }  # fmt: skip
        parallelize_module(block, mesh, plan)
        block.attn.n_heads //= tp
        block.attn.n_kv_heads //= tp
    return model


def _deepspeed_autotp_engine(model: Any, tp: int, lr: float, batch: int) -> Any:
    """DeepSpeed's AutoTP training (``tensor_parallel.autotp_size``) with the same split named by
    ``partition_config.layer_specs``; AutoTP divides the attention's ``n_heads`` itself, not ``n_kv_heads``."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    for block in model.blocks:
        block.attn.n_kv_heads //= tp
    specs = [
        {"patterns": [r".*\.(wq|wk|wv|w_gate|w_up)\.weight$"], "partition_type": "column"},
        {"patterns": [r".*\.(wo|w_down)\.weight$"], "partition_type": "row"},
    ]
    config = {
        "train_micro_batch_size_per_gpu": batch,
        "optimizer": {"type": "SGD", "params": {"lr": lr}},
        "tensor_parallel": {"autotp_size": tp, "partition_config": {"use_default_specs": False, "layer_specs": specs}},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def run_variant(rank: int, world: int, variant: str, sizes: dict[str, int], steps: int) -> dict[str, Any]:
    import torch

    import dscompile
    from dscompile.zoo import build, make_batch

    case = build("llama", seed=0, **sizes)
    model = case.model
    full = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    lr = 0.01
    if variant.startswith("dscompile") or variant == "deepspeed autotp":  # engines: engine(batch), backward, step
        if variant == "deepspeed autotp":
            engine = _deepspeed_autotp_engine(model, world, lr, sizes["batch_size"])
            model = engine.module
        else:
            tc = {"autotp_size": world, "vocab_parallel_lm_head": variant == "dscompile vocab", "tp_overlap_comm": variant == "dscompile overlap"}
            engine, *_ = dscompile.initialize(model=model, config={"optimizer": {"type": "SGD", "params": {"lr": lr}}, "tensor_parallel": tc})

        def step(batch: tuple) -> float:
            loss = engine(*batch)
            engine.backward(loss)
            engine.step()
            return float(loss.detach())
    else:
        model = _dtensor_model(model, world)
        run = torch.compile(model) if variant == "dtensor compiled" else model
        opt = torch.optim.SGD(model.parameters(), lr=lr)

        def step(batch: tuple) -> float:
            loss = run(*batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss.detach())

    batches = [make_batch(case, seed=i) for i in range(steps + 2)]
    losses = [step(batches[0]), step(batches[1])]  # warm-up: capture, compile
    rss_before = _rss("VmRSS:")
    _reset_peak()
    times = []
    for batch in batches[2:]:
        t0 = time.perf_counter()
        losses.append(step(batch))
        times.append(time.perf_counter() - t0)
    peak_added = _rss("VmHWM:") - rss_before

    def local_bytes(p: Any) -> int:
        t = p.to_local() if hasattr(p, "to_local") else p
        return t.numel() * t.element_size()

    params = dict(model.named_parameters())
    held = sum(local_bytes(p) for p in params.values())
    split = [n for n, p in params.items() if local_bytes(p) < full[n]]
    ideal = sum(full.values()) - sum(full[n] for n in split) + sum(full[n] for n in split) // world
    return {"ms": 1000 * statistics.median(times), "held": held, "ideal": ideal, "peak_added": peak_added, "losses": losses}


VARIANTS = ("dscompile", "dscompile overlap", "dscompile vocab", "dtensor eager", "dtensor compiled", "deepspeed autotp")


def main() -> None:
    from dscompile.testing.distributed import run_distributed

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1, help="variants alternated A B C A B C ...: each runs this many times; median and spread")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {', '.join(VARIANTS)} (dtensor compiled always runs)")
    args = parser.parse_args()
    sizes = {
        "d_model": args.d_model, "n_heads": 8, "n_kv_heads": 4, "n_layers": args.layers, "hidden_dim": 4 * args.d_model,
        "seq_len": args.seq, "vocab_size": 512, "batch_size": args.batch,
    }  # fmt: skip

    def run_peer(variant: str, round_index: int) -> dict[str, Any]:
        env = {"DS_ACCELERATOR": "cpu"} if variant.startswith("deepspeed") else None
        results = run_distributed(run_variant, 2, variant, sizes, args.steps, timeout=900, env=env)
        row = {
            "ms": max(r["ms"] for r in results),
            "held": max(r["held"] for r in results),
            "ideal": results[0]["ideal"],
            "peak_added": max(r["peak_added"] for r in results),
            "loss": results[0]["losses"][-1],
        }
        print(f"[round {round_index + 1}] {variant}: {row['ms']:.1f} ms/step", flush=True)
        return row

    chosen = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(chosen) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {VARIANTS}")
    if "deepspeed autotp" in chosen and importlib.util.find_spec("deepspeed") is None:
        print("DeepSpeed is not installed: its AutoTP training is left out (pip install deepspeed)")
        chosen.remove("deepspeed autotp")
    chosen = [v for v in VARIANTS if v in chosen or v == "dtensor compiled"]
    runs = alternate(tuple(chosen), args.rounds, run_peer)
    base = runs["dtensor compiled"]
    print(f"TP=2 on gloo, zoo llama {sizes}; {args.rounds} round(s), variants alternated, medians; ratio: median of per-round ratios [min-max]")
    print(f"{'variant':18} {'step ms':>9} {'spread':>7} {'x dt-comp':>20} {'param MiB/rank':>15} {'vs ideal':>9} {'peak+ MiB':>10} {'last loss':>10}")
    for variant, rows in runs.items():
        ms, spread = median_spread(r["ms"] for r in rows)
        r = rows[-1]
        print(
            f"{variant:18} {ms:9.1f} {spread:6.0%} {ratio_cell(rows, base, 'ms'):>20} {r['held'] / 2**20:15.2f} {r['held'] / r['ideal']:9.3f} "
            f"{max(x['peak_added'] for x in rows) / 2**20:10.1f} {r['loss']:10.4f}"
        )

if __name__ == "__main__":
    main()
