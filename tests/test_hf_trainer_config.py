"""``dscompile.integrations.huggingface``'s arguments, in one process: how the ds_config's ``"auto"`` values are filled,
what is refused, and that without a ds_config the Trainer is transformers' own (the training runs are in
``test_hf_trainer.py``)."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from dscompile.config import load_config  # noqa: E402
from dscompile.errors import DSCompileConfigError  # noqa: E402
from dscompile.integrations import huggingface as hf  # noqa: E402

HIDDEN = 32
STEPS = 10
HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None

ALL_AUTO = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"},
}


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=8, n_embd=HIDDEN, n_layer=1, n_head=4, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def arguments(tmp_path, cls=None, **overrides):
    cls = cls or hf.TrainingArguments
    values = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=3,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        adam_beta1=0.8,
        adam_beta2=0.95,
        adam_epsilon=1e-7,
        weight_decay=0.05,
        max_grad_norm=0.5,
        warmup_steps=4,
        bf16=True,
        use_cpu=True,
        report_to=[],
    )
    values.update(overrides)
    return cls(**values)


def test_auto_values_are_filled_from_the_arguments(tmp_path):
    user_config = {k: (dict(v) if isinstance(v, dict) else v) for k, v in ALL_AUTO.items()}
    args = arguments(tmp_path, deepspeed=user_config)
    assert args.deepspeed is None and args.deepspeed_plugin is None  # transformers (and the deepspeed package) never see it
    assert user_config == ALL_AUTO  # the caller's dict is left alone
    filled = args.ds_config.finalized(args, tiny_model(), STEPS)
    assert filled["train_micro_batch_size_per_gpu"] == 3 and filled["gradient_accumulation_steps"] == 2
    assert filled["train_batch_size"] == 3 * 2 * args.world_size
    assert filled["gradient_clipping"] == 0.5
    assert filled["bf16"] == {"enabled": True} and filled["fp16"] == {"enabled": False}
    assert filled["optimizer"]["params"] == {"lr": 3e-3, "betas": [0.8, 0.95], "eps": 1e-7, "weight_decay": 0.05}
    assert filled["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 3e-3, "warmup_num_steps": 4, "total_num_steps": STEPS}
    zero = filled["zero_optimization"]
    assert zero["reduce_bucket_size"] == HIDDEN * HIDDEN
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * HIDDEN * HIDDEN)
    assert zero["stage3_param_persistence_threshold"] == 10 * HIDDEN
    assert args.ds_config.config["scheduler"]["params"]["total_num_steps"] == "auto"  # filled per train() call, on a copy
    load_config(filled)  # dscompile accepts the filled config


@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="DeepSpeed is not installed")
def test_auto_values_match_transformers_deepspeed_integration(tmp_path):
    """The same filled config as transformers' DeepSpeed integration makes from the same arguments."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    ours = arguments(tmp_path, deepspeed=ALL_AUTO)
    try:
        theirs = arguments(tmp_path, cls=transformers.TrainingArguments, deepspeed=ALL_AUTO)
        theirs.hf_deepspeed_config.trainer_config_finalize(theirs, tiny_model(), STEPS)
        expected = dict(theirs.hf_deepspeed_config.config)
        expected.pop("steps_per_print")  # accelerate's DeepSpeedPlugin quiets DeepSpeed's logging (inf), not an "auto"
        assert ours.ds_config.finalized(ours, tiny_model(), STEPS) == expected
    finally:
        unset_hf_deepspeed_config()  # transformers' global: from_pretrained would build models under DeepSpeed's zero.Init


