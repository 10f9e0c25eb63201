"""``dscompile::block_sparse_attention``: the op the sparse-attention pass puts in graphs.

A ``torch.library`` custom op with a fake (meta) implementation and an autograd formula whose
backward is the op ``dscompile::block_sparse_attention_backward``, so Dynamo and AOTAutograd
trace it as one node, other passes see it, and dumps show it. The same op lowers to three
implementations, picked by ``kernel``:

- ``reference``: block-sparse PyTorch (``block_sparse_reference``), memory linear in the
  nonzero blocks; the CPU default.
- ``triton``: the Triton kernels (``block_sparse_attention``); the CUDA default.
- ``flex``: PyTorch's FlexAttention with a ``BlockMask`` built from the same look-up table
  (its backward recomputes the forward under autograd; on CPU, where FlexAttention has no
  backward, the reference computes the gradients).

Why ``reference`` is the CPU default although FlexAttention's forward is faster there: a
training step with ``flex`` on CPU is FlexAttention's forward *plus* the reference's forward
(for the row log-sum-exp) and backward, so it is always slower than ``reference`` alone, and it
compiles FlexAttention once per shape. Measured with bench/sparse_attention.py on the shared
2-core development CPU, one thread (BigBird, 4 heads, head dim 64, block 64, fp32): a training
step at 2k/4k/8k tokens takes 139/378/1477 ms with ``reference`` and 156/428/1694 ms with
``flex``, whose first call at each new shape also compiles for 6-14 s (warm Inductor cache;
29 s cold). FlexAttention's forward alone is faster (20/70/162 ms vs 46/153/593 ms), but
inference-only use pays that compile per sequence length and, past Dynamo's recompile limit,
falls back to unfused FlexAttention that builds the S x S scores; so on CPU ``flex`` is
opt-in. On CUDA the Triton kernels are the default (no GPU run has measured them against
flex yet; the benchmark does when a GPU is lent).

Sequence lengths that are not a multiple of ``block`` are padded here (the padded keys are
masked, the padded rows dropped); the pass logs when that happens.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from dscompile.kernels import block_sparse_reference as reference
from dscompile.kernels import layout_cache

KERNELS = ("auto", "triton", "flex", "reference")


def resolve_kernel(kernel: str, device: torch.device) -> str:
    """The implementation ``kernel`` names on ``device``: ``auto`` is ``triton`` on CUDA, ``reference`` elsewhere.

    ``reference`` beats ``flex`` on CPU for a training step (see the module docstring for the figures).
    """
    if kernel not in KERNELS:
        raise ValueError(f"unknown sparse-attention kernel {kernel!r}; use one of {', '.join(KERNELS)}")
    if kernel == "auto":
        return "triton" if device.type == "cuda" else "reference"
    return kernel


def _pad_seq(x: Tensor, padded: int, dims: tuple[int, ...]) -> Tensor:
    """Zero-pad ``x`` along the given dims (only those whose size is the unpadded length) to ``padded``."""
    for dim in dims:
        size = x.shape[dim]
        if size != 1 and size != padded:
            pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, padded - size]
            x = F.pad(x, pad)
    return x


def _prepare(
    q: Tensor, k: Tensor, v: Tensor, layout: Tensor, bias: Tensor | None, block: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None, int]:
    """Pad to a multiple of ``block``, check the layout, expand a shared layout to every head."""
    b, h, s, d = q.shape
    nb = -(-s // block)
    if layout.dim() != 3 or layout.shape[1:] != (nb, nb) or layout.shape[0] not in (1, h):
        raise ValueError(
            f"layout has shape {list(layout.shape)} but {h} heads and sequence length {s} with block {block} "
            f"need [{h}, {nb}, {nb}] (or [1, {nb}, {nb}])"
        )
    layout = layout_cache.on_device(layout, q.device).expand(h, nb, nb)
    if bias is not None:
        while bias.dim() < 4:
            bias = bias.unsqueeze(0)
        if bias.dtype == torch.bool:
            bias = torch.where(bias, 0.0, float("-inf"))
    padded = nb * block
    if padded != s:
        q, k, v = (_pad_seq(x, padded, (2,)) for x in (q, k, v))
        if bias is not None:
            bias = _pad_seq(bias, padded, (-2, -1))
    return q, k, v, layout, bias, s


LayoutBuilder = Callable[[str, int, int, str], Tensor]
_layout_builder: LayoutBuilder | None = None


def register_layout_builder(builder: LayoutBuilder) -> None:
    """``builder(sparsity_json, num_heads, seq_len, device)``: the layout an op called with a spec instead of a
    layout tensor uses. ``dscompile.sparsity`` registers it; kernels never import the config layer above them."""
    global _layout_builder
    _layout_builder = builder


def _resolve_layout(layout: Tensor | None, sparsity: str, q: Tensor) -> Tensor:
    if layout is not None:
        return layout
    if not sparsity:
        raise ValueError("block_sparse_attention needs a layout tensor or a sparsity spec")
    if _layout_builder is None:
        raise RuntimeError("block_sparse_attention got a sparsity spec but no layout builder: import dscompile.sparsity first")
    return _layout_builder(sparsity, q.shape[1], q.shape[2], str(q.device))


# ----------------------------------------------------------------------------- FlexAttention lowering


@functools.cache
def _compiled_flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


FLEX_GPU_BLOCK = 128  # the BlockMask granularity on a GPU (see _flex_block_mask)


def flex_block_mask(layout: Tensor, block: int, seq_len: int, causal: bool, kv_len: int, batch: int = 1) -> Any:
    """A FlexAttention ``BlockMask`` visiting exactly the layout's nonzero blocks (cached per layout)."""
    build = lambda: _flex_block_mask(layout, block, seq_len, causal, kv_len, batch)
    return layout_cache.cached("flex", layout, (block, seq_len, causal, kv_len, batch), build)


