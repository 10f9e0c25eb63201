"""Every capability trained for several steps under the lowerings users get, not only ``lower: eager``.

The capability tests elsewhere run their graphs as plain aten (``lower: eager``) to isolate each
pass. Users get Inductor on a CPU and dscompile's Triton lowering on a GPU, so here each
capability trains for ``STEPS`` (>= 5) optimizer steps under ``inductor`` and under ``triton`` (in
Triton's interpreter on a CPU, small shapes) and is compared with eager PyTorch (or a
single-process run for the distributed ones):

- ZeRO-1/2/3 on 2 gloo ranks (one spawn per lowering runs the three stages) against one process
  running every rank's micro-batch: fp32, losses rtol 1e-5, parameters relative norm error 1e-5
  (``test_zero.assert_params_close``'s measure; a fused kernel changes summation order only);
- activation checkpointing (``full``: only block inputs saved) against eager: losses rtol 1e-5,
  gradients rtol 1e-4 / atol 1e-6, and the backward graph really recomputes;
- bf16 and fp16 (the engine's amp pass, fp32 master weights, fp16 loss scaling) against
  ``torch.autocast`` + ``GradScaler``: the tolerances of ``test_mixed_precision`` for the default
  policy (bf16 loss 2e-2 / gradients 5e-2, fp16 4e-3 / 4e-2, relative);
- sparse attention (BigBird layout) against eager attention masked with the same layout: losses
  and gradients rtol 1e-4 / atol 1e-5;
- pipeline parallelism (2 stages on 2 gloo ranks, 1F1B, stages compiled) against one process.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dscompile
from dscompile.testing.distributed import requires_backend, run_distributed_or_fail
from dscompile.zoo import build, make_batch

LOWERINGS = ["inductor", "triton"]
STEPS = 5
LR = 1e-2
WORLD = 2
GPT = {"seq_len": 8, "d_model": 16, "n_heads": 2, "n_layers": 1, "vocab_size": 40, "bias": False}


def _case(**overrides: Any) -> Any:
    return build("gpt", seed=3, batch_size=2, **{**GPT, **overrides})


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _flat(tensors: Any) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


# ---------------------------------------------------------------------------------------------
# ZeRO-1/2/3
# ---------------------------------------------------------------------------------------------


def _micro_batch(case: Any, step: int, rank: int) -> tuple[torch.Tensor, ...]:
    return make_batch(case, seed=10_000 + 100 * step + rank)


def zero_reference(steps: int = STEPS) -> dict[str, Any]:
    case = _case()
    opt = torch.optim.AdamW(case.model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for step in range(steps):
        total = 0.0
        for rank in range(WORLD):
            loss = case.model(*_micro_batch(case, step, rank)) / WORLD
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in case.model.named_parameters()}}


def zero_stages_rank(rank: int, world: int, lower: str) -> dict[int, dict[str, Any]]:
    out = {}
    for stage in (1, 2, 3):
        torch._dynamo.reset()
        case = _case()
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "torch_adam": True}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "lower": lower,
        }
        engine, *_ = dscompile.initialize(model=case.model, config=config)
        losses = []
        for step in range(STEPS):
            loss = engine(*_micro_batch(case, step, rank))
            engine.backward(loss)
            engine.step()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(float(total) / world)
        out[stage] = {"losses": losses, "params": engine.full_parameters()}
    return out


@pytest.mark.slow
@pytest.mark.distributed
@requires_backend("gloo")
@pytest.mark.parametrize("lower", LOWERINGS)
def test_zero_stages_match_single_process(lower: str) -> None:
    results = run_distributed_or_fail(zero_stages_rank, WORLD, lower, timeout=600)
    ref = zero_reference()
    for rank, by_stage in enumerate(results):
        for stage, result in by_stage.items():
            torch.testing.assert_close(result["losses"], ref["losses"], rtol=1e-5, atol=1e-6, msg=lambda m, s=stage, r=rank: f"ZeRO-{s} rank {r}: {m}")
            for name, value in ref["params"].items():
                error = _rel(result["params"][name], value)
                assert error <= 1e-5, (f"ZeRO-{stage} rank {rank}", name, error)


# ---------------------------------------------------------------------------------------------
# activation checkpointing
# ---------------------------------------------------------------------------------------------


def _train_compiled_vs_eager(compiled_model: Any, compiled_params: list, eager_model: Any, case: Any, seed0: int = 100) -> tuple[list, list]:
    opts = [torch.optim.AdamW(compiled_params, lr=LR), torch.optim.AdamW(eager_model.parameters(), lr=LR)]
    losses: list[tuple[float, float]] = []
    grads: list[tuple[torch.Tensor, torch.Tensor]] = []
    for step in range(STEPS):
        batch = make_batch(case, seed=seed0 + step)
        pair_loss, pair_grad = [], []
        for model, params, opt in ((compiled_model, compiled_params, opts[0]), (eager_model, list(eager_model.parameters()), opts[1])):
            loss = model(*batch)
            loss.backward()
            pair_loss.append(float(loss.detach()))
            pair_grad.append(_flat([p.grad for p in params]).clone())
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(tuple(pair_loss))
        grads.append(tuple(pair_grad))
    return losses, grads


@pytest.mark.slow
@pytest.mark.parametrize("lower", LOWERINGS)
def test_checkpointing_matches_eager(lower: str) -> None:
    from dscompile.passes.checkpointing import checkpoint_reports, clear_reports

    case = _case(n_layers=2)
    eager = copy.deepcopy(case.model)
    clear_reports()
    compiled = torch.compile(case.model, backend="dscompile", options={"lower": lower, "activation_checkpointing": {"policy": "full"}})
    losses, grads = _train_compiled_vs_eager(compiled, list(case.model.parameters()), eager, case)
    reports = checkpoint_reports()
    assert reports and reports[-1]["recomputed_nodes"] > 0, "nothing was recomputed: the test would not exercise checkpointing"
    for step, ((got, want), (g, w)) in enumerate(zip(losses, grads)):
        assert abs(got - want) <= 1e-5 * abs(want), (step, got, want)
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6, msg=lambda m, s=step: f"step {s}: {m}")


# ---------------------------------------------------------------------------------------------
# bf16 / fp16
# ---------------------------------------------------------------------------------------------

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}
AMP_TOL = {"bf16": {"loss": 2e-2, "grad": 5e-2}, "fp16": {"loss": 4e-3, "grad": 4e-2}}


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("lower", LOWERINGS)
def test_mixed_precision_matches_autocast(lower: str, precision: str) -> None:
    case, ref_case = _case(), _case()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0}},
        precision: {"enabled": True, **({"hysteresis": 1} if precision == "fp16" else {})},
        "lower": lower,
    }
    engine, *_ = dscompile.initialize(model=case.model, config=config)
    ref_opt = torch.optim.AdamW(ref_case.model.parameters(), lr=3e-3, weight_decay=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=1000, enabled=precision == "fp16")
    tol = AMP_TOL[precision]
    for step in range(STEPS):
        batch = make_batch(case, seed=100 + step)
        loss = engine(*batch)
        engine.backward(loss)
        scale = engine.loss_scaler.loss_scale if engine.loss_scaler else 1.0
        grads = _flat([p.grad for p in engine.module.parameters()]) / scale
        with torch.autocast("cpu", dtype=LOW[precision]):
            ref_loss = ref_case.model(*batch)
        scaler.scale(ref_loss).backward()
        scaler.unscale_(ref_opt)
        ref_grads = _flat([p.grad for p in ref_case.model.parameters()])
        assert abs(loss.item() - ref_loss.item()) <= tol["loss"] * abs(ref_loss.item()), (step, loss.item(), ref_loss.item())
        assert _rel(grads, ref_grads) <= tol["grad"], (step, _rel(grads, ref_grads))
        engine.step()
        scaler.step(ref_opt)
        scaler.update()
        ref_opt.zero_grad(set_to_none=True)
    assert engine.skipped_steps == 0
    for (name, p), q in zip(engine.module.named_parameters(), ref_case.model.parameters()):
        assert p.dtype == torch.float32
        assert _rel(p.detach(), q.detach()) <= 2e-2, name


# ---------------------------------------------------------------------------------------------
# sparse attention
# ---------------------------------------------------------------------------------------------

SEQ, DIM, HEADS, BLOCK = 64, 32, 2, 16
BIGBIRD = {"mode": "bigbird", "block": BLOCK, "num_random_blocks": 1, "num_sliding_window_blocks": 1, "different_layout_per_head": True}


class SparseLM(torch.nn.Module):
    """One attention layer and a head; ``layout_mask`` (eager only) applies the layout as a mask."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(DIM, 3 * DIM)
        self.out = torch.nn.Linear(DIM, DIM)
        self.head = torch.nn.Linear(DIM, 1)
        self.layout_mask: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (y.view(b, t, HEADS, -1).transpose(1, 2) for y in self.qkv(x).split(DIM, -1))
        mask = self.layout_mask[None] if self.layout_mask is not None else None
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = self.out(y.transpose(1, 2).reshape(b, t, DIM))
        return torch.nn.functional.mse_loss(self.head(y).squeeze(-1), target)


