"""Quantizers against plain-torch references of DeepSpeed's formulas; packed storage; quantized matmul."""

from __future__ import annotations

import math

import pytest
import torch

from dscompile.kernels.masks import topk_mask
from dscompile.kernels.quantize import (
    dequantize,
    fake_quantize,
    fake_quantize_weight,
    mask_packed,
    pack_codes,
    quantize_weight,
    select_columns,
    select_rows,
    unpack_codes,
)
from dscompile.kernels.quantized_matmul import quantized_matmul_reference, quantized_matmul_torch, quantized_matmul_triton


# --------------------------------------------------------------------------------------------
# DeepSpeed's quantizers, transcribed from deepspeed/compression/utils.py and runtime/quantize.py
# --------------------------------------------------------------------------------------------
def ds_symmetric(x: torch.Tensor, num_bits: int, num_groups: int, p: torch.Tensor | float = 0.0) -> torch.Tensor:
    q_range = 2**num_bits
    flat = x.reshape(num_groups, -1)
    max_input = torch.amax(torch.abs(flat), dim=-1).view(num_groups, -1)
    scale = 2 * max_input / q_range
    out = (flat / scale + p).round().clamp(-q_range // 2, q_range // 2 - 1) * scale
    return out.reshape(x.shape)


def ds_asymmetric(x: torch.Tensor, num_bits: int, num_groups: int, p: torch.Tensor | float = 0.0) -> torch.Tensor:
    q_range = 2**num_bits
    flat = x.reshape(num_groups, -1)
    min_value = flat.amin(dim=-1, keepdim=True)
    max_value = flat.amax(dim=-1, keepdim=True)
    scale = (max_value - min_value) / q_range
    zero_point = (min_value / scale).round() * scale
    out = ((flat - zero_point) / scale + p).round().clamp(0, q_range - 1) * scale + zero_point
    return out.reshape(x.shape)


def ds_ternary(x: torch.Tensor, num_groups: int) -> torch.Tensor:
    flat = x.reshape(num_groups, -1)
    n = flat.shape[1]
    m = flat.norm(p=1, dim=1).div(n)
    thres = (0.7 * m).view(-1, 1)
    pos = (flat > thres).type(x.type())
    neg = (flat < -thres).type(x.type())
    mask = (flat.abs() > thres).type(x.type())
    alpha = ((mask * flat).abs().sum(dim=1) / mask.sum(dim=1)).view(-1, 1)
    return (alpha * pos - alpha * neg).reshape(x.shape)


def ds_binary(x: torch.Tensor, num_groups: int) -> torch.Tensor:
    flat = x.reshape(num_groups, -1)
    m = flat.norm(p=1, dim=1, keepdim=True).div(flat.shape[1])
    return flat.sign().mul(m).reshape(x.shape)


def ds_topk(scores: torch.Tensor, threshold: float) -> torch.Tensor:
    mask = scores.clone()
    _, idx = scores.flatten().sort(descending=True)
    j = math.ceil(threshold * scores.numel())
    flat = mask.flatten()
    flat[idx[j:]] = 0.0
    flat[idx[:j]] = 1.0
    return flat.reshape(scores.shape)


SHAPES_GROUPS = [((12, 20), 1), ((12, 20), 4), ((12, 20), 12), ((12, 20), 48), ((8, 3, 3, 3), 8), ((16, 64), 32)]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("shape,groups", SHAPES_GROUPS)
def test_fake_quantize_equals_deepspeed_exactly(bits: int, symmetric: bool, shape: tuple[int, ...], groups: int) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(bits * 7 + groups))
    expected = (ds_symmetric if symmetric else ds_asymmetric)(x, bits, groups)
    assert torch.equal(fake_quantize(x, bits, groups, symmetric), expected)
    # the graph's spelling (bits as a tensor, switch on, straight-through) gives the same values
    one = torch.tensor(1.0)
    graph = fake_quantize_weight(
        x,
        torch.tensor(float(bits)),
        one,
        one,
        num_groups=groups,
        symmetric=symmetric,
        stochastic=False,
        integer=True,
        ternary=False,
        binary=False,
        mix_real=False,
    )
    assert torch.equal(graph, expected)