def _flex_block_mask(layout: Tensor, block: int, seq_len: int, causal: bool, kv_len: int, batch: int) -> Any:
    """Build the BlockMask of ``flex_block_mask``.

    Blocks wholly inside the causal triangle and the valid keys are "full" (no mask_mod
    evaluated); the diagonal blocks (causal) and the last, padded block are "partial".
    """
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    from dscompile.kernels.block_sparse_attention import build_lut

    lay = layout.bool()
    if lay.device.type == "cuda" and block % FLEX_GPU_BLOCK:
        # FlexAttention's GPU backward tiles are 128 tokens (Hopper, head dim 64-128) and skip masks of smaller
        # blocks: 128-token blocks, each token pair looked up in the layout by the mask function
        def layout_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            keep = lay[h, q_idx // block, kv_idx // block] & (kv_idx < kv_len)
            return keep & (q_idx >= kv_idx) if causal else keep

        return create_block_mask(layout_mod, batch, lay.shape[0], seq_len, seq_len, device=lay.device, BLOCK_SIZE=FLEX_GPU_BLOCK)
    nb = lay.shape[-1]
    idx = torch.arange(nb, device=lay.device)
    partial_cols = torch.zeros(nb, nb, dtype=torch.bool, device=lay.device)
    if causal:
        lay = lay & (idx[:, None] >= idx[None, :])
        partial_cols |= idx[:, None] == idx[None, :]
    if kv_len < seq_len:
        partial_cols |= (idx[None, :] + 1) * block > kv_len
    partial = lay & partial_cols
    full = lay & ~partial_cols
    # FlexAttention wants index tables as wide as the number of key blocks.
    widen = lambda t: F.pad(t, [0, nb - t.shape[-1]])
    p_idx, p_cnt, _, _ = build_lut(partial, causal=False)
    f_idx, f_cnt, _, _ = build_lut(full, causal=False)
    p_idx, f_idx = widen(p_idx), widen(f_idx)

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        keep = kv_idx < kv_len
        if causal:
            keep = keep & (q_idx >= kv_idx)
        return keep

    expand = lambda t: t[None].expand(batch, *t.shape)
    return BlockMask.from_kv_blocks(
        expand(p_cnt),
        expand(p_idx),
        expand(f_cnt),
        expand(f_idx),
        BLOCK_SIZE=block,
        mask_mod=mask_mod,
        seq_lengths=(seq_len, seq_len),
    )


def _flex_run(q: Tensor, k: Tensor, v: Tensor, layout: Tensor, bias: Tensor | None, block: int, scale: float,
              causal: bool, kv_len: int) -> tuple[Tensor, Tensor]:  # fmt: skip
    b, h, s, d = q.shape
    mask = flex_block_mask(layout, block, s, causal, kv_len, batch=b)
    score_mod = None
    if bias is not None:
        full_bias = bias.expand(b, h, s, s)

        def score_mod(score: Tensor, bi: Tensor, hi: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
            return score + full_bias[bi, hi, qi, ki].to(score.dtype)

    flex = _compiled_flex()
    if q.device.type == "cuda":
        return flex(q, k, v, score_mod=score_mod, block_mask=mask, scale=scale, return_lse=True)
    # On CPU the compiled FlexAttention is inference-only and cannot return the lse.
    with torch.no_grad():
        out = flex(q.detach(), k.detach(), v.detach(), score_mod=score_mod, block_mask=mask, scale=scale)
    return out, torch.full((b, h, s), float("nan"), device=q.device)


# ----------------------------------------------------------------------------- the ops


def _check_dropout(kernel: str, dropout_p: float, seed: Tensor | None) -> None:
    if dropout_p > 0.0 and seed is None:
        raise ValueError("block_sparse_attention: dropout_p > 0 needs a seed tensor")
    if dropout_p > 0.0 and kernel == "flex":
        raise ValueError("kernel 'flex' has no attention dropout; use sparse_attention.kernel='triton' or 'reference'")


@torch.library.custom_op("dscompile::block_sparse_attention", mutates_args=())
def block_sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: Tensor | None,
    bias: Tensor | None,
    seed: Tensor | None,
    block: int,
    scale: float,
    causal: bool,
    dropout_p: float,
    kernel: str,
    sparsity: str = "",
) -> tuple[Tensor, Tensor]:
    """softmax(q kᵀ·scale + bias, restricted to the layout's blocks [and causal]) · v, and the row lse.

    The lse is internal (for the backward); the CPU flex lowering cannot produce it and leaves NaN.

    ``q, k, v``: ``[B, H, S, D]``; ``layout``: ``[H or 1, ceil(S/block), ceil(S/block)]`` 0/1,
    or None with ``sparsity`` a JSON ``sparse_attention`` section the layout is made (and cached) from;
    ``bias``: additive float or boolean keep-mask broadcastable to ``[B, H, S, S]``.
    """
    kern = resolve_kernel(kernel, q.device)
    _check_dropout(kern, dropout_p, seed)
    layout = _resolve_layout(layout, sparsity, q)
    qp, kp, vp, lay, bias_p, s = _prepare(q, k, v, layout, bias, block)
    if kern == "flex":
        out, lse = _flex_run(qp, kp, vp, lay, bias_p, block, scale, causal, s)
    else:
        impl = reference if kern == "reference" else _triton()
        out, lse = impl.block_sparse_attention_forward(
            qp, kp, vp, lay, block, scale, bias=bias_p, causal=causal, kv_len=s, dropout_p=dropout_p, seed=seed
        )
    return out[:, :, :s].contiguous().to(q.dtype), lse[:, :, :s].float().contiguous()


@block_sparse_attention.register_fake
def _block_sparse_attention_fake(q, k, v, layout, bias, seed, block, scale, causal, dropout_p, kernel, sparsity=""):  # noqa: ANN001
    b, h, s, _ = q.shape
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty((b, h, s), dtype=torch.float32)


def _triton() -> Any:
    from dscompile.kernels import block_sparse_attention as triton_impl

    return triton_impl


@torch.library.custom_op("dscompile::block_sparse_attention_backward", mutates_args=())
def block_sparse_attention_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    layout: Tensor | None,
    bias: Tensor | None,
    seed: Tensor | None,
    block: int,
    scale: float,
    causal: bool,
    dropout_p: float,
    kernel: str,
    sparsity: str = "",
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of q, k, v of ``block_sparse_attention`` (block-sparse in every implementation)."""
    kern = resolve_kernel(kernel, q.device)
    layout = _resolve_layout(layout, sparsity, q)
    qp, kp, vp, lay, bias_p, s = _prepare(q, k, v, layout, bias, block)
    padded = qp.shape[2]
    if kern == "flex" and q.device.type != "cuda":
        # CPU FlexAttention has no backward: the block-sparse reference computes the same gradients.
        _, lse_ref = reference.block_sparse_attention_forward(qp, kp, vp, lay, block, scale, bias=bias_p, causal=causal, kv_len=s)
        go = _pad_seq(grad_out, padded, (2,))
        outp = _pad_seq(out, padded, (2,))
        grads = reference.block_sparse_attention_backward(
            go, qp, kp, vp, outp, lse_ref, lay, block, scale, bias=bias_p, causal=causal, kv_len=s
        )
    elif kern == "flex":
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_() for x in (qp, kp, vp)]
            recomputed, _ = _flex_run(*leaves, lay, bias_p, block, scale, causal, s)
            grads = torch.autograd.grad(recomputed[:, :, :s], leaves, grad_out.to(recomputed.dtype))
    else:
        go = _pad_seq(grad_out, padded, (2,))
        outp = _pad_seq(out, padded, (2,))
        lsep = F.pad(lse, [0, padded - s], value=float("inf")) if padded != s else lse  # a zero pad would still copy
        impl = reference if kern == "reference" else _triton()
        grads = impl.block_sparse_attention_backward(
            go, qp, kp, vp, outp, lsep, lay, block, scale, bias=bias_p, causal=causal, kv_len=s, dropout_p=dropout_p, seed=seed
        )
    dq, dk, dv = (g[:, :, :s].to(x.dtype).contiguous() for g, x in zip(grads, (q, k, v), strict=True))
    return dq, dk, dv


@block_sparse_attention_backward.register_fake
def _block_sparse_attention_backward_fake(grad_out, q, k, v, out, lse, layout, bias, seed, *options):  # noqa: ANN001
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, layout, bias, seed, block, scale, causal, dropout_p, kernel, sparsity = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, layout, bias, seed, out, lse)
    ctx.options = (block, scale, causal, dropout_p, kernel, sparsity)
    ctx.bias_needs_grad = isinstance(bias, Tensor) and bias.requires_grad
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # the lse's gradient is never read: no zeros kernel for it per call


def _backward(ctx: Any, grad_out: Tensor, grad_lse: Tensor | None) -> tuple[Any, ...]:
    if ctx.bias_needs_grad:
        raise NotImplementedError(
            "dscompile::block_sparse_attention has no gradient for its bias; the sparse_attention pass "
            "leaves attention with a trainable bias unchanged"
        )
    if grad_out is None:  # grads are not materialized: the output took no part in the loss
        return (None,) * 12
    q, k, v, layout, bias, seed, out, lse = ctx.saved_tensors
    dq, dk, dv = block_sparse_attention_backward(grad_out, q, k, v, out, lse, layout, bias, seed, *ctx.options)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


block_sparse_attention.register_autograd(_backward, setup_context=_setup_context)