@pytest.mark.slow
@pytest.mark.parametrize("lower", LOWERINGS)
def test_sparse_attention_matches_masked_eager(lower: str) -> None:
    from dscompile.sparsity import layout_to_mask, parse_sparse_attention

    torch.manual_seed(0)
    model = SparseLM()
    eager = copy.deepcopy(model)
    layout = parse_sparse_attention(BIGBIRD).sparsity_config(HEADS).make_layout(SEQ)
    assert layout.float().mean() < 0.9
    eager.layout_mask = layout_to_mask(layout, BLOCK)
    # Inductor on a CPU: the op's default kernel there (reference); the Triton lowering: the Triton kernel
    section = {**BIGBIRD, **({"kernel": "triton"} if lower == "triton" else {})}
    compiled = torch.compile(model, backend="dscompile", options={"lower": lower, "sparse_attention": section})
    opts = [torch.optim.AdamW(model.parameters(), lr=LR), torch.optim.AdamW(eager.parameters(), lr=LR)]
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        x, target = torch.randn(2, SEQ, DIM, generator=gen), torch.randn(2, SEQ, generator=gen)
        results = []
        for net, params, opt in ((compiled, model.parameters(), opts[0]), (eager, eager.parameters(), opts[1])):
            loss = net(x, target)
            loss.backward()
            params = list(params)
            results.append((float(loss.detach()), _flat([p.grad for p in params]).clone()))
            opt.step()
            opt.zero_grad(set_to_none=True)
        (loss, grads), (ref_loss, ref_grads) = results
        assert abs(loss - ref_loss) <= 1e-4 * abs(ref_loss) + 1e-5, (step, loss, ref_loss)
        torch.testing.assert_close(grads, ref_grads, rtol=1e-4, atol=1e-5, msg=lambda m, s=step: f"step {s}: {m}")


