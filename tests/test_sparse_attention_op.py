"""dscompile::block_sparse_attention: forward and backward equal dense attention under the layout's mask.

The reference runs on CPU directly; the Triton kernels run under TRITON_INTERPRET=1 (set here
before triton is imported) with tiny shapes.
"""

from __future__ import annotations

import os
import sys

_TRITON_PREIMPORTED = "triton" in sys.modules
if not _TRITON_PREIMPORTED:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from dscompile.kernels.sparse_attention_op import block_sparse_attention  # noqa: E402
from dscompile.sparsity import (  # noqa: E402
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    VariableSparsityConfig,
    layout_to_mask,
)

B, H, D, BLOCK = 2, 2, 16, 16

LAYOUTS = {
    "dense": lambda: DenseSparsityConfig(H, BLOCK),
    "fixed": lambda: FixedSparsityConfig(H, BLOCK, True, num_local_blocks=2, num_global_blocks=1, num_different_global_patterns=2),
    "variable": lambda: VariableSparsityConfig(H, BLOCK, True, num_random_blocks=1, local_window_blocks=[1, 2], global_block_indices=[3]),
    "bigbird": lambda: BigBirdSparsityConfig(H, BLOCK, True, num_random_blocks=1, num_sliding_window_blocks=1, num_global_blocks=1),
    "bslongformer": lambda: BSLongformerSparsityConfig(H, BLOCK, True, num_sliding_window_blocks=1, global_block_indices=[2]),
}


def dense_attention(q, k, v, layout, scale, causal=False, bias=None):  # noqa: ANN001, ANN201
    """Plain eager attention with the layout turned into a token mask."""
    s = q.shape[2]
    allowed = layout_to_mask(layout, BLOCK, s)[None]
    if causal:
        allowed = allowed & torch.ones(s, s, dtype=torch.bool).tril()
    scores = (q @ k.transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + (torch.where(bias, 0.0, float("-inf")) if bias.dtype == torch.bool else bias)
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v


def _inputs(seq: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, seq, D, generator=gen).to(dtype).requires_grad_() for _ in range(3)]


def _padding_mask(seq: int) -> torch.Tensor:
    lengths = torch.tensor([seq, seq - 5])
    return (torch.arange(seq)[None, :] < lengths[:, None])[:, None, None, :]  # keep-mask [B, 1, 1, S]


def _compare(kernel: str, mode: str, seq: int, causal: bool, with_bias: bool, dtype=torch.float32, tol=2e-5):  # noqa: ANN001
    layout = LAYOUTS[mode]().make_layout(seq)
    q, k, v = _inputs(seq, dtype)
    bias = _padding_mask(seq) if with_bias else None
    out, lse = block_sparse_attention(q, k, v, layout, bias, None, BLOCK, 0.25, causal, 0.0, kernel)
    ref = dense_attention(*(x.double() for x in (q, k, v)), layout, 0.25, causal, bias)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    mine = torch.autograd.grad(out, (q, k, v), grad)
    theirs = torch.autograd.grad(ref, (q, k, v), grad.double())
    torch.testing.assert_close(out.double(), ref.detach(), atol=tol, rtol=tol)
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a.double(), b.double(), atol=tol * 4, rtol=tol * 4)
    assert out.dtype == dtype and lse.shape == (B, H, seq)


