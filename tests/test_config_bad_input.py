"""Bad input is refused naming the key: an unfilled "auto", a string where a number goes, inf/NaN, a directory as the config file."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import dscompile
from dscompile.compression import init_compression
from dscompile.config import load_config
from dscompile.errors import DSCompileConfigError

ADAMW = {"type": "AdamW", "params": {"lr": 0.01}}
ZERO3 = {"stage": 3}


def _initialize(config: dict) -> None:
    """Build an engine (optimizer and scheduler included) and take one step: a bad value must fail before the step."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    engine, *_ = dscompile.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1, "lower": "eager", **config})
    loss = engine(torch.randn(1, 3)).sum()
    engine.backward(loss)
    engine.step()
    assert all(torch.isfinite(p).all() for p in model.parameters()), "the step made a parameter inf or NaN"


# Keys Hugging Face's DeepSpeed integration sets to "auto" in its example configs, and the Trainer fills.
AUTO = [
    ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, "optimizer.params.lr"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": "auto"}}}, "optimizer.params.betas"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.9, "auto"]}}}, "optimizer.params.betas"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "eps": "auto"}}}, "optimizer.params.eps"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": "auto"}}}, "optimizer.params.weight_decay"),
    ({"optimizer": ADAMW, "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}}, "scheduler.params.warmup_max_lr"),
    ({"optimizer": ADAMW, "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 9, "warmup_min_lr": "auto"}}}, "scheduler.params.warmup_min_lr"),
    ({"optimizer": ADAMW, "gradient_accumulation_steps": "auto"}, "gradient_accumulation_steps"),
    ({"optimizer": ADAMW, "gradient_clipping": "auto"}, "gradient_clipping"),
    ({"optimizer": ADAMW, "bf16": {"enabled": "auto"}}, "bf16.enabled"),
    ({"optimizer": ADAMW, "fp16": {"enabled": "auto"}}, "fp16.enabled"),
    ({"optimizer": ADAMW, "amp": {"enabled": "auto"}}, "amp.enabled"),
    ({"optimizer": ADAMW, "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}, "zero_optimization.reduce_bucket_size"),
    ({"optimizer": ADAMW, "zero_optimization": {**ZERO3, "stage3_prefetch_bucket_size": "auto"}}, "zero_optimization.stage3_prefetch_bucket_size"),
    ({"optimizer": ADAMW, "zero_optimization": {**ZERO3, "stage3_param_persistence_threshold": "auto"}}, "zero_optimization.stage3_param_persistence_threshold"),  # noqa: E501
]


@pytest.mark.parametrize(("config", "key"), AUTO, ids=[key for _, key in AUTO])
def test_unfilled_auto_is_refused_naming_the_key_and_who_fills_it(config: dict, key: str) -> None:
    with pytest.raises(DSCompileConfigError) as info:
        _initialize(config)
    assert info.value.key == key
    assert '"auto"' in info.value.problem and "Trainer" in info.value.problem and "Accelerate" in info.value.problem


NON_FINITE = [
    ({"optimizer": {"type": "AdamW", "params": {"lr": math.inf}}}, "optimizer.params.lr"),
    ({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": math.nan}}}, "optimizer.params.momentum"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.9, math.inf]}}}, "optimizer.params.betas"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": -math.inf}}}, "optimizer.params.weight_decay"),
    ({"optimizer": ADAMW, "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": math.inf}}}, "scheduler.params.warmup_max_lr"),
    ({"optimizer": ADAMW, "gradient_clipping": math.nan}, "gradient_clipping"),
    ({"optimizer": ADAMW, "bf16": {"enabled": True}, "gradient_clipping": math.inf}, "gradient_clipping"),
]


@pytest.mark.parametrize(("config", "key"), NON_FINITE, ids=[key for _, key in NON_FINITE])
def test_non_finite_hyperparameters_are_refused(config: dict, key: str) -> None:
    with pytest.raises(DSCompileConfigError, match="must be a finite number") as info:
        _initialize(config)
    assert info.value.key == key


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"optimizer": {"type": "AdamW", "params": {"lr": "0.01"}}}, "optimizer.params.lr"),
        ({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": True}}}, "optimizer.params.momentum"),
        ({"optimizer": ADAMW, "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "0.1"}}}, "scheduler.params.warmup_max_lr"),
    ],
)
def test_a_string_or_bool_where_a_number_goes_names_the_key(config: dict, key: str) -> None:
    with pytest.raises(DSCompileConfigError, match="expected a number") as info:
        _initialize(config)
    assert info.value.key == key


def test_finite_values_and_string_options_still_load() -> None:
    """The checks refuse only what they name: strings where strings go, and finite numbers, pass."""
    warmup = {"type": "WarmupLR", "params": {"warmup_type": "linear", "warmup_max_lr": [0.02]}}
    _initialize({"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.8, 0.9]}}, "scheduler": warmup})
    assert load_config({"pipeline": {"stages": "auto"}, "gradient_clipping": 1}).gradient_clipping == 1.0


def test_a_config_path_that_is_a_directory_says_so(tmp_path) -> None:
    for source in (str(tmp_path), {"config": tmp_path}):
        with pytest.raises(DSCompileConfigError, match="is a directory, not a file") as info:
            load_config(source)
        assert info.value.key == "config"
    with pytest.raises(DSCompileConfigError, match="is a directory, not a file") as info:
        init_compression(nn.Linear(2, 2), str(tmp_path))
    assert info.value.key == "deepspeed_config"


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_non_finite_pass_option_in_a_textual_pipeline_is_refused(value: str) -> None:
    with pytest.raises(DSCompileConfigError, match=f"checkpoint.budget: must be a finite number, got {value}") as info:
        load_config({"pipeline": f"checkpoint(policy=budget,budget={value}),lower(eager)"})
    assert info.value.key == "pipeline"
