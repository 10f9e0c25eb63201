"""1-bit pack/unpack: the vectorized torch path and the Triton kernel (interpreter on CPU) against the plain reference."""

from __future__ import annotations

import pytest
import torch

from dscompile.kernels import onebit
from dscompile.kernels.onebit_reference import compress_reference, decompress_mean_reference, decompress_reference

IMPLS = ["torch", "triton"]
SHAPES = [(1, 8), (3, 64), (2, 1032), (5, 16), (1, 2048)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("rows,n", SHAPES)
def test_compress_matches_reference(impl, rows, n):
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, n, generator=gen)
    error = torch.randn(rows, n, generator=gen) * 0.3
    packed_ref, scales_ref, error_ref = compress_reference(x, error)
    mine = error.clone()
    packed, scales = onebit.compress(x, mine, impl=impl)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, n // 8)
    assert torch.equal(packed, packed_ref)
    torch.testing.assert_close(scales, scales_ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(mine, error_ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_compress_without_error_and_bit_order(impl):
    x = torch.tensor([[1.0, -1.0, 0.0, -0.0, -2.0, 3.0, -4.0, 5.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, 2.0]])
    packed, scales = onebit.compress(x, impl=impl)
    # First value -> most significant bit; >= 0 (and -0.0) is a set bit.
    assert packed.tolist() == [[0b10110101, 0b00000001]]
    torch.testing.assert_close(scales, torch.linalg.vector_norm(x, dim=1) / 4.0)
    assert torch.equal(onebit.decompress(packed, scales, impl=impl), decompress_reference(packed, scales))


def test_scale_keeps_the_norm_and_error_is_the_loss():
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(3))
    error = torch.zeros_like(x)
    packed, scales = onebit.compress(x, error)
    restored = onebit.decompress(packed, scales)
    torch.testing.assert_close(torch.linalg.vector_norm(restored, dim=1), torch.linalg.vector_norm(x, dim=1))
    torch.testing.assert_close(restored + error, x)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("k", [1, 2, 4])
def test_decompress_mean_matches_reference(impl, k):
    gen = torch.Generator().manual_seed(k)
    packed = torch.randint(0, 256, (k, 3, 40), generator=gen, dtype=torch.uint8)
    scales = torch.rand(k, 3, generator=gen)
    torch.testing.assert_close(onebit.decompress_mean(packed, scales, impl=impl), decompress_mean_reference(packed, scales), rtol=1e-6, atol=1e-7)


def test_nan_counts_as_positive_like_deepspeed():
    x = torch.tensor([[float("nan"), -1.0, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0]])
    packed, _ = onebit.compress(x)
    assert packed.tolist() == compress_reference(x)[0].tolist() == [[0b10101010]]


def test_bad_inputs_say_what_to_fix():
    with pytest.raises(ValueError, match="multiple of 8"):
        onebit.compress(torch.zeros(2, 12))
    with pytest.raises(ValueError, match="2-D fp32"):
        onebit.compress(torch.zeros(16))
    with pytest.raises(ValueError, match="fp32"):
        onebit.compress(torch.zeros(2, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="shaped like x"):
        onebit.compress(torch.zeros(2, 16), torch.zeros(2, 8))
    with pytest.raises(ValueError, match="impl"):
        onebit.compress(torch.zeros(2, 16), impl="cuda")
    with pytest.raises(ValueError, match="scales"):
        onebit.decompress_mean(torch.zeros(2, 3, 4, dtype=torch.uint8), torch.zeros(2))
