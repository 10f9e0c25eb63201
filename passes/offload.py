"""ZeRO-Offload / ZeRO-Infinity: the ``offload_optimizer`` and ``offload_param`` configs and their engine extensions.

``offload_param`` (``OffloadParamConfig``, ZeRO-3 only) is at the end: ``ParamOffloadExtension`` moves the partitioned
parameter shards into ``runtime/offload/params.ParamStore`` (host or NVMe) and has ``ZeroModule`` read them
through ``zero_param_load`` right before their all-gather; the planner (``plan_param_offload``) sets the
read-ahead distance.

``zero_optimization.offload_optimizer`` (DeepSpeed's keys and defaults) moves the fp32 master shards and
the optimizer states of ZeRO stages 1-3 to the host (``device: cpu``) or to swap files under
``nvme_path`` (``device: nvme``); the engine extension registered here wraps ZeRO's sharded
optimizer in ``runtime/offload.OffloadedOptimizer`` (``build_offloaded_optimizer``) at engine construction. With ``device: cpu`` (or ``nvme``, below) and
ZeRO-2/3, the ``offload_gradients`` pass (last before the lowering) adds one ``dscompile::offload_gradient``
node per host-stepped shard to each backward graph, where its gradient is final (after its bucket's
reduce-scatter wait; for a shard stepped in place, also after the graph's last read of it): the host
step of that shard may start there, on a worker thread, while backward goes on. It starts only when
``OptimizerOffloadExtension.early_step_allowed`` says nothing global decides it: the engine's backward of a single
forward, on the micro-step that ends a batch (the accumulated gradient is added as AccumulateGrad does),
no ``gradient_clipping``, no overflow check (fp16 loss scaling; bf16 too: its static scaler skips a step
with inf/NaN gradients), no other extension acting on
ready gradients, ``ignore_unused_parameters`` on. Otherwise every shard is stepped at ``engine.step()``
as before (its gradient copied from a post-accumulate-grad hook, after the backward graph returned).
With ``device: nvme`` the same hand-offs step whole tiles in the backward once every shard cut into a tile has its
gradient (``NvmeOffloadedOptimizer._early_hand_off``: on the main thread, the tile reads and writes in flight around it, so
the swap I/O overlaps backward; the tiles' counter is ``early_tiles``). The counters
(``communication_stats()`` / ``ext.counters()``) say ``early_host_steps``: ``submitted`` (handed off
during backward), ``started_in_backward`` and ``finished_in_backward`` (by the worker before backward returned).

How each key is used:

- ``device``: ``none`` | ``cpu`` | ``nvme``.
- ``nvme_path``: the directory (it must exist); each rank writes ``nvme_path/rank_N/tile_*.swp``.
- ``ratio``: the fraction of the shard elements offloaded (in parameter order); the rest is stepped on
  the device (DeepSpeed's Twin-Flow).
- ``buffer_count``: NVMe tile buffers alive during the step (read-ahead plus write-behind); at least 1. The
  first ``buffer_count`` tiles are read from the forward of the micro-step that ends a batch on
  (``OptimizerOffloadExtension.before_forward``), so those reads overlap the forward and backward.
- ``pipeline_read`` / ``pipeline_write``: read tiles ahead / write them back while the next tile is
  stepped; false waits for each read / write (DeepSpeed's meaning). dscompile pipelines by default
  (DeepSpeed's defaults are false; results are identical either way).
- ``fast_init``: true skips writing zeroed state segments at start (they are written at the first step);
  false (DeepSpeed's default) preallocates the whole swap files, so a disk too small fails at start.
- ``pin_memory``: pins the host masters and swap buffers when CUDA exists (on a CPU-only machine there is
  no device copy, so nothing to pin).
- ``cpuadam_cores_perc``: the host step runs with this fraction of the CPU cores as torch threads
  (unset: torch's own setting at ``engine.step()``; for steps started during backward, the cores
  torch's threads leave free, at least one).
- ``super_offload`` (DeepSpeed's SuperOffload for superchips) is refused.
- ``zero_optimization.sub_group_size``: the NVMe tile, in elements (as in DeepSpeed's swapper). Not given, the
  planner sizes the tiles (``planner.nvme_tile_elements``: 1/8 of the offloaded states over ``buffer_count``
  buffers, between 2^20 and 2^24 elements), where DeepSpeed's default (1e9) would make one tile of any model
  under a billion parameters: all states in memory at the step and no read/step overlap.
- ``zero_optimization.offload_memory_limit`` (dscompile's own; bytes of model states per rank, 0 = no
  limit): the planner (``dscompile/planner/offload.py``) offloads only the optimizer states that do not fit
  under it (none when everything fits), never more than ``ratio``, and then, with ``offload_param``,
  only the ZeRO-3 parameter shards that still do not fit; its plan tables are logged at start,
  written to ``DUMP/offload_plan.txt`` / ``DUMP/param_offload_plan.txt`` when a dump directory is set,
  and printed by ``dscompile plan``.

The top-level ``aio`` section tunes the swap I/O: ``block_size`` (bytes per read/write call),
``intra_op_parallelism`` / ``thread_count`` (I/O threads: the larger is used; 4 when neither is set). ``queue_depth``,
``single_submit`` and ``overlap_events`` tune libaio submission, which is not used here (a thread pool
issues whole-file reads and writes in chunks of ``block_size``, always overlapped with the step); they
are accepted and have no effect. ``use_gds`` (GPUDirect Storage) is refused.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx

from dscompile.errors import DSCompileConfigError, DSCompileNotSupportedError
from dscompile.graph import set_fake_value
from dscompile.pipeline import PassContext, invocation, register_config_rule, register_pass
from dscompile.planner import OffloadPlan, ParamPlan, PlannedParameter, non_shard_device_bytes, plan_optimizer_offload, plan_param_offload
from dscompile.runtime.engine_core import EngineExtension, register_engine_extension
from dscompile.runtime.training_core import TrainingCore

log = logging.getLogger("dscompile.passes.offload")


@dataclass
class OffloadOptimizerConfig:
    """``zero_optimization.offload_optimizer`` (DeepSpeed 0.19's keys and defaults; see the module docstring)."""

    device: str | None = "none"
    nvme_path: str | None = None
    buffer_count: int = 4
    pin_memory: bool = False
    pipeline_read: bool = True
    pipeline_write: bool = True
    fast_init: bool = False
    ratio: float = 1.0
    super_offload: bool = False
    cpuadam_cores_perc: float | None = None

    def validate(self, path: str) -> None:
        if self.device is None:
            self.device = "none"
        if self.device not in ("none", "cpu", "nvme"):
            raise DSCompileConfigError(f"{path}.device", f"must be none, cpu or nvme, got {self.device!r}")
        if self.device == "nvme" and not self.nvme_path:
            raise DSCompileConfigError(f"{path}.nvme_path", "is required with device nvme", "set it to a directory on the fast disk")
        if not isinstance(self.buffer_count, int) or self.buffer_count < 1:
            raise DSCompileConfigError(f"{path}.buffer_count", f"must be a whole number >= 1, got {self.buffer_count!r}")
        if not 0.0 < float(self.ratio) <= 1.0:
            raise DSCompileConfigError(f"{path}.ratio", f"must be in (0, 1] (the fraction of optimizer states offloaded), got {self.ratio}")
        if self.super_offload:
            raise DSCompileNotSupportedError(f"{path}.super_offload", "SuperOffload (superchip CPU/GPU optimizer split)")
        if self.cpuadam_cores_perc is not None and not 0.0 < float(self.cpuadam_cores_perc) <= 1.0:
            raise DSCompileConfigError(f"{path}.cpuadam_cores_perc", f"must be in (0, 1], got {self.cpuadam_cores_perc}")

    @property
    def enabled(self) -> bool:
        return self.device in ("cpu", "nvme")


@dataclass
class OffloadParamConfig:
    """``zero_optimization.offload_param`` (DeepSpeed 0.19's keys and defaults; ZeRO stage 3 only).

    ``device``: none | cpu | nvme. ``nvme_path``: the directory (it must exist); each rank writes
    ``nvme_path/rank_N/param_*.swp``, one file per partitioned shard. ``pin_memory``: pins the host copies
    and read buffers when CUDA exists. ``buffer_count``: how many shards are read ahead of their all-gather
    (the planner's prefetch distance). ``buffer_size`` and ``max_in_cpu`` (elements) cap the read-ahead
    window: the planner lowers the distance until the largest shards in flight fit in ``buffer_count x
    buffer_size`` and in ``max_in_cpu`` (one shard is always read); the same window caps the shard writes left in
    flight after the optimizer step (``ParamPlan.write_behind``). Read buffers are sized to each shard
    (reused by size, at most the prefetch distance of a size: ``ParamStore._read_buffer``), so there is no fixed pool
    of ``buffer_size`` buffers.
    """

    device: str | None = "none"
    nvme_path: str | None = None
    pin_memory: bool = False
    buffer_count: int = 5
    buffer_size: int | float = 100_000_000
    max_in_cpu: int | float = 1_000_000_000

    def validate(self, path: str) -> None:
        if self.device is None:
            self.device = "none"
        if self.device not in ("none", "cpu", "nvme"):
            raise DSCompileConfigError(f"{path}.device", f"must be none, cpu or nvme, got {self.device!r}")
        if self.device == "nvme" and not self.nvme_path:
            raise DSCompileConfigError(f"{path}.nvme_path", "is required with device nvme", "set it to a directory on the fast disk")
        if not isinstance(self.buffer_count, int) or self.buffer_count < 1:
            raise DSCompileConfigError(f"{path}.buffer_count", f"must be a whole number >= 1, got {self.buffer_count!r}")
        for key in ("buffer_size", "max_in_cpu"):
            value = getattr(self, key)
            if value != int(value) or value < 1:
                raise DSCompileConfigError(f"{path}.{key}", f"must be a whole number of elements >= 1, got {value}")
            setattr(self, key, int(value))

    @property
    def enabled(self) -> bool:
        return self.device in ("cpu", "nvme")


DEFAULT_IO_THREADS = 4
"""I/O threads without an ``aio`` thread setting: one thread leaves the disk idle between calls (measured:
a 25M-element AdamW swap step took half the time with 4 threads as with 1, on this machine's virtio disk)."""


def aio_settings(config: Any) -> dict[str, Any]:
    """The ``aio`` section's block size (DeepSpeed's 1 MiB default) and I/O thread count (``DEFAULT_IO_THREADS`` where unset)."""
    aio = getattr(config, "sections", {}).get("aio") or {}
    if aio.get("use_gds"):
        raise DSCompileNotSupportedError("aio.use_gds", "GPUDirect Storage")
    given = [int(aio[key]) for key in ("intra_op_parallelism", "thread_count") if aio.get(key)]
    return {"block_size": int(aio.get("block_size", 1 << 20)), "io_threads": max(given) if given else DEFAULT_IO_THREADS}


class OptimizerOffloadExtension(EngineExtension):
    """Wraps ZeRO's sharded optimizer so its offloaded part is stepped on the host or from NVMe."""

    name = "zero_offload"

    def __init__(self, zc: Any, config: Any) -> None:
        self.zc = zc
        self.config = config
        self.optimizer: Any = None
        self.plan: OffloadPlan | None = None
        self._forwards = 0  # engine forwards since the last backward

    def configure(self, engine: TrainingCore) -> None:
        from dscompile.runtime.offload import OffloadSettings, build_offloaded_optimizer
        from dscompile.runtime.offload.host import host_threads_from_fraction, state_bytes_per_element

        if engine.context.zero is None:
            raise DSCompileConfigError("zero_optimization.offload_optimizer", "needs ZeRO (stage 1, 2 or 3) to partition the optimizer first")
        if engine.optimizer is None:
            log.warning("zero_optimization.offload_optimizer: no optimizer, so there are no optimizer states to offload")
            return
        from dscompile.runtime.onebit.base import CompressedCommOptimizer

        if isinstance(engine.optimizer, CompressedCommOptimizer):
            raise DSCompileConfigError(
                "zero_optimization.offload_optimizer",
                f"{type(engine.optimizer).__name__} communicates its own compressed momentum; offloading its states is not built",
                "drop offload_optimizer, or use Adam/AdamW with offload",
            )
        oc = self.zc.offload_optimizer
        zero = engine.context.zero
        shards = dict(zip((layout.name for layout in zero.layouts), zero.shards, strict=True))
        self.plan = plan_optimizer_offload(
            [PlannedParameter(layout.name, layout.numel, layout.shard_numel, layout.persistent) for layout in zero.layouts],
            stage=zero.stage,
            world=zero.world,
            device=oc.device,
            state_bytes_per_element=state_bytes_per_element(engine.optimizer),
            ratio=float(oc.ratio),
            limit=int(self.zc.offload_memory_limit),
            host_is_device=all(s.device.type == "cpu" for s in zero.shards),
            sub_group_size=self.zc.sub_group_size,
            buffer_count=oc.buffer_count,
        )
        engine.replan(engine.plan.with_placements(optimizer=self.plan))  # the one plan references it
        if zero.rank == 0:
            log.info("%s", self.plan.table())
            if engine.config.dump:  # beside the graphs: DUMP/offload_plan.txt
                root = Path(engine.config.dump)
                root.mkdir(parents=True, exist_ok=True)
                (root / "offload_plan.txt").write_text(self.plan.table() + "\n")
        if not self.plan.offloaded_names:
            log.info("zero_optimization.offload_memory_limit: every model state fits on the device, nothing is offloaded")
            return
        settings = OffloadSettings(
            device=oc.device,
            nvme_path=oc.nvme_path,
            pin_memory=oc.pin_memory if self.zc.cpu_offload_use_pin_memory is None else bool(self.zc.cpu_offload_use_pin_memory),
            buffer_count=oc.buffer_count,
            ratio=float(oc.ratio),
            tile_elements=self.plan.tile_elements or 1,
            pipeline_read=oc.pipeline_read,
            pipeline_write=oc.pipeline_write,
            preallocate_states=not oc.fast_init,
            host_threads=host_threads_from_fraction(oc.cpuadam_cores_perc),
            verify_reads=bool(self.config.debug),
            # offload_param releases the shards' storage between uses: cpu offload steps every master at once, outside
            # the shards' residency, so its masters must be copies; NVMe steps each tile with its shards resident.
            separate_master=oc.device == "cpu" and self.zc.offload_param is not None and self.zc.offload_param.enabled,
            **aio_settings(self.config),
        )
        chosen = [shards[name] for name in self.plan.offloaded_names]
        self.optimizer = build_offloaded_optimizer(engine.optimizer, zero.shards, settings, rank=zero.rank, chosen=chosen)
        # device->host gradient copies start from backward, on the micro-step that ends a batch
        self.optimizer.copy_gradients_during_backward(engine.is_gradient_accumulation_boundary)
        # the host step of each shard may start from the backward graph (``offload_gradients`` pass) when nothing global decides it
        self.optimizer.early_gate = lambda: self.early_step_allowed(engine)
        engine.replace_optimizer(self.optimizer)  # the scheduler follows

    def early_step_allowed(self, engine: TrainingCore) -> bool:
        """Whether the backward running now may start host steps: it is the engine's backward of the one forward since
        the last step or backward, it ends an accumulation batch, and nothing between backward and ``optimizer.step()``
        reads all gradients or changes them (no ``gradient_clipping``, no fp16 loss scaling or other overflow check,
        no extension acting on ready gradients, ZeRO-2/3 whose gradients the graphs reduce, unused parameters not checked)."""
        zero = engine.context.zero
        if not engine.in_engine_backward or self._forwards != 1 or engine.optimizer is not self.optimizer:
            return False
        if zero is None or zero.stage < 2 or not self.zc.ignore_unused_parameters or not engine.is_gradient_accumulation_boundary():
            return False
        if engine.config.gradient_clipping > 0 or engine.fp16_enabled():
            return False
        for extension in engine.extensions:
            if extension is self or extension.name == "onebit":  # 1-bit optimizers are refused with offload: it only watches
                continue
            if extension.checks_overflow:
                return False
            for hook in ("on_gradients_ready", "before_optimizer_step"):
                if getattr(type(extension), hook) is not getattr(EngineExtension, hook):
                    return False
        return True

    def before_forward(self, engine: TrainingCore) -> None:
        """Counts forwards (the early step's gate); NVMe: the micro-step that ends a batch starts reading the first
        tiles, so the reads overlap its forward and backward."""
        self._forwards += 1
        if self.optimizer is not None and engine.is_gradient_accumulation_boundary():
            self.optimizer.prefetch()

    def after_backward(self, engine: TrainingCore) -> None:
        self._forwards = 0
        if self.optimizer is not None:
            self.optimizer.end_backward()

    def after_optimizer_step(self, engine: TrainingCore, overflow: bool) -> None:
        self._forwards = 0

    def counters(self) -> dict[str, Any]:
        return self.optimizer.counters() if self.optimizer is not None else {}

    def destroy(self, engine: TrainingCore) -> None:
        if self.optimizer is not None:
            self.optimizer.detach_gradient_copies()
            self.optimizer.close()


# -- the graph hook: each host-stepped shard's final gradient handed to the offloaded optimizer --------------
@dataclass
class OffloadGradientsOptions:
    pass


@register_config_rule(95, "zero_offload")
def _offload_gradients_rule(config: Any) -> list[Any]:
    """Last before the lowering: the pass reads the backward graph's final gradient values."""
    zc = getattr(config, "sections", {}).get("zero_optimization")
    if zc is None or zc.stage < 2 or zc.offload_optimizer is None or zc.offload_optimizer.device not in ("cpu", "nvme"):
        return []
    return [invocation("offload_gradients")]


@register_pass("offload_gradients", graphs=("pre_autograd", "backward"), options=OffloadGradientsOptions, requires=("zero",))
def offload_gradients(gm: torch.fx.GraphModule, ctx: PassContext, options: OffloadGradientsOptions) -> torch.fx.GraphModule:
    """Hand each host-stepped shard's gradient to the offloaded optimizer as soon as the backward graph has it.

    On the Dynamo graph: which inputs are shards of a live cpu-offloaded optimizer (its real inputs are the
    parameters). On the backward graph, whose outputs are the gradients of those inputs in the same order: a
    ``dscompile::offload_gradient`` node right after each such gradient's final value (after its bucket's
    reduce-scatter wait), and after every node of this graph that still reads the shard itself (ZeRO-3 gathers it
    again in backward; an early step updates an in-place shard). The op does nothing unless the engine lets the
    step start early (``OptimizerOffloadExtension.early_step_allowed``)."""
    from dscompile.runtime.offload.gradient_sink import OFFLOAD_GRADIENT, gradient_sink_of

    if ctx.graph_kind == "pre_autograd":
        ctx.analysis["offload_gradients"] = {
            i: hit for i, value in enumerate(ctx.example_inputs) if (hit := gradient_sink_of(value)) is not None
        }
        return gm
    sinks: dict[int, tuple[int, int, bool]] = ctx.analysis.get("offload_gradients", {})
    if not sinks:
        return gm
    graph = gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    grads = output.args[0]
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    order = {n: k for k, n in enumerate(graph.nodes)}
    inserted = skipped = 0
    for position, (_, index, inplace) in sorted(sinks.items()):
        grad = grads[position] if position < len(grads) else None
        if not isinstance(grad, torch.fx.Node):
            continue
        after = _shard_readers(placeholders.get(f"primals_{position + 1}")) if inplace else []
        if after is None:
            skipped += 1  # a reader whose value is not one tensor: this shard keeps the step at step()
            continue
        anchor = max([grad, *after], key=order.__getitem__)
        with graph.inserting_after(anchor):
            node = graph.call_function(OFFLOAD_GRADIENT, (grad, after, index))
        set_fake_value(node)
        inserted += 1
    ctx.analysis.setdefault("offload_gradients_inserted", {})[ctx.graph_name] = inserted
    log.debug("%s: %d gradient hand-offs to the host step inserted, %d shards left to step()", ctx.graph_name, inserted, skipped)
    return gm


def _shard_readers(shard: torch.fx.Node | None) -> list[torch.fx.Node] | None:
    """The nodes whose execution last reads ``shard`` (through its views); a functional collective reads its
    input until its wait. None when one of them does not produce a single tensor."""
    if shard is None:
        return []
    aliases, stack, readers = {shard}, [shard], []
    while stack:
        node = stack.pop()
        for user in node.users:
            if user.op == "call_function" and isinstance(user.target, torch._ops.OpOverload) and user.target.is_view:
                if user not in aliases:
                    aliases.add(user)
                    stack.append(user)
            elif user.op != "output":
                readers.append(user)
    out = []
    for reader in readers:
        if reader.op == "call_function" and str(reader.target).startswith("_c10d_functional."):
            waits = [u for u in reader.users if u.target is torch.ops._c10d_functional.wait_tensor.default]
            if len(waits) != 1:
                return None
            reader = waits[0]
        if not isinstance(reader.meta.get("val"), torch.Tensor):
            return None
        out.append(reader)
    return out


@register_engine_extension(11, "zero_offload")
def _offload_extension(config: Any) -> EngineExtension | None:
    """After ZeRO (order 10) has moved the optimizer onto the shards."""
    zc = getattr(config, "sections", {}).get("zero_optimization")
    if zc is None or zc.stage == 0 or zc.offload_optimizer is None or not zc.offload_optimizer.enabled:
        return None
    return OptimizerOffloadExtension(zc, config)


class ParamOffloadExtension(EngineExtension):
    """ZeRO-3 parameter shards on the host or in NVMe files (``offload_param``), read before their all-gather."""

    name = "zero_offload_param"

    def __init__(self, zc: Any, config: Any) -> None:
        self.zc = zc
        self.config = config
        self.store: Any = None
        self.plan: ParamPlan | None = None

    def configure(self, engine: TrainingCore) -> None:
        from dscompile.runtime.offload.params import ParamOffloadSettings, ParamStore
        from dscompile.runtime.zero_shard import ZeroModule

        zero = engine.context.zero
        target = engine.context.compile_target
        if zero is None or zero.stage != 3 or not isinstance(target, ZeroModule):
            raise DSCompileConfigError("zero_optimization.offload_param", "needs ZeRO stage 3 (partitioned parameters)", "set zero_optimization.stage to 3")
        op = self.zc.offload_param
        planned = [PlannedParameter(layout.name, layout.numel, layout.shard_numel, layout.persistent) for layout in zero.layouts]
        self.plan = plan_param_offload(
            planned,
            world=zero.world,
            device=op.device,
            bytes_per_element=zero.shards[0].element_size(),
            buffer_count=op.buffer_count,
            buffer_size=op.buffer_size,
            max_in_cpu=op.max_in_cpu,
            limit=int(self.zc.offload_memory_limit),
            other_device_bytes=self._other_device_bytes(engine, planned, zero.shards[0].element_size()),
            host_is_device=all(s.device.type == "cpu" for s in zero.shards),
        )
        engine.replan(engine.plan.with_placements(param=self.plan))  # the one plan references it
        if zero.rank == 0:
            log.info("%s", self.plan.table())
            if engine.config.dump:
                root = Path(engine.config.dump)
                root.mkdir(parents=True, exist_ok=True)
                (root / "param_offload_plan.txt").write_text(self.plan.table() + "\n")
        names = set(self.plan.offloaded_names)
        indices = [i for i, layout in enumerate(zero.layouts) if layout.name in names]
        aio = aio_settings(self.config)
        settings = ParamOffloadSettings(
            device=op.device,
            nvme_path=op.nvme_path,
            pin_memory=op.pin_memory,
            prefetch_distance=self.plan.prefetch_distance,
            write_behind=self.plan.write_behind,
            block_size=aio["block_size"],
            io_threads=aio["io_threads"],
            verify_reads=bool(self.config.debug),
        )
        self.store = ParamStore(zero.shards, indices, settings, rank=zero.rank)
        target.offloaded_shards = {i: self.store.id for i in indices}
        offloaded_optimizer = engine.extension("zero_offload")
        if offloaded_optimizer is not None and getattr(offloaded_optimizer, "optimizer", None) is not None:
            offloaded_optimizer.optimizer.residency = self.store.resident  # tile by tile
        elif engine.optimizer is not None:
            engine.optimizer.step = _shard_by_shard(engine.optimizer, self.store)
        zero.residency = self.store.resident  # full parameters and checkpoints read and write the shards' values

    @staticmethod
    def _other_device_bytes(engine: TrainingCore, planned: list[PlannedParameter], shard_bytes: int) -> int:
        from dscompile.runtime.offload.host import state_bytes_per_element

        optimizer_plan = getattr(engine.extension("zero_offload"), "plan", None)  # configured first (order 11)
        if optimizer_plan is not None:
            return non_shard_device_bytes(planned, shard_bytes, optimizer_plan)
        per_element = state_bytes_per_element(engine.optimizer) if engine.optimizer is not None else 0
        return non_shard_device_bytes(planned, shard_bytes, None, per_element)

    def after_optimizer_step(self, engine: TrainingCore, overflow: bool) -> None:
        self.store.end_step()

    def counters(self) -> dict[str, Any]:
        return self.store.counters() if self.store is not None else {}

    def destroy(self, engine: TrainingCore) -> None:
        if self.store is not None:
            self.store.close()


def _shard_by_shard(optimizer: Any, store: Any) -> Any:
    """``optimizer.step`` that steps the resident tensors together, then each offloaded shard on its own while it is
    resident (read, stepped, written back, released), so at most one offloaded shard is in memory at the step.
    Equal bit for bit to one step over all: ZeRO's optimizers update each tensor on its own (``zero_extension``)."""
    inner_step = optimizer.step
    offloaded = {id(store.shards[i]): i for i in store.indices}

    def step(closure: Any = None) -> Any:
        groups = optimizer.param_groups
        full = [list(g["params"]) for g in groups]
        try:
            for g, params in zip(groups, full, strict=True):
                g["params"] = [p for p in params if id(p) not in offloaded]
            loss = inner_step(closure)
            for gi, params in enumerate(full):
                for p in params:
                    if id(p) not in offloaded or p.grad is None:
                        continue
                    for g in groups:
                        g["params"] = []
                    groups[gi]["params"] = [p]
                    with store.resident([offloaded[id(p)]]):
                        inner_step()
        finally:
            for g, params in zip(groups, full, strict=True):
                g["params"] = params
        return loss

    return step


@register_engine_extension(12, "zero_offload_param")
def _param_offload_extension(config: Any) -> EngineExtension | None:
    """After ZeRO (order 10) partitioned the model and optimizer offload (11) wrapped the optimizer."""
    zc = getattr(config, "sections", {}).get("zero_optimization")
    if zc is None or zc.offload_param is None or not zc.offload_param.enabled:
        return None
    return ParamOffloadExtension(zc, config)
