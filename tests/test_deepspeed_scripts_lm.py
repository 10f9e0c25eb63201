"""DeepSpeed's language-model scripts (HelloDeepSpeed's masked LM, the bf16-master-weights example, hand-placed
activation checkpointing) port by changing their imports: losses equal plain PyTorch and DeepSpeed's.

Apart from ``test_deepspeed_scripts.py`` (whose harness it uses) so that the two run on different workers.
"""

from __future__ import annotations

import pytest
from test_deepspeed_scripts import (
    CHECKPOINTING_CONFIG,
    HAVE_DEEPSPEED,
    LM_CASES,
    MASKED_LM_BF16_CONFIG,
    MASKED_LM_CONFIG,
    RTOL,
    STEPS,
    Runs,
    assert_losses,
    assert_trains,
    bf16_masters_config,
    bf16_masters_reference,
    compare_with_deepspeed,
    deepspeed_cases,
    masked_lm_reference,
    tower_reference,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="session")
def run(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("deepspeed_scripts_lm"))


def test_hand_placed_activation_checkpointing(run):
    result = run("checkpointing.py", CHECKPOINTING_CONFIG)
    assert result["configured"]
    assert_losses(result["losses"], tower_reference(1.0)[0], RTOL, "checkpointing")


def test_masked_lm_with_the_engine_surface(run):
    """HelloDeepSpeed's idiom: config dict, the model's own methods through the engine, tput_timer,
    see_memory_usage, save/load_checkpoint with client_state; fp32 losses equal plain PyTorch."""
    result = run("masked_lm.py", MASKED_LM_CONFIG)
    assert_losses(result["losses"], masked_lm_reference(1.0), RTOL, "masked LM")
    assert result["client_step"] == STEPS and result["reload_equal"] and result["state_dtype"] == "torch.float32"
    assert result["timed_steps"] == STEPS and result["samples_per_sec"] > 0  # DeepSpeed's timer: steps after the first 2 timed


def test_masked_lm_bf16_with_the_optimizer_on_the_host(run):
    """HelloDeepSpeed's own config (bf16, ZeRO-1, offload_optimizer cpu): the saved module state is bf16, as
    DeepSpeed's, and reloading the checkpoint restores it exactly (the fp32 masters are kept beside it)."""
    result = run("masked_lm.py", MASKED_LM_BF16_CONFIG)
    assert_losses(result["losses"], masked_lm_reference(0.0), 2e-2, "masked LM, bf16")
    assert_trains(result["losses"], masked_lm_reference(0.0), masked_lm_reference(0.0, lr=0.0), "masked LM, bf16")
    assert result["state_dtype"] == "torch.bfloat16" and result["reload_equal"]


@pytest.mark.parametrize("stage,autocast", [pytest.param(2, False, marks=pytest.mark.extended), (3, True)])
def test_bf16_master_weights_and_grads(run, stage, autocast):
    """bf16 masters, gradients and Adam moments (ZeRO-2; ZeRO-3 with the example's torch_autocast): the run
    follows a plain PyTorch bf16 model with AdamW over its bf16 parameters."""
    result = run("bf16_masters.py", bf16_masters_config(stage, autocast=autocast))
    assert result["param_dtype"] == "torch.bfloat16" and result["moment_dtypes"] == ["torch.bfloat16"], result
    assert result["state_dtype"] == "torch.bfloat16"
    assert_losses(result["losses"], bf16_masters_reference(1.0), 2e-2, f"bf16 masters, ZeRO-{stage}")
    assert_trains(result["losses"], bf16_masters_reference(1.0), bf16_masters_reference(1.0, lr=0.0), f"bf16 masters, ZeRO-{stage}")


@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="deepspeed is not installed")
@pytest.mark.parametrize("case", deepspeed_cases(LM_CASES))
def test_same_losses_as_deepspeed(run, case):
    compare_with_deepspeed(run, case)
