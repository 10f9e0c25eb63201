"""Block-sparse attention vs dense SDPA vs FlexAttention (same block mask), forward, on this machine.

    python bench/sparse_attention.py [--seq 1024 2048 4096] [--heads 4] [--dim 64] [--block 64]

For each layout (BigBird, Fixed) and sequence length: median time of dscompile's op (the
``reference`` kernel on CPU, ``triton`` on CUDA), of dense ``F.scaled_dot_product_attention``,
and of compiled FlexAttention with the equivalent BlockMask; and the peak tensor memory of
each (the running sum of allocations seen by the profiler on CPU, ``max_memory_allocated`` on
CUDA). Prints a table with ratios against dense. Flex's first compile takes tens of seconds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from dscompile.kernels.sparse_attention_op import block_sparse_attention, flex_block_mask, resolve_kernel

from dscompile.sparsity import BigBirdSparsityConfig, FixedSparsityConfig


def peak_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Peak bytes of tensors alive while ``fn`` runs (beyond those alive before)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # each op's own allocations at its start, frees as "[memory]" events, in time order
    current = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        current += event.self_cpu_memory_usage
        peak = max(peak, current)
    return peak


def median_time(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compile is slow)")
    parser.add_argument("--dense-max", type=int, default=8192, help="longest sequence to run dense SDPA at")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kernel = resolve_kernel("auto", device)
    layouts = {
        "bigbird": lambda h: BigBirdSparsityConfig(h, args.block, num_random_blocks=1, num_sliding_window_blocks=3, num_global_blocks=1),
        "fixed": lambda h: FixedSparsityConfig(h, args.block, num_local_blocks=4, num_global_blocks=1),
    }
    print(f"device {device}, kernel {kernel}, heads {args.heads}, head dim {args.dim}, block {args.block}, batch 1, fp32, forward")
    header = f"{'layout':8} {'seq':>6} {'density':>7} | {'ours ms':>8} {'dense ms':>8} {'flex ms':>8} | " \
             f"{'ours MB':>8} {'dense MB':>8} {'flex MB':>8} | {'dense/ours t':>12} {'flex/ours t':>11} {'dense/ours mem':>14}"  # fmt: skip
    print(header)
    print("-" * len(header))
    for name, make in layouts.items():
        for seq in args.seq:
            layout = make(args.heads).make_layout(seq)
            q, k, v = (torch.randn(1, args.heads, seq, args.dim, device=device) for _ in range(3))
            ours = lambda: block_sparse_attention(q, k, v, layout, None, None, args.block, args.dim**-0.5, False, 0.0, kernel)
            row = {"ours": (median_time(ours, device, args.repeats), peak_bytes(ours, device))}
            if seq <= args.dense_max:
                dense = lambda: F.scaled_dot_product_attention(q, k, v)
                row["dense"] = (median_time(dense, device, args.repeats), peak_bytes(dense, device))
            if not args.no_flex:
                from dscompile.kernels.sparse_attention_op import _compiled_flex

                mask = flex_block_mask(layout.to(device), args.block, seq, causal=False, kv_len=seq)
                flex = _compiled_flex()
                run_flex = lambda: flex(q, k, v, block_mask=mask, scale=args.dim**-0.5)
                row["flex"] = (median_time(run_flex, device, args.repeats), peak_bytes(run_flex, device))
            t = {key: value[0] * 1e3 for key, value in row.items()}
            m = {key: value[1] / 2**20 for key, value in row.items()}
            fmt = lambda d, key: f"{d[key]:8.1f}" if key in d else f"{'-':>8}"
            ratio = lambda a, b, d: f"{d[a] / d[b]:.2f}x" if a in d and b in d and d[b] > 0 else "-"
            print(f"{name:8} {seq:6d} {layout.float().mean().item():7.3f} | {fmt(t, 'ours')} {fmt(t, 'dense')} {fmt(t, 'flex')} | "
                  f"{fmt(m, 'ours')} {fmt(m, 'dense')} {fmt(m, 'flex')} | {ratio('dense', 'ours', t):>12} "
                  f"{ratio('flex', 'ours', t):>11} {ratio('dense', 'ours', m):>14}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
