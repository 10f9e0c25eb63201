"""The reference lowering: run the transformed FX graph as Python, op by op."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.fx

from dscompile.backends import register_lowering


@register_lowering("eager")
def lower_eager(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], ctx: Any) -> Callable[..., Any]:
    """Run the graph as is: the numerics reference for every other lowering."""
    from torch._functorch.aot_autograd import make_boxed_func

    return make_boxed_func(gm.forward)
