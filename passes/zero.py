"""ZeRO stages 1-3: the ``zero_optimization`` config section and the collective-insertion pass.

A ZeRO model (``dscompile.runtime.zero_shard``) reads its parameters through the custom ops
``dscompile.zero_gather`` (ZeRO-3: gather the shards) and ``dscompile.zero_use`` (ZeRO-2 and
persistent parameters: the kept full copy); their backward is ``dscompile.zero_reduce_scatter``.
This pass works on them in three graphs:

- joint: marks every gather (and use) ``MUST_RECOMPUTE`` so the partitioner does not keep the
  full parameter alive from forward to backward: it is released after its last forward use and
  gathered again in backward. Two exceptions are kept saved (``MUST_SAVE``): the parameters
  reused within ``stage3_max_reuse_distance`` elements (DeepSpeed's rule: the last blocks, whose
  backward comes right after their forward), and, with selective unsharding (``unshard_budget``
  elements), the largest other gathers that fit, so the fewest bytes are re-gathered.
- forward/backward: replaces each op with functional collectives (``_c10d_functional``
  ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` + ``wait_tensor``) plus the slicing
  and the division by the world size around them, and moves every gather to just before its
  first use (the model issues them all up front). ``zero_bucketing``, ``zero_prefetch`` and
  ``zero_overlap`` then schedule these nodes.

Metadata: the start node of each collective carries ``meta["dscompile"]["zero"]`` =
``{"kind": "all_gather"|"reduce_scatter", "elements": full padded elements, "group": name,
"world": N, "shard_numel": L, "members": 1}``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from dscompile.config import log_no_effect, log_no_effect_keys, parse_dataclass, register_section, unbuilt
from dscompile.errors import DSCompileConfigError, DSCompileNotSupportedError
from dscompile.graph import ds_meta, node_value, set_fake_value
from dscompile.passes.offload import OffloadOptimizerConfig, OffloadParamConfig
from dscompile.pipeline import PassContext, invocation, register_config_rule, register_pass
from dscompile.planner import zero_schedule_of
from dscompile.runtime import zero_ops
from dscompile.runtime.engine_core import register_engine_extension
from dscompile.runtime.zero_leaf import LeafModuleConfig

log = logging.getLogger("dscompile.passes.zero")

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


# ---------------------------------------------------------------------------------------------
# Config: DeepSpeed's ``zero_optimization`` keys (sizes in elements, as DeepSpeed counts them).
# ---------------------------------------------------------------------------------------------
@dataclass
class ZeroConfig:
    """``zero_optimization``. Sizes are numbers of elements, as in DeepSpeed; ``5e8`` is accepted.

    ``overlap_comm`` defaults to DeepSpeed's: on for stage 3, off below. ``unshard_budget`` is
    dscompile's own: elements of ZeRO-3 parameters that may stay gathered from forward to backward.
    ``profile_steps`` is dscompile's own too (DeepCompile's optimization cycle, stages 2-3, through
    ``dscompile.initialize``): the first ``profile_steps`` optimizer steps time every op and the live
    memory, then bucket sizes, the prefetch window and (on GPU, from the measured memory) the unshard
    budget are planned again from the measurements, agreed across ranks, and the model recompiled
    once; the sizes above become upper bounds. 0 (the default) plans from the config alone, with no
    profiling steps (they run op by op, slower) and no second compile.
    ``stage3_max_reuse_distance`` is DeepSpeed's: a ZeRO-3 parameter used again (in backward) before
    that many elements of other parameters is kept gathered from forward to backward instead of
    re-gathered (DeepSpeed's default 1e9 keeps every parameter of a model under ~0.5B; 0 re-gathers
    all), nearest reuses first, at most ``stage3_max_live_parameters`` elements kept.
    ``contiguous_gradients``, ``round_robin_gradients``,
    ``memory_efficient_linear``, ``use_multi_rank_bucket_allreduce``,
    ``legacy_stage1``,
    ``parameter_alignment``, ``stage3_module_granularity_threshold``,
    ``stage3_use_all_reduce_for_fetch_params``, ``stage3_allgather_sequential``,
    ``enable_sanity_checks``, ``log_trace_cache_warnings`` and
    ``save_muon_momentum_buffer_in_memory`` are accepted and change nothing here (they tune
    DeepSpeed's own buffers, hooks and logs; the maths is the same); ``reduce_scatter: false`` (an
    all-reduce instead) is logged and reduce-scattered all the same; ``elastic_checkpoint`` is logged
    as having no effect: every ZeRO checkpoint here loads on any world size. ``override_module_apply`` is read by
    ``zero.Init``. The ``stage3_``-less spellings DeepSpeed also accepts (``prefetch_bucket_size``,
    ...) are read as the ``stage3_`` keys. Read by the engine (``runtime/zero_extension.py``):
    ``allgather_partitions`` (false: the post-step refresh is one broadcast per rank), ``compute_grad_norm`` (true, the
    default: the global norm every step, for ``get_global_grad_norm()``; false, stages 1-2 without clipping: None),
    ``stage3_model_persistence_threshold`` (total elements of small parameters kept whole),
    ``ignore_unused_parameters`` (false: a parameter with no gradient is an error),
    ``stage3_gather_16bit_weights_on_model_save`` (``engine.save_16bit_model`` gathers under ZeRO-3;
    ``stage3_gather_fp16_weights_on_model_save`` is its old name). ``load_from_fp32_weights: false``
    (rebuild master weights from 16-bit copies) is refused: checkpoints hold the fp32 shards.
    ``offload_optimizer`` (``passes/offload.py``: fp32 master shards and optimizer states on the host or
    in NVMe swap files; ``cpu_offload: true`` and ``cpu_offload_use_pin_memory`` are its old spellings)
    works with stages 1-3, and then ``sub_group_size`` is the NVMe swap tile in elements (not given: the
    planner sizes the tiles, ``planner.nvme_tile_elements``, where DeepSpeed's default is one 1e9-element group);
    ``offload_memory_limit`` (dscompile's own, bytes per rank, 0 = none) lets the planner offload only
    what does not fit. ``offload_param`` (stage 3 only; ``passes/offload.py``) keeps the ZeRO-3
    parameter shards on the host or in NVMe swap files, read just before their all-gather (under
    ``offload_memory_limit`` only the shards that do not fit).
    ``leaf_module`` (``classes``, ``names``, ``name_suffixes``; DeepSpeed's default classes are the Hugging Face
    sparse MoE blocks) flags ZeRO-3 leaf modules before partitioning (``runtime/zero_leaf.py``): each one's
    parameters are gathered together, as one all-gather, before its first use.
    ZeRO++, ZenFlow and MiCS are refused.
    """

    stage: int = 0
    contiguous_gradients: bool = True
    overlap_comm: bool | None = None
    reduce_scatter: bool = True
    reduce_bucket_size: int | float = 500_000_000
    allgather_partitions: bool = True
    allgather_bucket_size: int | float = 500_000_000
    load_from_fp32_weights: bool = True
    elastic_checkpoint: bool = False
    stage3_prefetch_bucket_size: int | float = 50_000_000
    stage3_param_persistence_threshold: int | float = 100_000
    stage3_model_persistence_threshold: int | float = 1 << 62
    stage3_max_live_parameters: int | float = 1_000_000_000
    stage3_max_reuse_distance: int | float = 1_000_000_000
    stage3_gather_16bit_weights_on_model_save: bool = False
    stage3_gather_fp16_weights_on_model_save: bool = False
    sub_group_size: int | float | None = None  # DeepSpeed's default 1e9; not given: the planner sizes NVMe tiles
    round_robin_gradients: bool = False
    ignore_unused_parameters: bool = True
    memory_efficient_linear: bool = True
    offload_optimizer: OffloadOptimizerConfig | None = None
    offload_param: OffloadParamConfig | None = None
    cpu_offload: bool | None = False
    zero_hpz_partition_size: int = 1
    zero_quantized_weights: bool = False
    zero_quantized_gradients: bool = False
    mics_shard_size: int = -1
    use_multi_rank_bucket_allreduce: bool = True
    compute_grad_norm: bool = True
    stage3_module_granularity_threshold: int | float = 0
    stage3_use_all_reduce_for_fetch_params: bool = False
    stage3_allgather_sequential: bool = False
    legacy_stage1: bool = False
    parameter_alignment: bool = False
    override_module_apply: bool = True
    log_trace_cache_warnings: bool = False
    enable_sanity_checks: bool = False
    save_muon_momentum_buffer_in_memory: bool = False
    cpu_offload_use_pin_memory: bool | None = None
    leaf_module: dict | None = None
    cpu_offload_param: bool | None = unbuilt(None, "ZeRO-Offload (CPU/NVMe offload)")
    zero_quantized_nontrainable_weights: bool = unbuilt(False, "ZeRO++ quantized weights")
    zenflow: dict | None = unbuilt(None, "ZenFlow (stall-free offload)")
    pipeline_loading_checkpoint: bool = unbuilt(False, "loading ZeRO-3 checkpoints in pipeline mode")
    unshard_budget: int | float = 0
    profile_steps: int = 0
    offload_memory_limit: int | float = 0

    _SIZES = (
        "reduce_bucket_size",
        "allgather_bucket_size",
        "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold",
        "stage3_model_persistence_threshold",
        "stage3_max_live_parameters",
        "stage3_max_reuse_distance",
        "sub_group_size",
        "stage3_module_granularity_threshold",
        "unshard_budget",
    )

    def validate(self, path: str) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise DSCompileConfigError(f"{path}.stage", f"must be 0, 1, 2 or 3, got {self.stage}")
        for key in self._SIZES:
            value = getattr(self, key)
            if value is None and key == "sub_group_size":
                continue
            if value != int(value) or value < 0:
                raise DSCompileConfigError(f"{path}.{key}", f"must be a whole number of elements >= 0, got {value}")
            setattr(self, key, int(value))
        for key in ("reduce_bucket_size", "allgather_bucket_size"):
            if getattr(self, key) <= 0:
                raise DSCompileConfigError(f"{path}.{key}", "must be positive")
        if self.offload_param is not None and self.offload_param.enabled and self.stage != 3:
            # DeepSpeed reads offload_param only at stage 3 and trains stages 0-2 as if it were absent: so do we, saying so.
            log.warning("%s.offload_param is ignored at ZeRO stage %d, as DeepSpeed ignores it (only stage 3 offloads parameters)", path, self.stage)
            self.offload_param = None
        if self.cpu_offload:  # DeepSpeed's old spelling of offload_optimizer.device = cpu
            if self.offload_optimizer is not None and self.offload_optimizer.device != "cpu":
                raise DSCompileConfigError(f"{path}.cpu_offload", f"contradicts offload_optimizer.device={self.offload_optimizer.device}", "keep one of them")
            self.offload_optimizer = self.offload_optimizer or OffloadOptimizerConfig(device="cpu")
        if self.offload_memory_limit != int(self.offload_memory_limit) or self.offload_memory_limit < 0:
            raise DSCompileConfigError(f"{path}.offload_memory_limit", f"must be a whole number of bytes >= 0, got {self.offload_memory_limit}")
        self.offload_memory_limit = int(self.offload_memory_limit)
        offloading = any(section is not None and section.enabled for section in (self.offload_optimizer, self.offload_param))
        if self.offload_memory_limit > 0 and not offloading:
            raise DSCompileConfigError(
                f"{path}.offload_memory_limit",
                "caps the model states kept on the device by offloading optimizer states or parameter shards, but "
                "offload_optimizer.device and offload_param.device are none",
                'say where states may go: "offload_optimizer": {"device": "cpu"} or {"device": "nvme", "nvme_path": ...} '
                "(and, at stage 3, the same under offload_param)",
            )
        if self.offload_optimizer is not None and self.offload_optimizer.enabled and self.stage == 0:
            raise DSCompileConfigError(
                f"{path}.offload_optimizer", "offloads ZeRO's partitioned optimizer states, and ZeRO is off (stage 0)", "set stage to 1, 2 or 3"
            )
        if self.zero_hpz_partition_size > 1:
            raise DSCompileNotSupportedError(f"{path}.zero_hpz_partition_size", "ZeRO++ hierarchical partitioning")
        for key in ("zero_quantized_weights", "zero_quantized_gradients"):
            if getattr(self, key):
                raise DSCompileNotSupportedError(f"{path}.{key}", "ZeRO++ quantized communication")
        if self.mics_shard_size > 0:
            raise DSCompileNotSupportedError(f"{path}.mics_shard_size", "MiCS sharding")
        if not self.load_from_fp32_weights:
            raise DSCompileConfigError(
                f"{path}.load_from_fp32_weights",
                "false (rebuild the fp32 master weights from 16-bit model weights) is not supported: dscompile's ZeRO checkpoints "
                "hold the fp32 master shards and always restore them",
                "drop the key (true, the default, is what dscompile does)",
            )
        if not self.compute_grad_norm and self.stage not in (1, 2):
            raise DSCompileConfigError(f"{path}.compute_grad_norm", "false is supported only with ZeRO stage 1 or 2 (as in DeepSpeed)", "drop the key")
        _leaf_module_config(self.leaf_module, f"{path}.leaf_module")  # refuse a bad section now, not at partitioning
        if self.overlap_comm is None:
            self.overlap_comm = self.stage == 3
        if not isinstance(self.profile_steps, int) or isinstance(self.profile_steps, bool) or self.profile_steps < 0:
            raise DSCompileConfigError(f"{path}.profile_steps", f"must be a whole number of steps >= 0, got {self.profile_steps!r}")

    @property
    def enabled(self) -> bool:
        return self.stage > 0

    @property
    def leaf_modules(self) -> LeafModuleConfig:
        """The modules the engine flags as ZeRO-3 leaves (``leaf_module``, DeepSpeed's defaults where not given)."""
        return _leaf_module_config(self.leaf_module, "zero_optimization.leaf_module")


def _leaf_module_config(value: Any, path: str) -> LeafModuleConfig:
    """``leaf_module`` as DeepSpeed reads it: a mapping of ``classes`` / ``names`` / ``name_suffixes``, each a string or
    a list of strings; the keys not given keep DeepSpeed's defaults."""
    if value is None:
        return LeafModuleConfig()
    if not isinstance(value, dict):
        raise DSCompileConfigError(path, f"must be a mapping of classes / names / name_suffixes, got {value!r}")
    fields: dict[str, list[str]] = {}
    for key, entries in value.items():
        if key not in ("classes", "names", "name_suffixes"):
            raise DSCompileConfigError(f"{path}.{key}", "is not a leaf_module key", "use classes, names or name_suffixes")
        entries = [entries] if isinstance(entries, str) else entries
        if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
            raise DSCompileConfigError(f"{path}.{key}", f"must be a string or a list of strings, got {entries!r}")
        fields[key] = list(dict.fromkeys(entries))
    return LeafModuleConfig(**fields)


# DeepSpeed's field names, accepted beside the ``stage3_`` spellings its documentation uses.
_STAGE3_ALIASES = {
    name: "stage3_" + name
    for name in (
        "prefetch_bucket_size",
        "param_persistence_threshold",
        "model_persistence_threshold",
        "max_live_parameters",
        "max_reuse_distance",
        "gather_16bit_weights_on_model_save",
        "module_granularity_threshold",
        "use_all_reduce_for_fetch_params",
        "allgather_sequential",
    )
}


_SAME = "it tunes DeepSpeed's own buffers, hooks or logs; the compiled graphs do the same maths without them"
_NO_EFFECT = {
    "contiguous_gradients": "ZeRO-2/3 gradients here are the graph's reduce-scatter outputs, already one buffer per bucket",
    "round_robin_gradients": "it orders DeepSpeed's copies into its CPU-offload buffers; the offloaded step reads each shard's gradient in place",
    "memory_efficient_linear": "it picks DeepSpeed's ZeRO-3 linear autograd function; the compiled graph releases gathered weights itself",
    "use_multi_rank_bucket_allreduce": _SAME,
    "stage3_use_all_reduce_for_fetch_params": _SAME,
    "stage3_allgather_sequential": _SAME,
    "legacy_stage1": _SAME,
    "parameter_alignment": _SAME,
    "log_trace_cache_warnings": _SAME,
    "enable_sanity_checks": _SAME,
    "save_muon_momentum_buffer_in_memory": _SAME,
    "stage3_module_granularity_threshold": "it sets DeepSpeed's ZeRO-3 hook granularity; the compiled graph places gathers per use",
    "elastic_checkpoint": 'every dscompile ZeRO checkpoint loads on any world size (resharded on load), whatever it says',
}
"""ZeRO keys accepted with no effect here, and why (logged once when given)."""


def _parse_section(value: Any, path: str) -> ZeroConfig:
    if isinstance(value, dict):
        value = dict(value)
        for short, long in _STAGE3_ALIASES.items():
            if short in value:
                if long in value:
                    raise DSCompileConfigError(f"{path}.{short}", f"given twice, also as {long}", "keep one of them")
                value[long] = value.pop(short)
        log_no_effect_keys(path, value, _NO_EFFECT)
        if value.get("reduce_scatter") is False:
            log_no_effect(f"{path}.reduce_scatter", "false (an all-reduce) is reduce-scattered all the same: the same mean, fewer bytes")
    return parse_dataclass(ZeroConfig, value, path)


register_section("zero_optimization", _parse_section, "ZeRO optimization")


@register_engine_extension(10, "zero")
def _zero_engine_extension(config: Any) -> Any:
    """Engines partition the model (``dscompile.runtime.zero_extension``) when ZeRO is on."""
    from dscompile.runtime.zero_extension import ZeroExtension

    zc = zero_config(config)
    return ZeroExtension(zc) if zc is not None else None


def zero_config(config: Any) -> ZeroConfig | None:
    """The parsed ``zero_optimization`` section, or None when ZeRO is off."""
    section = getattr(config, "sections", {}).get("zero_optimization")
    return section if section is not None and section.stage > 0 else None


@register_config_rule(20, "zero")
def _zero_rule(config: Any) -> list[Any]:
    """ZeRO's passes with the schedule the planner decided (``planner.ZeroSchedule``, the engine's ``plan`` when an
    engine compiles, re-planned after profiling), never sizes read from the config here."""
    schedule = zero_schedule_of(config)
    if not schedule.in_graphs:
        return []  # ZeRO-1 communicates only at the accumulation boundary, outside the graphs
    items = [
        invocation("zero", stage=schedule.stage, unshard_budget=schedule.unshard_budget, max_reuse_distance=schedule.max_reuse_distance,
                   max_live_parameters=schedule.max_live_parameters),
        invocation("zero_bucketing", allgather_bucket_size=schedule.gather_bucket_elements, reduce_bucket_size=schedule.reduce_bucket_elements),
    ]
    if schedule.stage == 3:
        items.append(
            invocation(
                "zero_prefetch",
                stage3_prefetch_bucket_size=schedule.prefetch_elements,
                stage3_max_live_parameters=schedule.max_live_parameters,
            )
        )
    items.append(invocation("zero_overlap", overlap_comm=schedule.overlap_comm, reduce_bucket_size=schedule.reduce_bucket_elements))
    if schedule.profile_steps > 0:
        items.append(invocation("zero_profile"))
    items.append(invocation("zero_agree"))  # fingerprints the final schedule
    if schedule.profile_steps == 0:  # the profiler times gloo's own collectives
        items.append(invocation("zero_gloo"))
    return items


# ---------------------------------------------------------------------------------------------
# The pass.
# ---------------------------------------------------------------------------------------------
@dataclass
class ZeroPassOptions:
    stage: int = 3
    unshard_budget: int = 0
    max_reuse_distance: int = 1_000_000_000
    max_live_parameters: int = 1_000_000_000


def is_zero_start(node: torch.fx.Node, kind: str | None = None) -> bool:
    info = node.meta.get("dscompile", {}).get("zero")
    return info is not None and (kind is None or info["kind"] == kind)


def new_node(graph: torch.fx.Graph, target: Any, args: tuple, kwargs: dict | None = None) -> torch.fx.Node:
    node = graph.call_function(target, args, kwargs or {})
    set_fake_value(node)
    return node


def _group_size(group: str) -> int | None:
    import torch.distributed as dist

    if not group or not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.get_world_size(zero_ops.resolve_group(group))


@register_pass("zero", graphs=("joint", "forward", "backward"), options=ZeroPassOptions, provides=("zero",))
def zero_pass(gm: torch.fx.GraphModule, ctx: PassContext, options: ZeroPassOptions) -> torch.fx.GraphModule:
    """ZeRO: pin parameter gathers to recompute (joint), then turn the ZeRO ops into functional collectives."""
    if ctx.graph_kind == "joint":
        _mark_recompute(gm, options)
        return gm
    graph = gm.graph
    counts = {"all_gather": 0, "reduce_scatter": 0, "use": 0}
    in_place: list[torch.fx.Node] = []
    leaves: dict[str, list[list[torch.fx.Node]]] = {}
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is zero_ops.USE:
            node.replace_all_uses_with(node.args[1])
            graph.erase_node(node)
            counts["use"] += 1
        elif node.target is zero_ops.GATHER:
            source = node.args[0]
            if _insert_gather(graph, node, leaves):
                counts["all_gather"] += 1
            elif node._erased:  # an offloaded shard's read used in place (world 1)
                in_place.append(source)
        elif node.target is zero_ops.REDUCE_SCATTER:
            if _insert_reduce_scatter(graph, node, ctx.config):
                counts["reduce_scatter"] += 1
    if leaves:
        counts["leaf_modules"] = _gather_leaves_together(graph, leaves)
    if in_place:
        _pin_reads(graph, in_place)
        counts["param_loads_in_place"] = len(in_place)
    ctx.analysis.setdefault("zero", {})[ctx.graph_kind] = counts
    log.debug("%s: inserted %s", ctx.graph_name, counts)
    return gm


def _mark_recompute(gm: torch.fx.GraphModule, options: ZeroPassOptions) -> None:
    gathers = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (zero_ops.GATHER, zero_ops.USE)]
    keep = _reused_soon(gm.graph, gathers, options.max_reuse_distance, options.max_live_parameters)
    budget = options.unshard_budget
    if budget > 0:
        # Selective unsharding: keeping the biggest gathers that fit re-gathers the fewest bytes.
        sized = sorted((n for n in gathers if n.target is zero_ops.GATHER), key=lambda n: -int(n.args[2]))
        for node in sized:
            if node not in keep and int(node.args[2]) <= budget:
                keep.add(node)
                budget -= int(node.args[2])
    for node in gathers:
        node.meta["recompute"] = CheckpointPolicy.MUST_SAVE if node in keep else CheckpointPolicy.MUST_RECOMPUTE
        ds_meta(node)["recomputable"] = node not in keep
        ds_meta(node)["zero_unsharded"] = node in keep
    for node in gm.graph.nodes:  # offload_param: a shard read from the host/NVMe is read again in backward, never kept
        if node.op == "call_function" and node.target is zero_ops.PARAM_LOAD:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            ds_meta(node)["recomputable"] = True


def _reused_soon(graph: torch.fx.Graph, uses: list[torch.fx.Node], max_distance: int, max_live: int) -> set[torch.fx.Node]:
    """DeepSpeed's ``stage3_max_reuse_distance``: the gathers to keep from forward to backward.

    A parameter is released after its last forward use unless it is used again (in backward) before
    ``max_distance`` elements of other parameters have been used: then re-gathering it would cost a
    collective for a tensor that is needed again almost at once (the last blocks of a model, first in
    backward). Distances count, as DeepSpeed's trace does, each parameter once per run of consecutive
    uses. Kept elements stay under ``max_live`` (``stage3_max_live_parameters``), the nearest reuses
    first. Shards read from the host or NVMe (``offload_param``) are never kept: that offload is for memory.
    """
    gathers = [n for n in uses if n.target is zero_ops.GATHER and not _reads_offloaded_shard(n)]
    if max_distance <= 0 or not gathers:
        return set()
    backward = joint_backward(graph)
    order = {n: i for i, n in enumerate(graph.nodes)}
    events: list[tuple[int, torch.fx.Node, bool]] = []
    for gather in gathers:
        views = _view_closure(gather)
        events += [(order[u], gather, u in backward) for v in (gather, *views) for u in v.users if u not in views]
    events.sort(key=lambda e: e[0])
    trace: list[tuple[torch.fx.Node, bool]] = []  # one entry per run of uses of the same parameter in one direction
    for _, gather, in_backward in events:
        if not trace or trace[-1] != (gather, in_backward):
            trace.append((gather, in_backward))
    last_forward: dict[torch.fx.Node, int] = {}
    first_backward: dict[torch.fx.Node, int] = {}
    for index, (gather, in_backward) in enumerate(trace):
        if not in_backward:
            last_forward[gather] = index
        else:
            first_backward.setdefault(gather, index)
    prefix = [0]  # elements used before each trace entry
    for gather, _ in trace:
        prefix.append(prefix[-1] + int(gather.args[2]))
    candidates = []
    for gather, start in last_forward.items():
        end = first_backward.get(gather)
        if end is None or end < start:
            continue
        distance = prefix[end] - prefix[start + 1]
        if distance < max_distance:
            candidates.append((distance, order[gather], gather))
    keep: set[torch.fx.Node] = set()
    live = 0
    for _, _, gather in sorted(candidates, key=lambda c: c[:2]):
        if live + int(gather.args[2]) <= max_live:
            keep.add(gather)
            live += int(gather.args[2])
    return keep


def _reads_offloaded_shard(gather: torch.fx.Node) -> bool:
    """Whether the gather's shard comes from ``zero_param_load`` (directly, or through a cast or view)."""
    node = gather.args[0]
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        if node.target is zero_ops.PARAM_LOAD:
            return True
        inputs = node.all_input_nodes
        if len(inputs) != 1:
            return False
        node = inputs[0]
    return False


def joint_backward(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The joint graph's backward: the ``tangents_*`` inputs and every node computed from them."""
    found: set[torch.fx.Node] = set()
    frontier = [n for n in graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")]
    while frontier:
        node = frontier.pop()
        if node not in found:
            found.add(node)
            frontier.extend(node.users)
    return found


def _insert_gather(graph: torch.fx.Graph, node: torch.fx.Node, leaves: dict[str, list[list[torch.fx.Node]]] | None = None) -> bool:
    shard, shape, numel, group = node.args[:4]
    leaf = str(node.args[4] if len(node.args) > 4 else node.kwargs.get("leaf", ""))
    world = _group_size(group)
    if world is None:
        log.info("%s: no process group, leaving the eager zero_gather in place", node.name)
        return False
    if world == 1 and isinstance(shard, torch.fx.Node) and shard.target is zero_ops.PARAM_LOAD and len(shard.users) == 1:
        _use_loaded_shard(graph, node, shard, shape, numel)
        return False
    length = node_value(shard).shape[0]
    users = list(node.users)
    with graph.inserting_before(node):
        start = new_node(graph, c10d.all_gather_into_tensor.default, (shard, world, group))
        wait = new_node(graph, c10d.wait_tensor.default, (start,))
        value = wait
        if numel != world * length:
            value = new_node(graph, aten.slice.Tensor, (wait, 0, 0, numel))
        value = new_node(graph, aten.view.default, (value, list(shape)))
    ds_meta(start)["zero"] = {"kind": "all_gather", "elements": world * length, "group": group, "world": world, "shard_numel": length, "members": 1}
    if leaf:
        ds_meta(start)["zero"]["leaf"] = leaf
    node.replace_all_uses_with(value)
    graph.erase_node(node)
    if users:
        first = min(users, key=_position(graph))
        chain = [start, wait] + ([value.args[0]] if value.args[0] is not wait else []) + [value]
        if isinstance(shard, torch.fx.Node) and shard.target is zero_ops.PARAM_LOAD and len(shard.users) == 1:
            chain.insert(0, shard)  # offload_param: the shard is read just before its gather (prefetch passes hoist both)
        for item in chain:
            first.prepend(item)
        if leaf and leaves is not None:
            leaves.setdefault(leaf, []).append(chain)
    return True


def _gather_leaves_together(graph: torch.fx.Graph, leaves: dict[str, list[list[torch.fx.Node]]]) -> int:
    """ZeRO-3 leaf modules (``runtime/zero_leaf.py``): every gather of a leaf's parameters moves up to the first of
    them, so the leaf's parameters arrive together before its first use (``zero_bucketing`` then issues them as one
    all-gather). Each chain reads only its shard (a graph input), so moving it up keeps the graph valid.
    Returns the number of leaf modules gathered as a unit."""
    grouped = 0
    for chains in leaves.values():
        if len(chains) < 2:
            continue
        order = _position(graph)
        chains = sorted(chains, key=lambda chain: order(chain[0]))
        cursor = chains[0][-1]
        for chain in chains[1:]:
            for item in chain:
                if cursor.next is not item:
                    cursor.append(item)
                cursor = item
        grouped += 1
    return grouped


def _use_loaded_shard(graph: torch.fx.Graph, node: torch.fx.Node, shard: torch.fx.Node, shape: list[int], numel: int) -> None:
    """offload_param at world 1: the shard read from the host/NVMe is the whole parameter, and that fresh buffer
    is nobody else's, so it is used in place: no all-gather copy, and no second full-size tensor alive while
    the read one waits for its gather (the prefetch window then holds the parameters once, as without offload).
    The read moves right before the first use (the store reads it ahead in the background), pinned after the
    nearest tensor computed before that point (``zero_param_load_after``) so the lowering keeps it there."""
    users = list(node.users)
    with graph.inserting_before(node):
        value = shard
        if numel != node_value(shard).shape[0]:
            value = new_node(graph, aten.slice.Tensor, (value, 0, 0, numel))
        value = new_node(graph, aten.view.default, (value, list(shape)))
    node.replace_all_uses_with(value)
    graph.erase_node(node)
    if not users:
        return
    # The parameter's views (a Linear's ``t``) may sit far ahead of the op that reads it: move them with the read,
    # right before the first op that is not a view of it.
    views = _view_closure(value)
    order = _position(graph)
    consumers = [u for v in [value, *views] for u in v.users if u not in views]
    first = min(consumers, key=order)
    chain = [shard] + ([value.args[0]] if value.args[0] is not shard else []) + [value] + sorted(views, key=order)
    for item in chain:
        first.prepend(item)


def pin_param_loads(graph: torch.fx.Graph) -> int:
    """Pin every ``zero_param_load`` left in ``graph`` (world > 1: each feeds its all-gather) where it stands now.

    Run once the gathers are scheduled (``zero_prefetch``). Returns the number pinned."""
    reads = [n for n in graph.nodes if n.op == "call_function" and n.target is zero_ops.PARAM_LOAD]
    _pin_reads(graph, reads)
    return len(reads)


def _pin_reads(graph: torch.fx.Graph, reads: list[torch.fx.Node]) -> None:
    """Once every read is in its final place: each one after the nearest tensor computed before it."""
    for shard in reads:
        after = shard.prev
        while after.op == "call_function" and not isinstance(after.meta.get("val"), torch.Tensor):
            after = after.prev
        if after.op != "call_function":
            continue  # nothing computed before it: the read is first anyway
        with graph.inserting_before(shard):
            pinned = new_node(graph, zero_ops.PARAM_LOAD_AFTER, (*shard.args, after))
        if "stack_trace" in shard.meta:
            pinned.meta["stack_trace"] = shard.meta["stack_trace"]
        shard.replace_all_uses_with(pinned)
        graph.erase_node(shard)


_VIEWS = {aten.t.default, aten.permute.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int,
          aten.expand.default, aten.alias.default, aten.slice.Tensor, aten.unsqueeze.default, aten.squeeze.dim}


def _view_closure(value: torch.fx.Node) -> set[torch.fx.Node]:
    """The view ops over ``value`` (transitively) whose only tensor input is ``value`` or another of them."""
    found: set[torch.fx.Node] = set()
    frontier = [value]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user in found or user.op != "call_function" or user.target not in _VIEWS:
                continue
            if all(i is value or i in found for i in user.all_input_nodes):
                found.add(user)
                frontier.append(user)
    return found


def _insert_reduce_scatter(graph: torch.fx.Graph, node: torch.fx.Node, config: Any = None) -> bool:
    """The gradient's mean over the ranks: reduce-scatter (sum) and divide. With ``prescale_gradients`` /
    ``gradient_predivide_factor`` (``DSConfig.gradient_predivisor``) part of the division moves before the sum,
    as DeepSpeed's all-reduce path does it (the sum of fp16 gradients then stays in range)."""
    grad, length, group = node.args
    world = _group_size(group)
    if world is None:
        log.info("%s: no process group, leaving the eager zero_reduce_scatter in place", node.name)
        return False
    numel = node_value(grad).numel()
    predivisor = config.gradient_predivisor(world) if hasattr(config, "gradient_predivisor") else 1.0
    with graph.inserting_before(node):
        flat = new_node(graph, aten.reshape.default, (grad, [-1]))
        if numel != world * length:
            flat = new_node(graph, aten.constant_pad_nd.default, (flat, [0, world * length - numel]))
        if predivisor != 1.0:
            flat = new_node(graph, aten.div.Tensor, (flat, predivisor))
        start = new_node(graph, c10d.reduce_scatter_tensor.default, (flat, "sum", world, group))
        wait = new_node(graph, c10d.wait_tensor.default, (start,))
        out = new_node(graph, aten.div.Tensor, (wait, world if predivisor == 1.0 else world / predivisor))
    ds_meta(start)["zero"] = {"kind": "reduce_scatter", "elements": world * length, "group": group, "world": world, "shard_numel": length, "members": 1}
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    return True


@register_pass("zero_gloo", graphs=("forward", "backward"), requires=("zero",))
def zero_gloo(gm: torch.fx.GraphModule, ctx: PassContext, options: None) -> torch.fx.GraphModule:
    """On gloo groups, ZeRO's collectives move their bytes the way gloo moves them fastest (the values are the same).

    - Each reduce-scatter becomes one all-to-all and a sum where it waits. Gloo's reduce-scatter clones the whole
      input and all-reduces it: twice the bytes (measured: 8M fp32 elements on 2 ranks, 43 ms against 16 ms for
      the all-to-all and the sum). Chunk r of the flat gradient goes to rank r; the chunks received are summed in
      rank order. Two ranks' sums are the same addition either way; with more ranks the order may differ from
      gloo's. Gloo reads the all-to-all's input after the call returns, so the wait (``zero_sum_received``,
      which stands in for ``wait_tensor``) takes the input as an argument: the lowering cannot reuse its buffer
      before then.
    - Each all-gather over ``GLOO_BROADCASTS_ABOVE`` elements becomes one broadcast per rank
      (``zero_broadcast_gather``, waited by the same ``wait_tensor``): gloo's all-gather is 2-3x slower.
    The new nodes keep the collective's ``zero`` metadata (stats count them as the reduce-scatter or all-gather).
    Decided per collective by the backend that carries its tensor (``zero_ops.moves_like_gloo``): on NCCL the
    graphs keep ``reduce_scatter_tensor`` and ``all_gather_into_tensor``, NCCL's fast collectives."""
    graph = gm.graph
    counts = {"reduce_scatter": 0, "all_gather": 0}
    for start in [n for n in graph.nodes if n.op == "call_function" and is_zero_start(n)]:
        if start.target is c10d.reduce_scatter_tensor.default:
            counts["reduce_scatter"] += _reduce_scatter_as_all_to_all(graph, start)
        elif start.target is c10d.all_gather_into_tensor.default:
            counts["all_gather"] += _all_gather_as_broadcasts(graph, start)
    if any(counts.values()):
        gm.recompile()
    ctx.analysis.setdefault("zero_gloo", {})[ctx.graph_name] = counts
    return gm


def _reduce_scatter_as_all_to_all(graph: torch.fx.Graph, start: torch.fx.Node) -> int:
    flat, reduce_op, world, group = start.args
    waits = [u for u in start.users if u.target is c10d.wait_tensor.default]
    if reduce_op != "sum" or len(start.users) != 1 or len(waits) != 1 or not _is_gloo(group, flat):
        return 0
    [wait] = waits
    length = node_value(flat).shape[0] // world
    with graph.inserting_before(start):
        exchange = new_node(graph, c10d.all_to_all_single.default, (flat, [length] * world, [length] * world, group))
    ds_meta(exchange)["zero"] = dict(ds_meta(start)["zero"])
    with graph.inserting_before(wait):
        summed = new_node(graph, zero_ops.SUM_RECEIVED, (exchange, flat, world))
    wait.replace_all_uses_with(summed)
    graph.erase_node(wait)
    graph.erase_node(start)
    return 1


def _all_gather_as_broadcasts(graph: torch.fx.Graph, start: torch.fx.Node) -> int:
    flat, world, group = start.args
    if node_value(flat).numel() * world <= zero_ops.GLOO_BROADCASTS_ABOVE or not _is_gloo(group, flat):
        return 0
    with graph.inserting_before(start):
        gather = new_node(graph, zero_ops.BROADCAST_GATHER, (flat, world, group))
    ds_meta(gather)["zero"] = dict(ds_meta(start)["zero"])
    start.replace_all_uses_with(gather)
    graph.erase_node(start)
    return 1


def _is_gloo(group: str, flat: torch.fx.Node) -> bool:
    """Whether gloo carries this collective's tensor (``zero_ops.moves_like_gloo``); NCCL keeps its own collectives."""
    import torch.distributed as dist

    if not (group and dist.is_available() and dist.is_initialized()):
        return False
    return zero_ops.moves_like_gloo(zero_ops.resolve_group(group), node_value(flat).device.type)


def _position(graph: torch.fx.Graph) -> Any:
    order = {n: i for i, n in enumerate(graph.nodes)}
    return order.__getitem__