def test_accelerate_launch_deepspeed_settings_are_the_ds_config(tmp_path, monkeypatch):
    """``accelerate launch --use_deepspeed --zero_stage 3 --offload_optimizer_device cpu --gradient_accumulation_steps 2
    --mixed_precision bf16`` sets these variables; the script's arguments take them (accelerate's own reading) and
    accelerate is kept out of its DeepSpeed mode."""
    for name, value in {
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu",
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "2",
        "ACCELERATE_GRADIENT_CLIPPING": "0.5",
        "ACCELERATE_MIXED_PRECISION": "bf16",
    }.items():
        monkeypatch.setenv(name, value)
    args = arguments(tmp_path, bf16=True)  # with bf16=False transformers' check refuses the launcher's bf16, as for DeepSpeed
    assert args.deepspeed_plugin is None and os.environ["ACCELERATE_USE_DEEPSPEED"] == "false"
    filled = args.ds_config.finalized(args, tiny_model(), STEPS)
    assert filled["zero_optimization"]["stage"] == 3 and filled["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert filled["gradient_accumulation_steps"] == 2 and filled["gradient_clipping"] == 0.5
    assert filled["bf16"]["enabled"] is True and filled["train_micro_batch_size_per_gpu"] == 3
    load_config(filled)


def test_accelerate_launch_config_file_is_the_ds_config(tmp_path, monkeypatch):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, **{k: ALL_AUTO[k] for k in ("train_batch_size", "train_micro_batch_size_per_gpu")}}))
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(path))
    args = arguments(tmp_path, bf16=False, gradient_accumulation_steps=1)
    filled = args.ds_config.finalized(args, tiny_model(), STEPS)
    assert filled["zero_optimization"]["stage"] == 2 and filled["train_batch_size"] == 3 * args.world_size


def test_an_auto_no_argument_fills_is_refused_by_name(tmp_path):
    args = arguments(tmp_path, deepspeed={"zero_optimization": {"stage": 2, "sub_group_size": "auto"}, "train_micro_batch_size_per_gpu": "auto"})
    with pytest.raises(DSCompileConfigError, match=r"'zero_optimization\.sub_group_size'.*no Trainer argument fills it"):
        args.ds_config.finalized(args, tiny_model(), STEPS)


def test_a_value_that_contradicts_the_arguments_is_refused(tmp_path):
    """transformers' rule: a set value must equal its argument ('auto' takes the argument's)."""
    args = arguments(tmp_path, deepspeed={"gradient_accumulation_steps": 4, "zero_optimization": {"stage": 2}})
    with pytest.raises(ValueError, match="gradient_accumulation_steps=4 vs hf gradient_accumulation_steps=2"):
        args.ds_config.finalized(args, tiny_model(), STEPS)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"torch_compile": True}, "TrainingArguments.torch_compile"),
        ({"auto_find_batch_size": True}, "TrainingArguments.auto_find_batch_size"),
        ({"bf16_full_eval": True}, "TrainingArguments.bf16_full_eval"),
        ({"deepspeed": {"zero_optimization": {"stage": 2}, "tensor_parallel": {"autotp_size": 2}}}, "tensor_parallel.autotp_size"),
        ({"deepspeed": {"zero_optimization": {"stage": 1}, "pipeline": {"stages": 2}}}, "pipeline"),
    ],
)
def test_unsupported_combinations_are_refused_by_name(tmp_path, overrides, key):
    values = {"deepspeed": {"zero_optimization": {"stage": 2}}, **overrides}
    args = arguments(tmp_path, **values)
    with pytest.raises(DSCompileConfigError, match=f"'{key}'"):
        hf.Trainer(model=tiny_model(), args=args)


@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="transformers needs DeepSpeed to build TrainingArguments(deepspeed=...)")
def test_transformers_arguments_with_a_ds_config_are_refused(tmp_path):
    """They handed the config to the DeepSpeed package already (its zero.Init, its plugin): say which import to change."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    try:
        theirs = arguments(tmp_path, cls=transformers.TrainingArguments, deepspeed={"zero_optimization": {"stage": 2}})
        with pytest.raises(DSCompileConfigError, match="import TrainingArguments from dscompile.integrations.huggingface"):
            hf.Trainer(model=tiny_model(), args=theirs)
    finally:
        unset_hf_deepspeed_config()


class _Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def test_without_a_ds_config_it_is_the_transformers_trainer(tmp_path):
    losses = []
    for cls, trainer_cls in ((transformers.TrainingArguments, transformers.Trainer), (hf.TrainingArguments, hf.Trainer)):
        args = arguments(tmp_path / cls.__module__, cls=cls, bf16=False, max_steps=2, logging_steps=1, per_device_train_batch_size=2)
        trainer = trainer_cls(model=tiny_model(), args=args, train_dataset=_Tokens())
        trainer.train()
        losses.append([entry["loss"] for entry in trainer.state.log_history if "loss" in entry])
    assert trainer.engine is None and trainer.model_wrapped is trainer.model
    assert losses[0] == losses[1]