@pytest.mark.parametrize("shape,groups", SHAPES_GROUPS)
def test_ternary_and_binary_equal_deepspeed_exactly(shape: tuple[int, ...], groups: int) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(groups))
    assert torch.equal(fake_quantize(x, 2, groups), ds_ternary(x, groups))
    assert torch.equal(fake_quantize(x, 1, groups), ds_binary(x, groups))
    one = torch.tensor(1.0)
    kwargs = dict(num_groups=groups, symmetric=True, stochastic=False, integer=True, ternary=True, binary=True, mix_real=False)
    for bits, expected in ((1, ds_binary(x, groups)), (2, ds_ternary(x, groups)), (5, ds_symmetric(x, 5, groups))):
        assert torch.equal(fake_quantize_weight(x, torch.tensor(float(bits)), one, one, **kwargs), expected)


@pytest.mark.parametrize("symmetric", [True, False])
def test_stochastic_rounding_matches_deepspeed_noise_and_is_unbiased(symmetric: bool) -> None:
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
    # the same uniform noise in DeepSpeed's MoQ formula gives the same values
    noise = torch.rand(4, 128, generator=torch.Generator().manual_seed(3)) - 0.5
    reference = (ds_symmetric if symmetric else ds_asymmetric)(x, 4, 4, noise)
    assert torch.equal(fake_quantize(x, 4, 4, symmetric, stochastic=True, generator=torch.Generator().manual_seed(3)), reference)
    # unbiased: averaged over many draws the error vanishes (interior values, away from the clamp)
    gen = torch.Generator().manual_seed(1)
    draws = torch.stack([fake_quantize(x, 4, 4, symmetric, stochastic=True, generator=gen) for _ in range(4000)])
    step = (x.reshape(4, -1).abs().amax(dim=1) * 2 / 16).repeat_interleave(128).reshape(x.shape)
    nearest_error = (fake_quantize(x, 4, 4, symmetric) - x).abs().mean()
    mean_error = (draws.mean(dim=0) - x) / step
    interior = x.abs() < 0.7 * x.reshape(4, -1).abs().amax(dim=1).repeat_interleave(128).reshape(x.shape)
    assert mean_error[interior].abs().mean() < 0.02  # standard error of 4000 draws ~ 0.008 of a step
    assert (draws[0] - x).abs().mean() > nearest_error  # really stochastic: one draw is noisier


def test_topk_mask_equals_deepspeed_topk_binarizer() -> None:
    scores = torch.randn(7, 9, generator=torch.Generator().manual_seed(0))
    for ratio in (0.1, 0.25, 0.5, 0.9, 1.0):
        mask = topk_mask(scores, ratio)
        assert torch.equal(mask, ds_topk(scores, ratio))
        assert int(mask.sum()) == math.ceil(ratio * scores.numel())


# --------------------------------------------------------------------------------------------
# packed storage
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [4, 2])
def test_pack_unpack_round_trip(bits: int) -> None:
    codes = torch.randint(0, 2**bits, (5, 13), generator=torch.Generator().manual_seed(bits))
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (5, math.ceil(13 * bits / 8))
    assert torch.equal(unpack_codes(packed, bits, 13), codes.to(torch.int32))


