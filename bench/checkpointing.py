"""Activation checkpointing: dscompile's budgets against torch's activation_memory_budget and torch.utils.checkpoint.

For the GPT- and Llama-style zoo models, at budgets 1.0, 0.8, 0.6, 0.4, 0.2 and ``full``:
saved bytes (what forward hands to backward, from the partitioned graphs), recompute FLOPs
(matmul-like ops only, the ones torch's FlopCounterMode counts, so that every method has the
same yardstick: from the partitioned backward graph for compiled methods, as the backward's
extra FLOPs over plain eager under FlopCounterMode for utils.checkpoint; the "model GFLOP"
column adds dscompile's cost-model count of every recomputed op, pointwise included), memory held after forward and the peak of a step
(resident memory, /proc/self/status), and the step time. torch's budget runs under
``torch.compile`` with the aot_eager pipeline (min-cut partitioner, eager kernels) so that,
like ``lower(eager)`` here, only the save/recompute choice differs. ``torch.utils.checkpoint``
wraps every block (eager, non-reentrant). Prints a table and writes the Pareto curves as PNG.

    python bench/checkpointing.py [--out bench/out] [--models gpt,llama] [--steps 3]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from dscompile.passes import checkpointing as ckpt
from dscompile.zoo import build

BUDGETS = (1.0, 0.8, 0.6, 0.4, 0.2)
SIZES = {"d_model": 128, "n_heads": 4, "seq_len": 128, "vocab_size": 256, "n_layers": 4, "batch_size": 4}


def _rss(field: str = "VmRSS:") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _zero(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def measure(model: torch.nn.Module, batch: tuple, steps: int) -> dict[str, float]:
    """Step time (best of ``steps``: the machine is shared), memory held between forward and backward, and the step's peak."""
    times = []
    for _ in range(steps):
        _zero(model)
        start = time.perf_counter()
        model(*batch).backward()
        times.append(time.perf_counter() - start)
    _zero(model)
    gc.collect()
    before = _rss()
    has_peak = _reset_peak()
    loss = model(*batch)
    held = _rss() - before
    loss.backward()
    peak = _rss("VmHWM:") - before if has_peak else float("nan")
    _zero(model)
    return {"step_s": min(times), "held_after_forward": held, "peak_step": peak}


def backward_flops(model: torch.nn.Module, batch: tuple) -> int:
    loss = model(*batch)
    with FlopCounterMode(display=False) as counter:
        loss.backward()
    _zero(model)
    return counter.get_total_flops()


