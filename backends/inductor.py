"""Hand the transformed graphs to Inductor, PyTorch's own code generator (the CPU default)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.fx

from dscompile.backends import register_lowering


def _inductor_decompositions() -> dict:
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


@register_lowering("inductor", decompositions=_inductor_decompositions)
def lower_inductor(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], ctx: Any) -> Callable[..., Any]:
    """Compile the graph with Inductor's ``compile_fx_inner`` (C++/OpenMP on CPU, Triton on GPU).

    A ``torch.compile(mode=...)`` other than ``"default"`` (``ctx.analysis["mode"]``) applies
    Inductor's option set for that mode, as ``backend="inductor"`` would.
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
    with torch._inductor.config.patch(patches):
        return compile_fx_inner(gm, list(example_inputs), **kwargs)
