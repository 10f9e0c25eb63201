"""dscompile's own lowering: fused regions run as generated Triton kernels, the rest as aten.

Each ``call_module`` region left by the ``fuse`` pass (the lowering runs the partitioning
itself when the pipeline had no ``fuse``) is replaced by a ``TritonRegion`` that launches the
region's kernel; regions the codegen rejects keep their FX submodule and run op by op, with
the reason logged. On a GPU, matmuls with a bias/activation/residual epilogue are folded into
one kernels/matmul_epilogue.py template call before the regions are formed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from dscompile.backends import register_lowering
from dscompile.backends.triton.generate import generate_kernel, region_parts
from dscompile.backends.triton.specs import CodegenUnsupported, KernelSource, TensorSpec, output_spec_for

log = logging.getLogger("dscompile.backends.triton")

aten = torch.ops.aten


def _var_mean_decomposition(x: torch.Tensor, dim: Any = None, *, correction: Any = None, keepdim: bool = False) -> Any:
    """var_mean as two trailing reductions (the row is in one tile, so two passes cost nothing)."""
    dims = list(range(x.dim())) if dim is None else ([dim] if isinstance(dim, int) else list(dim))
    n = 1
    for d in dims:
        n *= x.shape[d]
    corr = 1 if correction is None else correction
    mean = torch.ops.aten.mean.dim(x, dims, True)
    centered = torch.ops.aten.sub.Tensor(x, mean)
    var = torch.ops.aten.sum.dim_IntList(torch.ops.aten.mul.Tensor(centered, centered), dims, keepdim)
    var = torch.ops.aten.div.Scalar(var, max(n - corr, 0))
    if not keepdim:
        mean = torch.ops.aten.squeeze.dims(mean, dims)
    return var, mean


def triton_decompositions() -> dict:
    """Inductor's table (layer norm, softmax, losses → pointwise + reductions) plus var_mean.

    ``gelu`` and ``silu`` stay whole: the codegen has rules for them and the matmul-epilogue
    template matches them as activations.
    """
    from dscompile.backends.triton.kernel_cache import ensure_runnable

    ensure_runnable()  # before Inductor's import pulls in triton
    from dscompile.backends.inductor import inductor_decomposition_table

    table = inductor_decomposition_table()
    table[aten.var_mean.correction] = _var_mean_decomposition
    for op in (aten.gelu.default, aten.silu.default):
        table.pop(op, None)
    return table


class TritonRegion(torch.nn.Module):
    """Runs one region's kernel; re-specialises when runtime strides differ from the traced ones."""

    def __init__(self, name: str, fallback: torch.fx.GraphModule, kernel: Any, src: KernelSource) -> None:
        super().__init__()
        self.region_name = name
        self.fallback = fallback
        self.kernel = kernel
        self.src = src
        self.variants: dict[tuple, Any] = {tuple(src.input_specs): kernel}

    def forward(self, *args: Any) -> Any:
        from dscompile.backends.triton.kernel_cache import get_kernel

        specs = tuple(TensorSpec.of(a) for a in args)
        kernel = self.variants.get(specs)
        if kernel is None:
            try:
                placeholders, nodes, outputs, is_tuple = region_parts(self.fallback)
                src = generate_kernel(placeholders, nodes, outputs, specs, self.src.output_specs, is_tuple)
                kernel = get_kernel(src)
            except CodegenUnsupported as exc:
                log.info("%s: runtime strides not generated (%s); running aten", self.region_name, exc)
                kernel = self.fallback
            self.variants[specs] = kernel
        return kernel(*args)


def _compile_region(gm: torch.fx.GraphModule, node: torch.fx.Node, sub: torch.fx.GraphModule) -> tuple[Any, KernelSource]:
    from dscompile.backends.triton.kernel_cache import get_kernel

    placeholders, nodes, outputs, is_tuple = region_parts(sub)
    input_specs = [TensorSpec.of(a.meta["val"]) for a in node.args]
    output_specs = [output_spec_for(o.meta["val"]) for o in outputs]
    src = generate_kernel(placeholders, nodes, outputs, input_specs, output_specs, is_tuple)
    return get_kernel(src), src


def lower_regions(gm: torch.fx.GraphModule, ctx: Any = None) -> dict[str, Any]:
    """Replace the region submodules the ``fuse`` pass made by kernel launchers; returns {region: KernelSource | reason}."""
    from dscompile.backends.assignment import REGION_PREFIX
    from dscompile.graph import ds_meta

    results: dict[str, Any] = {}
    for node in gm.graph.nodes:
        if node.op != "call_module" or not str(node.target).startswith(REGION_PREFIX):
            continue
        sub = getattr(gm, node.target)
        if isinstance(sub, TritonRegion):
            results[node.target] = sub.src
            continue
        try:
            kernel, src = _compile_region(gm, node, sub)
        except CodegenUnsupported as exc:
            log.info("%s: region runs as aten (%s)", node.target, exc)
            ds_meta(node)["fusion_skip_reason"] = f"codegen: {exc}"
            results[node.target] = str(exc)
            continue
        ds_meta(node)["kernel"] = src.name
        setattr(gm, node.target, TritonRegion(node.target, sub, kernel, src))
        results[node.target] = src
    return results


@register_lowering("triton", decompositions=triton_decompositions, required_passes=("fuse",))
def lower_triton(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], ctx: Any) -> Callable[..., Any]:
    """Fused regions become generated Triton kernels; matmuls and the rest run as aten calls."""
    from torch._functorch.aot_autograd import make_boxed_func

    from dscompile.backends.triton.kernel_cache import interpreting

    devices = {a.device.type for a in example_inputs if isinstance(a, torch.Tensor)}
    if devices == {"cpu"} and torch.cuda.is_available() and not interpreting():
        # Compiled kernels take GPU tensors; CPU tensors on a GPU machine run the graph as aten.
        log.warning("%s: CPU tensors on a machine with CUDA: regions run as aten (set TRITON_INTERPRET=1 to interpret)", getattr(ctx, "graph_name", "graph"))
        return make_boxed_func(gm.forward)
    results = lower_regions(gm, ctx)
    gm.recompile()
    from dscompile.backends.triton.kernel_cache import LOWERED_GRAPHS

    sources = [r for r in results.values() if isinstance(r, KernelSource)]
    templates = sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.meta.get("dscompile", {}).get("kernel") == "matmul_epilogue")
    summary = {"regions": len(results), "kernels": len(sources), "kernel_names": [s.name for s in sources], "matmul_templates": templates}
    if ctx is not None:
        ctx.analysis.setdefault("triton", {})[ctx.graph_name] = summary
        LOWERED_GRAPHS[ctx.graph_name] = summary
        dump = getattr(getattr(ctx, "config", None), "dump", None)
        if dump:
            from dscompile.backends.assignment import region_report
            from dscompile.backends.triton.kernel_cache import write_dump

            path = write_dump(sources, dump, ctx.graph_name)
            (path.parent / "regions.txt").write_text(region_report(gm))
    return make_boxed_func(gm.forward)
