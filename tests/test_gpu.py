"""What only a GPU can check: the lowerings on CUDA (default Inductor, and Triton), CUDA RNG under dropout, NCCL buffers.

Every test here is marked ``gpu`` and skipped without CUDA (tests/conftest.py);
``bench/gpu_check.py`` runs them on a GPU together with the GPU timings. Tolerances as in the CPU
tests they mirror: fp32 training against eager rtol 1e-4 (TF32 is off), bf16 against autocast 2e-2
(loss) / 5e-2 (gradients), relative.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch._inductor.config as inductor_config
import torch.distributed as dist

import dscompile
from dscompile.zoo import build, make_batch

pytestmark = pytest.mark.gpu
STEPS = 5
GPT = {"seq_len": 32, "d_model": 64, "n_heads": 4, "n_layers": 2, "vocab_size": 128, "bias": False}


@pytest.fixture(autouse=True)
def _no_tf32() -> None:
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _case(**overrides: object) -> object:
    return build("gpt", seed=3, batch_size=4, **{**GPT, **overrides}).to("cuda")


def _train(model: torch.nn.Module, params: list, case: object) -> list[float]:
    opt = torch.optim.AdamW(params, lr=1e-3)
    losses = []
    for step in range(STEPS):
        loss = model(*make_batch(case, seed=step))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("lower", ["auto", "inductor", "triton"])
def test_lowerings_train_like_eager_on_cuda(lower: str) -> None:
    from dscompile.frontend import resolve_lowering

    assert resolve_lowering("auto") == "inductor"  # the default, on a GPU as on a CPU
    case = _case()
    eager = copy.deepcopy(case.model)
    options = {} if lower == "auto" else {"lower": lower}  # no key: the default lowering
    compiled = torch.compile(case.model, backend="dscompile", options=options)
    got = _train(compiled, list(case.model.parameters()), case)
    want = _train(eager, list(eager.parameters()), case)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("lower", ["triton", "inductor"])
def test_dropout_on_cuda_masks_agree_and_replay(lower: str) -> None:
    """Inductor's / Triton's CUDA RNG: drop rate within 5 sigma, backward reuses the forward mask,
    the same seed replays it; with fallback_random the masks are eager's."""
    p = 0.1
    drop = torch.nn.Dropout(p).train()
    compiled = torch.compile(drop, backend="dscompile", options={"lower": lower})
    x = (torch.rand(256, 512, device="cuda") + 0.5).requires_grad_()
    torch.manual_seed(0)
    y = compiled(x)
    y.sum().backward()
    kept = y != 0
    rate = 1 - kept.float().mean().item()
    assert abs(rate - p) <= 5 * math.sqrt(p * (1 - p) / kept.numel())
    torch.testing.assert_close(x.grad, kept.float() / (1 - p))
    torch.manual_seed(0)
    assert torch.equal(compiled(x) != 0, kept)
    torch._dynamo.reset()
    with inductor_config.patch(fallback_random=True):
        fallback = torch.compile(torch.nn.Dropout(p).train(), backend="dscompile", options={"lower": lower})
        torch.manual_seed(1)
        got = fallback(x)
    torch.manual_seed(1)
    torch.testing.assert_close(got, torch.nn.functional.dropout(x, p), rtol=0, atol=0)


def test_checkpointed_dropout_on_cuda_reuses_masks() -> None:
    case = _case()
    for module in case.model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.1
    results = []
    for options in ({}, {"activation_checkpointing": {"policy": "full"}}):
        torch._dynamo.reset()
        model = copy.deepcopy(case.model)
        compiled = torch.compile(model, backend="dscompile", options=options)
        torch.manual_seed(0)
        loss = compiled(*make_batch(case, seed=0))
        loss.backward()
        results.append((float(loss), [q.grad.clone() for q in model.parameters()]))
    assert results[0][0] == results[1][0]
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.fixture
def nccl_one_rank() -> object:
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    if not dist.is_nccl_available():
        pytest.skip("NCCL not available")
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_zero3_bf16_step_with_nccl_matches_autocast(nccl_one_rank: object) -> None:
    """One NCCL rank: every collective buffer the engine builds must be on the GPU (a CPU one fails here).
    Losses within 2e-2 of autocast's and each parameter's update within 5e-2 (an optimizer that never
    steps is 1.0 off; the losses alone stayed within 2.1e-3 of autocast's then). SGD with momentum: its
    update is linear in the gradients, where AdamW's sign-like first steps magnify bf16 rounding."""
    case, ref_case = _case(), _case()
    start = {n: p.detach().clone() for n, p in ref_case.model.named_parameters()}
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
    }
    engine, *_ = dscompile.initialize(model=case.model, config=config)
    ref_opt = torch.optim.SGD(ref_case.model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        batch = make_batch(case, seed=step)
        loss = engine(*batch)
        engine.backward(loss)
        engine.step()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ref_loss = ref_case.model(*batch)
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(ref_case.model.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        assert abs(float(loss) - float(ref_loss)) <= 2e-2 * abs(float(ref_loss)), (step, float(loss), float(ref_loss))
    assert engine.skipped_steps == 0
    got = engine.full_parameters()
    errors = {}
    for name, p in ref_case.model.named_parameters():
        want = p.detach() - start[name]
        errors[name] = float(((got[name].to(want.device) - start[name]) - want).norm() / want.norm())
    assert max(errors.values()) <= 5e-2, errors
