"""Load generated kernel source once per region key and launch it (triton is imported lazily).

The cache is process-wide: a region with the same structure, dtypes, shapes and strides compiles
once however many graphs or compiles contain it. Launch and hit counters back the tests and the
benchmark's kernel counts.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dscompile.backends.triton.specs import KernelSource


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    launches: int = 0


STATS = CacheStats()
# graph name -> {"regions": n, "kernels": n, "kernel_names": [...]}, filled by the lowering.
LOWERED_GRAPHS: dict[str, dict] = {}
_CACHE: dict[str, CompiledKernel] = {}
_LOCK = threading.Lock()


log = logging.getLogger("dscompile.backends.triton")


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpret_without_gpu() -> bool:
    """Switch Triton's interpreter on where no GPU can run kernels and the user chose nothing; True if switched.

    Only effective before triton is imported (see ``ensure_runnable``)."""
    if "TRITON_INTERPRET" in os.environ or torch.cuda.is_available():
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    return True


def ensure_runnable() -> None:
    """Without a GPU, generated kernels can only run in Triton's interpreter: switch it on.

    Triton decides at decoration time, and ``triton.language`` decorates its own helpers
    (``tl.sum``...) when imported, so this works only before triton is imported (the triton
    lowering calls it when a compile starts); after that it raises a clear error.
    """
    if interpreting() or torch.cuda.is_available():
        return
    standard = sys.modules.get("triton.language.standard")
    if standard is not None and type(getattr(standard, "sum", None)).__name__ != "InterpretedFunction":
        from dscompile.errors import DSCompileConfigError

        raise DSCompileConfigError(
            "lower",
            "'triton' without a GPU runs Triton's interpreter, which must be on before triton is imported, and triton is already imported",
            "start Python with TRITON_INTERPRET=1 in the environment, or use lower='inductor' (the CPU default)",
        )
    log.warning("no CUDA device: running dscompile's Triton kernels in Triton's interpreter (TRITON_INTERPRET=1), which is slow")
    os.environ["TRITON_INTERPRET"] = "1"  # also where the variable is set to "0": no GPU can run the kernels


def _source_dir() -> Path:
    root = Path(os.environ.get("DSCOMPILE_KERNEL_DIR") or Path(tempfile.gettempdir()) / f"dscompile_kernels_{os.getuid()}")
    root.mkdir(parents=True, exist_ok=True)
    return root


def _block_configs(src: KernelSource) -> list[dict[str, int]]:
    """Tile sizes from the problem size; several candidates when autotuning on a GPU."""
    if src.kind == "pointwise":
        if interpreting():
            return [{"XBLOCK": min(_pow2(src.xnumel), 16384)}]
        return [{"XBLOCK": b} for b in (256, 512, 1024) if b <= max(_pow2(src.xnumel), 256)]
    if interpreting():
        return [{"XBLOCK": max(1, min(_pow2(src.xnumel), 65536 // src.rblock))}]
    cap = max(1, min(_pow2(src.xnumel), 8192 // src.rblock))
    return [{"XBLOCK": b} for b in (1, 2, 4, 8, 16, 32) if b <= cap] or [{"XBLOCK": 1}]


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class CompiledKernel:
    """A loaded kernel and its launch: allocate outputs, pick the grid, run."""

    def __init__(self, src: KernelSource) -> None:
        import triton

        ensure_runnable()
        self.src = src
        path = _source_dir() / f"{src.name}.py"
        if not path.exists() or path.read_text() != src.source:
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(src.source)
            tmp.replace(path)
        spec = importlib.util.spec_from_file_location(f"dscompile_kernels.{src.name}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        fn = getattr(module, src.name)
        self.configs = _block_configs(src)
        if len(self.configs) > 1:
            warps = 4 if src.kind == "pointwise" else 8
            fn = triton.autotune([triton.Config(c, num_warps=warps) for c in self.configs], key=[])(fn)
            self.fixed: dict[str, int] = {}
        else:
            self.fixed = dict(self.configs[0])
        if src.kind == "reduction":
            self.fixed["RBLOCK"] = src.rblock
        self.fn = fn
        self.path = path

    def __call__(self, *inputs: torch.Tensor) -> Any:
        device = next((a.device for a in inputs if a.device.type != "cpu"), None)
        if device is not None:
            # AOTAutograd keeps Python scalars of the graph as 0-dim CPU tensors (Inductor passes them by value);
            # a compiled kernel reads every input through a pointer, so such a scalar moves to the GPU first
            inputs = tuple(a.to(device, non_blocking=True) if a.device.type == "cpu" else a for a in inputs)
        elif not interpreting() and torch.cuda.is_available():
            # no GPU input (a region that only creates values, e.g. zeros in a backward): compiled kernels run on
            # the GPU (the lowering runs CPU graphs as aten on a machine with CUDA)
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
        outs = [torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device=device) for s in self.src.output_specs]
        xnumel = self.src.xnumel
        grid = lambda meta: (triton_cdiv(xnumel, meta["XBLOCK"]),)
        self.fn[grid](*inputs, *outs, **self.fixed)
        STATS.launches += 1
        if self.src.output_is_tuple:
            return tuple(outs)
        return outs[0]


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def get_kernel(src: KernelSource) -> CompiledKernel:
    """The compiled kernel for this source's key, compiling it on first use."""
    with _LOCK:
        kernel = _CACHE.get(src.key)
        if kernel is not None:
            STATS.hits += 1
            return kernel
        STATS.misses += 1
        kernel = CompiledKernel(src)
        _CACHE[src.key] = kernel
        return kernel


def cached(key: str) -> bool:
    return key in _CACHE


def clear_cache() -> None:
    with _LOCK:
        _CACHE.clear()
        STATS.hits = STATS.misses = STATS.launches = 0
        LOWERED_GRAPHS.clear()


def write_dump(sources: Sequence[KernelSource], dump_dir: str, graph_name: str) -> Path:
    """Write each kernel's source into ``<dump>/<graph_name>/kernels/``."""
    target = Path(dump_dir) / graph_name / "kernels"
    target.mkdir(parents=True, exist_ok=True)
    for src in sources:
        (target / f"{src.name}.py").write_text(src.source)
    return target