# ---------------------------------------------------------------------------------------------
# pipeline parallelism
# ---------------------------------------------------------------------------------------------

PIPE_M = 2


def _pipe_data(case: Any) -> list:
    return [make_batch(case, 1000 * s + mb) for s in range(STEPS) for mb in range(PIPE_M)]


def pipeline_reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    case = _case(n_layers=2)
    opt = torch.optim.SGD(case.model.parameters(), lr=0.1)
    data = _pipe_data(case)
    losses = []
    for s in range(STEPS):
        total = 0.0
        for mb in range(PIPE_M):
            loss = case.model(*data[s * PIPE_M + mb])
            (loss / PIPE_M).backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total / PIPE_M)
    return losses, {n: p.detach().clone() for n, p in case.model.named_parameters()}


def pipeline_rank(rank: int, world: int, lower: str) -> dict[str, Any]:
    from dscompile.engines.pipeline_parallel import PipelineEngine

    case = _case(n_layers=2)
    config = {
        "lower": lower,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "pipeline": {"stages": 2, "schedule": "1f1b", "micro_batches": PIPE_M, "compile": True},
    }
    engine = PipelineEngine(case.model, config)
    data = iter(_pipe_data(case))
    losses = [float(engine.train_batch(data)) for _ in range(STEPS)]
    return {"losses": losses, "params": engine.stage_parameters()}


@pytest.mark.slow
@pytest.mark.distributed
@requires_backend("gloo")
@pytest.mark.parametrize("lower", LOWERINGS)
def test_pipeline_matches_single_process(lower: str) -> None:
    results = run_distributed_or_fail(pipeline_rank, WORLD, lower, timeout=600)
    ref_losses, ref_params = pipeline_reference()
    owned: set[str] = set()
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["losses"], ref_losses, rtol=1e-5, atol=0, msg=lambda m, r=rank: f"rank {r}: {m}")
        for name, value in result["params"].items():
            torch.testing.assert_close(value, ref_params[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        owned |= set(result["params"])
    assert owned == set(ref_params)
