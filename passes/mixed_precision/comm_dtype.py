"""The ``comm_dtype`` pass: ZeRO-2/3 gradient reduce-scatters in ``communication_data_type``.

It casts each gradient before ``dscompile::zero_reduce_scatter`` and the averaged shard back after; it runs before
``zero`` turns those ops into collectives, so the collective and its buckets inherit the dtype.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.fx

from dscompile.graph import ds_meta, set_fake_value
from dscompile.passes.mixed_precision.config import COMM_DTYPES
from dscompile.passes.mixed_precision.folding import _dtype
from dscompile.pipeline import PassContext, register_pass
from dscompile.runtime import zero_ops

log = logging.getLogger("dscompile.passes.amp")

aten = torch.ops.aten

@dataclass
class CommDtypeOptions:
    dtype: Literal["fp32", "fp16", "bf16"] = field(default="fp32", metadata={"help": "dtype gradients are reduced in"})


@register_pass("comm_dtype", graphs=("backward",), options=CommDtypeOptions)
def comm_dtype_pass(gm: torch.fx.GraphModule, ctx: PassContext, options: CommDtypeOptions) -> torch.fx.GraphModule:
    """Reduce-scatter every ZeRO gradient in ``dtype``: cast the gradient before, the averaged shard back after.

    Runs before ``zero`` (which turns ``dscompile::zero_reduce_scatter`` into functional collectives),
    so the collective inherits the dtype and bucketing groups gradients of one dtype together.
    """
    comm = COMM_DTYPES[options.dtype]
    graph = gm.graph
    stats = {"dtype": options.dtype, "reduce_scatters": 0, "recast": 0}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not zero_ops.REDUCE_SCATTER:
            continue
        stats["reduce_scatters"] += 1
        grad = node.args[0]
        dtype = _dtype(grad) if isinstance(grad, torch.fx.Node) else None
        if dtype is None or not dtype.is_floating_point or dtype == comm:
            continue
        with graph.inserting_before(node):
            down = graph.call_function(aten._to_copy.default, (grad,), {"dtype": comm})
        set_fake_value(down)
        ds_meta(down).update(dtype=comm, amp="cast", amp_cast={"reason": "communication", "source": grad.name})
        node.args = (down, *node.args[1:])
        set_fake_value(node)
        ds_meta(node)["dtype"] = comm
        with graph.inserting_after(node):
            back = graph.call_function(aten._to_copy.default, (node,), {"dtype": dtype})
        node.replace_all_uses_with(back, delete_user_cb=lambda user, keep=back: user is not keep)
        set_fake_value(back)
        ds_meta(back).update(dtype=dtype, amp="cast", amp_cast={"reason": "communication", "source": node.name})
        stats["recast"] += 1
    if stats["reduce_scatters"] == 0 and any(
        n.op == "call_function" and n.target is torch.ops._c10d_functional.reduce_scatter_tensor.default for n in graph.nodes
    ):
        log.warning("%s: comm_dtype found only functional reduce-scatters: put it before 'zero' in the pipeline", ctx.graph_name)
    ctx.analysis.setdefault("comm_dtype", {})[ctx.graph_name] = stats
    gm.recompile()
    return gm
