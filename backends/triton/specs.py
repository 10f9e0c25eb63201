"""What generated kernels are specialised on and typed with; the bottom of the Triton codegen.

The error every rule raises when it cannot express a region, the shape/stride/dtype a kernel is specialised on,
the Triton dtype of a torch dtype, and a generated value with how it (or a constant) is cast in Triton source.
It imports no other codegen module, so all of them can import it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


class CodegenUnsupported(Exception):
    """The region (or node) cannot be generated; the message says why."""


@dataclass(frozen=True)
class TensorSpec:
    """What a kernel is specialised on for one tensor: shape, strides and dtype."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @staticmethod
    def of(t: torch.Tensor) -> TensorSpec:
        return TensorSpec(tuple(int(s) for s in t.shape), tuple(int(s) for s in t.stride()), t.dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def contiguous_strides(shape: Sequence[int]) -> list[int]:
    """Row-major strides of ``shape``."""
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    return list(reversed(strides))


def output_spec_for(value: torch.Tensor) -> TensorSpec:
    """Outputs keep the strides AOTAutograd traced when they are dense, else become contiguous."""
    from torch._prims_common import is_non_overlapping_and_dense_or_false as is_non_overlapping_and_dense

    if is_non_overlapping_and_dense(value):
        return TensorSpec.of(value)
    shape = tuple(int(s) for s in value.shape)
    return TensorSpec(shape, tuple(contiguous_strides(shape)), value.dtype)


TL_DTYPES = {
    torch.float32: "tl.float32",
    torch.float16: "tl.float16",
    torch.bfloat16: "tl.bfloat16",
    torch.float64: "tl.float64",
    torch.int64: "tl.int64",
    torch.int32: "tl.int32",
    torch.int16: "tl.int16",
    torch.int8: "tl.int8",
    torch.uint8: "tl.uint8",
    torch.bool: "tl.int1",
}


def tl_dtype(dtype: torch.dtype) -> str:
    if dtype not in TL_DTYPES:
        raise CodegenUnsupported(f"dtype {dtype} is not generated")
    return TL_DTYPES[dtype]


def compute_float(dtype: torch.dtype) -> torch.dtype:
    """Half types compute in fp32 (as eager does per op); fp64 stays fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class Value:
    """A value the kernel computes: its variable name, dtype, and whether it varies along the reduction (``r``)."""

    name: str
    dtype: torch.dtype
    rdep: bool


def literal(value: Any) -> str:
    """A Python constant as Triton source."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        if math.isinf(value):
            return 'float("inf")' if value > 0 else 'float("-inf")'
        if math.isnan(value):
            return 'float("nan")'
        return repr(value)
    if isinstance(value, int):
        return str(value)
    raise CodegenUnsupported(f"cannot embed constant {value!r}")


def cast(v: Value | Any, dtype: torch.dtype) -> str:
    """Triton source for ``v`` (a generated value or a Python constant) as ``dtype``."""
    if not isinstance(v, Value):
        return literal(v)
    if v.dtype == dtype:
        return v.name
    if dtype == torch.bool:
        return f"({v.name} != 0)"
    return f"{v.name}.to({tl_dtype(dtype)})"


@dataclass
class KernelSource:
    """Generated source plus what the launcher needs to run it."""

    name: str
    source: str
    kind: str  # "pointwise" | "reduction"
    xnumel: int
    rnumel: int
    rblock: int
    input_specs: tuple[TensorSpec, ...]
    output_specs: tuple[TensorSpec, ...]
    output_is_tuple: bool
    key: str
    index_int64: bool
    notes: list[str] = field(default_factory=list)
