"""1-bit Adam, 0/1 Adam and 1-bit LAMB against AdamW (and LAMB) with fp32 all-reduce: bytes, step time, loss.

Gloo ranks on this machine (default 2 and 4) train the same small GPT on a learnable bigram language
(``dscompile.testing.onebit``) for ``--steps`` steps, every optimizer with the same learning-rate
schedule (linear warm-up over the first 10%, then linear decay to 10%). ``--path engine`` (the default,
the user's path) trains through ``dscompile.initialize``: the engine compiles the model and hands its
gradient communication to the 1-bit optimizers, and more rows run ZeRO-1 and ZeRO-2 (``adamw_zero1``,
``onebitadam_zero1``, ``lamb_zero1``, ``onebitlamb_zero1``, ``_zero2``: the 1-bit reduce-scatter, the fp32 parameter
all-gather kept). ``--path loop`` is
a plain eager loop where the 1-bit optimizers do all the communication themselves:

- ``adamw``: torch's AdamW after one fp32 all-reduce of the gradients per step (the baseline);
- ``onebitadam``: ``freeze_step`` = 15% of the run (the lower end of the 15-25% DeepSpeed's tutorial
  recommends);
- ``zerooneadam``: DeepSpeed's published BERT schedule (``var_freeze_step`` = end of the learning-rate
  warm-up, ``local_step_scaler`` = ``var_freeze_step``, ``local_step_clipper`` 16) scaled to the run,
  with ``var_update_scaler`` 1 (16 in a 1000-step variance phase is as dense as 1 in a 20-step one);
- ``lamb``: 1-bit LAMB's warm-up never ending: LAMB with fp32 all-reduce, the reference of
- ``onebitlamb``: ``freeze_step`` 15% of the run.

Bytes are those each rank sends, counted from the collectives issued (ring all-reduce
``2 (w-1)/w x bytes``, all-to-all ``(w-1)/w``, all-gather ``(w-1) x`` its input). Loopback gloo is not a
slow network, so every optimizer runs a second time with ``--bandwidth`` emulated: each collective
(``--path engine``: each step) first sleeps ``bytes sent / bandwidth``. Step times on a shared CPU are noisy. Prints a table per world
size with ratios to the baseline and the targets (>= 5x fewer bytes for 1-bit Adam, >= 26x for 0/1
Adam, momentum exchange after the freeze >= 16x fewer bytes than the fp32 all-reduce, final loss within 3% of the
uncompressed optimizer), and writes ``onebit.png`` (loss curves; matplotlib, from the ``test`` extra),
``onebit_curves.csv`` (the same curves) and ``onebit.json``.

    python bench/onebit.py [--path engine|loop] [--worlds 2,4] [--steps 200] [--bandwidth 1e6] [--out bench/out]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from dscompile.testing.distributed import run_distributed
from dscompile.testing.onebit import Workload, entropy_floor, train_rank, train_rank_engine

REFERENCE = {
    "onebitadam": "adamw",
    "zerooneadam": "adamw",
    "onebitlamb": "lamb",
    **{f"onebitadam_zero{s}": f"adamw_zero{s}" for s in (1, 2)},
    **{f"onebitlamb_zero{s}": f"lamb_zero{s}" for s in (1, 2)},
}
TARGET_RATIO = {"onebitadam": 5.0, "zerooneadam": 26.0}


def optimizers(steps: int) -> dict[str, dict[str, Any]]:
    warmup = max(1, steps // 10)
    freeze = max(1, int(0.15 * steps))
    return {
        "adamw": {"lr": 1e-2, "weight_decay": 0.01},
        "onebitadam": {"lr": 1e-2, "weight_decay": 0.01, "freeze_step": freeze},
        "zerooneadam": {
            "lr": 1e-2,
            "weight_decay": 0.01,
            "var_freeze_step": warmup,
            "var_update_scaler": 1,
            "local_step_scaler": warmup,
            "local_step_clipper": 16,
        },
        "lamb": {"lr": 3e-2, "weight_decay": 0.01},
        "onebitlamb": {"lr": 3e-2, "weight_decay": 0.01, "freeze_step": freeze},
    }


def _rank(rank: int, world: int, works: list[Workload], path: str) -> list[dict[str, Any]]:
    train = train_rank_engine if path == "engine" else train_rank
    return [{k: v for k, v in train(rank, world, work).items() if k != "params"} for work in works]


def _workload(name: str, kw: dict[str, Any], **common: Any) -> Workload:
    base, _, zero = name.partition("_zero")
    return Workload(base, kw, zero_stage=int(zero or 0), **common)


def run_world(world: int, args: argparse.Namespace) -> dict[str, Any]:
    opts = optimizers(args.steps)
    if args.path == "engine":
        for stage in args.zero_stages:
            opts.update({f"adamw_zero{stage}": opts["adamw"], f"onebitadam_zero{stage}": opts["onebitadam"]})
            opts.update({f"lamb_zero{stage}": opts["lamb"], f"onebitlamb_zero{stage}": opts["onebitlamb"]})
    common = dict(steps=args.steps, d_model=args.d_model, n_layers=args.layers, lr_warmup_steps=max(1, args.steps // 10), lr_final_fraction=0.1)
    works = [_workload(name, kw, **common) for name, kw in opts.items()]
    capped = [_workload(name, kw, bandwidth_bytes_per_s=args.bandwidth, **common) for name, kw in opts.items()]
    ranks = run_distributed(_rank, world, works + capped, args.path, timeout=args.timeout)
    rows = {}
    for i, name in enumerate(opts):
        free, slow = [r[i] for r in ranks], [r[len(opts) + i] for r in ranks]
        curve = [sum(r["losses"][s] for r in free) / world for s in range(args.steps)]
        rows[name] = {
            "params": opts[name],
            "eval_loss": sum(r["eval_loss"] for r in free) / world,
            "total_bytes": free[0]["stats"]["total_bytes"],
            "bytes_by_purpose": free[0]["stats"]["bytes_by_purpose"],
            "bytes_per_step": free[0]["bytes"],
            "step_ms": 1000 * statistics.mean(s for r in free for s in r["seconds"]),
            "step_ms_capped": 1000 * statistics.mean(s for r in slow for s in r["seconds"]),
            "emulated_comm_ms": 1000 * row_bytes(free[0]) / args.bandwidth / args.steps,
            "loss_curve": curve,
        }
    return rows


def row_bytes(rank_result: dict[str, Any]) -> int:
    return rank_result["stats"]["total_bytes"]


def print_table(world: int, rows: dict[str, Any], bandwidth: float) -> list[str]:
    print(f"\nworld {world} (gloo, CPU; step times noisy: the machine is shared)")
    header = (
        f"{'optimizer':17s} {'eval loss':>9s} {'vs ref':>7s} {'MB sent':>8s} {'x fewer':>8s} {'B/step warm':>11s} "
        f"{'B/step 1bit':>11s} {'local steps':>11s} {'ms/step':>8s} {'ms/step @cap':>12s} {'of which link':>13s}"
    )
    print(header)
    verdicts = []
    for name, row in rows.items():
        per_step = row["bytes_per_step"]
        warm = max(per_step)
        compressed = [b for b in per_step if 0 < b < warm]
        ref = REFERENCE.get(name)
        rel = f"{100 * (row['eval_loss'] / rows[ref]['eval_loss'] - 1):+.1f}%" if ref else ""
        ratio = rows["adamw" + name[len(name.partition("_zero")[0]) :]]["total_bytes"] / row["total_bytes"]
        print(
            f"{name:17s} {row['eval_loss']:9.4f} {rel:>7s} {row['total_bytes'] / 1e6:8.2f} {ratio:8.1f} {warm:11d} "
            f"{(statistics.median(compressed) if compressed else 0):11.0f} {per_step.count(0):11d} "
            f"{row['step_ms']:8.1f} {row['step_ms_capped']:12.1f} {row['emulated_comm_ms']:13.1f}"
        )
        if ref:
            loss_ok = row["eval_loss"] <= 1.03 * rows[ref]["eval_loss"]
            verdicts.append(f"world {world} {name}: final loss {rel} vs {ref} (target within 3%): {'ok' if loss_ok else 'MISSED'}")
        if name == "onebitadam" and compressed:
            exchange = warm / statistics.median(compressed)
            verdicts.append(
                f"world {world} {name}: momentum exchange after the freeze sends {exchange:.1f}x fewer bytes than the fp32 all-reduce "
                f"(target >= 16x): {'ok' if exchange >= 16 else 'MISSED'}"
            )
        if name in TARGET_RATIO:
            ok = ratio >= TARGET_RATIO[name]
            verdicts.append(f"world {world} {name}: {ratio:.1f}x fewer bytes than AdamW (target >= {TARGET_RATIO[name]:.0f}x): {'ok' if ok else 'MISSED'}")
    print(
        f"(ms/step: mean over the run; @cap: every collective first sleeps bytes / {bandwidth / 1e6:g} MB/s, 'of which link' is that sleep; "
        f"loss floor of the language {entropy_floor():.3f})"
    )
    return verdicts


def write_curves(results: dict[int, dict[str, Any]], path: Path) -> None:
    """The loss curves as CSV (world, optimizer, step, loss): readable without matplotlib."""
    lines = ["world,optimizer,step,loss"]
    for world, rows in results.items():
        for name, row in rows.items():
            lines += [f"{world},{name},{step + 1},{loss:.6f}" for step, loss in enumerate(row["loss_curve"])]
    path.write_text("\n".join(lines) + "\n")


def plot(results: dict[int, dict[str, Any]], path: Path) -> None:
    """Loss curves side by side, one panel per world size (matplotlib: the ``test`` extra declares it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.5), squeeze=False)
    for ax, (world, rows) in zip(axes[0], results.items()):
        for name, row in rows.items():
            curve = torch.tensor(row["loss_curve"])
            smooth = torch.nn.functional.avg_pool1d(curve.view(1, 1, -1), 9, stride=1, padding=4, count_include_pad=False).view(-1)
            ax.plot(smooth.tolist(), label=f"{name} ({row['eval_loss']:.3f})", linestyle="--" if name.startswith(("adamw", "lamb")) else "-")
        ax.axhline(entropy_floor(), color="gray", linewidth=0.8, linestyle=":")
        ax.set_title(f"{world} gloo ranks: training loss (9-step mean)")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_ylim(entropy_floor() - 0.1, 4.4)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", choices=("engine", "loop"), default="engine", help="through dscompile.initialize, or a plain eager loop")
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--d-model", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--bandwidth", type=float, default=1e6, help="emulated link, bytes per second per rank (1e6: 8 Mbit/s)")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--zero-stages", default="1,2", help="--path engine: ZeRO stages to add AdamW/OneBitAdam and LAMB/OneBitLamb rows for ('' for none)")
    parser.add_argument("--out", default="bench/out", help="directory for onebit.png and onebit.json")
    args = parser.parse_args()
    args.zero_stages = [int(s) for s in args.zero_stages.split(",") if s]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results, verdicts = {}, []
    for world in (int(w) for w in args.worlds.split(",")):
        results[world] = run_world(world, args)
        verdicts += print_table(world, results[world], args.bandwidth)
    print("\ntargets:")
    print("\n".join(verdicts))
    (out / "onebit.json").write_text(json.dumps({"args": vars(args), "results": results, "verdicts": verdicts}, indent=1))
    write_curves(results, out / "onebit_curves.csv")
    plot(results, out / "onebit.png")
    print(f"wrote {out / 'onebit.png'}, {out / 'onebit_curves.csv'} and {out / 'onebit.json'}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
