"""The ``amp`` pass: casts inserted on the Dynamo graph, annotated and folded on AOTAutograd's graphs.

On ``pre_autograd`` it runs ``_CastInserter``; on ``forward``/``backward`` it records each node's dtype and the
parameter casts. Either way it folds redundant casts and records the counts (``ctx.analysis["amp"]``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.fx

from dscompile.graph import ds_meta, fake_mode_of
from dscompile.passes.mixed_precision.config import LOW_DTYPES
from dscompile.passes.mixed_precision.folding import _dtype, cast_source, count_casts, fold_casts
from dscompile.passes.mixed_precision.insert import _CastInserter
from dscompile.pipeline import PassContext, register_pass

log = logging.getLogger("dscompile.passes.amp")

@dataclass
class AmpOptions:
    dtype: Literal["bf16", "fp16"] = field(default="bf16", metadata={"help": "low precision: bf16 | fp16"})
    policy: Literal["default", "autocast"] = field(
        default="default",
        metadata={"help": "default: norms/softmax/losses in fp32 everywhere; autocast: torch.autocast's lists for the device"},
    )
    cleanup: bool = field(default=True, metadata={"help": "fold redundant casts"})
    zero3_gather: Literal["low", "exact"] = field(
        default="low",
        metadata={
            "help": "ZeRO-3 all-gathers: low moves every parameter's low-precision copy (half the bytes, fp32 users read it "
            "upcast); exact lowers only gathers whose users all compute in the low precision"
        },
    )


def _has_user_autocast(gm: torch.fx.GraphModule) -> bool:
    names = {"_enter_autocast", "_exit_autocast"}
    return any(n.op == "call_function" and getattr(n.target, "__name__", "") in names for n in gm.graph.nodes)


def _annotate_aot_graph(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    params = {placeholders[i]: name for i, name in ctx.param_names.items() if i < len(placeholders)}
    for node in gm.graph.nodes:
        dtype = _dtype(node)
        if dtype is not None and dtype.is_floating_point and node.op != "output":
            ds_meta(node)["dtype"] = dtype
        found = cast_source(node)
        if found is not None:
            ds_meta(node)["amp"] = "cast"
            if found[0] in params:
                ds_meta(node)["amp_param_cast"] = params[found[0]]


@register_pass("amp", graphs=("pre_autograd", "forward", "backward"), options=AmpOptions)
def amp_pass(gm: torch.fx.GraphModule, ctx: PassContext, options: AmpOptions) -> torch.fx.GraphModule:
    """Give each op its compute dtype (low precision for matmuls, fp32 for sensitive ops) and fold redundant casts."""
    low = LOW_DTYPES[options.dtype]
    stats: dict[str, Any] = {"dtype": options.dtype, "policy": options.policy, "casts_inserted": 0}
    stats["casts_in_input"] = count_casts(gm)
    if ctx.graph_kind == "pre_autograd":
        if fake_mode_of(gm) is None:
            log.warning("%s: graph has no fake values; left unchanged (amp needs a Dynamo-captured graph)", ctx.graph_name)
            return gm
        if _has_user_autocast(gm):
            log.warning("%s: the model already uses torch.autocast; amp leaves this graph unchanged", ctx.graph_name)
            return gm
        inserter = _CastInserter(gm, ctx, low, options.policy, options.zero3_gather)
        stats["zero3_gathers_lowered"] = len(inserter.low_gathers)
        stats["casts_inserted"] = inserter.run()
        stats["casts_requested"] = inserter.requests
        stats["ops_by_rule"] = dict(inserter.rules)
    else:
        _annotate_aot_graph(gm, ctx)
    stats["casts_before_cleanup"] = count_casts(gm)
    removed = fold_casts(gm) if options.cleanup else 0
    stats["casts_removed"] = removed
    stats["casts_after_cleanup"] = count_casts(gm)
    ctx.analysis.setdefault("amp", {})[ctx.graph_name] = stats
    output = next(n for n in gm.graph.nodes if n.op == "output")
    ds_meta(output)["amp"] = {k: v for k, v in stats.items() if k != "ops_by_rule"}
    log.info("%s: %s casts before cleanup, %s after", ctx.graph_name, stats["casts_before_cleanup"], stats["casts_after_cleanup"])
    gm.recompile()
    return gm
