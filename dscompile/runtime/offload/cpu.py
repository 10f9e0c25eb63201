"""``CpuOffloadedOptimizer``: the offloaded masters and optimizer states in host memory (``device: cpu``).

Masters and states stay in host memory (pinned when ``pin_memory`` and CUDA exists). Gradients are copied
device→host into a host buffer, the host steps, parameters are copied back. Where the shard already lives in host
memory as fp32 (a CPU-only run) it is its own master (the host optimizer steps an alias of its storage): nothing is
copied. Masters are fp32 whatever the shard's dtype (DeepSpeed's fp32 master weights; dscompile's shards are fp32
already under ``bf16``/``fp16``, the graphs cast).

The early host step (ZeRO-2/3): the ``offload_gradients`` pass (``passes/offload.py``) puts a
``dscompile::offload_gradient`` node in each backward graph right where a host-stepped shard's gradient is final
(after its bucket's reduce-scatter wait, and after the graph's last read of the shard). When the engine's gate
allows it (``OptimizerOffloadExtension.early_step_allowed``: the engine's backward of one forward, on the micro-step
that ends a batch, no ``gradient_clipping``, no fp16 loss scaling or other overflow check, no extension acting on
ready gradients), ``hand_off`` adds the accumulated ``.grad`` as AccumulateGrad would, copies the gradient to the
host and submits that shard's host step to one worker thread (``host_threads``, else the cores torch's own threads
leave free), so the host steps while backward computes the remaining gradients. ``step()`` waits for those steps,
steps the rest and copies every separate master back to its shard (the device shard is not written during
backward; an in-place shard is, which is why its hand-off waits for the graph's last read of it). Stepping a subset
of the shards runs the same per-tensor arithmetic, so results are bitwise those of the step at ``step()``
(``tests/test_zero_offload_overlap.py``). How much overlaps depends on ZeRO's schedule: a gradient is final only
when its bucket's reduce-scatter is waited for (with one bucket for the whole model, at the end of backward).

Otherwise (the gate refuses, ZeRO-1, an uncompiled model), each shard's gradient is copied from its
post-accumulate-grad hook (``copy_gradients_during_backward``) on the micro-step that ends a batch; under compiled
graphs those hooks run once the backward graph has returned, so that copy does not overlap it. The step copies
again only a gradient changed since (unscaled, clipped) or never copied (ZeRO-1 reduces at the step).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from dscompile.runtime.offload.host import Piece
from dscompile.runtime.offload.optimizer import OffloadedOptimizer


class CpuOffloadedOptimizer(OffloadedOptimizer):
    """The offloaded part's masters and states in host memory; early steps on a worker thread (module docstring)."""

    def _init_state(self) -> None:
        self._host_grads: dict[int, torch.Tensor] = {}
        """Shard index -> the host buffer its gradient is copied into (shards with a separate master), reused every step."""
        self._copied: dict[int, tuple[torch.Tensor, int]] = {}
        """Shard index -> (the gradient copied to the host during backward, its version then)."""
        self._copy_hooks: list[Any] = []
        self._piece_of: dict[int, Piece] = {}
        # The early host step: shard index -> its step, submitted from the backward graph (``hand_off``).
        self._early: dict[int, Future[None]] = {}
        self._early_started: set[int] = set()
        self._early_lock = threading.Lock()
        self._worker: ThreadPoolExecutor | None = None

    # -- construction ----------------------------------------------------------------------------
    def _init_host(self, group_of: dict[int, int], rank: int) -> None:
        pin = self.settings.pin_memory and torch.cuda.is_available()
        for i in self.offloaded:
            shard = self.shards[i]
            inplace = self._own_master(shard)
            if inplace:
                # the host is the device and the shard is fp32: it is its own master. The host optimizer steps an alias
                # (same storage and version counter) whose .grad is its own, so a step may run while autograd sets the shard's.
                master = nn.Parameter(shard.detach())
            else:
                master = nn.Parameter(torch.empty(shard.shape, dtype=torch.float32, pin_memory=pin))
                with torch.no_grad():
                    master.copy_(shard.detach())
                self._host_grads[i] = torch.empty(shard.shape, dtype=torch.float32, pin_memory=pin)  # reused every step
            self.pieces.append(Piece(i, 0, shard.numel(), group_of[id(shard)], master, initialized=True, inplace=inplace))
        self._piece_of = {piece.shard: piece for piece in self.pieces}

    def _handed_shards(self) -> Iterable[int]:
        return self._piece_of

    def steps_in_place(self, i: int) -> bool:
        return self._piece_of[i].inplace

    def _publish_host_states(self) -> None:
        assert self.host_opt is not None
        for piece in self.pieces:
            if piece.master in self.host_opt.state:
                self.state[self.shards[piece.shard]] = self.host_opt.state[piece.master]

    # -- gradients copied from post-accumulate-grad hooks -----------------------------------------
    def copy_gradients_during_backward(self, when: Any) -> None:
        """Copy each host-mastered shard's gradient to the host from its post-accumulate-grad hook whenever ``when()``
        is true then (the engine passes "this backward ends a batch": earlier micro-steps' gradients still change)."""
        for i in self._host_grads:
            shard = self.shards[i]
            self._copy_hooks.append(shard.register_post_accumulate_grad_hook(lambda p, i=i: self._copy_gradient(i, p) if when() else None))

    def detach_gradient_copies(self) -> None:
        for handle in self._copy_hooks:
            handle.remove()
        self._copy_hooks.clear()

    @torch.no_grad()
    def _copy_gradient(self, i: int, shard: torch.Tensor) -> None:
        grad = shard.grad
        if grad is None or i in self._early:  # stepped from the graph already
            return
        host = self._host_grads[i]
        host.copy_(grad.detach(), non_blocking=host.is_pinned())
        self._copied[i] = (grad, grad._version)  # the reference keeps the tensor (and so its identity) until the step
        self.gradient_copies["during_backward"] += 1

    # -- the step --------------------------------------------------------------------------------
    def _step_host(self, early: set[int]) -> None:
        """Step every piece not stepped early from the backward graph; copy every separate master back to its shard."""
        assert self.host_opt is not None
        copies = []
        for piece in self.pieces:
            shard = self.shards[piece.shard]
            if piece.inplace:
                self._rebind(piece)
                piece.master.grad = None if piece.shard in early or shard.grad is None else shard.grad.detach()
                continue
            if piece.shard in early:  # stepped on the host during backward: only the copy back is left
                piece.master.grad = None
                copies.append(piece)
                continue
            if self._stale(piece):
                with self._resident([piece.shard]):
                    piece.master.copy_(shard.detach())
            copied = self._copied.get(piece.shard)
            if shard.grad is None:
                piece.master.grad = None
            elif copied is not None and copied[0] is shard.grad and copied[1] == shard.grad._version:
                piece.master.grad = self._host_grads[piece.shard]  # copied during backward and unchanged since
            else:
                host_grad = self._host_grads[piece.shard]
                host_grad.copy_(shard.grad.detach(), non_blocking=host_grad.is_pinned())
                piece.master.grad = host_grad
                self.gradient_copies["at_step"] += 1
            copies.append(piece)
        self._copied.clear()
        if copies and torch.cuda.is_available():
            torch.cuda.synchronize()
        self.host_opt.step()  # pieces whose master has no gradient (stepped early, or unused) are skipped
        for piece in copies:
            with self._resident([piece.shard]):
                self.shards[piece.shard].copy_(piece.master, non_blocking=piece.master.is_pinned())
            piece.master.grad = None
        for piece in self.pieces:
            piece.master.grad = None
        if copies and torch.cuda.is_available():
            torch.cuda.synchronize()

    def _rebind(self, piece: Piece) -> None:
        """An in-place master follows its shard if the shard's storage was replaced (its states move with it)."""
        shard = self.shards[piece.shard]
        if piece.master.data_ptr() == shard.data_ptr() and piece.master.shape == shard.shape:
            return
        assert self.host_opt is not None
        alias = nn.Parameter(shard.detach())
        state = self.host_opt.state.pop(piece.master, None)
        if state is not None:
            self.host_opt.state[alias] = state
        for group in self.host_opt.param_groups:
            group["params"] = [alias if p is piece.master else p for p in group["params"]]
        self._host_group_params = [[alias if p is piece.master else p for p in params] for params in self._host_group_params]
        piece.master = alias

    # -- the early host step: started from the backward graph -------------------------------------
    def _early_hand_off(self, i: int, grad: torch.Tensor) -> None:
        """The gradient, accumulated as AccumulateGrad would, is copied to the host (referenced where it is already a
        host fp32 tensor), and the shard's host step is submitted to the worker thread."""
        assert self.host_opt is not None
        piece = self._piece_of.get(i)
        if piece is None or grad.shape != self.shards[i].shape:
            return  # not one of this optimizer's host-stepped shards: stepped at step()
        if i in self._early:
            raise self._handed_twice(i)
        shard = self.shards[i]
        if not self._early:  # the first of this backward: the hyper-parameters the step would use
            self._sync_hyperparameters(self.host_opt)
        grad = self._final_gradient(i, grad)
        event = None
        if piece.inplace:
            self._rebind(piece)
            # an alias, not the graph's tensor: AccumulateGrad then takes that tensor as .grad instead of cloning it
            # (it clones a gradient referenced elsewhere); nothing writes it before step() has waited for the worker
            host = grad.detach()
        else:
            if self._stale(piece):
                with self._resident([i]):
                    piece.master.copy_(shard.detach())
                self._versions[i] = shard._version
            host = self._host_grads[i]  # the device->host copy (the path an accelerator takes, also when the host is the device)
            host.copy_(grad, non_blocking=host.is_pinned())
            if host.is_pinned() and torch.cuda.is_available():
                event = torch.cuda.Event()  # the worker steps once the copy has landed
                event.record()
            self.gradient_copies["during_backward"] += 1
        threads = self.settings.host_threads or max(1, (os.cpu_count() or 1) - torch.get_num_threads())
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dscompile-host-step")
        self._early[i] = self._worker.submit(self._early_step, piece, host, event, threads)
        self.early_steps["submitted"] += 1

    def _early_step(self, piece: Piece, grad: torch.Tensor, event: Any, threads: int) -> None:
        """On the worker thread: step one piece's master (the shard itself when in place) with ``grad``."""
        assert self.host_opt is not None
        if event is not None:
            event.synchronize()
        with self._early_lock:
            self._early_started.add(piece.shard)
        start = time.perf_counter()
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)  # this thread's own pool: the backward keeps its threads
        groups = self.host_opt.param_groups
        saved = [g["params"] for g in groups]
        piece.master.grad = grad
        try:
            for g, group in enumerate(groups):
                group["params"] = [piece.master] if g == piece.group else []
            self.host_opt.step()
        finally:
            for group, params in zip(groups, saved, strict=True):
                group["params"] = params
            piece.master.grad = None
        self.early_step_seconds += time.perf_counter() - start

    def end_backward(self) -> None:
        """After a backward: count the submitted steps that started (and finished) before it returned."""
        if not self._early:
            return
        with self._early_lock:
            started = len(self._early_started)
        self.early_steps["started_in_backward"] += started
        self.early_steps["finished_in_backward"] += sum(f.done() for f in self._early.values())

    def _wait_early(self) -> None:
        for future in list(self._early.values()):
            future.result()

    def _finish_early(self) -> set[int]:
        done = set(self._early)
        futures = list(self._early.values())
        self._early.clear()
        with self._early_lock:
            self._early_started.clear()
        for future in futures:
            future.result()
        return done

    def close(self) -> None:
        """Wait for submitted steps and stop the worker thread."""
        for future in self._early.values():
            with contextlib.suppress(Exception):
                future.result()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        super().close()

    # -- checkpoints -----------------------------------------------------------------------------
    def _host_states(self) -> dict[int, dict[str, Any]]:
        assert self.host_opt is not None
        states: dict[int, dict[str, Any]] = {}
        for piece in self.pieces:
            entry = self.host_opt.state.get(piece.master)
            if entry:
                states[piece.shard] = dict(entry)
        return states

    def _load_host(self, states: dict[int, dict[str, Any]]) -> None:
        assert self.host_opt is not None
        for piece in self.pieces:
            entry = self.host_opt.state[piece.master]
            entry.clear()
            entry.update({k: v.to("cpu").clone() if isinstance(v, torch.Tensor) else v for k, v in states.get(piece.shard, {}).items()})
            if not piece.inplace:
                piece.master.copy_(self.shards[piece.shard].detach())


__all__ = ["CpuOffloadedOptimizer"]
