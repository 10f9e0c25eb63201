"""The pass's driver: capture the model (``torch.export``), find and rewrite the blocks, partition the parameters.

``parallelize`` runs the steps in order and returns the split graph with its ``TensorParallelPlan``; ``capture``
is shared with the inference and sequence-parallel capabilities, which split the same captured graph their way.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from dscompile.errors import DSCompileConfigError
from dscompile.passes.tensor_parallel.blocks import Block, find_blocks
from dscompile.passes.tensor_parallel.config import TensorParallelConfig
from dscompile.passes.tensor_parallel.layer_specs import apply_layer_specs, check_layer_specs
from dscompile.passes.tensor_parallel.rewrite import rewrite
from dscompile.passes.tensor_parallel.sequence import find_sequence, shard_sequence
from dscompile.passes.tensor_parallel.vocab import find_vocab_heads, rewrite_vocab_heads
from dscompile.runtime.process_groups import ProcessGroups
from dscompile.runtime.tensor_parallel import SliceSpec

log = logging.getLogger("dscompile.passes.tensor_parallel")  # the pass's one logger, whichever module logs
aten = torch.ops.aten


@dataclass
class TensorParallelPlan:
    """What the pass decided: parameter slices, the blocks split and those left whole (with why)."""

    tp_size: int
    slices: dict[str, SliceSpec] = field(default_factory=dict)
    split: list[dict[str, Any]] = field(default_factory=list)
    replicated: list[dict[str, Any]] = field(default_factory=list)
    vocab: list[dict[str, Any]] = field(default_factory=list)  # LM heads split by vocabulary (vocab_parallel_lm_head)
    vocab_replicated: list[dict[str, Any]] = field(default_factory=list)
    sequence_parallel: dict[str, Any] | None = None  # sequence_parallel: the layout and the collectives it put in


def partition_parameters(model: nn.Module, slices: dict[str, SliceSpec], rank: int, tp: int) -> None:
    """Each parameter named in ``slices`` keeps only this rank's slice (same ``nn.Parameter`` object)."""
    with torch.no_grad():
        for name, spec in slices.items():
            p = model.get_parameter(name)
            p.data = spec.take(p.data, rank, tp).clone()


def _share_parameters(gm: fx.GraphModule, model: nn.Module) -> None:
    """The exported module reads the model's own ``nn.Parameter`` objects (those the optimizer steps)."""
    for name, _ in list(gm.named_parameters(remove_duplicate=False)):
        owner, _, leaf = name.rpartition(".")
        setattr(gm.get_submodule(owner) if owner else gm, leaf, model.get_parameter(name))


@contextlib.contextmanager
def _without_kv_cache(model: nn.Module) -> Iterator[None]:
    """Hugging Face models build a KV cache (a ``DynamicCache``) and return it, in training mode too.
    ``torch.export`` cannot return that object, and the split graph could not return it whole: each rank holds
    only its heads' keys and values, and returning them would pin every block's keys and values as outputs.
    Training and evaluation (a loss, logits) never read it, so the model is captured with ``use_cache`` off
    (in both modes; an explicit ``use_cache=True`` argument is turned off by ``without_cache_request``) and its
    outputs carry ``past_key_values=None``."""
    configs = {id(c): c for m in model.modules() if getattr(c := getattr(m, "config", None), "use_cache", None) is True}
    if configs:
        log.info("capturing %s with Hugging Face's use_cache off: the split graph returns no KV cache", type(model).__name__)
    for config in configs.values():
        config.use_cache = False
    try:
        yield
    finally:
        for config in configs.values():
            config.use_cache = True


