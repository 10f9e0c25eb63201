"""Pruning as a graph pass (``prune``): sparse, row, head and channel masks on the Dynamo graph.

For every weight whose layer ``init_compression`` prepared with a pruning technique, the pass
multiplies the weight (after the ``quantize`` pass's fake quantization, DeepSpeed's order) by its
mask: element-wise (``sparse``), per output row (``row``; the bias too), per attention head over
the input columns of the output projection (``head``) or per output channel of a Conv2d
(``channel``; the bias too). A mask is a state buffer (l1 and snip_momentum decide it from the
weights or gradients, on the schedule) or, for ``topk``, ``learned_mask`` of trainable scores whose
gradient the straight-through estimator provides. Each mask is gated by its technique's switch.

Why a graph pass: as for quantization, the mask then applies wherever the weight is read (ZeRO's
gathered copy, under checkpointing, before mixed precision's casts) with no module swapped, and
AOTAutograd derives the masked gradients. Physically removing pruned rows, heads and channels
changes parameter shapes and the layers that consume them, which the optimizer and the state_dict
see: that is ``redundancy_clean``'s job, on modules, once training is over.

Metadata: inserted nodes carry ``meta["dscompile"]["compression"] = {"layer", "role": "weight" |
"bias", "technique": "sparse_pruning" | "row_pruning" | "head_pruning" | "channel_pruning"}``.
"""

from __future__ import annotations

import logging

import torch
import torch.fx

from dscompile.errors import DSCompilePassError
from dscompile.kernels.masks import apply_head_mask, apply_row_mask, apply_sparse_mask, learned_mask, mask_vector
from dscompile.passes.compression import CONV_OPS, LINEAR_OPS, Site, compression_sites, insert_after, insert_before, lift, replace_weight, require_prepared
from dscompile.pipeline import PassContext, register_pass

log = logging.getLogger("dscompile.passes.prune")

_APPLY = {"sparse": apply_sparse_mask, "row": apply_row_mask, "head": apply_head_mask, "channel": apply_row_mask}


def _mask_node(gm: torch.fx.GraphModule, site: Site, technique: str) -> torch.fx.Node:
    state = site.state
    spec = state.masks[technique]
    if spec.method == "topk":
        scores = lift(gm, site, f"{technique}_scores")
        return insert_after(gm, scores, learned_mask, (scores, spec.dense_ratio), {}, state.layer_name, "mask", f"{technique}_pruning")
    return lift(gm, site, f"{technique}_mask")


def _position(gm: torch.fx.GraphModule):
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return lambda node: order[node]


def prune_site(gm: torch.fx.GraphModule, site: Site) -> int:
    state = site.state
    count = 0
    for technique in ("sparse", "row", "head", "channel"):
        spec = state.masks.get(technique)
        if spec is None:
            continue
        mask = _mask_node(gm, site, technique)
        on = lift(gm, site, f"{technique}_on")
        head = site.head()
        kwargs = {"num_heads": spec.num_heads} if technique == "head" else {}
        anchor = max((head, mask, on), key=_position(gm))
        node = insert_after(gm, anchor, _APPLY[technique], (head, mask, on), kwargs, state.layer_name, "weight", f"{technique}_pruning")
        replace_weight(site, node)
        if technique in ("row", "channel"):
            _mask_biases(gm, site, technique, mask, on)
        count += 1
    return count


def _mask_biases(gm: torch.fx.GraphModule, site: Site, technique: str, mask: torch.fx.Node, on: torch.fx.Node) -> None:
    """Row and channel pruning zero the bias of a pruned output too (DeepSpeed does)."""
    for user in site.consumers():
        ops = LINEAR_OPS if technique == "row" else CONV_OPS
        if user.op != "call_function" or user.target not in ops:
            raise DSCompilePassError(
                f"prune: {site.state.layer_name}'s weight is read by {user.format_node()}, not a "
                f"{'Linear' if technique == 'row' else 'Conv2d'}; {technique} pruning needs the layer's bias to mask it"
            )
        bias = user.args[2] if len(user.args) > 2 else user.kwargs.get("bias")
        if not isinstance(bias, torch.fx.Node):
            continue
        node = insert_before(gm, user, mask_vector, (bias, mask, on), {}, site.state.layer_name, "bias", f"{technique}_pruning")
        if len(user.args) > 2:
            user.args = (*user.args[:2], node, *user.args[3:])
        else:
            user.kwargs = {**user.kwargs, "bias": node}


@register_pass("prune", graphs=("pre_autograd",))
def prune_pass(gm: torch.fx.GraphModule, ctx: PassContext, options: None) -> torch.fx.GraphModule:
    """Apply the pruning masks of the layers init_compression prepared (after ``quantize``)."""
    require_prepared(ctx, ("sparse_pruning", "row_pruning", "head_pruning", "channel_pruning"))
    masked = sum(prune_site(gm, site) for site in compression_sites(gm, ctx) if site.state.masks)
    ctx.analysis.setdefault("compression", {}).setdefault(ctx.graph_name, {})["masked_weights"] = masked
    log.info("%s: %d pruning masks applied", ctx.graph_name, masked)
    return gm
