"""Ulysses sequence parallelism (``sequence_parallel_size: 2``) against data parallelism on 2 gloo ranks.

    python bench/sequence_parallel.py [--seq 2048] [--rounds 2] [--lower eager]

Both run the zoo Llama (GQA) through ``dscompile.initialize``, one micro-batch per rank and step:

- ``dp``: every rank trains on a whole sequence of its own (2 sequences a step);
- ``sp``: both ranks train on the same sequence, each on its half (1 sequence a step).

Printed per variant: the step time, tokens per second per rank, and the peak resident memory a step adds on
a rank (VmHWM above the resident set before the timed steps: activations and temporaries; parameters,
gradients and optimizer states were allocated in the warm-up steps). The variants alternate (A B A B ...),
ratios are medians of per-round ratios with their range. What sequence parallelism is for shows in the
memory column: a rank holds half of each activation along the sequence. DeepSpeed-Ulysses is not run as
a peer: its ``DistributedAttention`` needs a model written to take sequence chunks.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import alternate, median_spread, ratio_cell  # noqa: E402  (bench/harness.py)
from model_parallel import _reset_peak, _rss  # noqa: E402


def run_variant(rank: int, world: int, variant: str, sizes: dict[str, int], steps: int, lower: str) -> dict[str, Any]:
    import dscompile
    from dscompile.zoo import build, make_batch

    case = build("llama", seed=0, **sizes)
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": sizes["batch_size"], "optimizer": {"type": "SGD", "params": {"lr": 0.01}}, "lower": lower}
    if variant == "sp":
        config["sequence_parallel_size"] = world
    engine, *_ = dscompile.initialize(model=case.model, config=config)
    # sp: the group trains on one sequence (the engine broadcasts rank 0's); dp: each rank on its own
    batches = [make_batch(case, seed=i if variant == "sp" else 100 * rank + i) for i in range(steps + 2)]

    def step(batch: tuple) -> float:
        loss = engine(*batch)
        engine.backward(loss)
        engine.step()
        return float(loss.detach())

    losses = [step(batches[0]), step(batches[1])]  # warm-up: capture, compile, optimizer states
    rss_before = _rss("VmRSS:")
    _reset_peak()
    times = []
    for batch in batches[2:]:
        start = time.perf_counter()
        losses.append(step(batch))
        times.append(time.perf_counter() - start)
    tokens = sizes["batch_size"] * sizes["seq_len"] // (world if variant == "sp" else 1)
    seconds = statistics.median(times)
    return {"ms": 1000 * seconds, "tokens_per_s": tokens / seconds, "peak_added": _rss("VmHWM:") - rss_before, "loss": losses[-1]}


def main() -> None:
    from dscompile.testing.distributed import run_distributed

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2, help="variants alternated A B A B ...: each runs this many times")
    parser.add_argument("--lower", default="inductor", choices=("eager", "inductor"))
    args = parser.parse_args()
    sizes = {
        "d_model": args.d_model, "n_heads": 8, "n_kv_heads": 4, "n_layers": args.layers, "hidden_dim": 4 * args.d_model,
        "seq_len": args.seq, "vocab_size": 4096, "batch_size": args.batch,
    }  # fmt: skip

    def run_peer(variant: str, round_index: int) -> dict[str, Any]:
        results = run_distributed(run_variant, 2, variant, sizes, args.steps, args.lower, timeout=1800)
        row = {
            "ms": max(r["ms"] for r in results),
            "tokens_per_s": min(r["tokens_per_s"] for r in results),
            "peak_added": max(r["peak_added"] for r in results),
            "loss": results[0]["loss"],
        }
        print(f"[round {round_index + 1}] {variant}: {row['ms']:.1f} ms/step, peak +{row['peak_added'] / 2**20:.0f} MiB", flush=True)
        return row

    runs = alternate(("dp", "sp"), args.rounds, run_peer)
    base = runs["dp"]
    print(f"2 gloo ranks, zoo llama {sizes}, lower={args.lower}; {args.rounds} round(s) alternated; medians, ratio vs dp: median [range]")
    print(f"{'variant':8} {'step ms':>9} {'spread':>7} {'tok/s/rank':>11} {'peak+ MiB':>10} {'peak+ x dp':>18} {'last loss':>10}")
    for variant, rows in runs.items():
        ms, spread = median_spread(r["ms"] for r in rows)
        peak = statistics.median(r["peak_added"] for r in rows)
        tokens = statistics.median(r["tokens_per_s"] for r in rows)
        print(f"{variant:8} {ms:9.1f} {spread:6.0%} {tokens:11.0f} {peak / 2**20:10.1f} {ratio_cell(rows, base, 'peak_added'):>18} {rows[-1]['loss']:10.4f}")


if __name__ == "__main__":
    main()
