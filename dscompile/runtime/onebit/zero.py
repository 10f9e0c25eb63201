"""ZeRO-1/2 under 1-bit Adam and 1-bit LAMB: the gradient reduce-scatter goes 1-bit after the freeze, bucket by bucket.

The optimizer steps this rank's flat shards (``OneBitAdam.over_shards``, ``OneBitLamb.over_shards``). At each accumulation
boundary every bucket of parameters (ZeRO's out-of-graph buckets, ``reduce_bucket_size``) is
reduce-scattered into the shards' gradients:

- in the warm-up (``optimizer.needs_averaged_gradients()``), ZeRO-1's fp32 reduce-scatter;
- after the freeze, ``compressed_reduce_scatter``: each rank adds its worker error to its gradient,
  laid out as ``[world, shard]`` rows, and sends row ``r`` 1-bit to rank ``r`` (one all-to-all),
  which averages its row. The worker errors are per rank and per bucket and live in the
  optimizer's ``exchange_state`` (so they travel in the rank's checkpoint).

Overlap with backward: on the boundary micro-step of ``engine.backward`` a bucket's exchange starts as
soon as every one of its parameters has its gradient (post-accumulate-grad hooks), asynchronously, in a
fixed bucket order on every rank (so collectives pair up), and its full gradients are freed at once
(the exchange holds its own compressed or fp32 copy); the boundary starts what no hook did (a parameter
without gradient on this rank), then waits for every bucket in issue order and writes the shards'
gradients. No hook waits on a collective.
The momentum update needs only the averaged gradient of the shard, so nothing waits for the end
of backward. Hooks stand aside (everything is exchanged at the boundary, as before) when the
step must first see every gradient: fp16 overflow agreement (an overflow must leave the errors
untouched), ``ignore_unused_parameters: false`` (unused parameters are counted first), or a
``backward`` outside the engine.

Stage 2 differs from stage 1 by not compiling ZeRO's in-graph reduce-scatters (the 1-bit exchange
replaces them, outside the graphs, with per-rank errors): the model is compiled unwrapped, its full
gradients are freed bucket by bucket as they are exchanged, and only the shards keep gradients
(with gradient accumulation the full gradients are kept across the micro-steps of a batch).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dscompile.runtime.comm_stats import tensor_bytes
from dscompile.runtime.onebit.comm import Collectives, CommStats, CompressedReduceScatter, reduce_scatter_chunk
from dscompile.runtime.training_core import TrainingCore, _agree_any
from dscompile.runtime.zero_extension import ZeroGradients
from dscompile.runtime.zero_shard import ZeroPartition

ZERO3_REFUSAL = (
    "the 1-bit optimizers compose with ZeRO stages 1 and 2 only (OneBitAdam, OneBitLamb): ZeRO-3 gathers parameters and "
    "reduce-scatters gradients inside the compiled graphs, where the 1-bit exchange (with its per-rank worker errors, "
    "kept unscaled outside the graph) is not built",
    "set zero_optimization.stage to 2 or 1 (their reduce-scatter goes 1-bit after the freeze), or 0",
)
"""Why and what to do, for ``DSCompileConfigError("zero_optimization.stage", ...)``."""


class OneBitZeroGradients(ZeroGradients):
    """ZeRO-1/2 whose reduce-scatter goes 1-bit once the optimizer no longer needs fp32-averaged gradients."""

    name = "onebit_zero"

    def __init__(self, partition: ZeroPartition, ignore_unused_parameters: bool, block_size: int | None, kernel_impl: str | None) -> None:
        super().__init__(partition, ignore_unused_parameters)
        self.block_size = block_size
        self.kernel_impl = kernel_impl
        self.comm = Collectives(partition.group, CommStats())
        self.buckets = list(partition._buckets(range(len(partition.layouts))))  # fixed: every parameter, every step
        self.engine: TrainingCore | None = None
        self.exchange_log: list[tuple[int, bool]] = []
        """``(bucket, during_backward)`` for every bucket exchanged in the last step, in issue order."""
        self._bucket_of = {id(partition.full_params[i]): b for b, bucket in enumerate(self.buckets) for i in bucket}
        self._hooks: list[Any] = []
        self._reset_pending()

    # -- overlap with backward ------------------------------------------------------------------
    def attach(self, engine: TrainingCore) -> None:
        """Register the gradient-ready hooks (once, when the engine installs this strategy)."""
        self.engine = engine
        for p in self.partition.full_params:
            p.requires_grad_(True)  # stage 2 turned them off for its in-graph reduce-scatter: here the full gradient is the input
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_gradient_ready))

    def detach(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def _reset_pending(self) -> None:
        self._in_flight: list[tuple[list[int], Any]] = []
        """``(parameter indices, finish)`` of the bucket exchanges started and not yet written into the shards, in issue
        order; ``finish()`` waits for the collective and returns the bucket's averaged shard gradient."""
        self._missing = [len(bucket) for bucket in self.buckets]
        self._seen: set[int] = set()
        self._log_open = False
        self._next = len(self.buckets) - 1  # buckets are issued last first (backward's order), the same order on every rank

    def _overlapping(self, engine: TrainingCore) -> bool:
        """Whether this backward may exchange buckets as they become ready."""
        return (
            engine.in_engine_backward
            and engine.is_gradient_accumulation_boundary()
            and self.ignore_unused_parameters
            and not any(e.checks_overflow for e in engine.extensions)
        )

    @torch.no_grad()
    def _on_gradient_ready(self, p: torch.Tensor) -> None:
        engine = self.engine
        if engine is None or engine.optimizer is None or not self._overlapping(engine) or id(p) in self._seen:
            return
        self._seen.add(id(p))
        b = self._bucket_of[id(p)]
        self._missing[b] -= 1
        while self._next >= 0 and self._missing[self._next] == 0:
            self._exchange(engine, self._next, during_backward=True)
            self._next -= 1

    # -- the boundary ---------------------------------------------------------------------------
    def reduce(self, engine: TrainingCore) -> None:
        try:
            if self._next < len(self.buckets) - 1:  # hooks exchanged some: finish the rest in the same order
                self._finish(engine)
            elif engine.optimizer.needs_averaged_gradients():  # type: ignore[union-attr]
                self._fp32_reduce(engine)
            else:
                if not self.ignore_unused_parameters:
                    self._refuse_unused()
                self._compressed_reduce(engine)
        finally:
            self._reset_pending()

    def _finish(self, engine: TrainingCore) -> None:
        """Start what backward did not (the same order on every rank), then wait for every bucket in issue order and
        add its averaged gradient to the shards."""
        while self._next >= 0:
            self._exchange(engine, self._next, during_backward=False)
            self._next -= 1
        for p in self.partition.full_params:
            p.grad = None
        zero = self.partition
        for bucket, finish in self._in_flight:
            mine = finish()
            offset = 0
            for i in bucket:
                length = zero.layouts[i].shard_numel
                shard = zero.shards[i]
                piece = mine[offset : offset + length].to(shard.dtype)
                shard.grad = piece.clone() if shard.grad is None else shard.grad.add_(piece)
                offset += length
        self._in_flight = []

    def _fp32_reduce(self, engine: TrainingCore) -> None:
        """ZeRO-1's reduce-scatter (the warm-up), at any stage."""
        zero = self.partition
        zero.comm_dtype = engine.context.communication_data_type
        itemsize = (engine.context.communication_data_type or zero.shards[0].dtype).itemsize
        nbytes = sum(layout.shard_numel * zero.world for layout in zero.layouts) * itemsize
        self.exchange_log = [(b, False) for b in range(len(self.buckets))]
        with engine.comm_stats.timed("zero", "reduce_scatter", nbytes if zero.world > 1 else 0):
            zero.reduce_gradients()

    @torch.no_grad()
    def _compressed_reduce(self, engine: TrainingCore) -> None:
        zero = self.partition
        if zero.world > 1 and any(e.checks_overflow for e in engine.extensions):
            grads = [p.grad for p in zero.full_params if p.grad is not None]
            local = torch.stack([n.float() for n in torch._foreach_norm(grads, float("inf"))]).isfinite().all() if grads else True
            if _agree_any(not bool(local), zero.group):
                # An overflow somewhere: send nothing (the errors stay clean) and let the loss scaler see it on every rank.
                for shard in zero.shards:
                    shard.grad = torch.full_like(shard, float("inf"))
                for p in zero.full_params:
                    p.grad = None
                return
        self._finish(engine)

    @torch.no_grad()
    def _exchange(self, engine: TrainingCore, b: int, during_backward: bool) -> None:
        """Start bucket ``b``'s reduce-scatter (fp32 or 1-bit, asynchronous) and free its full gradients; the boundary
        (``_finish``) waits for it and writes the shards' gradients."""
        if not self._log_open:
            self.exchange_log, self._log_open = [], True
        self.exchange_log.append((b, during_backward))
        zero = self.partition
        bucket = self.buckets[b]
        rows = torch.cat([self._rows(i) for i in bucket], dim=1)  # row r: rank r's ZeRO shard of every parameter in the bucket
        if engine.optimizer.needs_averaged_gradients():  # type: ignore[union-attr]
            finish = self._fp32_bucket(engine, rows)
        else:
            scaler = engine.loss_scaler
            scale = float(getattr(scaler, "loss_scale", 1.0)) if scaler is not None else 1.0
            rows = rows.float()
            if scale != 1.0:
                rows.div_(scale)  # errors live unscaled, so a change of the loss scale does not corrupt them
            errors: list[torch.Tensor | None] = engine.optimizer.exchange_state.setdefault("worker_errors", [None] * len(self.buckets))  # type: ignore[union-attr]
            if errors[b] is None:
                chunk, _ = reduce_scatter_chunk(rows.shape[1], self.block_size)
                errors[b] = torch.zeros(zero.world * chunk, device=rows.device)
            exchange = CompressedReduceScatter(rows, errors[b], self.block_size, self.comm, "compressed_gradient", self.kernel_impl)  # type: ignore[arg-type]

            def finish() -> torch.Tensor:
                mine = exchange.wait()
                return mine.mul_(scale) if scale != 1.0 else mine  # the loss scaler unscales the shards next (a power of two: exact)

        self._in_flight.append((bucket, finish))
        for i in bucket:
            zero.full_params[i].grad = None  # ZeRO-2: the full gradient is gone as soon as its bucket is sent

    def _rows(self, i: int) -> torch.Tensor:
        zero = self.partition
        p, layout = zero.full_params[i], zero.layouts[i]
        g = p.grad.reshape(-1) if p.grad is not None else p.new_zeros(layout.numel)
        return F.pad(g, (0, layout.shard_numel * zero.world - layout.numel)).view(zero.world, -1)

    def _fp32_bucket(self, engine: TrainingCore, rows: torch.Tensor) -> Any:
        """Start one bucket of ZeRO-1's fp32 reduce-scatter, operation for operation (the warm-up equals it bitwise);
        returns what waits for it and averages."""
        zero = self.partition
        flat = rows.reshape(-1)
        grad_dtype = flat.dtype
        if engine.context.communication_data_type is not None and zero.world > 1:
            flat = flat.to(engine.context.communication_data_type)
        out = flat.new_empty(flat.numel() // zero.world)
        if zero.world == 1:
            out.copy_(flat)
            return lambda: out
        flat = flat.contiguous()
        engine.comm_stats.record("zero", "reduce_scatter", tensor_bytes(flat))
        work = dist.reduce_scatter_tensor(out, flat, group=zero.group, async_op=True)

        def finish(sent: torch.Tensor = flat) -> torch.Tensor:  # holds the input until the collective is done
            work.wait()
            return out.to(grad_dtype).div_(zero.world)

        return finish

    def trainable_parameters(self) -> list[nn.Parameter]:
        return list(self.partition.shards)