def without_cache_request(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with an explicit ``use_cache=True`` turned off, said once in the log: under tensor parallelism
    the model's outputs carry ``past_key_values=None`` (see ``_without_kv_cache``)."""
    if kwargs.get("use_cache") is not True:
        return kwargs
    if not getattr(without_cache_request, "said", False):
        log.warning(
            "tensor_parallel: use_cache=True has no effect in the engine: each rank holds only its attention heads' keys and values, "
            "so outputs carry past_key_values=None (losses and logits are unchanged); generate with dscompile.init_inference "
            "(tensor_parallel.tp_size) for a KV cache"
        )
        without_cache_request.said = True  # type: ignore[attr-defined]
    return {**kwargs, "use_cache": False}


def capture(model: nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    """The model's ATen graph at these inputs' shapes (``torch.export``, non-strict)."""
    with _without_kv_cache(model):
        exported = torch.export.export(model, tuple(args), without_cache_request(dict(kwargs)), strict=False)
    gm = exported.module()
    _share_parameters(gm, model)
    for node in list(gm.graph.nodes):  # export's dtype/device asserts: checks of the capture, not computation
        if node.target is aten._assert_tensor_metadata.default and not node.users:
            gm.graph.erase_node(node)
    gm.recompile()
    return gm


def split_entry(b: Block, tp: int) -> dict[str, Any]:
    """A split block in the plan: its linears, and, when it has fewer KV heads than ranks, which are replicated."""
    entry: dict[str, Any] = {"row": b.row.weight, "columns": [c.weight for c in b.columns]}
    if b.replicas > 1:
        kv = [c.weight for c in b.columns if c.node in b.kv]
        entry["kv_replicated"] = {"columns": kv, "kv_heads": tp // b.replicas, "ranks_per_kv_head": b.replicas}
    return entry


def parallelize(model: nn.Module, args: tuple, kwargs: dict, groups: ProcessGroups, tc: TensorParallelConfig) -> tuple[fx.GraphModule, TensorParallelPlan]:
    """Capture, find the blocks, rewrite the graph and partition ``model``'s parameters in place."""
    tp = groups.tp_size
    gm = capture(model, args, kwargs)
    seq = find_sequence(gm, tp) if tc.sequence_parallel else None
    blocks, whole = find_blocks(gm, tp)
    weights = [n for n, _ in model.named_parameters()]
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    blocks = apply_layer_specs(blocks, whole, tc.partition_config, weights, model_type)
    if not blocks:
        reasons = "; ".join(f"{w['row']}: {w['reason']}" for w in whole) or "no linear adds to a residual stream"
        raise DSCompileConfigError(
            "tensor_parallel.autotp_size",
            f"no transformer block of {type(model).__name__} can be split across {tp} ranks ({reasons})",
            "use a TP size that divides the heads and hidden sizes, or turn tensor_parallel off",
        )
    plan = TensorParallelPlan(tp)
    group_name = groups.tp_group.group_name if groups.tp_group is not None else ""
    plan.slices = rewrite(gm, blocks, group_name, tp, groups.tp_rank)
    plan.split = [split_entry(b, tp) for b in blocks]
    plan.replicated = whole
    canonical: dict[int, str] = {}
    for name, p in model.named_parameters():  # tied weights: the name the model lists first
        canonical.setdefault(id(p), name)
    names = {target: canonical[id(p)] for target, p in gm.named_parameters(remove_duplicate=False) if id(p) in canonical}
    summed = {names.get(target, target) for b in blocks for target in b.summed}
    check_layer_specs(plan.slices, summed, tc.partition_config, weights, model_type)
    if tc.vocab_parallel_lm_head:
        heads, plan.vocab_replicated = find_vocab_heads(gm)
        plan.slices |= rewrite_vocab_heads(gm, heads, group_name, tp, groups.tp_rank, names)
        plan.vocab = [{"weight": names.get(str(h.linear.node.args[1].target)), "vocab": h.vocab, "embeddings": len(h.embeddings)} for h in heads]
    if seq is not None:
        plan.sequence_parallel = shard_sequence(gm, seq, group_name, tp, groups.tp_rank)
    partition_parameters(model, plan.slices, groups.tp_rank, tp)
    return gm, plan
