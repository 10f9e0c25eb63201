"""What 1-bit Adam, 0/1 Adam and 1-bit LAMB share: buckets, gradient averaging, the compressed
exchange, byte counters, and their checkpoint share.

The parameters are cut into buckets (whole parameters, in parameter-group order, up to
``bucket_size`` values each); every collective works on one bucket's flat fp32 buffer, and
every bucket keeps its own worker and server error. Used in a plain loop, the optimizer does
all the data-parallel communication itself: call ``step()`` after ``backward()`` with each
rank's own (un-averaged) gradients. An engine that averages gradients itself when
``needs_averaged_gradients()`` says so calls ``set_gradient_averaging(by_caller=True)`` once.

Every trainable parameter is stepped every step; one without a gradient counts as a zero
gradient, so that all ranks issue the same collectives and replicas stay identical.

What an engine must do with one (``runtime/onebit/engine.py`` does it for every dscompile engine):

- build it with ``process_group=`` its data-parallel group, and either leave all communication
  to it (never average gradients itself) or call ``set_gradient_averaging(by_caller=True)`` and,
  at each accumulation boundary, average gradients in fp32 exactly when
  ``needs_averaged_gradients()`` is true (otherwise the optimizer needs each rank's own);
- clip and check fp16 overflow on what the optimizer will use: local gradients are not agreed
  across ranks, so an overflow flag must be (as the engine does for ZeRO);
- save and load ``state_dict()`` per rank (the errors differ), with the same world size;
- read ``communication_stats()`` for its byte counters.

Under ZeRO-1 the engine steps ``over_shards(groups)``: the same optimizer over the flat shards,
communicating nothing itself (``local=True``), while the engine's gradient strategy does the
exchange; what that exchange must keep per rank (its worker errors) lives in ``exchange_state``,
so it travels in this rank's ``state_dict()``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from dscompile.runtime.onebit.comm import Collectives, CommStats, CompressedAllReduce, CompressedLayout

DEEPSPEED_TRANSPORTS = ("nccl", "mpi", "compressed", "hccl")
"""``comm_backend_name`` values DeepSpeed accepted; here all of them mean torch.distributed."""
DEFAULT_BUCKET_SIZE = 2**24
DEFAULT_BLOCK_SIZE = 2048


class Bucket:
    """Consecutive parameters communicated as one flat fp32 buffer, with their compression errors."""

    def __init__(self, params: list[torch.nn.Parameter], world: int, block_size: int | None) -> None:
        self.params = params
        self.numels = [p.numel() for p in params]
        self.numel = sum(self.numels)
        self.layout = CompressedLayout.plan(self.numel, world, block_size)
        self.worker_error: torch.Tensor | None = None
        self.server_error: torch.Tensor | None = None

    def flatten(self, tensors: Iterable[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.reshape(-1).float() for t in tensors])

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [piece.view_as(p) for piece, p in zip(flat.split(self.numels), self.params)]

    def errors(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.worker_error is None or self.server_error is None:
            self.worker_error, self.server_error = self.layout.new_errors(self.params[0].device)
        return self.worker_error, self.server_error

    def reset_errors(self) -> None:
        if self.worker_error is not None and self.server_error is not None:
            self.worker_error.zero_()
            self.server_error.zero_()


class CompressedCommOptimizer(torch.optim.Optimizer):
    """Base of the three optimizers: subclasses implement ``step`` and ``needs_averaged_gradients``.

    ``process_group``: the data-parallel group (default: the world). ``bucket_size``: values per
    bucket. ``block_size``: values per compression scale (None: one per rank's chunk, as
    DeepSpeed's server side). ``kernel_impl``: ``"torch"``/``"triton"``/None (Triton on CUDA).
    ``zero_variance_mask``: see ``mask_compressed``. Subclasses set ``eps_inside_sqrt`` first."""

    eps_inside_sqrt = False

    zero_shardable = False
    """True when ``over_shards`` exists: the update is element-wise, so ZeRO may step flat shards."""

    _SCALARS: tuple[str, ...] = ()
    """Names of the subclass's optimizer-level counters, kept in ``state_dict()["onebit"]``."""

    def __init__(
        self,
        params: Any,
        defaults: dict[str, Any],
        *,
        comm_backend_name: str,
        cuda_aware: bool,
        process_group: dist.ProcessGroup | None,
        bucket_size: int,
        block_size: int | None,
        kernel_impl: str | None,
        zero_variance_mask: bool,
        name: str,
        local: bool = False,
    ) -> None:
        if comm_backend_name not in DEEPSPEED_TRANSPORTS:
            raise ValueError(
                f"{name}: comm_backend_name {comm_backend_name!r} is not a DeepSpeed transport; use one of {DEEPSPEED_TRANSPORTS} "
                "(all mean torch.distributed here: gloo on CPU, NCCL on GPU, whichever the process group uses)"
            )
        if not isinstance(cuda_aware, bool):
            raise ValueError(f"{name}: cuda_aware must be true or false, got {cuda_aware!r}")
        if kernel_impl not in (None, "torch", "triton"):
            raise ValueError(f"{name}: kernel_impl must be 'torch', 'triton' or null (Triton on CUDA, torch elsewhere), got {kernel_impl!r}")
        if not isinstance(zero_variance_mask, bool):
            raise ValueError(f"{name}: zero_variance_mask must be true or false, got {zero_variance_mask!r}")
        if not isinstance(bucket_size, int) or bucket_size < 1:
            raise ValueError(f"{name}: bucket_size must be a positive number of values, got {bucket_size!r}")
        super().__init__(params, defaults)
        self.comm_backend_name = comm_backend_name
        self.cuda_aware = cuda_aware  # DeepSpeed's MPI switch; torch.distributed moves device buffers itself
        self.block_size = block_size
        self.bucket_size = bucket_size
        self.kernel_impl = kernel_impl
        self.zero_variance_mask = bool(zero_variance_mask)
        self.comm = Collectives.local(CommStats()) if local else Collectives(process_group, CommStats())
        self.gradients_averaged_by_caller = local  # a local optimizer's caller communicates everything
        self.exchange_state: dict[str, Any] = {}
        """Per-rank state of a caller's gradient exchange (ZeRO-1's worker errors), saved in ``state_dict()``."""
        self.global_step = 0
        self._in_flight: dict[int, CompressedAllReduce] = {}
        """Compressed exchanges started and not yet taken, by bucket ``id``, in issue order."""
        trainable = []
        for group in self.param_groups:
            for p in group["params"]:
                if not p.requires_grad or p.numel() == 0:
                    continue
                if p.dtype != torch.float32:
                    raise ValueError(f"{name} steps fp32 parameters (fp32 master weights under mixed precision), got a {p.dtype} parameter")
                trainable.append(p)
        if not trainable:
            raise ValueError(f"{name} got no trainable parameters")
        self.buckets = _plan_buckets(trainable, bucket_size, self.comm.world, block_size)
        self._group_of = {id(p): group for group in self.param_groups for p in group["params"]}
        self._check_same_buckets_on_every_rank(name)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "buckets"):
            raise ValueError(
                f"{type(self).__name__}: parameter groups cannot be added after construction (every rank's buckets are fixed then); "
                "pass all groups to the constructor"
            )
        super().add_param_group(param_group)

    # -- what an engine calls -----------------------------------------------------------------
    def needs_averaged_gradients(self) -> bool:
        """Whether the coming ``step()`` uses gradients averaged in full precision across ranks."""
        raise NotImplementedError

    def set_gradient_averaging(self, by_caller: bool) -> None:
        """``by_caller=True``: whenever ``needs_averaged_gradients()`` is true, the caller has already
        averaged the gradients (an engine's bucketed all-reduce); otherwise ``step()`` averages them."""
        self.gradients_averaged_by_caller = bool(by_caller)

    def over_shards(self, param_groups: list[dict[str, Any]]) -> CompressedCommOptimizer:
        """The same optimizer (settings, hyper-parameters) over ZeRO's flat shards, communicating nothing itself."""
        from dscompile.errors import DSCompileConfigError

        raise DSCompileConfigError(
            "zero_optimization.stage",
            f"{type(self).__name__} cannot step ZeRO shards: its update is not element-wise (it needs whole parameters or every rank's full momentum)",
            "use OneBitAdam with ZeRO stage 1, or train this optimizer without ZeRO (stage 0)",
        )

    def communication_stats(self) -> dict[str, Any]:
        """Collectives issued by this optimizer on this rank and the bytes sent (see ``comm.wire_bytes``)."""
        return {"world_size": self.comm.world, "steps": self.global_step, **self.comm.stats.as_dict()}

    # -- helpers for the subclasses -------------------------------------------------------------
    def group_of(self, p: torch.nn.Parameter) -> dict[str, Any]:
        return self._group_of[id(p)]

    def local_gradients(self, bucket: Bucket) -> list[torch.Tensor]:
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]

    def averaged_gradients(self, bucket: Bucket) -> list[torch.Tensor]:
        """The bucket's gradients averaged over the ranks in fp32 (one all-reduce), or as given when
        the caller averaged them."""
        grads = self.local_gradients(bucket)
        if self.gradients_averaged_by_caller or self.comm.world == 1:
            return [g.float() for g in grads]
        flat = bucket.flatten(grads)
        self.comm.all_reduce_sum_(flat, "full_precision")
        flat.div_(self.comm.world)
        return bucket.split(flat)

    def compressed_mean(self, bucket: Bucket, tensors: list[torch.Tensor], purpose: str) -> list[torch.Tensor]:
        """The 1-bit mean of ``tensors`` over the ranks, now (``start_compressed_mean`` + ``take_compressed_mean``)."""
        self.start_compressed_mean(bucket, tensors, purpose)
        return self.take_compressed_mean(bucket)

    def start_compressed_mean(self, bucket: Bucket, tensors: list[torch.Tensor], purpose: str) -> None:
        """Start ``bucket``'s 1-bit mean of ``tensors`` (copied now: they may change afterwards) without waiting for it.

        Exchanges overlap as a pipeline of depth one: starting one moves every earlier exchange still in its first
        half to its second (their all-to-alls had the time since to finish), so the collectives are issued in the
        same order on every rank whatever the timing."""
        if id(bucket) in self._in_flight:
            raise RuntimeError(f"{type(self).__name__}: a bucket's compressed exchange was started twice in one step")
        worker_error, server_error = bucket.errors()
        self._in_flight[id(bucket)] = CompressedAllReduce(
            bucket.flatten(tensors), worker_error, server_error, bucket.layout, self.comm, purpose, self.kernel_impl
        )
        for exchange in list(self._in_flight.values())[:-1]:
            exchange.gather()

    def has_compressed_mean(self, bucket: Bucket) -> bool:
        """Whether ``bucket``'s exchange was started (from backward) and not yet taken."""
        return id(bucket) in self._in_flight

    def exchanges_in_flight(self) -> int:
        """How many started exchanges have not been taken: after an overlapped backward, every bucket's."""
        return len(self._in_flight)

    def take_compressed_mean(self, bucket: Bucket) -> list[torch.Tensor]:
        """The result of ``bucket``'s started exchange (every exchange in flight enters its second half first, in
        issue order, so that all-gathers pair up across ranks)."""
        for exchange in self._in_flight.values():
            exchange.gather()
        return bucket.split(self._in_flight.pop(id(bucket)).wait())

    def mask_compressed(self, p: torch.nn.Parameter, values: torch.Tensor, exp_avg_sq: torch.Tensor, bias_correction2_sqrt: float) -> None:
        """Zero, in a decompressed momentum (or gradient), what 1-bit values cannot represent: an exact zero.

        - DeepSpeed's per-group ``exp_avg_mask`` (positions that never learn), applied as given;
        - with ``zero_variance_mask`` (default on, a dscompile addition), every element whose variance
          is below the ``eps`` term of its denominator, i.e. one that has had no gradient to speak of
          (a key bias in attention, whose gradient is zero up to rounding). Sent 1-bit it still receives
          ``±scale`` and, divided by ``eps``, would grow without bound; exact Adam moves it by less
          than ``lr`` per step. The variance is the same on every rank, so is the mask."""
        mask = self.group_of(p).get("exp_avg_mask")
        if mask is not None:
            values.mul_(mask.to(values.device))
        if self.zero_variance_mask:
            eps = self.group_of(p)["eps"]
            v_hat = exp_avg_sq / bias_correction2_sqrt**2
            values.masked_fill_(v_hat <= (eps if self.eps_inside_sqrt else eps * eps), 0.0)

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state plus this rank's ``onebit`` share: counters and every bucket's
        errors (they differ per rank, so each rank must save its own)."""
        state = super().state_dict()
        state["onebit"] = {
            "global_step": self.global_step,
            "scalars": {name: _copy(getattr(self, name)) for name in self._SCALARS},
            "layout": [(b.numels, b.layout.world, b.layout.block) for b in self.buckets],
            "rank": self.comm.rank,
            "errors": [None if b.worker_error is None else (b.worker_error, b.server_error) for b in self.buckets],
            "exchange": _copy(self.exchange_state),
        }
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        share = state_dict.pop("onebit", None)
        if share is None:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: the state has no 'onebit' share: it was not saved by a {type(self).__name__}, "
                "or a checkpoint is being re-laid out (another world size or ZeRO stage), which the per-rank compression errors "
                "cannot follow; load it with load_optimizer_states=False (the weights and counters still load)"
            )
        layout = [(list(numels), world, block) for numels, world, block in share["layout"]]
        mine = [(b.numels, b.layout.world, b.layout.block) for b in self.buckets]
        if layout != mine:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: the checkpoint's buckets {layout} differ from this optimizer's {mine}; "
                "compression errors are per rank and per bucket: resume with the same world size, parameters, bucket_size and block_size"
            )
        if share["rank"] != self.comm.rank:
            raise ValueError(f"{type(self).__name__}.load_state_dict: this state was saved by rank {share['rank']}, loading on rank {self.comm.rank}")
        masks = [group.get("exp_avg_mask") for group in self.param_groups]
        super().load_state_dict(state_dict)
        for group, mask in zip(self.param_groups, masks):  # the mask is the user's, not the checkpoint's (as DeepSpeed)
            group.pop("exp_avg_mask", None)
            if mask is not None:
                group["exp_avg_mask"] = mask
        self._group_of = {id(p): group for group in self.param_groups for p in group["params"]}
        self.global_step = int(share["global_step"])
        for name, value in share["scalars"].items():
            setattr(self, name, _copy(value))
        device = self.buckets[0].params[0].device
        self.exchange_state = _copy(share.get("exchange", {}), device)
        for bucket, errors in zip(self.buckets, share["errors"]):
            if errors is None:
                bucket.worker_error = bucket.server_error = None
            else:
                device = bucket.params[0].device
                bucket.worker_error, bucket.server_error = (e.detach().to(device, torch.float32).clone() for e in errors)

    def _check_same_buckets_on_every_rank(self, name: str) -> None:
        """All ranks must issue the same collectives: compare the bucket layouts once."""
        if self.comm.world == 1:
            return
        mine = [len(self.buckets)] + [n for b in self.buckets for n in b.numels]
        layouts: list[Any] = [None] * self.comm.world
        dist.all_gather_object(layouts, mine, group=self.comm.group)
        if any(other != mine for other in layouts):
            raise ValueError(f"{name}: the ranks hold different parameters ({layouts}); every data-parallel rank must build it over the same model")


def bias_corrections(group: dict[str, Any], step_m: int, step_v: int) -> tuple[float, float]:
    """``(1 - beta1^step_m, sqrt(1 - beta2^step_v))``, or ``(1, 1)`` without bias correction."""
    if not group["bias_correction"]:
        return 1.0, 1.0
    beta1, beta2 = group["betas"]
    return 1 - beta1**step_m, (1 - beta2**step_v) ** 0.5


def adam_denominator(exp_avg_sq: torch.Tensor, bias_correction2_sqrt: float, eps: float, eps_inside_sqrt: bool) -> torch.Tensor:
    """``sqrt(v_hat) + eps`` (as torch's Adam computes it), or ``sqrt(v_hat + eps)``."""
    if eps_inside_sqrt:
        return (exp_avg_sq / bias_correction2_sqrt**2).add_(eps).sqrt_()
    return (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)


def check_hyperparameters(name: str, lr: float, betas: Any, eps: float, weight_decay: float, amsgrad: bool, max_grad_norm: float) -> tuple[float, float]:
    if amsgrad:
        raise ValueError(f"{name} does not support the AMSGrad variant (amsgrad=true), as in DeepSpeed")
    if max_grad_norm:
        raise ValueError(f"{name}: max_grad_norm is not applied by the optimizer; use the config's top-level gradient_clipping instead")
    if not 0.0 <= lr:
        raise ValueError(f"{name}: invalid learning rate {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"{name}: invalid eps {eps}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"{name}: invalid weight_decay {weight_decay}")
    beta1, beta2 = betas
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"{name}: betas must be in [0, 1), got {tuple(betas)}")
    return float(beta1), float(beta2)


