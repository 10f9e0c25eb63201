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
    Bucket,
    CompressedCommOptimizer,
    adam_denominator,
    bias_corrections,
    check_hyperparameters,
    check_step_count,
)
from dscompile.runtime.onebit.comm import Collectives, CommStats


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
        local: bool = False,
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
            local=local,
        )
        self.whole = ShardedWholeParameters.whole()
        """Where whole-parameter norms come from: the tensors themselves, or (over ZeRO shards) every rank's partials."""
        self._exchanged: dict[int, list[torch.Tensor]] = {}
        """Buckets whose momentum was exchanged this step (from backward or the step), with the momenta before."""

    zero_shardable = True

    def over_shards(self, param_groups: list[dict[str, Any]]) -> OneBitLamb:
        """The same 1-bit LAMB over ZeRO-1/2's flat shards, communicating no gradients itself (the engine's
        strategy hands it averaged shard gradients: fp32 reduce-scatter in the warm-up, the 1-bit one after).
        Its whole-parameter quantities (trust ratios' norms, the freeze's factor maxima) come from the shards'
        partials with one small all-gather per step, once ``attach_shards`` has named the ZeRO group."""
        if any(group.get("exp_avg_mask") is not None for group in self.param_groups):
            from dscompile.errors import DSCompileConfigError

            raise DSCompileConfigError(
                "optimizer.exp_avg_mask", "is shaped like whole parameters, but ZeRO steps flat shards", "drop the mask or use ZeRO stage 0"
            )
        shards = OneBitLamb(
            param_groups,
            freeze_step=self.freeze_step,
            eps_inside_sqrt=self.eps_inside_sqrt,
            cuda_aware=self.cuda_aware,
            comm_backend_name=self.comm_backend_name,
            coeff_beta=self.coeff_beta,
            factor_max=self.factor_max,
            factor_min=self.factor_min,
            factor_threshold=self.factor_threshold,
            bucket_size=self.bucket_size,
            block_size=self.block_size,
            kernel_impl=self.kernel_impl,
            zero_variance_mask=self.zero_variance_mask,
            local=True,
        )
        shards.whole = ShardedWholeParameters.pending()
        return shards

    def attach_shards(self, group: dist.ProcessGroup | None, valid_numels: dict[int, int]) -> None:
        """ZeRO names the group its shards are split over and how many values of each shard (by ``id``) are real
        (the rest is padding): whole-parameter norms and maxima are then reduced over that group."""
        self.whole = ShardedWholeParameters(group, valid_numels, self.comm.stats)

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
            updates = [(p, self._lamb_update(p, grad, step)) for bucket in self.buckets for p, grad in zip(bucket.params, self.averaged_gradients(bucket))]
            n = len(updates)
            norms, _ = self.whole.reduce([p for p, _ in updates] + [u for _, u in updates], [])
            for i, (p, update) in enumerate(updates):
                self._apply_lamb(p, update, norms[i], norms[n + i])
        else:
            pieces = []
            for bucket in self.buckets:
                if id(bucket) not in self._exchanged:
                    self._start_momentum_exchange(bucket)
                for p, mean in zip(bucket.params, self.take_compressed_mean(bucket)):
                    self.state[p]["exp_avg"].copy_(mean).div_(self.state[p]["scaling_coeff"])
                pieces += [(p, *self._compressed_update(p, last, step)) for p, last in zip(bucket.params, self._exchanged.pop(id(bucket)))]
            n = len(pieces)
            norms, maxima = self.whole.reduce([prelim for _, prelim, _, _ in pieces] + [update for _, _, update, _ in pieces], [r for *_, r in pieces])
            for i, (p, _, update, _) in enumerate(pieces):
                self._apply_frozen(p, update, norms[i], norms[n + i], maxima[i])
        self.global_step = step
        return loss

    def _lamb_update(self, p: torch.nn.Parameter, grad: torch.Tensor, step: int) -> torch.Tensor:
        """LAMB's moments and its update before the trust ratio."""
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
        return update

    def _apply_lamb(self, p: torch.nn.Parameter, update: torch.Tensor, weight_norm: torch.Tensor, update_norm: torch.Tensor) -> None:
        group = self.group_of(p)
        state = self.state[p]
        coeff = trust_ratio(weight_norm, update_norm, group["min_coeff"], group["max_coeff"])
        frozen = state["lamb_coeff_freeze"]
        frozen.copy_(torch.where(coeff != 1.0, self.coeff_beta * frozen + (1 - self.coeff_beta) * coeff, frozen))
        state["last_coeff"] = coeff
        p.addcmul_(update, coeff, value=-group["lr"])

    def _set_momentum_scaling(self) -> None:
        """Scale every momentum to the mean RMS of all of them, once, when compression starts (so that momenta of
        very different magnitudes share the 1-bit scales). Over ZeRO shards the momentum is not what is compressed
        (each rank's gradient is, in the reduce-scatter), so the factors are 1 there."""
        params = [p for b in self.buckets for p in b.params]
        if self.whole.sharded:
            rms = torch.ones(len(params), device=params[0].device)
        else:
            rms = torch.stack([torch.linalg.vector_norm(self.state[p]["exp_avg"]) / self.state[p]["exp_avg"].numel() ** 0.5 for p in params])
        mean_rms = rms.mean()
        for p, r in zip(params, rms):
            state = self.state[p]
            state["scaling_coeff"] = torch.where(r > 0, mean_rms / r, torch.ones_like(r))
            state["last_factor"] = torch.ones((), device=p.device)
            if "exp_avg_sq_fresh" not in state:  # loaded from a warm-up checkpoint saved before freeze_step
                state["exp_avg_sq_fresh"] = state["exp_avg_sq"].clone()

    def _start_momentum_exchange(self, bucket: Bucket) -> None:
        """Fold this rank's gradient into the bucket's scaled momentum and start its 1-bit average over the ranks (the
        step replaces the momentum by it, unscaled); keep the momentum before (the fresh variance's gradient is
        reconstructed from both)."""
        if "scaling_coeff" not in self.state[self.buckets[0].params[0]]:
            self._set_momentum_scaling()
        previous = []
        scaled = []
        for p, grad in zip(bucket.params, self.local_gradients(bucket)):
            state = self.state[p]
            previous.append(state["exp_avg"].clone())
            state["exp_avg"].lerp_(grad, 1 - self.group_of(p)["betas"][0]).mul_(state["scaling_coeff"])
            scaled.append(state["exp_avg"])
        self.start_compressed_mean(bucket, scaled, "compressed_momentum")
        self._exchanged[id(bucket)] = previous

    @torch.no_grad()
    def exchange_early(self, bucket: Bucket) -> bool:
        """During backward, once ``bucket``'s gradients are final: its momentum exchange now instead of in ``step()``
        (it needs that bucket's gradients and momenta only; the trust ratios' norms come in the step). The coming
        ``step()`` must be a compressed one using these gradients unchanged (the caller checks). Returns whether it
        exchanged."""
        if self.needs_averaged_gradients() or id(bucket) in self._exchanged:
            return False
        self._start_momentum_exchange(bucket)
        return True

    def _compressed_update(self, p: torch.nn.Parameter, last: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """After the exchange: the fresh variance's step, and ``(prelim, update, max frozen/fresh denominator)`` of
        this tensor (the maximum over its real values; a whole parameter's comes from its shards' in the step)."""
        group = self.group_of(p)
        state = self.state[p]
        exp_avg = state["exp_avg"]
        beta1, beta2 = group["betas"]
        bc1, bc2_frozen = bias_corrections(group, step, self.freeze_step)
        self.mask_compressed(p, exp_avg, state["exp_avg_sq"], bc2_frozen)
        grad = (exp_avg - beta1 * last) / (1 - beta1)
        state["exp_avg_sq_fresh"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        _, bc2_fresh = bias_corrections(group, step, step)
        denom = adam_denominator(state["exp_avg_sq"], bc2_frozen, group["eps"], self.eps_inside_sqrt)
        denom_fresh = adam_denominator(state["exp_avg_sq_fresh"], bc2_fresh, group["eps"], self.eps_inside_sqrt)
        prelim = exp_avg / bc1 / denom
        ratio_max = self.whole.local_max(p, denom / denom_fresh)
        update = prelim + group["weight_decay"] * p if group["weight_decay"] != 0 else prelim
        return prelim, update, ratio_max

    def _apply_frozen(self, p: torch.nn.Parameter, update: torch.Tensor, prelim_norm: torch.Tensor, update_norm: torch.Tensor, factor: torch.Tensor) -> None:
        """The frozen coefficient scaled by the clamped frozen/fresh factor, then the step."""
        group = self.group_of(p)
        state = self.state[p]
        if group["weight_decay"] != 0:
            ratio = torch.clamp(prelim_norm / update_norm, max=1.0)
            factor = factor * ratio + (1.0 - ratio)
        factor = factor.clamp(self.factor_min, self.factor_max)
        last_factor = state["last_factor"]
        factor = torch.minimum(torch.maximum(factor, last_factor * (1.0 - self.factor_threshold)), last_factor * (1.0 + self.factor_threshold))
        last_factor.copy_(factor)
        coeff = state["lamb_coeff_freeze"] * factor
        state["last_coeff"] = coeff
        p.addcmul_(update, coeff, value=-group["lr"])


class ShardedWholeParameters:
    """Whole-parameter squared norms and maxima for LAMB: of the tensors themselves (no ZeRO), or, over ZeRO shards,
    summed / maxed over the ranks' shards with one all-gather of every partial per step (the sum runs in rank
    order on every rank, so all ranks get the same bits)."""

    def __init__(self, group: dist.ProcessGroup | None, valid_numels: dict[int, int] | None, stats: CommStats | None) -> None:
        self.sharded = valid_numels is not None
        self.valid = valid_numels or {}
        self.comm = Collectives(group, stats) if self.sharded else None

    @classmethod
    def whole(cls) -> ShardedWholeParameters:
        return cls(None, None, None)

    @classmethod
    def pending(cls) -> ShardedWholeParameters:
        """Sharded, but not yet told the group (``OneBitLamb.attach_shards``)."""
        out = cls(None, {}, None)
        out.comm = None
        return out

    def _require_group(self) -> Collectives:
        if self.comm is None:
            raise RuntimeError("OneBitLamb over ZeRO shards steps before attach_shards() named the ZeRO group (the engine does it)")
        return self.comm

    def local_max(self, p: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Maximum of ``values`` (shaped like ``p``) over the real values this rank holds (-inf when none)."""
        if not self.sharded:
            return values.max()
        self._require_group()
        real = values.reshape(-1)[: self.valid[id(p)]]
        return real.max() if real.numel() else values.new_full((), float("-inf"))

    def reduce(self, tensors: list[torch.Tensor], maxima: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``(norms of the whole tensors, maxima over the whole tensors)``."""
        if not self.sharded:
            return [torch.linalg.vector_norm(t) for t in tensors], maxima
        comm = self._require_group()
        device = tensors[0].device if tensors else maxima[0].device
        partial = torch.stack([t.float().square().sum() for t in tensors] + [m.float() for m in maxima]).to(device)
        gathered = torch.empty(comm.world * partial.numel(), device=device)
        if comm.world > 1:
            comm.all_gather_(gathered, partial, "lamb_norms")
        else:
            gathered.copy_(partial)
        rows = gathered.view(comm.world, -1)
        n = len(tensors)
        sums = rows[0, :n].clone()
        for r in range(1, comm.world):
            sums += rows[r, :n]
        return list(sums.sqrt()), list(rows[:, n:].amax(dim=0))


def trust_ratio(weight_norm: torch.Tensor, update_norm: torch.Tensor, min_coeff: float, max_coeff: float) -> torch.Tensor:
    """LAMB's per-parameter ratio ``||p|| / ||u||`` clamped to ``[min_coeff, max_coeff]``; 1 when either norm is 0."""
    ratio = (weight_norm / update_norm).clamp(min_coeff, max_coeff)
    return torch.where((weight_norm > 0) & (update_norm > 0), ratio, torch.ones_like(ratio))
