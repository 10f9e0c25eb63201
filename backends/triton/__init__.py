"""dscompile's Triton lowering: fused regions become generated Triton kernels (rules in README.md).

``backends/__init__.py`` imports this package by name; importing ``lowering`` registers ``lower: triton``.
"""

from __future__ import annotations

from dscompile.backends.triton.lowering import TritonRegion, lower_regions, lower_triton, triton_decompositions

__all__ = ["TritonRegion", "lower_regions", "lower_triton", "triton_decompositions"]
