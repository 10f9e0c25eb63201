"""Activation checkpointing: dscompile's budgets against torch's activation_memory_budget and torch.utils.checkpoint.

For the GPT- and Llama-style zoo models, at budgets 1.0, 0.8, 0.6, 0.4, 0.2 and ``full``:
saved bytes, recompute cost, memory and step time of

- ``dscompile b``: ``memory_budget=b``, i.e. saved activations <= b x the bytes a compile saves
  *without activation checkpointing* (AOTAutograd's default min-cut, which already recomputes
  some cheap pointwise ops; measured by the pass on a copy of the graph); ``full``: inside each
  block only block inputs;
- ``torch b``: ``torch._functorch.config.activation_memory_budget=b`` under ``torch.compile``
  (aot_eager: min-cut partitioner, eager kernels, so that, like ``lower(eager)`` here, only the
  save/recompute choice differs). The same scale (1 = its default cut), so ``b`` asks both for
  the same bytes; torch's knapsack estimates sizes before its cut and may keep a little more;
- ``ds@torch b``: dscompile with ``memory_budget`` = what ``torch b`` really saved, as a
  fraction of the no-checkpointing bytes: the like-for-like row (equal or lower saved bytes);
- ``utils.checkpoint``: ``torch.utils.checkpoint`` (non-reentrant) around every block, eager.

Every row uses the same yardsticks. ``saved %``: bytes the forward hands to backward (compiled:
the partitioned forward's extra outputs, once per storage, graph inputs excluded; eager rows:
tensors packed for backward, counted by storage through saved-tensor hooks, plus block inputs
for utils.checkpoint) over the no-checkpointing bytes (eager keeps more than 100%: it recomputes
nothing). ``mm %``: recomputed matmul-class FLOPs (mm/addmm/bmm/attention) over the
forward's (compiled: cost model on the partitioned backward; utils.checkpoint: its extra
backward FLOPs over eager under FlopCounterMode, CPU attention included). ``time %``: roofline
recompute time (``passes/checkpointing.recompute_seconds``) over the forward's; for
utils.checkpoint, the roofline time of every forward op inside a block (what it replays).
Then the memory held between forward and backward and the peak of a step (resident memory,
/proc/self/status) and the best step time. Prints the table and a verdict per target, writes
JSON and the Pareto curves as PNG.

Measured on the shared 2-core machine (default sizes; the byte and roofline columns are
deterministic, step times there were too noisy to quote): gpt at memory_budget 0.8/0.6/0.4/0.2
saves 79/59/40/19% of the no-checkpointing bytes for 4/11/28/47% recompute time, torch's budget
77/56/41/21% for 5/29/46/64%; llama 79/60/40/19% for 8/16/31/54%, torch 74/62/43/21% for
13/40/55/77%. Every like-for-like row is ok (equal or lower bytes, less recompute).

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
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from dscompile.passes import checkpointing as ckpt
from dscompile.zoo import build

BUDGETS = (1.0, 0.8, 0.6, 0.4, 0.2)
SIZES = {"d_model": 128, "n_heads": 4, "seq_len": 128, "vocab_size": 256, "n_layers": 4, "batch_size": 4}
aten = torch.ops.aten
# FlopCounterMode has no formula for the CPU flash-attention kernels; give it torch's own SDPA counts.
CPU_ATTENTION_FLOPS = {
    aten._scaled_dot_product_flash_attention_for_cpu: lambda q, k, v, *_a, out_shape=None, **_k: flop_counter.sdpa_flop_count(q, k, v),
    aten._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda g, q, k, v, *_a, out_shape=None, **_k: flop_counter.sdpa_backward_flop_count(g, q, k, v),
}


def _counter() -> FlopCounterMode:
    return FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS)


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
    with _counter() as counter:
        loss.backward()
    _zero(model)
    return counter.get_total_flops()


def eager_saved_bytes(model: torch.nn.Module, batch: tuple) -> int:
    """Bytes an eager forward keeps for backward: packed tensors that are not parameters (one count
    per storage), plus, for checkpointed blocks, the block inputs the checkpoint holds and the CPU
    generator state it stashes per block (``preserve_rng_state``), as the compiled rows count theirs."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def keep(t: Any) -> None:
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    def pack(t: torch.Tensor) -> torch.Tensor:
        keep(t)
        return t

    def keep_inputs(_module: torch.nn.Module, args: tuple) -> None:
        for arg in args:
            keep(arg)

    blocks = model.blocks if getattr(model, "_checkpointed", False) else []
    hooks = [block.register_forward_pre_hook(keep_inputs) for block in blocks]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(*batch)
    for hook in hooks:
        hook.remove()
    loss.backward()
    _zero(model)
    return sum(storages.values()) + len(blocks) * torch.get_rng_state().nbytes


