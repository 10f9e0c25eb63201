"""Quantization-aware training as a graph pass (``quantize``): fake quantization on the Dynamo graph.

For every weight whose layer ``init_compression`` prepared (``weight.ds_compression``), the pass
inserts ``kernels.quantize.fake_quantize_weight`` between the weight and every op that reads it,
and, for layers with activation quantization, ``fake_quantize_activation`` (dynamic, per token or
sample) or ``calibrate_and_quantize`` (static range, updated in place while training; frozen under
``torch.no_grad()``) on the input of each Linear/Conv2d reading the weight. Both carry a
straight-through gradient, so AOTAutograd derives the QAT backward.

Why a graph pass and not swapped modules (DeepSpeed's ``LinearLayer_Compress``): the graph sees the
weight wherever it comes from, so quantization composes with the other passes without special
cases. It runs before mixed precision (the weight is quantized in fp32, then cast), on ZeRO's
gathered full weight (quantization groups span the whole matrix, not a shard), and inside the
region activation checkpointing recomputes (plain aten ops after AOTAutograd: the partitioner may
recompute them; stochastic rounding's random draws are never recomputed). The bit width, the
on/off switch and the calibrated range are inputs of the compiled graph (``lift_tensor``), so the
schedule (``CompressionScheduler``) changes them between steps without a recompile.

Metadata: inserted nodes carry ``meta["dscompile"]["compression"] = {"layer", "role": "weight" |
"activation", "technique": "weight_quantization" | "activation_quantization"}``.
"""

from __future__ import annotations

import logging

import torch
import torch.fx

from dscompile.kernels.quantize import calibrate_and_quantize, fake_quantize_activation, fake_quantize_static, fake_quantize_weight
from dscompile.passes.compression import CONV_OPS, LINEAR_OPS, Site, compression_sites, insert_after, insert_before, lift, replace_weight
from dscompile.pipeline import PassContext, register_pass

log = logging.getLogger("dscompile.passes.quantize")


def quantize_weight_node(gm: torch.fx.GraphModule, site: Site) -> torch.fx.Node:
    state = site.state
    spec = state.weight_quant
    reach = spec.reachable_bits()
    head = site.head()
    bits, on, ratio = lift(gm, site, "wq_bits"), lift(gm, site, "wq_on"), lift(gm, site, "wq_ratio")
    kwargs = dict(
        num_groups=spec.num_groups,
        symmetric=spec.symmetric,
        stochastic=spec.stochastic,
        integer=max(reach) >= 3,
        ternary=2 in reach,
        binary=1 in reach,
        mix_real=spec.mix_real,
    )
    anchor = max((head, bits, on, ratio), key=_position(gm))
    node = insert_after(gm, anchor, fake_quantize_weight, (head, bits, on, ratio), kwargs, state.layer_name, "weight", "weight_quantization")
    replace_weight(site, node)
    return node


def _position(gm: torch.fx.GraphModule):
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return lambda node: order[node]


def quantize_inputs(gm: torch.fx.GraphModule, site: Site, training: bool) -> int:
    """Insert activation fake quantization on the input of each Linear/Conv2d reading the weight."""
    state = site.state
    spec = state.act_quant
    count = 0
    for user in site.consumers():
        if user.op != "call_function" or user.target not in LINEAR_OPS | CONV_OPS or user.args[1] is not site.head():
            log.info("%s: activation quantization skips %s, which is not a Linear/Conv2d reading the weight", state.layer_name, user.format_node())
            continue
        x = user.args[0]
        on = lift(gm, site, "aq_on")
        if spec.static:
            value_range = lift(gm, site, "aq_range")
            if training:
                fn, args, kwargs = calibrate_and_quantize, (x, value_range, on), dict(bits=spec.bits, symmetric=spec.symmetric, momentum=spec.momentum)
            else:
                fn, args, kwargs = fake_quantize_static, (x, value_range, on), dict(bits=spec.bits, symmetric=spec.symmetric)
        else:
            fn, args, kwargs = fake_quantize_activation, (x, on), dict(bits=spec.bits, symmetric=spec.symmetric, per=spec.per)
        node = insert_before(gm, user, fn, args, kwargs, state.layer_name, "activation", "activation_quantization")
        user.args = (node, *user.args[1:])
        count += 1
    return count


@register_pass("quantize", graphs=("pre_autograd",))
def quantize_pass(gm: torch.fx.GraphModule, ctx: PassContext, options: None) -> torch.fx.GraphModule:
    """Fake-quantize the weights (and inputs) of the layers init_compression prepared, with STE."""
    sites = compression_sites(gm, ctx)
    training = torch.is_grad_enabled()
    weights = inputs = 0
    for site in sites:
        if site.state.weight_quant is not None:
            quantize_weight_node(gm, site)
            weights += 1
        if site.state.act_quant is not None:
            inputs += quantize_inputs(gm, site, training)
    _explain_nothing(ctx)
    ctx.analysis.setdefault("compression", {})[ctx.graph_name] = {"quantized_weights": weights, "quantized_inputs": inputs}
    log.info("%s: %d weights and %d layer inputs fake-quantized", ctx.graph_name, weights, inputs)
    return gm


def _explain_nothing(ctx: PassContext) -> None:
    """A config asking for quantization on a model nobody prepared would silently train in fp32."""
    from dscompile.passes.compression import require_prepared

    require_prepared(ctx, ("weight_quantization", "activation_quantization"))
