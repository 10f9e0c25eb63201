"""Hand the transformed graphs to Inductor, PyTorch's own code generator (the CPU default).

``torch.compile(backend="inductor")`` runs more than ``compile_fx_inner``: its AOTAutograd
partition function first runs Inductor's joint-graph passes, and Inductor's lowerings rely on
them. The one that matters for correctness is ``replace_random``: it rewrites ``aten.rand`` /
``aten.randn`` (what dropout decomposes to) into Inductor's seeded RNG (``inductor_seeds`` +
``inductor_random``); Inductor's lowering of a bare ``aten.rand`` is an assertion ("should have
been handled in replace_random.py"). dscompile owns the partition function, so this lowering
declares the joint-graph passes as its ``prepare_joint`` step and the frontend runs them after
dscompile's joint passes, just before partitioning, as Inductor itself does. Recompute tags set
by the checkpointing pass survive the rewrite (Inductor's pattern matcher copies ``recompute``
onto replacement nodes) and the seeds tensor is saved, not re-drawn, so a recomputed dropout
reuses its forward mask.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from dscompile.backends import register_lowering


def inductor_decomposition_table() -> dict:
    """Inductor's decomposition table, ready to trace with.

    Some of its entries (max_pool2d_with_indices) call ``torch._inductor.lowering`` at trace time
    without importing it; ``torch.compile(backend="inductor")`` has imported it by then, a custom
    backend has not, so import it here.
    """
    import torch._inductor.lowering  # noqa: F401  (see docstring)
    from torch._inductor.decomposition import select_decomp_table

    return dict(select_decomp_table())


def _input_device(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> torch.device | None:
    for value in example_inputs:
        if isinstance(value, torch.Tensor):
            return value.device
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        if node.op == "placeholder" and isinstance(value, torch.Tensor):
            return value.device
    return None


def inductor_joint_passes(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> torch.fx.GraphModule:
    """Run Inductor's joint-graph passes (random-op replacement, pattern rewrites) as its own partition step does."""
    from torch._guards import detect_fake_mode
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes
    from torch._inductor.virtualized import V

    fake_mode = detect_fake_mode(list(example_inputs)) or detect_fake_mode(
        [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    )
    if fake_mode is None:
        raise RuntimeError("inductor lowering: the joint graph carries no fake tensors; cannot run Inductor's joint-graph passes")
    with V.set_fake_mode(fake_mode):
        return joint_graph_passes(gm, _input_device(gm, example_inputs))


@register_lowering("inductor", decompositions=inductor_decomposition_table, prepare_joint=inductor_joint_passes)
def lower_inductor(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], ctx: Any) -> Callable[..., Any]:
    """Compile the graph with Inductor's ``compile_fx_inner`` (C++/OpenMP on CPU, Triton on GPU).

    A ``torch.compile(mode=...)`` other than ``"default"`` (``ctx.analysis["mode"]``) applies
    Inductor's option set for that mode, as ``backend="inductor"`` would. A pass that scheduled the
    graph's collectives itself leaves Inductor options for that graph kind in
    ``ctx.analysis["inductor_config"][kind]`` (``tp_overlap``: no reordering for peak memory, which would
    put the waits back next to their collectives).
    """
    import torch._inductor
    from torch._inductor.compile_fx import compile_fx_inner

    kwargs: dict[str, Any] = {"is_backward": ctx.graph_kind == "backward", "is_inference": ctx.is_inference}
    if ctx.graph_kind != "backward":
        # Parameters and buffers are the leading inputs of an AOT forward graph; telling Inductor
        # they are static lets it skip copying them.
        kwargs["static_input_idxs"] = sorted(ctx.param_names)
    mode = ctx.analysis.get("mode")
    patches = torch._inductor.list_mode_options(mode) if mode not in (None, "default") else {}
    # a scheduling pass that ordered the graph itself (tp_overlap) asks Inductor to keep that order
    patches = patches | ctx.analysis.get("inductor_config", {}).get(ctx.graph_kind, {})
    with torch._inductor.config.patch(patches):
        return compile_fx_inner(gm, list(example_inputs), **kwargs)
