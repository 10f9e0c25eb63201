"""``initialize(mpu=...)``: a Megatron-style model the script split itself, on 4 gloo ranks (TP=2 × DP=2).

The model's column- and row-parallel linears do their own collectives (``dist.all_reduce`` in autograd
functions, as Megatron's do) on the TP group an mpu object names. dscompile must average gradients
over the data-parallel group only, clip by the whole model's norm (split parameters' squares summed
over TP, replicated ones once), shard ZeRO over the DP group, and save one file per TP rank that
consolidates to the full model. Compared with the unsplit model trained on one process on the same
global batch: SGD within 1e-5 relative.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dscompile.testing.distributed import requires_backend, run_distributed_or_fail

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS, BATCH, CLIP = 3, 4, 0.05


class _Mpu:
    """The part of Megatron's ``parallel_state`` DeepSpeed calls, TP innermost (ranks 0-1 and 2-3 split the model)."""

    def __init__(self, tp: int) -> None:
        world, rank = dist.get_world_size(), dist.get_rank()
        for start in range(0, world, tp):
            group = dist.new_group(list(range(start, start + tp)))
            if start <= rank < start + tp:
                self.tp_group = group
        for t in range(tp):
            group = dist.new_group(list(range(t, world, tp)))
            if rank % tp == t:
                self.dp_group = group
        self.tp, self.rank, self.world = tp, rank, world

    def get_tensor_model_parallel_group(self) -> Any:
        return self.tp_group

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.tp

    def get_tensor_model_parallel_rank(self) -> int:
        return self.rank % self.tp

    def get_data_parallel_group(self) -> Any:
        return self.dp_group

    def get_data_parallel_world_size(self) -> int:
        return self.world // self.tp

    def get_data_parallel_rank(self) -> int:
        return self.rank // self.tp


class _CopyToModelParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromModelParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _full_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))


def _mark(p: nn.Parameter, dim: int) -> nn.Parameter:
    p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1  # Megatron's attributes
    return p


class _MegatronMLP(nn.Module):
    """The full model's MLP split Megatron-style: first linear by output rows, second by input columns."""

    def __init__(self, full: nn.Module, mpu: _Mpu) -> None:
        super().__init__()
        norm, up, _, down = full
        r, tp = mpu.get_tensor_model_parallel_rank(), mpu.tp
        self.group = mpu.get_tensor_model_parallel_group()
        self.norm = norm
        self.up_weight = _mark(nn.Parameter(up.weight.detach().chunk(tp, 0)[r].clone()), 0)
        self.up_bias = _mark(nn.Parameter(up.bias.detach().chunk(tp, 0)[r].clone()), 0)
        self.down_weight = _mark(nn.Parameter(down.weight.detach().chunk(tp, 1)[r].clone()), 1)
        self.down_bias = nn.Parameter(down.bias.detach().clone())  # replicated: added once, after the reduction

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = _CopyToModelParallel.apply(self.norm(x), self.group)
        h = F.gelu(F.linear(h, self.up_weight, self.up_bias))
        y = _ReduceFromModelParallel.apply(F.linear(h, self.down_weight), self.group) + self.down_bias
        return F.mse_loss(y, target)


def _batch(step: int, dp_rank: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, t = torch.randn(2 * BATCH, 8, generator=g), torch.randn(2 * BATCH, 8, generator=g)
    return (x, t) if dp_rank is None else (x[dp_rank * BATCH : (dp_rank + 1) * BATCH], t[dp_rank * BATCH : (dp_rank + 1) * BATCH])


def _names() -> dict[str, str]:
    """The split model's parameter names -> the full model's."""
    return {"norm.weight": "0.weight", "norm.bias": "0.bias", "up_weight": "1.weight", "up_bias": "1.bias", "down_weight": "3.weight", "down_bias": "3.bias"}


def _reference() -> dict[str, torch.Tensor]:
    model = _full_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        x, t = _batch(step, None)
        F.mse_loss(model(x), t).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(rank: int, world: int, tmp: str) -> dict[str, Any]:
    import dscompile
    from dscompile.runtime.checkpoint_formats import zero_to_fp32

    mpu = _Mpu(tp=2)
    out: dict[str, Any] = {}
    for stage in (0, 1, 2, 3):
        model = _MegatronMLP(_full_model(), mpu)
        if rank // 2:  # another replica starts from other weights: the engine must make the replicas of a slice equal
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        config = {"train_micro_batch_size_per_gpu": BATCH, "train_batch_size": 2 * BATCH, "gradient_clipping": CLIP}
        config |= {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": stage}}
        if stage:  # the default lowering (Inductor) once, for stage 0; the ZeRO stages in eager, to keep the suite short
            config["lower"] = "eager"
        engine, *_ = dscompile.initialize(model=model, config=config, mpu=mpu)
        assert engine.data_parallel_world_size() == 2
        for step in range(STEPS):
            loss = engine(*_batch(step, mpu.get_data_parallel_rank()))
            engine.backward(loss)
            engine.step()
        out[stage] = {"params": engine.full_parameters()}
        engine.save_checkpoint(tmp, tag=f"mpu{stage}")  # per TP rank; under ZeRO each TP rank's shards over its DP group
        dist.barrier()
        out[f"consolidated{stage}"] = zero_to_fp32(f"{tmp}/mpu{stage}")
    return out


@requires_backend("gloo")
def test_mpu_tp2_dp2_matches_single_process(tmp_path) -> None:
    ranks = run_distributed_or_fail(_train, 4, str(tmp_path), timeout=600)
    ref = _reference()
    names = _names()
    for r in ranks:
        for key in (0, 1, 2, 3, "consolidated0", "consolidated1", "consolidated2", "consolidated3"):
            got = r[key]["params"] if isinstance(key, int) else r[key]
            assert set(got) == set(names), (key, sorted(got))
            for split_name, full_name in names.items():
                want = ref[full_name]
                err = float((got[split_name].double() - want.double()).norm() / want.double().norm())
                assert err < 1e-5, (key, split_name, err)


def test_mpu_refusals() -> None:
    import dscompile
    from dscompile.errors import DSCompileConfigError

    model = _full_model()
    with pytest.raises(DSCompileConfigError, match="mesh_param"):
        dscompile.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1}, mesh_param=(2, 2))
    with pytest.raises(DSCompileConfigError, match="mpu.*torch.distributed"):
        dscompile.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1}, mpu=object())
