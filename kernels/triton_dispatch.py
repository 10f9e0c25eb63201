"""Which implementation of a kernel with a Triton and a torch spelling runs: the choice on a device.

``auto`` is the Triton kernel on CUDA tensors when triton imports, the torch path elsewhere (on CPU
the torch path is what Inductor compiles and fuses). ``triton`` can also be forced on CPU tensors
under Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is imported): how the tests
run the kernels without a GPU.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

IMPLS = ("auto", "triton", "torch")


@functools.cache
def triton_importable() -> bool:
    """Whether the ``triton`` package is installed (checked once, without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Triton kernels run in Triton's interpreter (CPU tensors) in this process."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_available(x: torch.Tensor) -> bool:
    """A Triton kernel can run on ``x``: a CUDA tensor, or any tensor under Triton's interpreter."""
    return triton_importable() and (x.is_cuda or interpreting())


def resolve_impl(impl: str, device: torch.device) -> str:
    """The implementation ``impl`` names on ``device``: ``auto`` is ``triton`` on CUDA when triton imports, else ``torch``."""
    if impl == "auto":  # on every op call: kept to an attribute read and a cached lookup
        kind = device.type if isinstance(device, torch.device) else torch.device(device).type
        return "triton" if kind == "cuda" and triton_importable() else "torch"
    if impl not in IMPLS:
        raise ValueError(f"impl {impl!r} is not one of {', '.join(IMPLS)}")
    return impl
