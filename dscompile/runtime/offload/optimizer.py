"""``OffloadedOptimizer``: ZeRO's sharded optimizer with its fp32 master shards and states on the host or NVMe.

The engine keeps stepping "the optimizer over this rank's shards" (``runtime/zero_extension.py``); this class is
that optimizer, so the engine, LR schedulers and checkpoints see the same ``param_groups`` (the shards) and the
same ``state_dict`` layout as without offload. The first ``ratio`` of the shard elements (in parameter order;
DeepSpeed's ``ratio``), or the planner's choice, are offloaded: a host optimizer of the user's class and
hyper-parameters steps fp32 master copies of them; the rest is stepped in place on the device by a device
optimizer of the same class. Where the host optimizer's masters and states live is a subclass's job:
``cpu.CpuOffloadedOptimizer`` (host memory) or ``nvme.NvmeOffloadedOptimizer`` (swap files, tile by tile);
``build_offloaded_optimizer`` (the package) picks one from ``settings.device``.

This base holds what both share: choosing the shards, the device optimizer, ``step()``'s frame, the gate of the
early host step (``hand_off``, called by ``dscompile::offload_gradient`` from the backward graph), checkpoints
and counters. Swapping is lossless: the host step runs the same implementation as the un-offloaded step (the
user's ``foreach``/``fused`` flags, or the fused kernel ZeRO picks when they are left open), so on a CPU-only
machine training with and without offload is bitwise equal (``tests/test_zero_offload.py``); an accelerator run
steps on the host instead of the device, equal to rounding. A shard changed outside the optimizer (a checkpoint
load) is noticed through its version counter and its master refreshed before the next step.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dscompile.errors import DSCompileConfigError, DSCompileError
from dscompile.runtime.offload import gradient_sink
from dscompile.runtime.offload.host import IMPLEMENTATION_KEYS, OffloadSettings, Piece, build_optimizer, host_group

if TYPE_CHECKING:
    from dscompile.runtime.offload.swap import SwapDirectory


class OffloadedOptimizer(torch.optim.Optimizer):
    """The sharded optimizer with its offloaded part stepped on the host (see the module docstring). Abstract: the
    subclass places the host masters and states (``_init_host``) and steps them (``_step_host``)."""

    swap: SwapDirectory | None = None
    """The NVMe swap directory (None for cpu offload)."""

    def __init__(
        self,
        sharded: torch.optim.Optimizer,
        shards: list[nn.Parameter],
        settings: OffloadSettings,
        rank: int = 0,
        chosen: list[nn.Parameter] | None = None,
    ) -> None:
        self._init_state()
        if sharded.state:
            raise DSCompileConfigError("optimizer", "already holds state; offload must take it over before the first step", "build the engine before training")
        self.cls = type(sharded)
        self.settings = settings
        groups = [dict(g) for g in sharded.param_groups]
        super().__init__(groups, dict(sharded.defaults))
        self.shards: list[nn.Parameter] = [p for g in self.param_groups for p in g["params"]]
        index = {id(p): i for i, p in enumerate(self.shards)}
        group_of = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        known = {id(s) for s in shards}
        if any(id(p) not in known for p in self.shards):
            raise DSCompileConfigError("zero_optimization.offload_optimizer", "the optimizer steps tensors that are not ZeRO shards")
        # Which shards are offloaded: the planner's choice, else the first `ratio` of the elements in parameter order.
        total = sum(p.numel() for p in self.shards)
        budget, taken = settings.ratio * total, 0
        picked = {id(p) for p in chosen} if chosen is not None else None
        self.offloaded: list[int] = []
        self.on_device: list[int] = []
        for i, p in enumerate(self.shards):
            if (id(p) in picked) if picked is not None else (taken + p.numel() <= budget + 1e-9 or settings.ratio >= 1.0):
                self.offloaded.append(i)
                taken += p.numel()
            else:
                self.on_device.append(i)
        self.offloaded_elements = taken
        self.device_opt: torch.optim.Optimizer | None = None
        if self.on_device:
            device_groups = [
                {**{k: v for k, v in g.items() if k != "params"}, "params": [p for p in g["params"] if index[id(p)] in set(self.on_device)]}
                for g in self.param_groups
            ]
            self.device_opt = build_optimizer(self.cls, device_groups, self.defaults)
        self.pieces: list[Piece] = []
        self.host_opt: torch.optim.Optimizer | None = None
        self._versions: dict[int, int] = {}
        self.host_step_seconds = 0.0
        self.gradient_copies = {"during_backward": 0, "at_step": 0}
        self.early_gate: Callable[[], bool] | None = None
        """Set by the engine: true while a backward runs whose gradients are final as the graph produces them."""
        self.sink_index: dict[int, int] = {}
        """id(shard) -> shard index, for the shards ``dscompile::offload_gradient`` may hand off (``gradient_sink``)."""
        self.early_steps = {"submitted": 0, "started_in_backward": 0, "finished_in_backward": 0}
        self.early_step_seconds = 0.0
        # offload_param: a context manager making the given shards' values resident (their storage is released
        # between uses); the step holds only the shards of the tile it steps.
        self.residency: Any = None
        if not self.offloaded:
            return
        self._init_host(group_of, rank)
        host_groups = [{**host_group(g), "params": []} for g in self.param_groups]
        for piece in self.pieces:
            host_groups[piece.group]["params"].append(piece.master)
        self.host_opt = build_optimizer(self.cls, [g for g in host_groups], self.defaults) if self.pieces else None
        self._host_group_params = [list(g["params"]) for g in self.host_opt.param_groups] if self.host_opt else []
        for i in self.offloaded:
            self._versions[i] = self.shards[i]._version
        self._publish_states()
        if self.host_opt is not None:
            self.sink_index = {id(self.shards[i]): i for i in self._handed_shards()}
            self.sink = gradient_sink.register(self)

    # -- what a subclass provides ----------------------------------------------------------------
    def _init_state(self) -> None:
        """Declare the subclass's own fields: called first, before the base places anything on the host."""

    def _init_host(self, group_of: dict[int, int], rank: int) -> None:
        """Place the offloaded shards' masters and states (``self.pieces``, before the host optimizer is built)."""
        raise NotImplementedError

    def _handed_shards(self) -> Iterable[int]:
        """The shards whose gradients the backward graph may hand off (``hand_off``)."""
        raise NotImplementedError

    def steps_in_place(self, i: int) -> bool:
        """Whether an early step of shard ``i`` changes the shard itself (then the backward graph must have read it
        for the last time before the hand-off)."""
        raise NotImplementedError

    def _step_host(self, early: set[int]) -> None:
        """Step the offloaded shards not stepped early (``early``: those stepped from the backward graph)."""
        raise NotImplementedError

    def _early_hand_off(self, i: int, grad: torch.Tensor) -> None:
        """Shard ``i``'s final gradient, the gate open (``hand_off``)."""
        raise NotImplementedError

    def _host_states(self) -> dict[int, dict[str, Any]]:
        """The offloaded shards' states, by shard index, as whole tensors in memory (for a checkpoint)."""
        raise NotImplementedError

    def _load_host(self, states: dict[int, dict[str, Any]]) -> None:
        """Take the offloaded shards' states from a checkpoint (by shard index) and refresh the masters."""
        raise NotImplementedError

    def _publish_host_states(self) -> None:
        """Add the host states held in memory to ``self.state`` (nothing for NVMe: they are on disk)."""

    def _finish_early(self) -> set[int]:
        """Wait for steps started during backward (re-raising a failure); the shard indices they stepped."""
        return set()

    def _wait_early(self) -> None:
        """Wait for steps started during backward, re-raising a failure (they stay recorded until ``step()``)."""

    def prefetch(self) -> None:
        """Start reading what the step will need (the engine calls this as the micro-step that ends a batch begins)."""

    def end_backward(self) -> None:
        """After a backward: count (and for NVMe settle) the steps started from the graph."""

    def copy_gradients_during_backward(self, when: Any) -> None:
        """Copy host-mastered shards' gradients to the host from their post-accumulate-grad hooks (cpu offload)."""

    def detach_gradient_copies(self) -> None:
        """Remove the hooks ``copy_gradients_during_backward`` added."""

    def _extra_counters(self) -> dict[str, Any]:
        return {}

    def swap_file_bytes(self) -> int:
        """Bytes of this rank's tile files on disk (0 without NVMe)."""
        return 0

    def expected_swap_bytes(self) -> int:
        """What the swap files hold once every state exists (0 without NVMe)."""
        return 0

    # -- shared helpers --------------------------------------------------------------------------
    def _publish_states(self) -> None:
        """``self.state``: the states held in memory, by shard (device ones; host ones for cpu offload), for memory accounting."""
        self.state.clear()
        if self.device_opt is not None:
            for i in self.on_device:
                if self.shards[i] in self.device_opt.state:
                    self.state[self.shards[i]] = self.device_opt.state[self.shards[i]]
        if self.host_opt is not None:
            self._publish_host_states()

    def _own_master(self, shard: torch.Tensor) -> bool:
        """The shard is an fp32 host tensor (the host is the device), so it serves as its own master: no copy to keep."""
        return shard.device.type == "cpu" and shard.dtype == torch.float32 and not self.settings.separate_master

    def _sync_hyperparameters(self, inner: torch.optim.Optimizer) -> None:
        for outer, group in zip(self.param_groups, inner.param_groups, strict=True):
            for key, value in outer.items():
                if key != "params" and key not in IMPLEMENTATION_KEYS:
                    group[key] = value

    @contextlib.contextmanager
    def _host_threads(self) -> Iterator[None]:
        wanted = self.settings.host_threads
        if wanted is None:
            yield
            return
        before = torch.get_num_threads()
        torch.set_num_threads(wanted)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def _resident(self, shards: list[int], in_backward: bool = False) -> contextlib.AbstractContextManager[None]:
        if self.residency is None:
            return contextlib.nullcontext()
        return self.residency(shards, in_backward=True) if in_backward else self.residency(shards)

    def _stale(self, piece: Piece) -> bool:
        return self.shards[piece.shard]._version != self._versions[piece.shard]

    def _final_gradient(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        """What AccumulateGrad would leave in shard ``i``'s ``.grad`` after this gradient: its dtype, plus the earlier
        micro-steps' gradient."""
        shard = self.shards[i]
        if grad.dtype != shard.dtype:
            grad = grad.to(shard.dtype)  # what autograd does to a gradient of another dtype than its leaf
        if shard.grad is not None:  # earlier micro-steps' gradient: AccumulateGrad adds this one to it
            grad = shard.grad + grad
        return grad

    @staticmethod
    def _handed_twice(i: int) -> DSCompileError:
        return DSCompileError(
            f"offload_optimizer: shard {i}'s gradient was handed to the host step twice before step(); call engine.step() after each batch's backward"
        )

    # -- the step --------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.device_opt is not None:
            self._sync_hyperparameters(self.device_opt)
            with self._resident(self.on_device):
                self.device_opt.step()
        if self.host_opt is not None:
            early = self._finish_early()
            self._sync_hyperparameters(self.host_opt)
            start = time.perf_counter()
            with self._host_threads():
                self._step_host(early)
            self.host_step_seconds += time.perf_counter() - start
            for i in self.offloaded:
                self._versions[i] = self.shards[i]._version
        self._publish_states()
        return loss

    @torch.no_grad()
    def hand_off(self, i: int, grad: torch.Tensor) -> None:
        """Called by ``dscompile::offload_gradient`` in the backward graph once shard ``i``'s gradient is final.

        When the engine's gate allows (a batch-ending backward whose gradients nothing global changes before the
        step: no clipping, no loss scaling), the subclass starts that shard's host step now, from the gradient
        AccumulateGrad would leave (``_early_hand_off``); backward continues meanwhile. Else nothing happens and
        the shard is stepped at ``step()`` as without the graph hook."""
        if self.early_gate is None or self.host_opt is None or not self.early_gate():
            return
        self._early_hand_off(i, grad)

    def close(self) -> None:
        """Make this optimizer unreachable from the graphs (subclasses also stop their workers)."""
        gradient_sink.unregister(getattr(self, "sink", -1))

    # -- checkpoints -----------------------------------------------------------------------------
    def _shard_states(self) -> dict[int, dict[str, Any]]:
        states: dict[int, dict[str, Any]] = {}
        if self.device_opt is not None:
            for i in self.on_device:
                entry = self.device_opt.state.get(self.shards[i])
                if entry:
                    states[i] = dict(entry)
        if self.host_opt is not None:
            states.update(self._host_states())
        return states

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The same layout as the un-offloaded sharded optimizer's ``state_dict`` (states read back from NVMe)."""
        self._wait_early()  # read between backward and step(): the states of the shards stepped early, not half-written
        index = {id(p): i for i, p in enumerate(self.shards)}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(p)] for p in g["params"]]} for g in self.param_groups]
        return {"state": self._shard_states(), "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        self._finish_early()  # a load replaces what steps started during backward would write
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
            len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, self.param_groups, strict=False)
        ):
            raise ValueError("loaded optimizer state_dict has groups of other sizes than this optimizer's")
        for group, saved in zip(self.param_groups, saved_groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        states = {int(k): v for k, v in state_dict["state"].items()}
        if self.device_opt is not None:
            for i in self.on_device:
                shard = self.shards[i]
                self.device_opt.state.pop(shard, None)
                if i in states:
                    self.device_opt.state[shard] = {
                        k: v.to(shard.device).clone() if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in states[i].items()
                    }
        if self.host_opt is None:
            self._publish_states()
            return
        self._load_host(states)
        for i in self.offloaded:
            self._versions[i] = self.shards[i]._version
        self._publish_states()

    # -- what tools read -------------------------------------------------------------------------
    def counters(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "device": self.settings.device,
            "offloaded_elements": self.offloaded_elements,
            "device_elements": sum(self.shards[i].numel() for i in self.on_device),
            "host_step_seconds": self.host_step_seconds,
            "gradient_copies": dict(self.gradient_copies),
            "early_host_steps": dict(self.early_steps),
            "early_host_step_seconds": self.early_step_seconds,
        }
        out.update(self._extra_counters())
        return out


__all__ = ["OffloadedOptimizer"]