def check_step_count(name: str, key: str, value: Any, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}: {key} must be an integer >= {minimum}, got {value!r}")
    return value


def _plan_buckets(params: list[torch.nn.Parameter], bucket_size: int, world: int, block_size: int | None) -> list[Bucket]:
    return [Bucket([params[i] for i in group], world, block_size) for group in plan_bucket_positions([p.numel() for p in params], bucket_size)]


def plan_bucket_positions(numels: list[int], bucket_size: int) -> list[list[int]]:
    """Consecutive parameters (by position) grouped into buckets of at most ``bucket_size`` values (one parameter alone
    may exceed it): the optimizers' buckets, and what ``predict.py`` plans from a model's parameter sizes alone."""
    buckets: list[list[int]] = []
    current: list[int] = []
    count = 0
    for i, numel in enumerate(numels):
        if current and count + numel > bucket_size:
            buckets.append(current)
            current, count = [], 0
        current.append(i)
        count += numel
    if current:
        buckets.append(current)
    return buckets


def _copy(value: Any, device: torch.device | None = None) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to(device).clone() if device is not None else value.detach().clone()
    if isinstance(value, list):
        return [_copy(v, device) for v in value]
    if isinstance(value, dict):
        return {k: _copy(v, device) for k, v in value.items()}
    return value
