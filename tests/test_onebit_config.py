"""``optimizer.type`` OneBitAdam / ZeroOneAdam / OneBitLamb: DeepSpeed's parameters and defaults, clear errors."""

from __future__ import annotations

import pytest
import torch

from dscompile.config import OptimizerConfig, load_config
from dscompile.errors import DSCompileConfigError
from dscompile.runtime.onebit import OneBitAdam, OneBitLamb, ZeroOneAdam
from dscompile.runtime.optimizers import build_optimizer


def _params():
    return torch.nn.Linear(8, 4).parameters()


@pytest.mark.parametrize(
    "type_,cls,params",
    [
        (
            "OneBitAdam",
            OneBitAdam,
            {"lr": 2e-4, "freeze_step": 400, "betas": [0.9, 0.98], "eps": 1e-6, "weight_decay": 0.01, "cuda_aware": False, "comm_backend_name": "nccl"},
        ),
        (
            "ZeroOneAdam",
            ZeroOneAdam,
            {"lr": 1e-3, "var_freeze_step": 1000, "var_update_scaler": 8, "local_step_scaler": 500, "local_step_clipper": 8, "comm_backend_name": "mpi"},
        ),
        (
            "OneBitLamb",
            OneBitLamb,
            {
                "lr": 1e-3,
                "freeze_step": 10,
                "max_coeff": 0.3,
                "min_coeff": 0.01,
                "coeff_beta": 0.9,
                "factor_max": 4.0,
                "factor_min": 0.5,
                "factor_threshold": 0.1,
                "comm_backend_name": "compressed",
            },
        ),
        ("onebit_adam", OneBitAdam, {"comm_backend_name": "hccl"}),
    ],
)
def test_config_builds_each_optimizer_with_its_parameters(type_, cls, params):
    opt = build_optimizer(OptimizerConfig(type_, params), _params())
    assert type(opt) is cls
    group = opt.param_groups[0]
    assert group["lr"] == params.get("lr", 1e-3)
    if "betas" in params:
        assert group["betas"] == (0.9, 0.98)
    for key in (
        "freeze_step",
        "var_freeze_step",
        "var_update_scaler",
        "local_step_scaler",
        "local_step_clipper",
        "factor_max",
        "factor_min",
        "factor_threshold",
        "coeff_beta",
    ):
        if key in params:
            assert getattr(opt, key) == params[key]
    if "max_coeff" in params:
        assert group["max_coeff"] == params["max_coeff"]


def test_deepspeed_defaults():
    adam = OneBitAdam(_params())
    assert (adam.freeze_step, adam.param_groups[0]["betas"], adam.param_groups[0]["eps"], adam.comm_backend_name, adam.cuda_aware) == (
        100000,
        (0.9, 0.999),
        1e-8,
        "nccl",
        False,
    )
    zero_one = ZeroOneAdam(_params())
    assert (zero_one.var_freeze_step, zero_one.var_update_scaler, zero_one.local_step_scaler, zero_one.local_step_clipper) == (100000, 16, 32678, 16)
    lamb = OneBitLamb(_params())
    assert (lamb.freeze_step, lamb.coeff_beta, lamb.factor_max, lamb.factor_min, lamb.factor_threshold) == (100000, 0.9, 4.0, 0.5, 0.1)
    assert (lamb.param_groups[0]["max_coeff"], lamb.param_groups[0]["min_coeff"]) == (10.0, 0.01)


@pytest.mark.parametrize(
    "type_,params,key",
    [
        ("OneBitAdam", {"freez_step": 10}, "optimizer.params.freez_step"),
        ("ZeroOneAdam", {"freeze_step": 10}, "optimizer.params.freeze_step"),  # 0/1 Adam names it var_freeze_step
        ("OneBitLamb", {"var_update_scaler": 2}, "optimizer.params.var_update_scaler"),
        ("OneBitAdam", {"deepspeed": None}, "optimizer.params.deepspeed"),
    ],
)
def test_unknown_parameters_are_refused_by_name(type_, params, key):
    with pytest.raises(DSCompileConfigError) as info:
        build_optimizer(OptimizerConfig(type_, params), _params())
    assert info.value.key == key