class Capture:
    """aot_eager with a partition function that applies torch's budget, records what the min-cut
    partitioner saved, and keeps the joint graph's block costs (what utils.checkpoint replays)."""

    def __init__(self, budget: float) -> None:
        self.budget = budget
        self.report: dict[str, Any] = {}
        self.block_seconds = 0.0
        self.block_matmul_flops = 0

    def backend(self) -> Callable[..., Any]:
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        def partition(joint, inputs, *, num_fwd_outputs, **kwargs):
            info = ckpt.analyse_joint(joint, num_fwd_outputs)
            in_blocks = [n for n in info.forward if ckpt.block_of(n) is not None]
            self.block_seconds = sum(info.seconds[n] for n in in_blocks)
            self.block_matmul_flops = sum(info.flops[n] for n in in_blocks if ckpt.is_matmul_class(n))
            with torch._functorch.config.patch(activation_memory_budget=self.budget):
                fw, bw = min_cut_rematerialization_partition(joint, inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
            self.report = ckpt.measure_partition(fw, bw, num_fwd_outputs)
            return fw, bw

        def nop(gm, _inputs):
            return gm.forward

        return aot_autograd(fw_compiler=nop, bw_compiler=nop, partition_fn=partition, keep_inference_input_mutations=True)


def checkpoint_blocks(model: torch.nn.Module) -> torch.nn.Module:
    from torch.utils.checkpoint import checkpoint

    for block in model.blocks:
        forward = block.forward
        block.forward = lambda *args, _f=forward: checkpoint(_f, *args, use_reentrant=False)
    model._checkpointed = True
    return model


def run_model(name: str, steps: int) -> list[dict[str, Any]]:
    case = build(name, **SIZES)
    batch = case.batch()
    rows: list[dict[str, Any]] = []
    eager = copy.deepcopy(case.model)
    with _counter() as counter:
        eager(*batch)
    fwd_matmul = counter.get_total_flops()
    base_bw = backward_flops(eager, batch)
    eager_saved = eager_saved_bytes(eager, batch)
    ref: dict[str, Any] = {}  # the no-checkpointing bytes and forward totals, from dscompile's first (budget) report

    def add(method: str, setting: str, model: torch.nn.Module, report: dict[str, Any], **extra: Any) -> dict[str, Any]:
        row = {"model": name, "method": method, "setting": setting, **extra, **measure(model, batch, steps)}
        row.update({k: report[k] for k in ("saved_bytes", "recompute_flops", "recompute_matmul_flops", "recompute_seconds",
                                           "baseline_saved_bytes", "memory_budget") if k in report})
        rows.append(row)
        return row

    def dscompile(setting: str, ac: dict[str, Any]) -> dict[str, Any]:
        torch._dynamo.reset()
        ckpt.clear_reports()
        model = copy.deepcopy(case.model)
        compiled = torch.compile(model, backend="dscompile", options={"lower": "eager", "activation_checkpointing": ac})
        compiled(*batch).backward()
        report = ckpt.checkpoint_reports()[-1]
        if not ref:
            ref.update(baseline=report["no_checkpointing_saved_bytes"], fwd_mm=report["forward_matmul_flops"], fwd_s=report["forward_seconds"])
        return add("dscompile", setting, compiled, report)

    for setting in [*BUDGETS, "full"]:
        dscompile(str(setting), {"policy": "full"} if setting == "full" else {"memory_budget": setting})
    block_cost: dict[str, float] = {}
    for budget in BUDGETS:
        torch._dynamo.reset()
        capture = Capture(budget)
        compiled = torch.compile(copy.deepcopy(case.model), backend=capture.backend())
        compiled(*batch).backward()
        add("torch", str(budget), compiled, capture.report)
        block_cost = {"seconds": capture.block_seconds, "matmul": capture.block_matmul_flops}
        matched = min(1.0, capture.report["saved_bytes"] / ref["baseline"])
        dscompile(f"{budget}", {"memory_budget": matched})["method"] = "ds@torch"
    torch._dynamo.reset()
    add("eager", "-", eager, {"saved_bytes": eager_saved, "recompute_flops": 0, "recompute_matmul_flops": 0, "recompute_seconds": 0.0})
    blocks = checkpoint_blocks(copy.deepcopy(case.model))
    add("utils.checkpoint", "per block", blocks, {"saved_bytes": eager_saved_bytes(blocks, batch),
                                                  "recompute_matmul_flops": backward_flops(blocks, batch) - base_bw,
                                                  "recompute_seconds": block_cost["seconds"]},
        graph_block_matmul_flops=block_cost["matmul"])
    for row in rows:
        row["saved_pct"] = 100.0 * row["saved_bytes"] / ref["baseline"]
        row["mm_pct"] = 100.0 * row["recompute_matmul_flops"] / ref["fwd_mm"]
        row["time_pct"] = 100.0 * row["recompute_seconds"] / ref["fwd_s"]
    rows[0]["reference"] = {"no_checkpointing_saved_bytes": ref["baseline"], "forward_matmul_flops_cost_model": ref["fwd_mm"],
                            "forward_matmul_flops_flopcounter": fwd_matmul, "forward_seconds_roofline": ref["fwd_s"]}
    return rows


LEGEND = """\
dscompile b   memory_budget=b: saved <= b x the bytes saved without checkpointing (default min cut); full: block inputs only
torch b       activation_memory_budget=b: the same scale (1 = torch's default min cut), a knapsack below it
ds@torch b    dscompile at memory_budget = (bytes torch b saved) / (no-checkpointing bytes): the like-for-like row
saved %       bytes forward hands to backward / no-checkpointing bytes  mm %   recomputed matmul FLOPs / forward's
time %        roofline recompute time / forward's (recompute_seconds)  held/peak: RSS after forward / during step"""


def print_table(rows: list[dict[str, Any]]) -> None:
    print(LEGEND)
    for name in dict.fromkeys(r["model"] for r in rows):
        ref = next(r["reference"] for r in rows if r["model"] == name and "reference" in r)
        print(f"\n{name}: no-checkpointing saved {ref['no_checkpointing_saved_bytes'] / 2**20:.2f} MiB, forward matmul "
              f"{ref['forward_matmul_flops_cost_model'] / 1e9:.3f} GFLOP (FlopCounterMode {ref['forward_matmul_flops_flopcounter'] / 1e9:.3f}), "
              f"forward roofline {1e3 * ref['forward_seconds_roofline']:.2f} ms")
        header = (f"{'method':16} {'setting':9} {'budget':>6} {'saved MiB':>9} {'saved %':>7} {'mm %':>6} {'time %':>6} "
                  f"{'held MiB':>8} {'peak MiB':>8} {'step ms':>7}")
        print(header)
        print("-" * len(header))
        order = {"eager": 0, "dscompile": 1, "torch": 2, "ds@torch": 2, "utils.checkpoint": 3}
        for r in sorted((r for r in rows if r["model"] == name), key=lambda r: (order[r["method"]], r["method"] == "ds@torch" and 0,
                                                                                   -_num(r["setting"]))):
            budget = f"{r['memory_budget']:.3f}" if r.get("memory_budget") is not None else "-"
            print(f"{r['method']:16} {r['setting']:9} {budget:>6} {r['saved_bytes'] / 2**20:9.2f} {r['saved_pct']:7.1f} "
                  f"{r['mm_pct']:6.1f} {r['time_pct']:6.1f} {r['held_after_forward'] / 2**20:8.1f} {r['peak_step'] / 2**20:8.1f} "
                  f"{1000 * r['step_s']:7.1f}")


def _num(setting: str) -> float:
    try:
        return float(setting)
    except ValueError:
        return -1.0


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """The issue's targets: at every torch budget, dscompile at equal or lower saved bytes recomputes
    no more (matmul FLOPs and roofline time); full is no worse than utils.checkpoint."""
    lines = []
    for name in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == name]
        for budget in BUDGETS:
            t = next(r for r in mine if r["method"] == "torch" and r["setting"] == str(budget))
            d = next(r for r in mine if r["method"] == "ds@torch" and r["setting"] == str(budget))
            ok = d["saved_bytes"] <= t["saved_bytes"] and d["recompute_matmul_flops"] <= t["recompute_matmul_flops"] \
                and d["recompute_seconds"] <= t["recompute_seconds"] * (1 + 1e-9)
            lines.append(f"{name} torch {budget}: saved {d['saved_pct']:.1f}% vs {t['saved_pct']:.1f}%, mm {d['mm_pct']:.1f}% vs "
                         f"{t['mm_pct']:.1f}%, time {d['time_pct']:.1f}% vs {t['time_pct']:.1f}%  {'ok' if ok else 'WORSE'}")
        f = next(r for r in mine if r["method"] == "dscompile" and r["setting"] == "full")
        c = next(r for r in mine if r["method"] == "utils.checkpoint")
        ok = f["saved_bytes"] <= c["saved_bytes"] and f["recompute_matmul_flops"] <= c["recompute_matmul_flops"] \
            and f["recompute_seconds"] <= c["recompute_seconds"]
        lines.append(f"{name} full vs utils.checkpoint: saved {f['saved_pct']:.1f}% vs {c['saved_pct']:.1f}%, mm {f['mm_pct']:.1f}% vs "
                     f"{c['mm_pct']:.1f}%, time {f['time_pct']:.1f}% vs {c['time_pct']:.1f}%  {'ok' if ok else 'WORSE'}")
    return lines


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    styles = (("dscompile", "o-"), ("ds@torch", "^:"), ("torch", "s--"), ("utils.checkpoint", "*"), ("eager", "x"))
    for ax, name in zip(axes[0], models):
        for method, style in styles:
            pts = sorted((r for r in rows if r["model"] == name and r["method"] == method), key=lambda r: r["time_pct"])
            if not pts:
                continue
            xs, ys = [r["time_pct"] for r in pts], [r["saved_pct"] for r in pts]
            ax.plot(xs, ys, style, label=method, markersize=9 if method == "utils.checkpoint" else 6)
            for x, y, r in zip(xs, ys, pts):
                if method in ("dscompile", "torch"):
                    ax.annotate(r["setting"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_title(f"{name}: saved activations vs recompute time")
        ax.set_xlabel("roofline recompute time (% of forward)")
        ax.set_ylabel("saved for backward (% of no-checkpointing bytes)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    global SIZES
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/out", help="directory for checkpointing.png and checkpointing.json")
    parser.add_argument("--models", default="gpt,llama")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="zoo default sizes (a quick smoke run)")
    args = parser.parse_args()
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        # A fixed mmap threshold makes glibc return freed activations to the OS, so RSS tracks them.
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    if args.tiny:
        SIZES = {"n_layers": 2}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    rows = [row for name in args.models.split(",") for row in run_model(name, args.steps)]
    print_table(rows)
    lines = verdicts(rows)
    print("\ntargets (dscompile vs torch at equal or lower saved bytes; full vs utils.checkpoint):")
    print("\n".join(lines))
    (out / "checkpointing.json").write_text(json.dumps({"rows": rows, "verdicts": lines}, indent=2, default=str))
    plot(rows, out / "checkpointing.png")
    print(f"wrote {out / 'checkpointing.png'} and {out / 'checkpointing.json'}")


if __name__ == "__main__":
    main()
