"""0/1 Adam (Lu et al., arXiv:2202.06009; DeepSpeed's ``ZeroOneAdam``).

Two schedules replace 1-bit Adam's single freeze point:

- *adaptive variance freezing*: the variance is updated (with gradients averaged in fp32) only at
  steps that are multiples of ``var_interval``; ``var_interval`` starts at 1 and doubles after
  every ``var_update_scaler`` such updates; after ``var_freeze_step`` it is never updated again.
  The other steps before then average the *gradient* with the 1-bit compressed all-reduce.
- *local steps*: after ``var_freeze_step`` each rank steps on its own gradients and momentum and
  communicates only every ``local_step_interval`` steps (step a multiple of it); the interval
  starts at 1 and doubles every ``local_step_scaler`` steps, up to ``local_step_clipper``. At a
  synchronisation the ranks average, 1-bit, the accumulated ``sum(step_size x momentum)`` of the
  interval; every rank restarts from the parameters of the previous synchronisation (kept as an
  anchor) and applies the averaged update, so replicas agree bitwise, and the momentum becomes
  the averaged one.

While ``var_interval`` is 1 (the first ``var_update_scaler`` steps) this is exact AdamW on
averaged gradients. The errors are reset when the variance freezes (from then on they compress
momentum sums, no longer gradients), as DeepSpeed does. Bias correction: the momentum's uses the
step, the variance's the number of variance updates (DeepSpeed never applied it: pass
``bias_correction=False`` for its update).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dscompile.config import ZERO_ONE_ADAM_ZERO_REFUSAL
from dscompile.runtime.onebit.base import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_BUCKET_SIZE,
    Bucket,
    CompressedCommOptimizer,
    adam_denominator,
    bias_corrections,
    check_hyperparameters,
    check_step_count,
)


class ZeroOneAdam(CompressedCommOptimizer):
    """0/1 Adam. In a plain loop: ``loss.backward(); opt.step()`` with each rank's own gradients."""

    _SCALARS = ("var_interval", "var_counter", "var_updates", "var_frozen", "local_step_interval", "local_step_counter", "lr_sums", "decays")

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        var_freeze_step: int = 100000,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
        *,
        process_group: dist.ProcessGroup | None = None,
        bucket_size: int = DEFAULT_BUCKET_SIZE,
        block_size: int | None = DEFAULT_BLOCK_SIZE,
        kernel_impl: str | None = None,
        zero_variance_mask: bool = True,
    ) -> None:
        name = type(self).__name__
        betas = check_hyperparameters(name, lr, betas, eps, weight_decay, amsgrad, max_grad_norm)
        self.var_freeze_step = check_step_count(name, "var_freeze_step", var_freeze_step, 1)
        self.var_update_scaler = check_step_count(name, "var_update_scaler", var_update_scaler, 1)
        self.local_step_scaler = check_step_count(name, "local_step_scaler", local_step_scaler, 1)
        self.local_step_clipper = check_step_count(name, "local_step_clipper", local_step_clipper, 1)
        self.eps_inside_sqrt = bool(eps_inside_sqrt)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bool(bias_correction))
        super().__init__(
            params,
            defaults,
            comm_backend_name=comm_backend_name,
            cuda_aware=cuda_aware,
            process_group=process_group,
            bucket_size=bucket_size,
            block_size=block_size,
            kernel_impl=kernel_impl,
            zero_variance_mask=zero_variance_mask,
            name=name,
        )
        self.var_interval = 1
        self.var_counter = 0
        self.var_updates = 0
        self.var_frozen = False
        self.local_step_interval = 1
        self.local_step_counter = 0
        self.lr_sums = [0.0] * len(self.param_groups)
        """Per group: sum of the step sizes since the last synchronisation."""
        self.decays = [1.0] * len(self.param_groups)
        """Per group: product of the weight-decay factors since the last synchronisation."""

    def over_shards(self, param_groups: list[dict[str, Any]]) -> CompressedCommOptimizer:
        """Refused: 0/1 Adam's local steps cannot be represented on ZeRO shards (``ZERO_ONE_ADAM_ZERO_REFUSAL`` says why)."""
        from dscompile.errors import DSCompileConfigError

        raise DSCompileConfigError("zero_optimization.stage", *ZERO_ONE_ADAM_ZERO_REFUSAL)

    # -- schedule ---------------------------------------------------------------------------------
    def is_variance_step(self, step: int) -> bool:
        return not self.var_frozen and step % self.var_interval == 0

    def is_sync_step(self, step: int) -> bool:
        """After the freeze: whether ``step`` communicates (the others are local steps)."""
        return step % self.local_step_interval == 0

    def needs_averaged_gradients(self) -> bool:
        return self.is_variance_step(self.global_step + 1)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        step = self.global_step + 1
        if self.var_frozen:
            self._local_phase_step(step)
        else:
            self._variance_phase_step(step)
        self.global_step = step
        return loss

    def _variance_phase_step(self, step: int) -> None:
        variance_step = self.is_variance_step(step)
        if variance_step:
            self.var_updates += 1
        for bucket in self.buckets:
            if variance_step:
                grads = self.averaged_gradients(bucket)
            elif self.has_compressed_mean(bucket):  # backward started it
                grads = self.take_compressed_mean(bucket)
            else:
                grads = self.compressed_mean(bucket, self.local_gradients(bucket), "compressed_gradient")
            for p, grad in zip(bucket.params, grads):
                group = self.group_of(p)
                state = self._state(p)
                beta1, beta2 = group["betas"]
                if group["weight_decay"] != 0:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                if not variance_step:
                    self.mask_compressed(p, grad, state["exp_avg_sq"], bias_corrections(group, step, self.var_updates)[1])
                state["exp_avg"].lerp_(grad, 1 - beta1)
                if variance_step:
                    state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                bc1, bc2_sqrt = bias_corrections(group, step, self.var_updates)
                p.addcdiv_(state["exp_avg"], self._denominator(p, bc2_sqrt), value=-(group["lr"] / bc1))
        if variance_step:
            self.var_counter += 1
            if self.var_counter == self.var_update_scaler:
                self.var_counter = 0
                self.var_interval *= 2
        if step >= self.var_freeze_step:
            self._freeze_variance()

    def _freeze_variance(self) -> None:
        self.var_frozen = True
        for bucket in self.buckets:
            bucket.reset_errors()
            for p in bucket.params:
                state = self.state[p]
                state["anchor"] = p.detach().clone()
                state["momentum_accumulator"] = torch.zeros_like(p)
        self.lr_sums = [0.0] * len(self.param_groups)
        self.decays = [1.0] * len(self.param_groups)

    def _local_phase_step(self, step: int) -> None:
        sync = self.is_sync_step(step)
        group_index = {id(g): i for i, g in enumerate(self.param_groups)}
        for i, group in enumerate(self.param_groups):
            bc1, _ = bias_corrections(group, step, self.var_updates)
            self.lr_sums[i] += group["lr"] / bc1
            self.decays[i] *= 1 - group["lr"] * group["weight_decay"]
        for bucket in self.buckets:
            if self.has_compressed_mean(bucket):  # a sync step whose exchange backward started
                averaged_sums = self.take_compressed_mean(bucket)
            else:
                for p, grad in zip(bucket.params, self.local_gradients(bucket)):
                    group = self.group_of(p)
                    state = self.state[p]
                    if group["weight_decay"] != 0:
                        p.mul_(1 - group["lr"] * group["weight_decay"])  # a sync step overwrites p from the anchor below
                    self._fold_gradient(p, grad, step)
                    bc1, bc2_sqrt = bias_corrections(group, step, self.var_updates)
                    p.addcdiv_(state["exp_avg"], self._denominator(p, bc2_sqrt), value=-(group["lr"] / bc1))
                if not sync:
                    continue
                averaged_sums = self.compressed_mean(bucket, [self.state[p]["momentum_accumulator"] for p in bucket.params], "compressed_momentum")
            for p, averaged in zip(bucket.params, averaged_sums):
                group = self.group_of(p)
                state = self.state[p]
                gi = group_index[id(group)]
                _, bc2_sqrt = bias_corrections(group, step, self.var_updates)
                self.mask_compressed(p, averaged, state["exp_avg_sq"], bc2_sqrt)
                p.copy_(state["anchor"])
                if group["weight_decay"] != 0:
                    p.mul_(self.decays[gi])
                p.addcdiv_(averaged, self._denominator(p, bc2_sqrt), value=-1.0)
                state["exp_avg"].copy_(averaged).div_(self.lr_sums[gi])
                state["anchor"].copy_(p)
                state["momentum_accumulator"].zero_()
        if sync:
            self.lr_sums = [0.0] * len(self.param_groups)
            self.decays = [1.0] * len(self.param_groups)
        self.local_step_counter += 1
        if self.local_step_counter == self.local_step_scaler:
            self.local_step_counter = 0
            self.local_step_interval = min(self.local_step_clipper, self.local_step_interval * 2)

    def _fold_gradient(self, p: torch.nn.Parameter, grad: torch.Tensor, step: int) -> None:
        """A local-phase step's momentum update and its share of the interval's ``sum(step_size x momentum)``."""
        group = self.group_of(p)
        state = self.state[p]
        state["exp_avg"].lerp_(grad, 1 - group["betas"][0])
        bc1, _ = bias_corrections(group, step, self.var_updates)
        state["momentum_accumulator"].add_(state["exp_avg"], alpha=group["lr"] / bc1)

    @torch.no_grad()
    def exchange_early(self, bucket: Bucket) -> bool:
        """During backward, once ``bucket``'s gradients are final: its compressed exchange now instead of in ``step()``.
        Before the variance freezes, a non-variance step's 1-bit gradient average; after it, a sync step's momentum
        update and the 1-bit average of the interval's momentum sum (the local update of the parameters, which the
        sync overwrites from the anchor, is skipped: bitwise the same result). Variance steps (fp32, the caller's) and
        local steps (nothing to send) return False. The coming ``step()`` must use these gradients unchanged (the
        caller checks: no clipping, no overflow skip)."""
        step = self.global_step + 1
        if self.has_compressed_mean(bucket) or self.needs_averaged_gradients() or (self.var_frozen and not self.is_sync_step(step)):
            return False
        if not self.var_frozen:
            self.start_compressed_mean(bucket, self.local_gradients(bucket), "compressed_gradient")
            return True
        for p, grad in zip(bucket.params, self.local_gradients(bucket)):
            self._fold_gradient(p, grad, step)
        sums = [self.state[p]["momentum_accumulator"] for p in bucket.params]
        self.start_compressed_mean(bucket, sums, "compressed_momentum")
        return True

    def _state(self, p: torch.nn.Parameter) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _denominator(self, p: torch.nn.Parameter, bc2_sqrt: float) -> torch.Tensor:
        return adam_denominator(self.state[p]["exp_avg_sq"], bc2_sqrt, self.group_of(p)["eps"], self.eps_inside_sqrt)
