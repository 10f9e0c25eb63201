"""Bytes a rank sends per optimizer step under a 1-bit optimizer, predicted without running an engine.

``dscompile dump`` runs no engine, so it cannot measure what the engine's collectives send; this plans the
same buckets the engine would (the optimizer's ``bucket_size`` buckets without ZeRO, the planner's ZeRO reduce
bucket, ``ZeroSchedule.reduce_bucket_elements``, with it, the same compressed layouts) from the model's trainable parameter
sizes and the config, lists the message of every collective a step of each phase issues, and converts them to
bytes sent with the engine's own conversion (``engine.bytes_sent``). Phases: ``full_precision`` (warm-up,
0/1 Adam's variance steps), ``compressed`` (1-bit exchange), ``local`` (0/1 Adam's local steps: nothing).
Equal to ``communication_rank<r>.json``'s measured bytes per phase (tested, ``tests/test_onebit_lamb_zero.py``).
"""

from __future__ import annotations

from typing import Any

from dscompile.planner import plan_zero_schedule
from dscompile.runtime.comm_stats import CommStats as EngineCommStats
from dscompile.runtime.onebit.base import DEFAULT_BLOCK_SIZE, DEFAULT_BUCKET_SIZE, plan_bucket_positions
from dscompile.runtime.onebit.comm import CompressedLayout, reduce_scatter_chunk, wire_bytes
from dscompile.runtime.onebit.engine import bytes_sent
from dscompile.runtime.zero_shard import plan_byte_buckets, shard_numel

ONEBIT_TYPES = {"onebitadam": "OneBitAdam", "zerooneadam": "ZeroOneAdam", "onebitlamb": "OneBitLamb"}


def predict_step_bytes(numels: list[int], world: int, config: Any, itemsize: int = 4) -> dict[str, Any] | None:
    """Predicted bytes this rank sends per step and phase for ``config``'s 1-bit optimizer over parameters of
    ``numels`` values (the trainable ones, in ``model.parameters()`` order) on ``world`` ranks; None when the
    config's optimizer is not a 1-bit one."""
    optimizer = getattr(config, "optimizer", None)
    kind = optimizer.type.lower().replace("_", "") if optimizer is not None else ""
    if kind not in ONEBIT_TYPES:
        return None
    numels = [n for n in numels if n > 0]
    params = optimizer.params
    block_size = params.get("block_size", DEFAULT_BLOCK_SIZE)
    zero = config.sections.get("zero_optimization")
    stage = getattr(zero, "stage", 0) if zero is not None else 0
    if stage == 0:
        buckets = [[numels[i] for i in b] for b in plan_bucket_positions(numels, params.get("bucket_size", DEFAULT_BUCKET_SIZE))]
        phases = {"full_precision": _data_parallel_step(buckets, itemsize), "compressed": _compressed_step(buckets, world, block_size, config)}
    else:
        phases = _zero_steps(kind, numels, world, block_size, zero, plan_zero_schedule(config).reduce_bucket_elements, itemsize)
        if zero.compute_grad_norm or config.gradient_clipping > 0:
            for stats in phases.values():  # the global norm, every step (get_global_grad_norm(), as DeepSpeed's ZeRO)
                stats.record("zero", "clip_norm.all_reduce", 4)
    if kind == "zerooneadam":
        phases["local"] = EngineCommStats()
    return {
        "optimizer": ONEBIT_TYPES[kind],
        "world_size": world,
        "zero_stage": stage,
        "bytes_sent_per_step": {phase: bytes_sent(stats, world) for phase, stats in phases.items()},
        "fp32_all_reduce_bytes_per_step": wire_bytes("all_reduce", 4 * sum(numels), world),
    }


def _data_parallel_step(buckets: list[list[int]], itemsize: int) -> EngineCommStats:
    """The fp32 all-reduce: every gradient and one presence flag per parameter."""
    stats = EngineCommStats()
    stats.record("data_parallel", "all_reduce", sum(sum(b) + len(b) for b in buckets) * itemsize)
    return stats


def _compressed_step(buckets: list[list[int]], world: int, block_size: int | None, config: Any) -> EngineCommStats:
    """Per bucket: the all-to-all of signs and scales, and the all-gather of the servers' recompressed chunks."""
    stats = EngineCommStats()
    for bucket in buckets:
        layout = CompressedLayout.plan(sum(bucket), world, block_size)
        message = world * (layout.chunk // 8 + 4 * layout.blocks_per_chunk)
        stats.record("onebit", "compressed.all_to_all", message)
        stats.record("onebit", "compressed.all_gather", message)
    if config.gradient_clipping > 0:
        stats.record("onebit", "clip_norm.all_reduce", 4)  # the ranks' mean local norm
    return stats


def _zero_steps(
    kind: str, numels: list[int], world: int, block_size: int | None, zero: Any, reduce_bucket_elements: int, itemsize: int
) -> dict[str, EngineCommStats]:
    """ZeRO-1/2: the reduce-scatter (fp32, or 1-bit per bucket), the parameter all-gather after the step, and for
    1-bit LAMB the all-gather of the shards' partial norms (2 per parameter in the warm-up, 3 after). The global
    gradient norm's scalar all-reduce is added by the caller."""
    shards = [shard_numel(n, world) for n in numels]
    full_bytes = sum(s * world for s in shards) * itemsize
    gather_op = "all_gather" if zero.allgather_partitions else "broadcast"
    sizes = [s * world * itemsize for s in shards]
    buckets = plan_byte_buckets(sizes, [None] * len(sizes), reduce_bucket_elements * itemsize)
    warm, compressed = EngineCommStats(), EngineCommStats()
    warm.record("zero", "reduce_scatter", full_bytes)
    for bucket in buckets:
        chunk, block = reduce_scatter_chunk(sum(shards[i] for i in bucket), block_size)
        compressed.record("onebit", "compressed_gradient.all_to_all", world * (chunk // 8 + 4 * (chunk // block)))
    for stats, partials in ((warm, 2), (compressed, 3)):
        stats.record("zero", gather_op, full_bytes)
        if kind == "onebitlamb":
            stats.record("onebit", "lamb_norms.all_gather", world * partials * len(numels) * 4)
    return {"full_precision": warm, "compressed": compressed}
