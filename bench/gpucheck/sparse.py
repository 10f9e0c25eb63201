"""Goal 2: block-sparse attention (BigBird, fwd+bwd) against dense SDPA and FlexAttention, and how far it scales.

- Side by side at each length (4k/8k/16k): dense / ours (target >= 6 at 16k) and FlexAttention with the same
  block mask / ours (target >= 1 at every length), peers alternated.
- Where a call's time goes (ours): kernels per call, their GPU time, the host's enqueue time, and the call
  replayed from a CUDA graph. Host time close to the wall time, or a replay much faster than the call, says
  the fixed per-call cost is on the host.
- Time against the number of nonzero blocks at the longest length (BigBird with growing windows): the slope
  (ms per 1000 nonzero blocks), the intercept (the fixed cost) and r² of a straight line.
- The longest sequence one attention layer trains (fwd+bwd, batch 1) with ours, with dense SDPA on the math
  backend (DeepSpeed's baseline: no memory-efficient kernel) and with flash / memory-efficient SDPA beside
  it: doubling, then bisection, each probe once, out-of-memory caught; target ours / math >= 10.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from dscompile.kernels import layout_cache
from gpucheck.common import Ctx, alternate, fit_line, free_memory, is_oom, per_round, timed_once

SECTION = "sparse attn"


def bigbird_layout(ctx: Ctx, seq: int, window: int = 3, global_blocks: int = 1) -> torch.Tensor:
    """The layout the sparse_attention pass would hand the op (DeepSpeed's BigBird, int64, on the device)."""
    from dscompile.sparsity import BigBirdSparsityConfig

    a = ctx.sizes.attention
    config = BigBirdSparsityConfig(a["heads"], a["block"], num_random_blocks=1, num_sliding_window_blocks=window, num_global_blocks=global_blocks)
    return config.make_layout(seq).to(ctx.device)


def _inputs(ctx: Ctx, seq: int) -> tuple[torch.Tensor, ...]:
    a = ctx.sizes.attention
    gen = torch.Generator(device=ctx.device).manual_seed(seq)
    shape = (1, a["heads"], seq, a["head_dim"])
    q, k, v = (torch.randn(shape, generator=gen, device=ctx.device, dtype=ctx.dtype).requires_grad_() for _ in range(3))
    return q, k, v, torch.randn(shape, generator=gen, device=ctx.device, dtype=ctx.dtype)


def _train(forward: Callable[[], torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor) -> Callable[[], Any]:
    return lambda: torch.autograd.grad(forward(), (q, k, v), grad)


def ours(ctx: Ctx, layout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: str = "auto") -> Callable[[], torch.Tensor]:
    """The op as the pass calls it, with the device's default kernel (``auto``: Triton on CUDA, the reference on a CPU)."""
    from dscompile.kernels.sparse_attention_op import block_sparse_attention

    a = ctx.sizes.attention
    scale = a["head_dim"] ** -0.5
    return lambda: block_sparse_attention(q, k, v, layout, None, None, a["block"], scale, False, 0.0, kernel)[0]


def _impls(ctx: Ctx, seq: int) -> tuple[dict[str, Callable[[], Any]], torch.Tensor]:
    from dscompile.kernels.sparse_attention_op import _compiled_flex, flex_block_mask

    q, k, v, grad = _inputs(ctx, seq)
    layout = bigbird_layout(ctx, seq)
    scale = ctx.sizes.attention["head_dim"] ** -0.5
    impls = {"ours": _train(ours(ctx, layout, q, k, v), q, k, v, grad),
             "dense SDPA": _train(lambda: F.scaled_dot_product_attention(q, k, v, scale=scale), q, k, v, grad)}
    if ctx.cuda:
        mask = flex_block_mask(layout, ctx.sizes.attention["block"], seq, causal=False, kv_len=seq)
        flex = _compiled_flex()
        impls["FlexAttention"] = _train(lambda: flex(q, k, v, block_mask=mask, scale=scale), q, k, v, grad)
    else:  # FlexAttention has no CPU backward: the op's flex kernel (flex forward, block-sparse reference backward)
        impls["FlexAttention"] = _train(ours(ctx, layout, q, k, v, "flex"), q, k, v, grad)
    return impls, layout


def _where_time_goes(ctx: Ctx, seq: int, call: Callable[[], Any]) -> None:
    """Kernels per call, GPU busy time, host enqueue time, and a CUDA-graph replay of the call (CUDA); on a CPU the
    launcher's ATen launches and host syncs (``dscompile.testing.host_work``)."""
    if not ctx.cuda:
        from dscompile.testing.host_work import count_host_work

        work = count_host_work(call)
        launches = sum(work.launches.values())
        ctx.table.add(SECTION, f"{seq}: ours per call", f"{launches} ATen launches", f"{work.syncs} host syncs (CPU: Triton launches not counted)")
        return
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    calls = 5
    ctx.sync()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    host = (time.perf_counter() - start) * 1000 / calls
    ctx.sync()
    wall = (time.perf_counter() - start) * 1000 / calls
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        ctx.sync()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    if kernels:
        gpu = sum(e.time_range.elapsed_us() for e in kernels) / 1000 / calls
        count, names = f"{len(kernels) / calls:.0f} kernels", sorted({e.name.split("(")[0][:40] for e in kernels})
    else:  # this profiler build lists no device events: the per-op device totals still hold the GPU time
        gpu = sum(e.self_device_time_total for e in prof.key_averages()) / 1000 / calls
        count, names = "? kernels", []
    ctx.table.add(SECTION, f"{seq}: ours per call", count,
                  f"GPU busy {gpu:.3f} ms, host enqueue {host:.3f} ms, wall {wall:.3f} ms; kernels: {', '.join(names)}")
    ctx.table.add(SECTION, f"{seq}: ours in a CUDA graph", *_graph_replay(ctx, call, wall))


def _graph_replay(ctx: Ctx, call: Callable[[], Any], wall: float) -> tuple[str, str]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            call()
    except Exception as exc:  # a host sync or a CPU tensor inside the call
        return "capture failed", f"{type(exc).__name__}: {str(exc)[:100]}"
    from gpucheck.common import steady_ms

    replay = steady_ms(graph.replay, ctx, 20)
    return f"{replay:.3f} ms", f"replay / eager call {replay / wall:.2f}x (much below 1: the per-call cost is host work)"


def _sides(ctx: Ctx) -> None:
    from dscompile.kernels.sparse_attention_op import resolve_kernel

    ctx.table.add(SECTION, "our kernel", resolve_kernel("auto", ctx.device), "the op's default on this device")
    seqs = ctx.sizes.seqs
    for seq in seqs:
        if ctx.left() < 0:
            ctx.table.add(SECTION, f"{seq}", "skipped", "section time spent")
            continue
        impls, layout = _impls(ctx, seq)
        density = float(layout.float().mean())
        for name, fn in list(impls.items()):
            try:
                _, first = timed_once(fn, ctx)
            except Exception as exc:
                if not is_oom(exc):
                    raise
                ctx.table.add(SECTION, f"{seq}: {name}", "out of memory")
                impls.pop(name)
                continue
            if first > 1.0:
                ctx.table.add(SECTION, f"{seq}: {name} first call", f"{first:.1f} s", "compiles")
        times = alternate(impls, ctx)
        for name, ms in times.items():
            note = "fwd+bwd" + (f"; layout density {density:.3f}" if name == "ours" else "")
            ctx.table.add(SECTION, f"{seq}: {name}", f"{sorted(ms)[len(ms) // 2]:.3f} ms", note)
        if "ours" in times:
            for other in ("dense SDPA", "FlexAttention"):
                if other in times:
                    target = ">= 6.0" if other == "dense SDPA" and seq == seqs[-1] else (">= 1.0" if other == "FlexAttention" else "")
                    ctx.table.ratio(SECTION, f"{seq}: {other} / ours", per_round(times[other], times["ours"]), target, "higher: ours faster")
            _where_time_goes(ctx, seq, impls["ours"])
        del impls, layout
        free_memory(ctx)


def _density(ctx: Ctx) -> None:
    """Time against nonzero blocks at the longest length: BigBird with windows of growing width."""
    seq = ctx.sizes.seqs[-1]
    nb = seq // ctx.sizes.attention["block"]
    q, k, v, grad = _inputs(ctx, seq)
    peers, nnz = {}, {}
    for window in [w for w in ctx.sizes.density_windows if w <= nb]:
        layout = bigbird_layout(ctx, seq, window)
        name = f"window {window}"
        nnz[name] = int(layout.count_nonzero())
        peers[name] = _train(ours(ctx, layout, q, k, v), q, k, v, grad)
        peers[name]()  # builds the layout's tables
    if len(peers) < 2:
        ctx.table.add(SECTION, f"{seq}: time vs nonzero blocks", "n/a", "fewer than two layouts")
        return
    times = alternate(peers, ctx)
    xs = [nnz[n] for n in peers]
    ys = [sorted(times[n])[len(times[n]) // 2] for n in peers]
    for name, x, y in zip(peers, xs, ys):
        ctx.table.add(SECTION, f"{seq}: ours, {name}", f"{y:.3f} ms", f"{x} nonzero blocks (all heads)")
    slope, intercept, r2 = fit_line(xs, ys)
    ctx.table.add(SECTION, f"{seq}: linear fit of time on nonzero blocks", f"r² {r2:.3f}",
                  f"{slope * 1000:.4f} ms per 1000 blocks; intercept (fixed cost) {intercept:.3f} ms; {intercept / ys[0]:.0%} of the sparsest")
    # BigBird's global row and column: one program walks all nb key blocks (forward, dq) or query blocks (dk/dv) in
    # sequence, a critical path linear in the length whatever the density. The same layout without them, side by side:
    local = bigbird_layout(ctx, seq, 3, global_blocks=0)
    pair = {"with global": peers["window 3"], "without global": _train(ours(ctx, local, q, k, v), q, k, v, grad)} if "window 3" in peers else {}
    if pair:
        pair["without global"]()
        times = alternate(pair, ctx)
        ctx.table.ratio(SECTION, f"{seq}: window 3, with / without the global block", per_round(times["with global"], times["without global"]),
                        note=f"nonzero blocks {nnz['window 3']} with, {int(local.count_nonzero())} without: a ratio far above theirs is the serial walk")


def _probe(ctx: Ctx, impl: str, seq: int) -> tuple[bool, float, str]:
    """One fwd+bwd of one attention layer at ``seq`` tokens: (ran, seconds, why not)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    free_memory(ctx)
    start = time.perf_counter()
    try:
        q, k, v, grad = _inputs(ctx, seq)
        scale = ctx.sizes.attention["head_dim"] ** -0.5
        if impl == "ours":
            fn = _train(ours(ctx, bigbird_layout(ctx, seq), q, k, v), q, k, v, grad)
            fn()
        else:
            backends = [SDPBackend.MATH] if impl == "dense math" else [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
            with sdpa_kernel(backends):
                torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, scale=scale), (q, k, v), grad)
        ctx.sync()
        return True, time.perf_counter() - start, ""
    except Exception as exc:
        if not is_oom(exc):
            return False, time.perf_counter() - start, f"{type(exc).__name__}: {str(exc)[:80]}"
        return False, time.perf_counter() - start, "out of memory"
    finally:
        layout_cache.clear()  # the cache holds each layout and its tables: quadratic in the length, gigabytes here
        free_memory(ctx)


def _longest_one(ctx: Ctx, impl: str, cap: int, deadline: float) -> tuple[int | None, str]:
    """The longest length that ran, and what stopped the search."""
    s = ctx.sizes.longest
    ok, failed, stop, seq = None, None, "length cap", s["start"]
    while seq <= cap:
        if time.perf_counter() > deadline:
            stop = "time budget"
            break
        ran, seconds, why = _probe(ctx, impl, seq)
        if not ran:
            failed, stop = seq, why
            break
        ok = seq
        if seconds > s["probe_s"]:
            stop = f"a probe took {seconds:.0f} s"
            break
        seq *= 2
    for _ in range(s["bisect"] if ok and failed else 0):
        middle = (ok + failed) // 2 // s["granule"] * s["granule"]
        if middle <= ok or time.perf_counter() > deadline:
            break
        ran, _, why = _probe(ctx, impl, middle)
        ok, failed = (middle, failed) if ran else (ok, middle)
    return ok, stop


def _longest(ctx: Ctx) -> None:
    cap = ctx.sizes.longest["cap"]
    # (cap, share of the time left): math fails within a few probes; flash/efficient, quadratic in time, stops at 16x the start
    plan = {"dense math": (cap, 0.2), "dense flash/efficient": (min(cap, 16 * ctx.sizes.longest["start"]), 0.2), "ours": (cap, 0.6)}
    found: dict[str, tuple[int | None, str]] = {}
    weights = [w for _, w in plan.values()]
    for index, (impl, (impl_cap, weight)) in enumerate(plan.items()):
        share = ctx.left() * weight / sum(weights[index:])
        found[impl] = _longest_one(ctx, impl, impl_cap, time.perf_counter() + share)
        ok, stop = found[impl]
        ctx.table.add(SECTION, f"longest fwd+bwd: {impl}", f"{ok or 0} tokens", f"stopped by: {stop}; 1 layer, batch 1, "
                      f"{ctx.sizes.attention['heads']} heads x {ctx.sizes.attention['head_dim']}, {str(ctx.dtype)[6:]}")
    ours_len, ours_stop = found["ours"]
    for base in ("dense math", "dense flash/efficient"):
        base_len, _ = found[base]
        if ours_len and base_len:
            bound = ">=" if ours_stop in ("length cap", "time budget") or ours_stop.startswith("a probe") else ""
            ctx.table.ratio(SECTION, f"longest: ours / {base}", [ours_len / base_len], ">= 10.0" if base == "dense math" else "",
                            "goal 2 (DeepSpeed's claim: 10x longer than dense)" if base == "dense math" else "beside it", bound)


def run(ctx: Ctx) -> None:
    for part in (_sides, _density, _longest):
        if ctx.left() < 0:
            ctx.table.add(SECTION, part.__name__.strip("_"), "skipped", "section time spent")
            continue
        part(ctx)