@pytest.mark.parametrize(
    "params,match",
    [
        ({"comm_backend_name": "gloo"}, "comm_backend_name 'gloo' is not a DeepSpeed transport"),
        ({"amsgrad": True}, "AMSGrad"),
        ({"max_grad_norm": 1.0}, "gradient_clipping"),
        ({"freeze_step": 0}, "freeze_step must be an integer >= 1"),
        ({"cuda_aware": "yes"}, "cuda_aware must be true or false"),
        ({"block_size": 12}, "multiple of 8"),
        ({"kernel_impl": "cuda"}, "kernel_impl must be"),
        ({"zero_variance_mask": 1}, "zero_variance_mask must be true or false"),
        ({"bucket_size": 0}, "bucket_size must be a positive"),
    ],
)
def test_bad_values_say_what_to_fix(params, match):
    with pytest.raises(DSCompileConfigError, match=match):
        build_optimizer(OptimizerConfig("OneBitAdam", params), _params())


def test_groups_cannot_be_added_later():
    opt = OneBitAdam(torch.nn.Linear(4, 4).parameters())
    with pytest.raises(ValueError, match="cannot be added after construction"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})


def test_fp16_parameters_are_refused():
    with pytest.raises(ValueError, match="fp32 parameters"):
        OneBitAdam(torch.nn.Linear(4, 4).half().parameters())


@pytest.mark.parametrize("type_", ["OneBitAdam", "ZeroOneAdam", "OneBitLamb"])
def test_zero_3_and_pipeline_are_refused(type_):
    for stage in (1, 2, 3) if type_ == "ZeroOneAdam" else (3,):
        with pytest.raises(DSCompileConfigError) as info:
            load_config({"optimizer": {"type": type_, "params": {}}, "zero_optimization": {"stage": stage}})
        assert info.value.key == "zero_optimization.stage"
    with pytest.raises(DSCompileConfigError) as info:
        load_config({"optimizer": {"type": type_, "params": {}}, "pipeline": {"stages": 2}})
    assert info.value.key == "pipeline"
    load_config({"optimizer": {"type": type_, "params": {}}, "zero_optimization": {"stage": 0}})
    if type_ != "ZeroOneAdam":  # their ZeRO-1/2 reduce-scatter goes 1-bit (test_onebit_engine.py, test_onebit_zero.py, test_onebit_lamb_zero.py)
        for stage in (1, 2):
            load_config({"optimizer": {"type": type_, "params": {}}, "zero_optimization": {"stage": stage}})


def test_single_process_is_adamw_then_frozen_variance():
    """A world of one has nothing to compress: warm-up is AdamW, then Adam with the variance frozen."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    reference = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    reference.load_state_dict(model.state_dict())
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=3, weight_decay=0.1)
    ref = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    frozen_v = None
    for step in range(1, 7):
        x = torch.randn(4, 6)
        model(x).square().mean().backward()
        reference(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if step <= 3:
            ref.step()
            assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
            frozen_v = [ref.state[p]["exp_avg_sq"].clone() for p in reference.parameters()]
        else:  # Adam with v (and its bias correction) frozen at step 3
            with torch.no_grad():
                for p, v in zip(reference.parameters(), frozen_v):
                    m = ref.state[p]["exp_avg"]
                    p.mul_(1 - 1e-2 * 0.1)
                    m.lerp_(p.grad, 0.1)
                    p.addcdiv_(m, v.sqrt() / (1 - 0.999**3) ** 0.5 + 1e-8, value=-1e-2 / (1 - 0.9**step))
            torch.testing.assert_close(list(model.parameters()), list(reference.parameters()), rtol=1e-6, atol=1e-7)
        reference.zero_grad()
    assert opt.communication_stats()["total_bytes"] == 0
