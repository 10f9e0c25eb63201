"""dscompile's inference kernels: the Triton cache attention and rotary against their torch paths (not one of
issue 35's goals; run when time is left).

Cache attention at decode (1 query, GQA, a cache of ``slots`` slots filled to two lengths) and prefill, against
the op's torch path and plain SDPA over the repeated cache; the Triton rotary against the torch path (bit-equal
or not); on CUDA a decode step (cache write, rotary, cache attention) captured in a CUDA graph and replayed at
several positions against eager.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from gpucheck.common import Ctx, steady_ms

SECTION = "inf kernels"


def _decode_inputs(ctx: Ctx, queries: int, filled: int) -> tuple[torch.Tensor, ...]:
    """q, a cache of ``slots`` slots whose first ``filled`` are valid, a causal mask."""
    d = ctx.sizes.kernels
    gen = torch.Generator().manual_seed(filled)
    q = torch.randn(d["batch"], d["heads"], queries, d["dim"], generator=gen).to(ctx.device, ctx.dtype)
    k, v = (torch.randn(d["batch"], d["kv_heads"], d["slots"], d["dim"], generator=gen).to(ctx.device, ctx.dtype) for _ in range(2))
    cols = torch.arange(d["slots"], device=ctx.device)
    rows = filled - queries + torch.arange(queries, device=ctx.device)
    mask = (cols[None, :] <= rows[:, None]).expand(d["batch"], 1, queries, d["slots"]).contiguous()
    return q, k, v, mask


def _attention(ctx: Ctx) -> None:
    from dscompile.kernels.cache_attention import cache_attention_torch, cache_attention_triton

    d = ctx.sizes.kernels
    rep = d["heads"] // d["kv_heads"]
    for kind, queries, filled in [("decode", 1, d["slots"] // 4), ("decode", 1, d["slots"] - 3), ("prefill", d["prefill"], d["prefill"])]:
        q, k, v, mask = _decode_inputs(ctx, queries, filled)
        valid = (slice(None), slice(None), slice(0, filled))
        expected = F.scaled_dot_product_attention(q.float(), k[valid].repeat_interleave(rep, 1).float(), v[valid].repeat_interleave(rep, 1).float(),
                                                  attn_mask=mask[..., :filled])
        k[:, :, filled:], v[:, :, filled:] = float("nan"), float("nan")  # unread by the bounded kernels
        full_k, full_v = torch.nan_to_num(k).repeat_interleave(rep, 1), torch.nan_to_num(v).repeat_interleave(rep, 1)
        impls = {
            "triton": lambda q=q, k=k, v=v, mask=mask: cache_attention_triton(q, k, v, mask),
            "torch path": lambda q=q, k=k, v=v, mask=mask: cache_attention_torch(q, k, v, mask),
            "SDPA, whole repeated cache": lambda q=q, fk=full_k, fv=full_v, mask=mask: F.scaled_dot_product_attention(q, fk, fv, attn_mask=mask),
        }
        times = {}
        for name, fn in impls.items():
            err = (fn().float() - expected).abs().max().item()
            times[name] = steady_ms(fn, ctx, ctx.sizes.steps)
            ok = err <= (2e-2 if ctx.dtype != torch.float32 else 1e-4)
            ctx.table.add(SECTION, f"attn {kind} q={queries} len={filled}/{d['slots']} {name}", f"{times[name]:.3f} ms",
                          f"max |diff| vs fp32 SDPA {err:.1e}" + ("" if ok else "; FAILED"))
        ctx.table.add(SECTION, f"attn {kind} len={filled}: torch path / triton", f"{times['torch path'] / times['triton']:.2f}x", "higher: triton faster")


def _rotary(ctx: Ctx) -> None:
    from dscompile.kernels.rotary import rotary_embedding, rotary_embedding_triton

    d = ctx.sizes.kernels
    gen = torch.Generator().manual_seed(0)
    for dt in dict.fromkeys((torch.float32, ctx.dtype)):
        for name, lead, rotary_dim in (("decode", (d["batch"], d["heads"], 1), None), ("prefill", (1, d["heads"], d["prefill"]), d["dim"] // 2)):
            x = torch.randn(*lead, d["dim"], generator=gen).to(ctx.device, dt)
            rd = rotary_dim or d["dim"]
            angles = torch.randn(lead[0], 1, lead[2], rd // 2, generator=gen).repeat(1, 1, 1, 2)
            cos, sin = angles.cos().to(ctx.device, dt), angles.sin().to(ctx.device, dt)
            equal = torch.equal(rotary_embedding_triton(x, cos, sin, rotary_dim), rotary_embedding(x, cos, sin, rotary_dim))
            t_triton = steady_ms(lambda x=x, cos=cos, sin=sin, rd=rotary_dim: rotary_embedding_triton(x, cos, sin, rd), ctx, ctx.sizes.steps)
            t_torch = steady_ms(lambda x=x, cos=cos, sin=sin, rd=rotary_dim: rotary_embedding(x, cos, sin, rd), ctx, ctx.sizes.steps)
            ctx.table.add(SECTION, f"rotary {name} {tuple(x.shape)} {str(dt)[6:]} rd={rd}", f"{t_triton:.3f} ms",
                          f"torch {t_torch:.3f} ms; bit-equal: {equal}" + ("" if equal else "; FAILED"))


def _cuda_graph_decode(ctx: Ctx) -> None:
    """A decode step (write k/v at a device-side position, rotary, the cache-attention op) captured once, replayed per token."""
    from dscompile.runtime.inference.ops import CACHE_ATTENTION, ROTARY_EMBEDDING

    d = ctx.sizes.kernels
    start = d["slots"] // 4
    q, k_cache, v_cache, mask = _decode_inputs(ctx, 1, start)
    gen = torch.Generator().manual_seed(1)
    new_k = torch.randn(d["batch"], d["kv_heads"], 1, d["dim"], generator=gen).to(ctx.device, ctx.dtype)
    new_v = torch.randn_like(new_k)
    angles = torch.randn(d["batch"], 1, 1, d["dim"] // 2, generator=gen).repeat(1, 1, 1, 2).to(ctx.device)
    cos, sin = angles.cos().to(ctx.dtype), angles.sin().to(ctx.dtype)
    pos = torch.tensor([start], device=ctx.device)

    def step() -> Any:
        k_cache.index_copy_(2, pos, ROTARY_EMBEDDING(new_k, cos, sin, None))
        v_cache.index_copy_(2, pos, new_v)
        mask.index_fill_(3, pos, True)
        return CACHE_ATTENTION(ROTARY_EMBEDDING(q, cos, sin, None), k_cache, v_cache, mask, None)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            out = step()
    except Exception as exc:  # the contract: no host sync inside the op
        ctx.table.add(SECTION, "decode step in a CUDA graph", "capture FAILED", f"{type(exc).__name__}: {str(exc)[:120]}")
        return
    worst = 0.0
    for i in range(8):
        pos.fill_(start + 1 + i)
        graph.replay()
        torch.cuda.synchronize()
        got = out.clone()
        worst = max(worst, (got.float() - step().float()).abs().max().item())
    replay, eager = steady_ms(graph.replay, ctx, ctx.sizes.steps), steady_ms(step, ctx, ctx.sizes.steps)
    ctx.table.add(SECTION, "decode step in a CUDA graph", f"{replay:.3f} ms replay",
                  f"eager {eager:.3f} ms; 8 replays vs eager max |diff| {worst:.1e}" + ("" if worst <= 1e-3 else "; FAILED"))


def run(ctx: Ctx) -> None:
    _attention(ctx)
    _rotary(ctx)
    if ctx.cuda:
        _cuda_graph_decode(ctx)
    else:
        ctx.table.add(SECTION, "decode step in a CUDA graph", "n/a", "CUDA only")