@pytest.mark.parametrize("bits,symmetric", [(8, True), (8, False), (6, True), (4, True), (4, False), (3, False), (2, True), (1, True)])
@pytest.mark.parametrize("shape,groups", SHAPES_GROUPS)
def test_packed_weight_dequantizes_to_the_fake_quantized_values(bits: int, symmetric: bool, shape: tuple[int, ...], groups: int) -> None:
    w = torch.randn(shape, generator=torch.Generator().manual_seed(11))
    packed = quantize_weight(w, bits, groups, symmetric)
    assert torch.equal(dequantize(packed), fake_quantize(w, bits, groups, symmetric))
    rows, columns = shape[0], math.prod(shape[1:])
    per_byte = 1 if bits > 4 else 2 if bits > 2 else 4
    assert packed.data.numel() == rows * math.ceil(columns / per_byte)
    assert packed.scale.shape == (rows, columns // packed.group_size)


def test_selecting_rows_and_columns_and_masking_keep_values_exact() -> None:
    w = torch.randn(12, 24, generator=torch.Generator().manual_seed(2))
    packed = quantize_weight(w, 4, 8, symmetric=True)  # groups of 36 elements: 12 columns per row group
    full = dequantize(packed)
    rows = torch.tensor([1, 0, 1, 1, 0, 1, 1, 1, 0, 0, 1, 1], dtype=torch.bool)
    cols = torch.rand(24, generator=torch.Generator().manual_seed(4)) > 0.4
    assert torch.equal(dequantize(select_rows(packed, rows)), full[rows])
    picked = select_columns(packed, cols)
    assert torch.equal(dequantize(picked), full[:, cols])
    keep = torch.rand(12, 24, generator=torch.Generator().manual_seed(5)) > 0.5
    assert torch.equal(dequantize(mask_packed(packed, keep)), full * keep)
    asym = quantize_weight(w, 8, 1, symmetric=False)
    assert torch.equal(dequantize(mask_packed(asym, keep)), dequantize(asym) * keep)


def test_conv_kernels_select_input_channels_with_their_window() -> None:
    w = torch.randn(6, 4, 3, 3, generator=torch.Generator().manual_seed(3))
    packed = quantize_weight(w, 8, 6)
    keep = torch.tensor([True, False, True, True])
    picked = select_columns(packed, keep, inner=9)
    assert picked.shape == (6, 3, 3, 3)
    assert torch.equal(dequantize(picked), dequantize(packed)[:, keep])


# --------------------------------------------------------------------------------------------
# quantized matmul
# --------------------------------------------------------------------------------------------
MATMUL_CASES = [(8, True, 1), (8, False, 4), (4, True, 20), (4, False, 40), (2, True, 10), (1, True, 1)]


@pytest.mark.parametrize("bits,symmetric,groups", MATMUL_CASES)
def test_quantized_matmul_torch_path_matches_reference(bits: int, symmetric: bool, groups: int) -> None:
    gen = torch.Generator().manual_seed(bits)
    w, x, b = torch.randn(20, 40, generator=gen), torch.randn(3, 5, 40, generator=gen), torch.randn(20, generator=gen)
    packed = quantize_weight(w, bits, groups, symmetric)
    expected = torch.nn.functional.linear(x.double(), dequantize(packed).double(), b.double()).float()
    torch.testing.assert_close(quantized_matmul_reference(x, packed, b), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(quantized_matmul_torch(x, packed, b), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits,symmetric,groups", MATMUL_CASES)
def test_quantized_matmul_triton_kernel_matches_reference(bits: int, symmetric: bool, groups: int) -> None:
    gen = torch.Generator().manual_seed(10 + bits)
    w, x, b = torch.randn(20, 40, generator=gen), torch.randn(7, 40, generator=gen), torch.randn(20, generator=gen)
    packed = quantize_weight(w, bits, groups, symmetric)
    torch.testing.assert_close(quantized_matmul_triton(x, packed, b), quantized_matmul_reference(x, packed, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(quantized_matmul_triton(x, packed), quantized_matmul_reference(x, packed), rtol=1e-5, atol=1e-5)


def test_quantized_matmul_torch_path_compiles_with_inductor() -> None:
    gen = torch.Generator().manual_seed(0)
    packed = quantize_weight(torch.randn(16, 32, generator=gen), 4, 16)
    x = torch.randn(4, 32, generator=gen)
    compiled = torch.compile(lambda inp: quantized_matmul_torch(inp, packed), backend="inductor")
    torch.testing.assert_close(compiled(x), quantized_matmul_reference(x, packed), rtol=1e-5, atol=1e-5)
