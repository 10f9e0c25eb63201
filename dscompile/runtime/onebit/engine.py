"""1-bit Adam, 0/1 Adam and 1-bit LAMB inside a dscompile engine: the engine hands them its gradient communication.

``OneBitExtension`` (registered by ``passes/onebit.py``, inert unless the engine's optimizer is one of
them) installs a gradient strategy at construction:

- without ZeRO, ``OneBitGradients``: at each accumulation boundary the gradients are averaged with the
  engine's fp32 all-reduce exactly when the optimizer's coming step needs them averaged
  (``needs_averaged_gradients()``: 1-bit Adam/LAMB's warm-up, 0/1 Adam's variance steps); otherwise
  each rank keeps its own and the optimizer's step exchanges its compressed momentum (0/1 Adam's
  local steps send nothing). So there is no second, uncompressed all-reduce.
- with ZeRO-1 or ZeRO-2 (``OneBitAdam``, ``OneBitLamb``: its trust ratios from the shards' partial norms),
  ``OneBitZeroGradients`` (``runtime/onebit/zero.py``): the optimizer steps this rank's flat
  shards (``over_shards``: it communicates nothing itself). In the warm-up ZeRO-1's fp32
  reduce-scatter feeds it; after the freeze a 1-bit reduce-scatter does
  (``compressed_reduce_scatter``): each rank compresses its own gradient, the momentum's per-rank
  contribution, with its worker error, laid out as ``[world, shard]`` rows so that the chunk a rank
  averages is exactly its ZeRO shard; the shard's momentum ``m = beta1 m + (1 - beta1) g`` is then
  formed from that average by the owner. No server error and no compressed all-gather: ZeRO-1's
  parameter all-gather after the step replaces them (so only the reduce half is compressed).
  The worker errors travel in the shard optimizer's ``state_dict`` (ZeRO's per-rank files).
  Buckets are exchanged during backward as they become ready (see that module); ZeRO-2 compiles the
  model without its in-graph reduce-scatters and frees each bucket's full gradients once exchanged.

Clipping (``gradient_clipping``) acts on the gradients the optimizer is about to use, as DeepSpeed
0.19.5's engine did with these optimizers (it switched its backward all-reduce off after the freeze
and clipped what was left with its ``clip_grad_norm_``, which averages the ranks' norms over the
data-parallel group): in warm-up steps the averaged gradient by its norm (equal on every rank);
after the freeze each rank's own gradient, scaled by ``max_norm / (mean of the ranks' local norms)``
(the same factor on every rank; ``get_global_grad_norm()`` reports that mean). DeepSpeed's fp16
optimizer used each rank's own norm instead; here every precision clips alike. Under ZeRO-1 the
gradient used is the 1-bit averaged one, clipped by its global norm (summed over the shards). fp16 overflow
is agreed across ranks by the engine core, so every rank skips the same steps; a skipped step leaves
the compression errors untouched (they are kept unscaled by the loss scale).

Counters: every collective of the 1-bit runtime appears in ``engine.communication_stats()`` under
``onebit`` (``<purpose>.<collective>``), and the extension's counters (under
``extensions.onebit``) give bytes *sent* per rank (the bandwidth-optimal algorithms' volume, as
``comm.wire_bytes``) for the last step, per phase, and what an fp32 all-reduce would send; the
progress log prints them every ``steps_per_print`` steps.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dscompile.errors import DSCompileConfigError
from dscompile.runtime.checkpoint_io import CheckpointError, CheckpointReader, CheckpointWriter
from dscompile.runtime.comm_stats import CommStats as EngineCommStats
from dscompile.runtime.comm_stats import tensor_bytes
from dscompile.runtime.data_parallel import DataParallelGradients
from dscompile.runtime.devices import collective_device
from dscompile.runtime.engine_core import EngineExtension
from dscompile.runtime.onebit.base import CompressedCommOptimizer
from dscompile.runtime.onebit.comm import CommStats, wire_bytes
from dscompile.runtime.onebit.zero import ZERO3_REFUSAL, OneBitZeroGradients
from dscompile.runtime.onebit.zero_one_adam import ZeroOneAdam
from dscompile.runtime.training_core import MODEL_STATES, TrainingCore
from dscompile.runtime.zero_extension import ZeroGradients
from dscompile.runtime.zero_shard import check_unused_parameters

log = logging.getLogger("dscompile.runtime.onebit")

_SENT_FACTOR = {
    "all_reduce": lambda w: 2 * (w - 1) / w,
    "reduce_scatter": lambda w: (w - 1) / w,
    "all_gather": lambda w: (w - 1) / w,  # of the gathered output, the engine's message size
    "all_to_all": lambda w: (w - 1) / w,
}


def bytes_sent(stats: EngineCommStats, world: int) -> int:
    """Bytes this rank put on the wire for the collectives in ``stats`` (message sizes converted with the
    ring/pairwise volumes of ``comm.wire_bytes``; an op of unknown algorithm counts its message size)."""
    if world <= 1:
        return 0
    total = 0.0
    for (_source, op), counter in stats.counters.items():
        kind = op.rsplit(".", 1)[-1]
        total += counter.bytes * (_SENT_FACTOR[kind](world) if kind in _SENT_FACTOR else 1.0)
    return int(round(total))


def rank_file(rank: int) -> str:
    return f"onebit_rank_{rank}_states.pt"


class OneBitGradients(DataParallelGradients):
    """Whole replicas; gradients averaged in fp32 only for the steps whose optimizer needs them averaged."""

    name = "onebit"

    def __init__(self, module: nn.Module, optimizer: CompressedCommOptimizer) -> None:
        super().__init__(module)
        optimizer.set_gradient_averaging(by_caller=True)
        self.exchange_log: list[tuple[int, bool]] = []
        """``(bucket, during_backward)`` for the exchanges (fp32 all-reduce or the optimizer's compressed one) started
        from backward in the last step."""
        self._hooks: list[Any] = []
        self._engine: TrainingCore | None = None
        self._bucket_of = {id(p): b for b, bucket in enumerate(optimizer.buckets) for p in bucket.params}
        self._fp32_pending: list[tuple[int, Any, torch.Tensor]] = []
        """``(bucket, work handle, flat buffer)`` of the fp32 all-reduces started from backward, in issue order."""
        self._reset_pending(optimizer)

    # -- overlap with backward: each bucket's exchange starts once its gradients are final ---------------------------
    def attach(self, engine: TrainingCore) -> None:
        """Start each bucket's exchange from backward (post-accumulate-grad hooks), in a fixed bucket order on every
        rank, asynchronously: the fp32 all-reduce of a warm-up step (waited at the boundary), the compressed exchange
        of an optimizer with ``exchange_early`` (1-bit Adam, 1-bit LAMB, 0/1 Adam's compressed steps; its all-to-all
        runs while backward goes on, its server half and all-gather start from the next bucket's hook, and the step
        waits for the results)."""
        if self.world_size == 1:
            return
        self._engine = engine
        for p in engine.optimizer.buckets:  # type: ignore[union-attr]
            for param in p.params:
                self._hooks.append(param.register_post_accumulate_grad_hook(self._on_gradient_ready))

    def detach(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def _reset_pending(self, optimizer: CompressedCommOptimizer) -> None:
        self._missing = [len(bucket.params) for bucket in optimizer.buckets]
        self._seen: set[int] = set()
        self._next = len(optimizer.buckets) - 1  # last bucket first (backward's order), the same order on every rank
        self._log_open = False
        self._fp32_pending = []

    def _overlapping(self, engine: TrainingCore) -> bool:
        """The coming step is a compressed one that uses these gradients unchanged: no clipping, no overflow skip."""
        optimizer = engine.optimizer
        return (
            hasattr(optimizer, "exchange_early")
            and engine.in_engine_backward
            and engine.is_gradient_accumulation_boundary()
            and engine.config.gradient_clipping <= 0
            and not any(e.checks_overflow for e in engine.extensions)
            and not optimizer.needs_averaged_gradients()  # type: ignore[union-attr]
        )

    def _fp32_overlapping(self, engine: TrainingCore) -> bool:
        """The coming step averages gradients in fp32 (or ``communication_data_type``) as ``DataParallelGradients.reduce``
        does: its all-reduce may start bucket by bucket, with the same casts and pre-/post-division per element.
        Clipping and the overflow check act on the averaged gradients after the boundary, as without overlap."""
        return (
            engine.in_engine_backward
            and engine.is_gradient_accumulation_boundary()
            and engine.optimizer.needs_averaged_gradients()  # type: ignore[union-attr]
        )

    @torch.no_grad()
    def _on_gradient_ready(self, p: torch.Tensor) -> None:
        engine = self._engine
        if engine is None or id(p) in self._seen:
            return
        fp32 = self._fp32_overlapping(engine)
        if not fp32 and not self._overlapping(engine):
            return
        self._seen.add(id(p))
        optimizer = engine.optimizer
        self._missing[self._bucket_of[id(p)]] -= 1
        while self._next >= 0 and self._missing[self._next] == 0:
            if fp32:
                self._start_fp32(engine, self._next)
            if fp32 or optimizer.exchange_early(optimizer.buckets[self._next]):  # type: ignore[union-attr]
                if not self._log_open:
                    self.exchange_log, self._log_open = [], True
                self.exchange_log.append((self._next, engine.in_engine_backward))
            self._next -= 1

    def _start_fp32(self, engine: TrainingCore, b: int) -> None:
        """Start bucket ``b``'s all-reduce (async) of what ``DataParallelGradients.reduce`` sends for it
        (``reduce_buffer``: gradients and presence flags, cast and pre-divided as configured)."""
        params = engine.optimizer.buckets[b].params  # type: ignore[union-attr]
        flat, _ = self.reduce_buffer(engine, params)
        engine.comm_stats.record("data_parallel", "all_reduce", tensor_bytes(flat))
        self._fp32_pending.append((b, dist.all_reduce(flat, group=self.group, async_op=True), flat))

    def _finish_fp32(self, engine: TrainingCore) -> None:
        """Start what backward did not (same order on every rank), wait for every bucket, average, check unused."""
        while self._next >= 0:
            self._start_fp32(engine, self._next)
            self._next -= 1
        config = engine.config
        optimizer = engine.optimizer
        names = {id(p): n for n, p in self.module.named_parameters()}
        params: list[nn.Parameter] = []
        counts: list[int] = []
        results = []
        for b, work, flat in self._fp32_pending:
            work.wait()
            bucket_params = optimizer.buckets[b].params  # type: ignore[union-attr]
            values = flat[: -len(bucket_params)]
            self.finish_average(engine, values)
            params += bucket_params
            counts += [round(c) for c in flat[-len(bucket_params) :].tolist()]
            results.append((bucket_params, values))
        check_unused_parameters([names.get(id(p), "?") for p in params], counts, self.world_size, config.sections.get("zero_optimization"))
        used = dict(zip(map(id, params), counts))
        for bucket_params, values in results:
            offset = 0
            for p in bucket_params:
                if used[id(p)] == 0:
                    p.grad = None
                else:
                    piece = values[offset : offset + p.numel()].view_as(p)
                    p.grad = torch.empty_like(p).copy_(piece) if p.grad is None else p.grad.copy_(piece)  # back in the gradient's dtype
                offset += p.numel()

    def reduce(self, engine: TrainingCore) -> None:
        try:
            if not self._log_open:
                self.exchange_log = []  # nothing started from backward: exchanges happen here or in the optimizer's step
            if self._fp32_pending:
                self._finish_fp32(engine)
            elif engine.optimizer.needs_averaged_gradients():  # type: ignore[union-attr]
                super().reduce(engine)
            # otherwise every rank keeps its own gradients: the optimizer's step exchanges them 1-bit (or, 0/1 Adam's local steps, not at all)
        finally:
            self._reset_pending(engine.optimizer)  # type: ignore[arg-type]

    def clip(self, engine: TrainingCore, params: list[nn.Parameter], max_norm: float) -> float:
        """Averaged gradients: by their norm (the same on every rank). Each rank's own gradients (after the freeze):
        every rank scales its own by ``max_norm / (mean of the ranks' norms + 1e-6)`` (at most 1), as DeepSpeed 0.19.5's
        ``clip_grad_norm_`` does; one scalar all-reduce."""
        if self.world_size == 1 or engine.optimizer.needs_averaged_gradients():  # type: ignore[union-attr]
            return super().clip(engine, params, max_norm)
        grads = [p.grad for p in params if p.grad is not None]
        device = grads[0].device if grads else params[0].device
        local = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))) if grads else torch.zeros((), device=device)
        mean = (local.float() / self.world_size).reshape(1).to(collective_device(like=local))
        with engine.comm_stats.timed("onebit", "clip_norm.all_reduce", 4):
            dist.all_reduce(mean)
        coefficient = torch.clamp(max_norm / (mean.to(device) + 1e-6), max=1.0).reshape(())
        if grads:
            torch._foreach_mul_(grads, coefficient)
        return float(mean)

    def save_checkpoint(self, engine: TrainingCore, ckpt: CheckpointWriter, client_state: dict | None) -> None:
        """Rank 0's model states as without 1-bit, plus every rank's own compression errors and counters."""
        super().save_checkpoint(engine, ckpt, client_state)
        share = engine.optimizer.state_dict()["onebit"]  # type: ignore[union-attr]
        ckpt.save({"rank": self.rank, "world_size": self.world_size, "onebit": share}, rank_file(self.rank))

    def load_checkpoint(
        self, engine: TrainingCore, directory: Path, load_optimizer_states: bool, load_lr_scheduler_states: bool, load_module_only: bool
    ) -> dict | None:
        client = super().load_checkpoint(engine, directory, False, load_lr_scheduler_states, load_module_only)
        if load_module_only or not load_optimizer_states or engine.optimizer is None:
            return client
        reader = CheckpointReader(directory)
        if not reader.has(rank_file(self.rank)):
            raise CheckpointError(
                f"{directory} has no 1-bit state for rank {self.rank} ({rank_file(self.rank)}): it was saved by another optimizer "
                f"or on fewer ranks; the compression errors are per rank, so resume on the same {self.world_size} ranks "
                "(or pass load_optimizer_states=False)"
            )
        own = reader.load(rank_file(self.rank))
        state = dict(reader.load(MODEL_STATES)["optimizer"])
        state["onebit"] = own["onebit"]
        engine.optimizer.load_state_dict(state)
        return client


def _phase(optimizer: CompressedCommOptimizer) -> str:
    """What the coming step communicates: ``full_precision``, ``compressed`` or (0/1 Adam) ``local``."""
    if optimizer.needs_averaged_gradients():
        return "full_precision"
    if isinstance(optimizer, ZeroOneAdam) and optimizer.var_frozen and not optimizer.is_sync_step(optimizer.global_step + 1):
        return "local"
    return "compressed"


class OneBitExtension(EngineExtension):
    """Hands the engine's gradient communication to a 1-bit optimizer; counts and logs the bytes per step."""

    name = "onebit"

    def __init__(self) -> None:
        self.optimizer: CompressedCommOptimizer | None = None
        self.purpose_stats: CommStats | None = None
        self.world = 1
        self.fp32_bytes_per_step = 0
        self.phase = ""
        self.last_step_bytes = 0
        self.bytes_by_phase: dict[str, int] = {}
        self.steps_by_phase: dict[str, int] = {}
        self._seen = 0
        self.history: list[dict[str, Any]] = []

    def configure(self, engine: TrainingCore) -> None:
        optimizer = engine.optimizer
        if not isinstance(optimizer, CompressedCommOptimizer):
            return  # not a 1-bit optimizer: nothing to do
        if isinstance(engine.gradients, ZeroGradients):
            zero = engine.gradients.partition
            if zero.stage == 3:
                raise DSCompileConfigError("zero_optimization.stage", *ZERO3_REFUSAL)
            attach_shards = getattr(optimizer, "attach_shards", None)
            if attach_shards is not None:  # 1-bit LAMB: whole-parameter norms from the shards' partials, over ZeRO's group
                real = {id(s): max(0, min(lay.shard_numel, lay.numel - zero.rank * lay.shard_numel)) for s, lay in zip(zero.shards, zero.layouts)}
                attach_shards(zero.group, real)
            strategy = OneBitZeroGradients(zero, engine.gradients.ignore_unused_parameters, optimizer.block_size, optimizer.kernel_impl)
            engine.context.compile_target = engine.module  # stage 2: no in-graph reduce-scatter, the 1-bit exchange replaces it
            strategy.attach(engine)
            engine.install_gradients(strategy)
            self.purpose_stats = strategy.comm.stats
        elif engine.gradients is None:
            gradients = OneBitGradients(engine.module, optimizer)
            gradients.attach(engine)
            engine.install_gradients(gradients)
            self.purpose_stats = optimizer.comm.stats
        else:
            raise DSCompileConfigError(
                "pipeline",
                f"{type(optimizer).__name__} does not support pipeline parallelism (its exchange would average across stages)",
                "train without a pipeline section, or use Adam/AdamW",
            )
        self.optimizer = optimizer
        self.world = engine.world_size
        numel = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
        self.fp32_bytes_per_step = wire_bytes("all_reduce", 4 * numel, self.world)

    def on_gradients_ready(self, engine: TrainingCore, params: list[nn.Parameter]) -> None:
        if self.optimizer is not None:
            self.phase = _phase(engine.optimizer)  # type: ignore[arg-type]

    def after_optimizer_step(self, engine: TrainingCore, overflow: bool) -> None:
        if self.optimizer is None:
            return
        sent = bytes_sent(engine.comm_stats, self.world)
        self.last_step_bytes = sent - self._seen
        self._seen = sent
        self.bytes_by_phase[self.phase] = self.bytes_by_phase.get(self.phase, 0) + self.last_step_bytes
        self.steps_by_phase[self.phase] = self.steps_by_phase.get(self.phase, 0) + 1
        if engine.config.dump:
            self._dump(Path(engine.config.dump), engine)
        if engine.global_rank == 0 and engine.global_steps % engine.config.steps_per_print == 0:
            ratio = f"{self.fp32_bytes_per_step / self.last_step_bytes:.1f}x fewer than" if self.last_step_bytes else "nothing, vs"
            log.info(
                "step %d (%s %s): %d bytes sent this step, %s an fp32 all-reduce (%d bytes)",
                engine.global_steps,
                type(self.optimizer).__name__,
                self.phase,
                self.last_step_bytes,
                ratio,
                self.fp32_bytes_per_step,
            )

    def _dump(self, directory: Path, engine: TrainingCore) -> None:
        """``communication_rank<r>.json`` in the dump directory: bytes this rank sent per step, per phase (``dscompile dump``
        and ``dump.print_summaries`` show them beside the graphs)."""
        self.history.append({"step": engine.global_steps, "phase": self.phase, "bytes_sent": self.last_step_bytes})
        del self.history[:-1000]  # the last 1000 steps
        record = {
            "optimizer": type(self.optimizer).__name__,
            "world_size": self.world,
            "fp32_all_reduce_bytes_per_step": self.fp32_bytes_per_step,
            "steps": self.history,
            "bytes_sent_by_phase": self.bytes_by_phase,
        }
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"communication_rank{engine.global_rank}.json").write_text(json.dumps(record, indent=1))

    def destroy(self, engine: TrainingCore) -> None:
        if isinstance(engine.gradients, (OneBitZeroGradients, OneBitGradients)):
            engine.gradients.detach()

    def counters(self) -> dict[str, Any]:
        if self.optimizer is None:
            return {}
        return {
            "optimizer": type(self.optimizer).__name__,
            "last_phase": self.phase,
            "bytes_sent_last_step": self.last_step_bytes,
            "fp32_all_reduce_bytes_per_step": self.fp32_bytes_per_step,
            "bytes_sent_by_phase": dict(self.bytes_by_phase),
            "steps_by_phase": dict(self.steps_by_phase),
            "onebit_bytes_sent_by_purpose": dict(self.purpose_stats.as_dict()["bytes_by_purpose"]) if self.purpose_stats else {},
        }


def onebit_extension(config: Any) -> OneBitExtension:
    """Every engine gets one; it acts only when the engine's optimizer is a 1-bit optimizer (from the
    config or passed in), so an optimizer object built by the user is handled like a configured one."""
    return OneBitExtension()