def torch_budget_backend(budget: float, sink: list[dict[str, Any]]) -> Callable[..., Any]:
    """aot_eager with a partition function that records what the min-cut partitioner saved."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def partition(joint, inputs, *, num_fwd_outputs, **kwargs):
        with torch._functorch.config.patch(activation_memory_budget=budget):
            fw, bw = min_cut_rematerialization_partition(joint, inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
        sink.append(ckpt.measure_partition(fw, bw, num_fwd_outputs))
        return fw, bw

    def nop(gm, _inputs):
        return gm.forward

    return aot_autograd(fw_compiler=nop, bw_compiler=nop, partition_fn=partition, keep_inference_input_mutations=True)


def checkpoint_blocks(model: torch.nn.Module) -> torch.nn.Module:
    from torch.utils.checkpoint import checkpoint

    for block in model.blocks:
        forward = block.forward
        block.forward = lambda *args, _f=forward: checkpoint(_f, *args, use_reentrant=False)
    return model


def run_model(name: str, steps: int) -> list[dict[str, Any]]:
    case = build(name, **SIZES)
    batch = case.batch()
    rows: list[dict[str, Any]] = []
    eager = copy.deepcopy(case.model)
    with FlopCounterMode(display=False) as counter:
        eager(*batch)
    fwd_flops = counter.get_total_flops()
    base_bw = backward_flops(eager, batch)
    rows.append({"model": name, "method": "eager", "setting": "-", "saved_bytes": None, "recompute_flops": 0,
                 "recompute_matmul_flops": 0, **measure(eager, batch, steps)})

    def add(method: str, setting: str, model: torch.nn.Module, report: dict[str, Any]) -> None:
        # compiled methods: from their partitioned backward graph; eager ones: FlopCounterMode over backward
        measured = report["recompute_matmul_flops"] if "recompute_matmul_flops" in report else backward_flops(model, batch) - base_bw
        rows.append({"model": name, "method": method, "setting": setting, "saved_bytes": report.get("saved_bytes"),
                     "recompute_flops": report.get("recompute_flops"), "recompute_matmul_flops": measured, **measure(model, batch, steps)})

    for setting in [*BUDGETS, "full"]:
        torch._dynamo.reset()
        ckpt.clear_reports()
        ac = {"policy": "full"} if setting == "full" else {"memory_budget": setting}
        model = copy.deepcopy(case.model)
        compiled = torch.compile(model, backend="dscompile", options={"lower": "eager", "activation_checkpointing": ac})
        compiled(*batch).backward()
        add("dscompile", str(setting), compiled, ckpt.checkpoint_reports()[-1])
    for budget in BUDGETS:
        torch._dynamo.reset()
        sink: list[dict[str, Any]] = []
        model = copy.deepcopy(case.model)
        compiled = torch.compile(model, backend=torch_budget_backend(budget, sink))
        compiled(*batch).backward()
        add("torch_budget", str(budget), compiled, sink[-1])
    torch._dynamo.reset()
    blocks = checkpoint_blocks(copy.deepcopy(case.model))
    add("utils.checkpoint", "per block", blocks, {})
    for row in rows:
        row["recompute_pct_of_forward"] = 100.0 * row["recompute_matmul_flops"] / fwd_flops
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (f"{'model':6} {'method':16} {'setting':9} {'saved MiB':>9} {'recomp %fwd':>11} {'model GFLOP':>11} "
              f"{'held MiB':>9} {'peak MiB':>9} {'step ms':>8}")
    print(header)
    print("-" * len(header))
    for r in rows:
        saved = "-" if r["saved_bytes"] is None else f"{r['saved_bytes'] / 2**20:9.2f}"
        model_flops = "-" if r["recompute_flops"] is None else f"{r['recompute_flops'] / 1e9:11.3f}"
        print(f"{r['model']:6} {r['method']:16} {r['setting']:9} {saved:>9} {r['recompute_pct_of_forward']:11.1f} {model_flops:>11} "
              f"{r['held_after_forward'] / 2**20:9.1f} {r['peak_step'] / 2**20:9.1f} {1000 * r['step_s']:8.1f}")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, name in zip(axes[0], models):
        for method, style in (("dscompile", "o-"), ("torch_budget", "s--"), ("utils.checkpoint", "*"), ("eager", "x")):
            pts = [r for r in rows if r["model"] == name and r["method"] == method]
            if not pts:
                continue
            ys = [(r["saved_bytes"] if r["saved_bytes"] is not None else r["held_after_forward"]) / 2**20 for r in pts]
            xs = [r["recompute_pct_of_forward"] for r in pts]
            ax.plot(xs, ys, style, label=method, markersize=9 if method == "utils.checkpoint" else 6)
            for x, y, r in zip(xs, ys, pts):
                if method != "eager":
                    ax.annotate(r["setting"].replace("per block", "ckpt"), (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_title(f"{name}: saved activations vs recompute")
        ax.set_xlabel("recompute FLOPs, measured by FlopCounterMode (% of forward)")
        ax.set_ylabel("saved for backward (MiB; utils.checkpoint/eager: held after forward)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/out", help="directory for checkpointing.png and checkpointing.json")
    parser.add_argument("--models", default="gpt,llama")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        # A fixed mmap threshold makes glibc return freed activations to the OS, so RSS tracks them.
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    rows = [row for name in args.models.split(",") for row in run_model(name, args.steps)]
    print_table(rows)
    (out / "checkpointing.json").write_text(json.dumps(rows, indent=2))
    plot(rows, out / "checkpointing.png")
    print(f"wrote {out / 'checkpointing.png'} and {out / 'checkpointing.json'}")


if __name__ == "__main__":
    main()
