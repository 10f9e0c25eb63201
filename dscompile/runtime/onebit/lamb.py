"""1-bit LAMB (Li et al., arXiv:2104.06069; DeepSpeed's ``OneBitLamb``).

Steps ``1..freeze_step`` are LAMB on gradients averaged in fp32: Adam's update
``u = m_hat / (sqrt(v_hat) + eps) + weight_decay x p`` scaled per parameter by the trust ratio
``clamp(||p|| / ||u||, min_coeff, max_coeff)`` (1 when either norm is 0), while an exponential
average (``coeff_beta``) of those ratios is kept. Then:

- the variance and the averaged ratios are frozen (the *frozen scaling coefficients*);
- at the first compressed step every parameter's momentum gets a fixed scaling factor
  ``mean_rms / rms(m_p)``, so that momenta of very different magnitudes share the 1-bit scales;
  each rank folds its own gradient into the scaled momentum, which is averaged with the 1-bit
  compressed all-reduce and unscaled;
- a *fresh* variance keeps following gradients reconstructed from consecutive momenta, and the
  ratio between the frozen and the fresh denominators (``max`` over the parameter, blended by the
  weight decay's share of the update, clamped to ``[factor_min, factor_max]`` and to
  ``1 ± factor_threshold`` of its previous value) scales the frozen coefficient.

Coefficients stay on the device (no host synchronisation per parameter). ``bias_correction``
is honoured as in ``OneBitAdam`` (DeepSpeed never applied it).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dscompile.runtime.onebit.base import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_BUCKET_SIZE,
    CompressedCommOptimizer,
    adam_denominator,
    bias_corrections,
    check_hyperparameters,
    check_step_count,
)


class OneBitLamb(CompressedCommOptimizer):
    """1-bit LAMB. In a plain loop: ``loss.backward(); opt.step()`` with each rank's own gradients."""

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
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
        *,
        process_group: dist.ProcessGroup | None = None,
        bucket_size: int = DEFAULT_BUCKET_SIZE,
        block_size: int | None = DEFAULT_BLOCK_SIZE,
        kernel_impl: str | None = None,
        zero_variance_mask: bool = True,
    ) -> None:
        name = type(self).__name__
        betas = check_hyperparameters(name, lr, betas, eps, weight_decay, amsgrad, max_grad_norm)
        self.freeze_step = check_step_count(name, "freeze_step", freeze_step, 1)
        if not 0.0 < min_coeff <= max_coeff:
            raise ValueError(f"{name}: need 0 < min_coeff <= max_coeff, got {min_coeff} and {max_coeff}")
        if not 0.0 <= coeff_beta < 1.0:
            raise ValueError(f"{name}: coeff_beta must be in [0, 1), got {coeff_beta}")
        if not 0.0 < factor_min <= factor_max:
            raise ValueError(f"{name}: need 0 < factor_min <= factor_max, got {factor_min} and {factor_max}")
        if not 0.0 <= factor_threshold:
            raise ValueError(f"{name}: factor_threshold must be >= 0, got {factor_threshold}")
        self.eps_inside_sqrt = bool(eps_inside_sqrt)
        self.coeff_beta = float(coeff_beta)
        self.factor_max = float(factor_max)
        self.factor_min = float(factor_min)
        self.factor_threshold = float(factor_threshold)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bool(bias_correction), max_coeff=max_coeff, min_coeff=min_coeff)
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

    def needs_averaged_gradients(self) -> bool:
        return self.global_step + 1 <= self.freeze_step

    def lamb_coefficients(self) -> list[float]:
        """The trust ratio each parameter used at the last step (DeepSpeed's ``get_lamb_coeffs``)."""
        return [float(self.state[p]["last_coeff"]) for b in self.buckets for p in b.params if "last_coeff" in self.state[p]]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        step = self.global_step + 1
        if step <= self.freeze_step:
            for bucket in self.buckets:
                for p, grad in zip(bucket.params, self.averaged_gradients(bucket)):
                    self._lamb_step(p, grad, step)
        else:
            if "scaling_coeff" not in self.state[self.buckets[0].params[0]]:
                self._set_momentum_scaling()
            for bucket in self.buckets:
                self._compressed_step(bucket, step)
        self.global_step = step
        return loss

    def _lamb_step(self, p: torch.nn.Parameter, grad: torch.Tensor, step: int) -> None:
        group = self.group_of(p)
        state = self.state[p]
        if not state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["lamb_coeff_freeze"] = torch.zeros((), device=p.device)
        beta1, beta2 = group["betas"]
        state["exp_avg"].lerp_(grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        if step == self.freeze_step:
            state["exp_avg_sq_fresh"] = state["exp_avg_sq"].clone()
        bc1, bc2_sqrt = bias_corrections(group, step, step)
        update = state["exp_avg"] / bc1 / adam_denominator(state["exp_avg_sq"], bc2_sqrt, group["eps"], self.eps_inside_sqrt)
        if group["weight_decay"] != 0:
            update.add_(p, alpha=group["weight_decay"])
        coeff = trust_ratio(torch.linalg.vector_norm(p), torch.linalg.vector_norm(update), group["min_coeff"], group["max_coeff"])
        frozen = state["lamb_coeff_freeze"]
        frozen.copy_(torch.where(coeff != 1.0, self.coeff_beta * frozen + (1 - self.coeff_beta) * coeff, frozen))
        state["last_coeff"] = coeff
        p.addcmul_(update, coeff, value=-group["lr"])

    def _set_momentum_scaling(self) -> None:
        """Scale every momentum to the mean RMS of all of them, once, when compression starts."""
        params = [p for b in self.buckets for p in b.params]
        rms = torch.stack([torch.linalg.vector_norm(self.state[p]["exp_avg"]) / self.state[p]["exp_avg"].numel() ** 0.5 for p in params])
        mean_rms = rms.mean()
        for p, r in zip(params, rms):
            state = self.state[p]
            state["scaling_coeff"] = torch.where(r > 0, mean_rms / r, torch.ones_like(r))
            state["last_factor"] = torch.ones((), device=p.device)
            if "exp_avg_sq_fresh" not in state:  # loaded from a warm-up checkpoint saved before freeze_step
                state["exp_avg_sq_fresh"] = state["exp_avg_sq"].clone()

    def _compressed_step(self, bucket: Any, step: int) -> None:
        previous = []
        scaled = []
        for p, grad in zip(bucket.params, self.local_gradients(bucket)):
            state = self.state[p]
            previous.append(state["exp_avg"].clone())
            state["exp_avg"].lerp_(grad, 1 - self.group_of(p)["betas"][0]).mul_(state["scaling_coeff"])
            scaled.append(state["exp_avg"])
        averaged = self.compressed_mean(bucket, scaled, "compressed_momentum")
        for p, exp_avg, mean, last in zip(bucket.params, scaled, averaged, previous):
            group = self.group_of(p)
            state = self.state[p]
            beta1, beta2 = group["betas"]
            bc1, bc2_frozen = bias_corrections(group, step, self.freeze_step)
            exp_avg.copy_(mean).div_(state["scaling_coeff"])
            self.mask_compressed(p, exp_avg, state["exp_avg_sq"], bc2_frozen)
            grad = (exp_avg - beta1 * last) / (1 - beta1)
            state["exp_avg_sq_fresh"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            _, bc2_fresh = bias_corrections(group, step, step)
            denom = adam_denominator(state["exp_avg_sq"], bc2_frozen, group["eps"], self.eps_inside_sqrt)
            denom_fresh = adam_denominator(state["exp_avg_sq_fresh"], bc2_fresh, group["eps"], self.eps_inside_sqrt)
            prelim = exp_avg / bc1 / denom
            factor = (denom / denom_fresh).max()
            if group["weight_decay"] != 0:
                update = prelim + group["weight_decay"] * p
                ratio = torch.clamp(torch.linalg.vector_norm(prelim) / torch.linalg.vector_norm(update), max=1.0)
                factor = factor * ratio + (1.0 - ratio)
            else:
                update = prelim
            factor = factor.clamp(self.factor_min, self.factor_max)
            last_factor = state["last_factor"]
            factor = torch.minimum(torch.maximum(factor, last_factor * (1.0 - self.factor_threshold)), last_factor * (1.0 + self.factor_threshold))
            last_factor.copy_(factor)
            coeff = state["lamb_coeff_freeze"] * factor
            state["last_coeff"] = coeff
            p.addcmul_(update, coeff, value=-group["lr"])


def trust_ratio(weight_norm: torch.Tensor, update_norm: torch.Tensor, min_coeff: float, max_coeff: float) -> torch.Tensor:
    """LAMB's per-parameter ratio ``||p|| / ||u||`` clamped to ``[min_coeff, max_coeff]``; 1 when either norm is 0."""
    ratio = (weight_norm / update_norm).clamp(min_coeff, max_coeff)
    return torch.where((weight_norm > 0) & (update_norm > 0), ratio, torch.ones_like(ratio))
