"""1-bit Adam (Tang et al., arXiv:2102.02888; DeepSpeed's ``OneBitAdam``).

Steps ``1..freeze_step`` are exact AdamW (decoupled weight decay) on gradients averaged in fp32:
bitwise ``torch.optim.AdamW(foreach=False)`` on those gradients. After them the variance
(``exp_avg_sq``) and its bias correction are frozen; each rank folds its own gradient into the
momentum, and the momentum is averaged with the 1-bit compressed all-reduce (error feedback) and
drives the update ``m_hat / (sqrt(v_hat) + eps)``.

DeepSpeed 0.19.5 accepted ``bias_correction`` but never applied it; here it is honoured (default
true, as Adam); ``bias_correction=False`` gives DeepSpeed's update.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

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


class OneBitAdam(CompressedCommOptimizer):
    """1-bit Adam. In a plain loop: ``loss.backward(); opt.step()`` with each rank's own gradients."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        freeze_step: int = 100000,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
        *,
        process_group: dist.ProcessGroup | None = None,
        bucket_size: int = DEFAULT_BUCKET_SIZE,
        block_size: int | None = DEFAULT_BLOCK_SIZE,
        kernel_impl: str | None = None,
        zero_variance_mask: bool = True,
        local: bool = False,
    ) -> None:
        name = type(self).__name__
        betas = check_hyperparameters(name, lr, betas, eps, weight_decay, amsgrad, max_grad_norm)
        self.freeze_step = check_step_count(name, "freeze_step", freeze_step, 1)
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
            local=local,
        )

    zero_shardable = True

    def over_shards(self, param_groups: list[dict[str, Any]]) -> OneBitAdam:
        """The same 1-bit Adam over ZeRO-1's flat shards, communicating nothing itself: the engine's
        gradient strategy hands it averaged gradients (fp32 reduce-scatter in the warm-up, the 1-bit
        one after), and every update is element-wise, so stepping shards equals stepping parameters."""
        if any(group.get("exp_avg_mask") is not None for group in self.param_groups):
            from dscompile.errors import DSCompileConfigError

            raise DSCompileConfigError(
                "optimizer.exp_avg_mask", "is shaped like whole parameters, but ZeRO steps flat shards", "drop the mask or use ZeRO stage 0"
            )
        return OneBitAdam(
            param_groups,
            freeze_step=self.freeze_step,
            eps_inside_sqrt=self.eps_inside_sqrt,
            cuda_aware=self.cuda_aware,
            comm_backend_name=self.comm_backend_name,
            bucket_size=self.bucket_size,
            block_size=self.block_size,
            kernel_impl=self.kernel_impl,
            zero_variance_mask=self.zero_variance_mask,
            local=True,
        )

    def needs_averaged_gradients(self) -> bool:
        return self.global_step + 1 <= self.freeze_step

    @property
    def compressing(self) -> bool:
        """True once the variance is frozen and the momentum travels 1-bit."""
        return self.global_step >= self.freeze_step

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        step = self.global_step + 1
        warmup = step <= self.freeze_step
        for bucket in self.buckets:
            if warmup:
                for p, grad in zip(bucket.params, self.averaged_gradients(bucket)):
                    self._adam_step(p, grad, step)
                continue
            if not self.has_compressed_mean(bucket):
                self._start_momentum_exchange(bucket)
            for exp_avg, averaged in zip((self.state[p]["exp_avg"] for p in bucket.params), self.take_compressed_mean(bucket)):
                exp_avg.copy_(averaged)
            for p in bucket.params:
                exp_avg = self.state[p]["exp_avg"]
                self.mask_compressed(p, exp_avg, self.state[p]["exp_avg_sq"], bias_corrections(self.group_of(p), step, self.freeze_step)[1])
                self._frozen_variance_step(p, step)
        self.global_step = step
        return loss

    def _start_momentum_exchange(self, bucket: Bucket) -> None:
        """Fold this rank's gradient into the bucket's momentum and start its 1-bit average over the ranks (the step
        replaces the momentum by it)."""
        momenta = []
        for p, grad in zip(bucket.params, self.local_gradients(bucket)):
            exp_avg = self.state[p]["exp_avg"]
            exp_avg.lerp_(grad, 1 - self.group_of(p)["betas"][0])
            momenta.append(exp_avg)
        self.start_compressed_mean(bucket, momenta, "compressed_momentum")

    @torch.no_grad()
    def exchange_early(self, bucket: Bucket) -> bool:
        """During backward, once ``bucket``'s gradients are final: start its momentum exchange now instead of in
        ``step()`` (the momentum update needs that bucket's gradient only; ``step()`` takes the result). The coming
        ``step()`` must be a compressed one with these gradients as they are (no clipping, no overflow skip): the
        caller checks. Returns whether it started one."""
        if self.needs_averaged_gradients() or self.has_compressed_mean(bucket):
            return False
        self._start_momentum_exchange(bucket)
        return True

    def _adam_step(self, p: torch.nn.Parameter, grad: torch.Tensor, step: int) -> None:
        """torch's single-tensor AdamW, operation for operation (so the warm-up matches it bitwise)."""
        group = self.group_of(p)
        state = self.state[p]
        if not state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        beta1, beta2 = group["betas"]
        if group["weight_decay"] != 0:
            p.mul_(1 - group["lr"] * group["weight_decay"])
        state["exp_avg"].lerp_(grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bc1, bc2_sqrt = bias_corrections(group, step, step)
        denom = adam_denominator(state["exp_avg_sq"], bc2_sqrt, group["eps"], self.eps_inside_sqrt)
        p.addcdiv_(state["exp_avg"], denom, value=-(group["lr"] / bc1))

    def _frozen_variance_step(self, p: torch.nn.Parameter, step: int) -> None:
        group = self.group_of(p)
        state = self.state[p]
        if group["weight_decay"] != 0:
            p.mul_(1 - group["lr"] * group["weight_decay"])
        bc1, bc2_sqrt = bias_corrections(group, step, self.freeze_step)
        denom = adam_denominator(state["exp_avg_sq"], bc2_sqrt, group["eps"], self.eps_inside_sqrt)
        p.addcdiv_(state["exp_avg"], denom, value=-(group["lr"] / bc1))
