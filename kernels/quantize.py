"""Quantizers (DeepSpeed Compression's formulas) and really packed weight storage.

Fake quantization (``fake_quantize``) returns the float values a quantized tensor stands for; it is
what quantization-aware training computes in the graph, with a straight-through estimator
(``straight_through``) so gradients pass as if the rounding were the identity. Its formulas are
DeepSpeed's, over ``num_groups`` equal chunks of the flattened tensor:

- symmetric, ``b`` bits: ``scale = 2 * max|x| / 2**b``, ``q = clamp(round(x / scale + p), -2**(b-1), 2**(b-1) - 1)``,
  value ``q * scale``;
- asymmetric: ``scale = (max - min) / 2**b``, ``zero = round(min / scale) * scale``,
  ``q = clamp(round((x - zero) / scale + p), 0, 2**b - 1)``, value ``q * scale + zero``;
- ternary (2 bits, XTC): ``t = 0.7 * mean|x|``, ``alpha`` = mean of ``|x|`` over ``|x| > t``,
  value ``alpha * sign(x)`` where ``|x| > t``, else 0;
- binary (1 bit): value ``mean|x| * sign(x)``;

where ``p`` is 0 for nearest rounding and uniform in [-0.5, 0.5) for stochastic rounding (unbiased:
``E[round(y + p)] = y``). A group whose values are all zero gets scale 1 (DeepSpeed divides by
zero there). ``bits`` may be a Python int or a 0-d tensor, so a compiled graph follows a bit
schedule without recompiling.

``quantize_weight`` produces the same values as integer codes: a ``PackedWeight`` holds int8 codes
(8 bits) or unsigned codes packed ``8 // bits`` to a byte along the input dimension (4, 2 bits),
with float32 scales (and zero points) per group of ``group_size`` consecutive input columns of a
row. DeepSpeed's groups are chunks of the flattened tensor; a chunk of ``C`` elements in rows of
``K`` maps to row groups of ``gcd(C, K)`` columns, so ``dequantize(quantize_weight(w))`` equals
``fake_quantize(w)`` bit for bit. Binary and ternary weights are stored as 2-bit codes {-1, 0, 1}
(zeros from pruning are a third level). The quantized matmul kernel (``kernels.quantized_matmul``)
reads this storage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

Bits = int | torch.Tensor


# ---------------------------------------------------------------------------------------------
# fake quantization
# ---------------------------------------------------------------------------------------------
def _levels(bits: Bits) -> Bits:
    """``2**bits`` as a float (tensor when ``bits`` is one, so the graph reads the current value)."""
    if isinstance(bits, torch.Tensor):
        return torch.pow(2.0, bits.to(torch.float32))
    return float(2**bits)


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def group_view(x: torch.Tensor, num_groups: int) -> torch.Tensor:
    """``x`` as ``[num_groups, numel // num_groups]``: DeepSpeed's quantization groups."""
    if num_groups < 1 or x.numel() % num_groups:
        raise ValueError(f"{x.numel()} elements cannot be split into {num_groups} equal quantization groups")
    return x.reshape(num_groups, -1)


def symmetric_params(flat: torch.Tensor, bits: Bits) -> torch.Tensor:
    """Per-group scale of symmetric quantization (``flat`` is ``[groups, chunk]``)."""
    return _nonzero(2 * flat.abs().amax(dim=-1, keepdim=True) / _levels(bits))


def asymmetric_params(flat: torch.Tensor, bits: Bits) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group ``(scale, zero)`` of asymmetric quantization; ``zero`` is a multiple of ``scale``."""
    low = flat.amin(dim=-1, keepdim=True)
    high = flat.amax(dim=-1, keepdim=True)
    scale = _nonzero((high - low) / _levels(bits))
    return scale, (low / scale).round() * scale


def _code_range(bits: Bits, symmetric: bool) -> tuple[Bits, Bits]:
    levels = _levels(bits)
    return (-levels / 2, levels / 2 - 1) if symmetric else (0.0 * levels, levels - 1)


def _noise(flat: torch.Tensor, stochastic: bool, generator: torch.Generator | None) -> torch.Tensor | float:
    if not stochastic:
        return 0.0
    return torch.rand(flat.shape, dtype=flat.dtype, device=flat.device, generator=generator) - 0.5


def integer_codes(flat: torch.Tensor, bits: Bits, symmetric: bool, noise: torch.Tensor | float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(q, scale, zero)`` of ``[groups, chunk]``: codes as floats, per-group parameters."""
    low, high = _code_range(bits, symmetric)
    if symmetric:
        scale = symmetric_params(flat, bits)
        return torch.clamp((flat / scale + noise).round(), low, high), scale, None
    scale, zero = asymmetric_params(flat, bits)
    return torch.clamp(((flat - zero) / scale + noise).round(), low, high), scale, zero


def ternary_params(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """XTC's ternary split of ``[groups, chunk]``: ``(codes in {-1, 0, 1}, alpha per group)``."""
    threshold = 0.7 * flat.norm(p=1, dim=1, keepdim=True).div(flat.shape[1])
    pos = (flat > threshold).to(flat.dtype)
    neg = (flat < -threshold).to(flat.dtype)
    kept = (flat.abs() > threshold).to(flat.dtype)
    alpha = (kept * flat).abs().sum(dim=1, keepdim=True) / kept.sum(dim=1, keepdim=True)
    return pos - neg, torch.nan_to_num(alpha)


def binary_params(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """XTC's binary split of ``[groups, chunk]``: ``(sign codes, mean |x| per group)``."""
    return flat.sign(), flat.norm(p=1, dim=1, keepdim=True).div(flat.shape[1])


def ternary_values(flat: torch.Tensor) -> torch.Tensor:
    codes, alpha = ternary_params(flat)
    pos, neg = (codes > 0).to(flat.dtype), (codes < 0).to(flat.dtype)
    return alpha * pos - alpha * neg


def binary_values(flat: torch.Tensor) -> torch.Tensor:
    codes, mean = binary_params(flat)
    return codes.mul(mean)


def fake_quantize(
    x: torch.Tensor,
    bits: Bits,
    num_groups: int = 1,
    symmetric: bool = True,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The values ``x`` takes after quantization to ``bits`` (1: binary, 2: ternary, >= 3: integer)."""
    flat = group_view(x, num_groups)
    if isinstance(bits, int) and bits <= 2:
        if not symmetric or stochastic:
            raise ValueError("binary and ternary quantization are symmetric with nearest rounding (as in DeepSpeed)")
        values = binary_values(flat) if bits == 1 else ternary_values(flat)
        return values.reshape(x.shape)
    q, scale, zero = integer_codes(flat, bits, symmetric, _noise(flat, stochastic, generator))
    values = q * scale if zero is None else q * scale + zero
    return values.reshape(x.shape)


def straight_through(value: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``value`` in the forward, the identity's gradient to ``x`` in the backward (exactly ``value``)."""
    return value.detach() + (x - x.detach())


# ---------------------------------------------------------------------------------------------
# what the compression passes insert into graphs (bits, switches and ranges are 0-d/1-d tensors)
# ---------------------------------------------------------------------------------------------
def fake_quantize_weight(
    w: torch.Tensor,
    bits: torch.Tensor,
    enabled: torch.Tensor,
    real_ratio: torch.Tensor,
    *,
    num_groups: int,
    symmetric: bool,
    stochastic: bool,
    integer: bool,
    ternary: bool,
    binary: bool,
    mix_real: bool,
) -> torch.Tensor:
    """Weight fake quantization at the scheduled ``bits`` with a straight-through gradient.

    ``integer``/``ternary``/``binary`` say which quantizers the schedule can reach (bits >= 3, 2, 1);
    where several can, the current ``bits`` selects one. ``mix_real`` blends
    ``real_ratio * w + (1 - real_ratio) * q(w)`` (DeepSpeed's ``fp16_mixed_quantize``). ``enabled``
    is 0 before the technique's ``schedule_offset``: the weight passes unchanged.
    """
    flat = group_view(w, num_groups)
    value: torch.Tensor | None = None
    if integer:
        q, scale, zero = integer_codes(flat, bits, symmetric, _noise(flat, stochastic, None))
        value = q * scale if zero is None else q * scale + zero
    if ternary:
        t = ternary_values(flat)
        value = t if value is None else torch.where(bits == 2, t, value)
    if binary:
        b = binary_values(flat)
        value = b if value is None else torch.where(bits == 1, b, value)
    assert value is not None, "a weight quantizer needs at least one reachable bit width"
    value = value.reshape(w.shape)
    if mix_real:
        value = real_ratio * w + (1 - real_ratio) * value
    value = torch.where(enabled > 0, value, w)
    return straight_through(value, w)


def activation_values(x: torch.Tensor, *, bits: int, symmetric: bool, per: str) -> torch.Tensor:
    """Dynamic activation quantization: one group per token (``per="token"``: each row of the last
    dimension, DeepSpeed's Linear) or per sample (``per="sample"``: each leading index, its Conv2d)."""
    flat = x.reshape(-1, x.shape[-1]) if per == "token" else x.reshape(x.shape[0], -1)
    q, scale, zero = integer_codes(flat, bits, symmetric)
    return (q * scale if zero is None else q * scale + zero).reshape(x.shape)


def static_values(x: torch.Tensor, value_range: torch.Tensor, *, bits: int, symmetric: bool) -> torch.Tensor:
    """Activation quantization over a calibrated ``[min, max]`` (one group)."""
    low, high = value_range[0], value_range[1]
    levels = float(2**bits)
    if symmetric:
        scale = _nonzero(2 * torch.maximum(low.abs(), high) / levels)
        return torch.clamp((x / scale).round(), -levels / 2, levels / 2 - 1) * scale
    scale = _nonzero((high - low) / levels)
    zero = (low / scale).round() * scale
    return torch.clamp(((x - zero) / scale).round(), 0, levels - 1) * scale + zero


def fake_quantize_activation(x: torch.Tensor, enabled: torch.Tensor, *, bits: int, symmetric: bool, per: str) -> torch.Tensor:
    """``activation_values`` once ``enabled``, with a straight-through gradient."""
    value = activation_values(x, bits=bits, symmetric=symmetric, per=per)
    return straight_through(torch.where(enabled > 0, value, x), x)


def update_activation_range(x: torch.Tensor, value_range: torch.Tensor, momentum: float) -> torch.Tensor:
    """DeepSpeed's static range calibration: the first batch sets ``[min, max]``, then every batch
    moves it by ``momentum``; returns the new range (the caller writes it back)."""
    current = torch.stack([x.detach().amin(), x.detach().amax()]).to(value_range.dtype)
    start = torch.where(value_range[0] == value_range[1], current, value_range)
    return start * momentum + current * (1 - momentum)


def fake_quantize_static(x: torch.Tensor, value_range: torch.Tensor, enabled: torch.Tensor, *, bits: int, symmetric: bool) -> torch.Tensor:
    """``static_values`` once ``enabled``, with a straight-through gradient."""
    value = static_values(x, value_range, bits=bits, symmetric=symmetric)
    return straight_through(torch.where(enabled > 0, value, x), x)


def calibrate_and_quantize(x: torch.Tensor, value_range: torch.Tensor, enabled: torch.Tensor, *, bits: int, symmetric: bool, momentum: float) -> torch.Tensor:
    """Training-time static activation quantization: update the range in place, then quantize."""
    new_range = torch.where(enabled > 0, update_activation_range(x, value_range, momentum), value_range)
    value_range.copy_(new_range)
    return fake_quantize_static(x, value_range, enabled, bits=bits, symmetric=symmetric)


# ---------------------------------------------------------------------------------------------
# packed storage
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PackedWeight:
    """A quantized ``[N, K]`` matrix (a conv or embedding weight flattened to it).

    ``data``: int8 ``[N, K]`` codes for 8 bits (uint8 for asymmetric), else uint8
    ``[N, ceil(K / (8 // bits))]`` with ``8 // bits`` codes per byte, lowest bits first; signed
    codes are stored with an offset of ``2**(bits-1)``. ``scale`` (and ``zero`` when asymmetric):
    float32 ``[N, K // group_size]``; value = ``code * scale (+ zero)``. ``shape``: the original
    weight shape.
    """

    data: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    bits: int
    group_size: int
    shape: tuple[int, ...]

    @property
    def symmetric(self) -> bool:
        return self.zero is None

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def columns(self) -> int:
        return math.prod(self.shape[1:])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.zero) if t is not None)


def codes_per_byte(bits: int) -> int:
    if bits not in (8, 4, 2):
        raise ValueError(f"packed storage holds 8-, 4- or 2-bit codes, not {bits}")
    return 8 // bits


def code_offset(bits: int, symmetric: bool) -> int:
    """What is added to a code before it is stored (signed codes below 8 bits are stored unsigned)."""
    return 2 ** (bits - 1) if symmetric and bits < 8 else 0


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned integer codes ``[N, K]`` (values < 2**bits) ``8 // bits`` per byte along K."""
    per = codes_per_byte(bits)
    if per == 1:
        raise ValueError("8-bit codes are stored unpacked")
    rows, cols = codes.shape
    padded = torch.nn.functional.pad(codes.to(torch.int32), (0, (-cols) % per))
    groups = padded.reshape(rows, -1, per)
    shifts = torch.arange(per, dtype=torch.int32, device=codes.device) * bits
    return (groups << shifts).sum(dim=-1).to(torch.uint8)


def unpack_codes(data: torch.Tensor, bits: int, columns: int) -> torch.Tensor:
    """Inverse of ``pack_codes``: int32 codes ``[N, columns]``."""
    per = codes_per_byte(bits)
    shifts = torch.arange(per, dtype=torch.int32, device=data.device) * bits
    codes = (data.to(torch.int32).unsqueeze(-1) >> shifts) & (2**bits - 1)
    return codes.reshape(data.shape[0], -1)[:, :columns]


def row_group_size(numel: int, num_groups: int, columns: int) -> int:
    """Columns per row group that reproduce DeepSpeed's flat chunks exactly: ``gcd(chunk, columns)``."""
    return math.gcd(numel // num_groups, columns)


def _per_row(values: torch.Tensor, rows: int, columns: int, group_size: int, chunk: int) -> torch.Tensor:
    """Per-chunk values ``[groups, 1]`` spread to ``[rows, columns // group_size]`` row groups."""
    starts = torch.arange(rows, device=values.device)[:, None] * columns + torch.arange(0, columns, group_size, device=values.device)[None, :]
    return values.reshape(-1)[starts // chunk].to(torch.float32)


def quantize_weight(w: torch.Tensor, bits: int, num_groups: int = 1, symmetric: bool = True) -> PackedWeight:
    """Integer codes and scales whose dequantization equals ``fake_quantize(w, bits, num_groups, symmetric)``.

    Codes are stored in ``storage_bits(bits)``: 2 (binary, ternary), 4 (3, 4 bits) or 8 (5 to 8 bits).
    """
    shape = tuple(w.shape)
    rows, columns = shape[0], math.prod(shape[1:])
    flat = group_view(w.detach(), num_groups)
    chunk = flat.shape[1]
    group = row_group_size(w.numel(), num_groups, columns)
    zero: torch.Tensor | None = None
    if bits <= 2:
        if not symmetric:
            raise ValueError("binary and ternary quantization are symmetric")
        codes, scale = binary_params(flat) if bits == 1 else ternary_params(flat)
        stored_bits = 2
    else:
        codes, scale, zero_g = integer_codes(flat, bits, symmetric)
        zero = None if zero_g is None else _per_row(zero_g, rows, columns, group, chunk)
        stored_bits = storage_bits(bits)
    codes = codes.reshape(rows, columns).to(torch.int32)
    scales = _per_row(scale, rows, columns, group, chunk)
    return PackedWeight(store_codes(codes, stored_bits, zero is None), scales, zero, stored_bits, group, shape)


def storage_bits(bits: int) -> int:
    """The packed width that holds ``bits``-bit codes: 2 (binary, ternary), 4 (3, 4 bits) or 8."""
    if not 1 <= bits <= 8:
        raise ValueError(f"weights are stored with 1 to 8 bits, not {bits}")
    return 2 if bits <= 2 else 4 if bits <= 4 else 8


def store_codes(codes: torch.Tensor, bits: int, symmetric: bool) -> torch.Tensor:
    """Integer codes ``[N, K]`` in their storage form (int8/uint8 for 8 bits, packed below)."""
    if bits == 8:
        return codes.to(torch.int8 if symmetric else torch.uint8)
    return pack_codes(codes + code_offset(bits, symmetric), bits)


def stored_codes(packed: PackedWeight) -> torch.Tensor:
    """The integer codes ``[N, K]`` (int32) of a packed weight, offsets removed."""
    if packed.bits == 8:
        return packed.data.to(torch.int32)
    return unpack_codes(packed.data, packed.bits, packed.columns) - code_offset(packed.bits, packed.symmetric)


def dequantize(packed: PackedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight a ``PackedWeight`` stands for, in its original shape."""
    codes = stored_codes(packed).to(torch.float32)
    rows, columns = packed.rows, packed.columns
    scale = packed.scale.repeat_interleave(packed.group_size, dim=1)
    value = codes * scale
    if packed.zero is not None:
        value = value + packed.zero.repeat_interleave(packed.group_size, dim=1)
    return value.reshape(rows, columns).reshape(packed.shape).to(dtype)


def zero_code(packed: PackedWeight) -> torch.Tensor | None:
    """Per row group, the integer code whose value is exactly 0, or None where 0 is not a level."""
    if packed.zero is None:
        return torch.zeros_like(packed.scale, dtype=torch.int32)
    code = -(packed.zero / packed.scale)
    rounded = code.round()
    if not torch.equal(rounded, code) or bool(((rounded < 0) | (rounded > 2**packed.bits - 1)).any()):
        return None
    return rounded.to(torch.int32)


def mask_packed(packed: PackedWeight, keep: torch.Tensor) -> PackedWeight:
    """Set the entries where ``keep`` (shape ``[N, K]`` or the weight's) is 0 to the code of exactly 0."""
    zero = zero_code(packed)
    if zero is None:
        raise ValueError("an asymmetric group whose range excludes 0 cannot store a pruned (zero) weight exactly")
    codes = stored_codes(packed)
    keep2d = keep.reshape(packed.rows, packed.columns).to(torch.bool)
    zero_full = zero.repeat_interleave(packed.group_size, dim=1)
    codes = torch.where(keep2d, codes, zero_full)
    return replace(packed, data=store_codes(codes, packed.bits, packed.symmetric))


def select_rows(packed: PackedWeight, rows: torch.Tensor) -> PackedWeight:
    """Keep the rows whose ``rows`` flag is set (output features of a pruned layer)."""
    index = rows.nonzero().reshape(-1)
    zero = None if packed.zero is None else packed.zero[index]
    shape = (int(index.numel()), *packed.shape[1:])
    return PackedWeight(packed.data[index], packed.scale[index], zero, packed.bits, packed.group_size, shape)


def select_columns(packed: PackedWeight, keep: torch.Tensor, inner: int = 1) -> PackedWeight:
    """Keep the input features whose ``keep`` flag is set; each feature spans ``inner`` stored
    columns (a conv's kernel window). Scales follow their columns exactly: the new group size is
    the largest that never splits a run of columns sharing a scale."""
    columns = packed.columns
    keep_cols = keep.to(torch.bool).repeat_interleave(inner)
    if keep_cols.numel() != columns:
        raise ValueError(f"column mask of {keep_cols.numel()} entries for a weight of {columns} columns")
    index = keep_cols.nonzero().reshape(-1)
    new_columns = int(index.numel())
    group_of = index // packed.group_size
    boundaries = (group_of[1:] != group_of[:-1]).nonzero().reshape(-1) + 1
    group = new_columns
    for b in boundaries.tolist():
        group = math.gcd(group, b)
    group = max(group, 1)
    starts = torch.arange(0, new_columns, group, device=index.device)
    old_groups = group_of[starts]
    codes = stored_codes(packed)[:, index]
    zero = None if packed.zero is None else packed.zero[:, old_groups]
    shape = (packed.shape[0], new_columns // inner, *packed.shape[2:]) if len(packed.shape) > 2 else (packed.shape[0], new_columns)
    return PackedWeight(store_codes(codes, packed.bits, packed.symmetric), packed.scale[:, old_groups], zero, packed.bits, group, shape)


def embedding_rows(packed: PackedWeight, indices: torch.Tensor) -> torch.Tensor:
    """``F.embedding(indices, dequantize(packed))`` reading only the looked-up rows."""
    rows = PackedWeight(
        packed.data[indices.reshape(-1)],
        packed.scale[indices.reshape(-1)],
        None if packed.zero is None else packed.zero[indices.reshape(-1)],
        packed.bits,
        packed.group_size,
        (indices.numel(), *packed.shape[1:]),
    )
    return dequantize(rows).reshape(*indices.shape, packed.columns)