@pytest.mark.parametrize("mode", list(LAYOUTS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_reference_matches_dense(mode: str, causal: bool, with_bias: bool) -> None:
    _compare("reference", mode, 64, causal, with_bias)


@pytest.mark.parametrize("mode", ["bigbird", "fixed"])
def test_reference_pads_sequence_lengths(mode: str) -> None:
    _compare("reference", mode, 57, causal=True, with_bias=True)


def test_additive_bias_and_shared_layout() -> None:
    seq = 64
    layout = BigBirdSparsityConfig(1, BLOCK, num_random_blocks=1).make_layout(seq)  # one layout for every head
    q, k, v = _inputs(seq)
    bias = torch.randn(1, H, seq, seq)
    out, _ = block_sparse_attention(q, k, v, layout, bias, None, BLOCK, 0.3, False, 0.0, "reference")
    torch.testing.assert_close(out, dense_attention(q, k, v, layout.expand(H, -1, -1), 0.3, bias=bias), atol=2e-5, rtol=2e-5)


def test_reference_memory_is_linear_in_nonzero_blocks() -> None:
    """The reference never builds S x S scores: its peak allocation tracks the nonzero blocks."""
    from torch.profiler import ProfilerActivity, profile

    def peak(seq: int) -> int:
        layout = BSLongformerSparsityConfig(1, BLOCK, num_sliding_window_blocks=3).make_layout(seq)
        q, k, v = (torch.randn(1, 1, seq, D) for _ in range(3))
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            block_sparse_attention(q, k, v, layout, None, None, BLOCK, 0.25, False, 0.0, "reference")
        return max(e.cpu_memory_usage for e in prof.key_averages())

    small, large = peak(512), peak(2048)
    assert large < 4 * small * 1.5  # 4x the sequence: about 4x the memory, far from the 16x of dense scores


def test_errors_name_the_problem() -> None:
    q, k, v = _inputs(64)
    bad = DenseSparsityConfig(H, BLOCK).make_layout(128)
    with pytest.raises(ValueError, match=r"layout has shape \[2, 8, 8\]"):
        block_sparse_attention(q, k, v, bad, None, None, BLOCK, 0.25, False, 0.0, "reference")
    with pytest.raises(ValueError, match="unknown sparse-attention kernel"):
        block_sparse_attention(q, k, v, bad[:, :4, :4], None, None, BLOCK, 0.25, False, 0.0, "cuda")
    with pytest.raises(ValueError, match="seed"):
        block_sparse_attention(q, k, v, bad[:, :4, :4], None, None, BLOCK, 0.25, False, 0.1, "reference")


def _directional_check(kernel: str) -> None:
    """With a fixed seed, dropout is a deterministic function: its gradient matches finite differences."""
    seq = 64
    layout = LAYOUTS["bigbird"]().make_layout(seq)
    q, k, v = (x.detach() for x in _inputs(seq))
    seed = torch.tensor(1234)
    f = lambda q, k, v: block_sparse_attention(q, k, v, layout, None, seed, BLOCK, 0.25, False, 0.3, kernel)[0]
    out = f(q, k, v)
    assert torch.equal(out, f(q, k, v))  # same seed, same mask
    no_drop = block_sparse_attention(q, k, v, layout, None, None, BLOCK, 0.25, False, 0.0, kernel)[0]
    assert not torch.allclose(out, no_drop)
    gen = torch.Generator().manual_seed(3)
    dirs = [torch.randn(q.shape, generator=gen) for _ in range(3)]
    grad_out = torch.randn(out.shape, generator=gen)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    grads = torch.autograd.grad(f(*leaves), leaves, grad_out)
    eps = 1e-2
    plus = f(*(x + eps * d for x, d in zip((q, k, v), dirs, strict=True)))
    minus = f(*(x - eps * d for x, d in zip((q, k, v), dirs, strict=True)))
    numeric = ((plus - minus) * grad_out).sum() / (2 * eps)
    analytic = sum((g * d).sum() for g, d in zip(grads, dirs, strict=True))
    torch.testing.assert_close(analytic, numeric, rtol=2e-2, atol=2e-2)


def test_reference_dropout_is_consistent() -> None:
    _directional_check("reference")


def test_opcheck() -> None:
    """torch.library's own checks: fake registration, autograd registration, schema."""
    seq = 32
    layout = LAYOUTS["bigbird"]().make_layout(seq)
    q, k, v = _inputs(seq)
    torch.library.opcheck(
        torch.ops.dscompile.block_sparse_attention.default,
        (q, k, v, layout, _padding_mask(seq), None, BLOCK, 0.25, True, 0.0, "reference"),
    )


def test_layout_from_spec() -> None:
    """Graphs name the layout by its config; the op builds the same layout the classes do."""
    seq = 64
    q, k, v = _inputs(seq)
    spec = '{"block": 16, "mode": "bigbird", "num_random_blocks": 1, "num_sliding_window_blocks": 1, "different_layout_per_head": true}'
    layout = BigBirdSparsityConfig(H, BLOCK, True, num_random_blocks=1, num_sliding_window_blocks=1).make_layout(seq)
    a, _ = block_sparse_attention(q, k, v, None, None, None, BLOCK, 0.25, False, 0.0, "reference", spec)
    b, _ = block_sparse_attention(q, k, v, layout, None, None, BLOCK, 0.25, False, 0.0, "reference")
    assert torch.equal(a, b)


# ----------------------------------------------------------------------------- Triton (interpreter on CPU)

needs_interpreter = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="triton was imported before TRITON_INTERPRET=1 could be set; run this module on its own",
)


@needs_interpreter
@pytest.mark.parametrize("mode", ["dense", "fixed", "bigbird", "bslongformer", "variable"])
@pytest.mark.parametrize("causal", [False, True])
def test_triton_matches_dense(mode: str, causal: bool) -> None:
    _compare("triton", mode, 64, causal, with_bias=mode in ("bigbird", "variable"))


@needs_interpreter
def test_triton_pads_and_masks() -> None:
    _compare("triton", "bigbird", 57, causal=False, with_bias=True)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_half_precision(dtype: torch.dtype) -> None:
    _compare("triton", "bigbird", 64, causal=True, with_bias=False, dtype=dtype, tol=2e-2)


@needs_interpreter
def test_triton_dropout_is_consistent() -> None:
    _directional_check("triton")


@needs_interpreter
def test_triton_rejects_small_blocks() -> None:
    q, k, v = _inputs(64)
    layout = DenseSparsityConfig(H, 8).make_layout(64)
    with pytest.raises(ValueError, match="block >= 16"):
        block_sparse_attention(q, k, v, layout, None, None, 8, 0.25, False, 0.0, "triton")


# ----------------------------------------------------------------------------- FlexAttention lowering


@pytest.mark.slow
def test_flex_matches_dense() -> None:
    _compare("flex", "bigbird", 64, causal=True, with_bias=True, tol=5e-5)


# ----------------------------------------------------------------------------- layout caches


def test_lut_is_cached_per_layout_and_rebuilt_after_inplace_change() -> None:
    from dscompile.kernels import layout_cache
    from dscompile.kernels.block_sparse_attention import build_lut, cached_lut

    layout = LAYOUTS["bigbird"]().make_layout(64)
    first = cached_lut(layout, causal=True)
    assert cached_lut(layout, causal=True) is first  # same layout: the same tables, not rebuilt
    assert cached_lut(layout.expand(H, -1, -1), causal=True) is first  # the op's expanded view of it hits too
    assert cached_lut(layout, causal=False) is not first  # causal changes the tables
    before = layout_cache.stats["misses"]
    layout[0, 0, 3] = 1 - layout[0, 0, 3]  # an in-place write bumps the version: the entry is stale
    rebuilt = cached_lut(layout, causal=False)
    assert layout_cache.stats["misses"] == before + 1
    for a, b in zip(rebuilt, build_lut(layout, causal=False), strict=True):
        assert torch.equal(a, b)
    other = layout.clone()  # equal contents, different tensor: its own entry
    assert cached_lut(other, causal=False) is not rebuilt


def test_op_reuses_the_layout_analysis_and_follows_inplace_changes() -> None:
    from dscompile.kernels import layout_cache

    seq = 64
    layout = LAYOUTS["fixed"]().make_layout(seq)
    q, k, v = (x.detach() for x in _inputs(seq))
    call = lambda: block_sparse_attention(q, k, v, layout, None, None, BLOCK, 0.25, False, 0.0, "reference")[0]
    call()
    misses = layout_cache.stats["misses"]
    call()
    assert layout_cache.stats["misses"] == misses  # the second call built nothing
    layout[:, :, 0] = 1 - layout[:, :, 0]  # change the layout in place: the op must see the new one
    torch.testing.assert_close(call(), dense_attention(q, k, v, layout, 0.25), atol=2e-5, rtol=2e-5)
