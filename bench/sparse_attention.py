"""Block-sparse attention vs dense SDPA vs FlexAttention (same block mask): time and peak memory.

    python bench/sparse_attention.py [--seq 1024 2048 4096 8192 16384] [--heads 4] [--dim 64] [--block 64]

For the BigBird and Fixed layouts at each sequence length, three implementations run the
forward (under ``no_grad``) and a training step (forward + backward of q, k, v):

- ``ours``: ``dscompile::block_sparse_attention`` with the default kernel of this device;
- ``dense``: ``F.scaled_dot_product_attention`` without a mask (what the model computed before
  the pass; the layout does not change it, so it runs once per length);
- ``flex``: compiled FlexAttention with the equivalent ``BlockMask``. FlexAttention has no CPU
  backward, so on CPU its training step is the op with ``kernel='flex'`` (FlexAttention forward,
  block-sparse reference backward), which is what choosing that kernel costs a training step.

Every measurement runs in a fresh subprocess, so one configuration's allocations, caches and
compiles cannot hide another's. Memory, two ways:

- peak RSS growth: after a warm-up (FlexAttention's compile included), the kernel's peak-RSS
  mark is reset (``/proc/self/clear_refs``), one call runs, and VmHWM minus the RSS before it is
  reported: everything the call touched, library scratch space included;
- tensor peak: the highest running total of the allocator's allocations minus frees during
  one call, from the profiler's memory events (``max_memory_allocated`` on CUDA).

Each measurement uses ``--threads`` CPU threads (default 1: on a shared 2-core machine, two
OpenMP threads per process stall on each other's time slices and the many small ops of the
reference slow down 3-4x, which would measure the neighbours, not the kernels). Times are the
best of up to five calls after the warm-up; ``1st s`` is the first call in a fresh
process (for flex: its compile for this shape, from the on-disk Inductor cache when warm). The
last lines give each implementation's memory growth per doubling of the sequence (2x = linear).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

IMPLS = ("ours", "dense", "flex")
MODES = ("fwd", "train")


# ----------------------------------------------------------------------------- memory probes (child side)


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def rss_growth_mb(fn: Callable[[], object]) -> float | None:
    """Peak RSS during ``fn`` minus the RSS before it (None where the peak mark cannot be reset)."""
    _trim()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        return None
    base = _status_kb("VmRSS")
    fn()
    return (_status_kb("VmHWM") - base) / 1024


def tensor_peak_mb(fn: Callable[[], object], device: Any) -> float:
    """Highest running total of tensor allocations during ``fn``."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    current = peak = 0
    for event in sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: float(e["ts"])):
        current += int(event["args"]["Bytes"])
        peak = max(peak, current)
    return peak / 2**20


# ----------------------------------------------------------------------------- one configuration (child side)


def _layout(name: str, heads: int, block: int, seq: int) -> Any:
    from dscompile.sparsity import BigBirdSparsityConfig, FixedSparsityConfig

    if name == "bigbird":
        config = BigBirdSparsityConfig(heads, block, num_random_blocks=1, num_sliding_window_blocks=3, num_global_blocks=1)
    else:
        config = FixedSparsityConfig(heads, block, num_local_blocks=4, num_global_blocks=1)
    return config.make_layout(seq)


def _make_call(impl: str, mode: str, layout_name: str, seq: int, opts: dict, device: Any) -> Callable[[], object]:
    """A closure running one call of ``impl`` in ``mode`` on fresh inputs of length ``seq``."""
    import torch
    import torch.nn.functional as F

    from dscompile.kernels.sparse_attention_op import _compiled_flex, block_sparse_attention, flex_block_mask, resolve_kernel

    heads, dim, block = opts["heads"], opts["dim"], opts["block"]
    scale = dim**-0.5
    train = mode == "train"
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, seq, dim, generator=gen).to(device).requires_grad_(train) for _ in range(3))
    grad_out = torch.randn(1, heads, seq, dim, generator=gen).to(device)
    layout = _layout(layout_name, heads, block, seq).to(device)

    def op(kernel: str) -> Callable[[], Any]:
        return lambda: block_sparse_attention(q, k, v, layout, None, None, block, scale, False, 0.0, kernel)[0]

    if impl == "ours":
        forward = op(resolve_kernel("auto", device))
    elif impl == "dense":
        forward = lambda: F.scaled_dot_product_attention(q, k, v, scale=scale)
    elif train and device.type != "cuda":
        forward = op("flex")  # FlexAttention has no CPU backward: the op's flex kernel pairs it with the reference's
    else:
        mask = flex_block_mask(layout, block, seq, causal=False, kv_len=seq)
        flex = _compiled_flex()
        forward = lambda: flex(q, k, v, block_mask=mask, scale=scale)

    def call() -> object:
        if not train:
            with torch.no_grad():
                return forward()
        out = forward()
        return torch.autograd.grad(out, (q, k, v), grad_out)

    def synced() -> object:
        result = call()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return result

    return synced


def run_child(spec: dict) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    impl, mode, layout_name, seq = spec["impl"], spec["mode"], spec["layout"], spec["seq"]
    call = _make_call(impl, mode, layout_name, seq, spec, device)
    start = time.perf_counter()
    if impl == "flex":
        call()  # the first call compiles FlexAttention for this shape: warm up at the real shape
    else:
        _make_call(impl, mode, layout_name, 4 * spec["block"], spec, device)()  # load libraries, start thread pools
    result: dict[str, Any] = {"first_s": time.perf_counter() - start}
    t0 = time.perf_counter()
    result["rss_mb"] = rss_growth_mb(call)
    times = [time.perf_counter() - t0]
    if impl != "flex":
        result["first_s"] = times[0]  # nothing to compile: the first call at this shape is the measured one
    if times[0] < spec["slow_s"]:
        result["tensor_mb"] = tensor_peak_mb(call, device)
        while len(times) < 5 and sum(times) < spec["slow_s"]:
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
    elif device.type == "cuda":
        result["tensor_mb"] = tensor_peak_mb(call, device)
    result["ms"] = min(times) * 1e3
    result["density"] = float(_layout(layout_name, spec["heads"], spec["block"], seq).float().mean())
    return result


# ----------------------------------------------------------------------------- driver (parent side)


def measure(spec: dict, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout {timeout:.0f}s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        reason = "killed (out of memory?)" if done.returncode < 0 else (done.stderr.strip().splitlines() or ["failed"])[-1]
        return {"error": reason[:80]}
    return json.loads(lines[-1])


def _cell(result: dict | None, key: str, fmt: str = "8.1f") -> str:
    if result is None or result.get(key) is None:
        return f"{'-':>8}" if result is None or "error" not in result else f"{'err':>8}"
    return format(result[key], fmt)


def _ratio(a: dict | None, b: dict | None, key: str) -> str:
    if not a or not b or a.get(key) is None or not b.get(key):
        return "-"
    return f"{a[key] / b[key]:.2f}x"


def _growth(results: dict, impl: str, layout: str, mode: str, seqs: list[int], key: str) -> str:
    values = [(s, results.get((impl, layout, mode, s), {}).get(key)) for s in seqs]
    values = [(s, v) for s, v in values if v]
    if len(values) < 2:
        return "-"
    (s0, v0), (s1, v1) = values[0], values[-1]
    doublings = (s1 // s0).bit_length() - 1
    return f"x{(v1 / v0) ** (1 / doublings):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--layouts", nargs="+", default=["bigbird", "fixed"], choices=["bigbird", "fixed"])
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--dense-train-max", type=int, default=8192, help="longest sequence for dense SDPA's training step")
    parser.add_argument("--slow-s", type=float, default=4.0, help="one call longer than this is timed once, without the profiler")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per configuration")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per measurement (1: stable on a shared machine)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_child(json.loads(args.child))), flush=True)
        return

    import torch

    from dscompile.kernels.sparse_attention_op import resolve_kernel

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    base = {"device": str(device), "heads": args.heads, "dim": args.dim, "block": args.block, "slow_s": args.slow_s, "threads": args.threads}
    print(f"device {device} ({args.threads} of {os.cpu_count()} CPU threads), ours = kernel '{resolve_kernel('auto', device)}', "
          f"heads {args.heads}, head dim {args.dim}, block {args.block}, batch 1, fp32; fwd = no_grad forward, "
          f"train = forward + backward of q, k, v")  # fmt: skip
    if device.type == "cpu":
        print("flex train on CPU = op kernel='flex' (FlexAttention forward + reference backward; no CPU flex backward)")
    header = (f"{'layout':8} {'seq':>6} {'dens':>5} {'mode':5} | {'time ms: ours':>13} {'dense':>8} {'flex':>8} | "
              f"{'RSS MB: ours':>12} {'dense':>8} {'flex':>8} | {'tensor MB: ours':>15} {'dense':>8} {'flex':>8} | "
              f"{'dense/ours t':>12} {'flex/ours t':>11} {'dense/ours RSS':>14} {'flex 1st s':>10}")  # fmt: skip
    print(header)
    print("-" * len(header), flush=True)
    results: dict[tuple, dict] = {}
    for layout in args.layouts:
        for seq in args.seq:
            for mode in args.modes:
                row: dict[str, dict | None] = {}
                for impl in args.impls:
                    key = (impl, "-" if impl == "dense" else layout, mode, seq)
                    if impl == "dense" and mode == "train" and seq > args.dense_train_max:
                        row[impl] = None
                        continue
                    if key not in results:
                        spec = dict(base, impl=impl, mode=mode, layout=layout, seq=seq)
                        results[key] = measure(spec, args.timeout)
                    row[impl] = results[key]
                ours, dense, flex = row.get("ours"), row.get("dense"), row.get("flex")
                density = next((r["density"] for r in row.values() if r and "density" in r), float("nan"))
                print(f"{layout:8} {seq:6d} {density:5.3f} {mode:5} | {_cell(ours, 'ms'):>13} {_cell(dense, 'ms')} {_cell(flex, 'ms')} | "
                      f"{_cell(ours, 'rss_mb'):>12} {_cell(dense, 'rss_mb')} {_cell(flex, 'rss_mb')} | "
                      f"{_cell(ours, 'tensor_mb'):>15} {_cell(dense, 'tensor_mb')} {_cell(flex, 'tensor_mb')} | "
                      f"{_ratio(dense, ours, 'ms'):>12} {_ratio(flex, ours, 'ms'):>11} {_ratio(dense, ours, 'rss_mb'):>14} "
                      f"{_cell(flex, 'first_s', '10.1f')}", flush=True)  # fmt: skip
                for impl, result in row.items():
                    if result and "error" in result:
                        print(f"    {impl}: {result['error']}")
    print("\nmemory growth per doubling of the sequence (first to last length measured; linear = x2, quadratic = x4):")
    for layout in args.layouts:
        for mode in args.modes:
            parts = []
            for impl in args.impls:
                lay = "-" if impl == "dense" else layout
                rss = _growth(results, impl, lay, mode, args.seq, "rss_mb")
                tensor = _growth(results, impl, lay, mode, args.seq, "tensor_mb")
                parts.append(f"{impl} RSS {rss} tensor {tensor}")
            print(f"  {layout:8} {mode:5}: " + "; ".join(parts))


if __name__ == "__main__":
    main()
