"""``engine.generate`` of an encoder-decoder model (T5): Hugging Face's loop over the engine's compiled forward gives
Hugging Face's tokens, and a forward set on the model instance (accelerate's hooks do that) is the model's again after.
The DeepSpeedExamples T5 scripts run under torchrun in ``test_deepspeed_scripts_inference.py``."""

from __future__ import annotations

import pytest
import torch

import dscompile

transformers = pytest.importorskip("transformers")


def tiny_t5() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=40, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0, initializer_factor=8.0
    )
    return transformers.T5ForConditionalGeneration(config).eval()


def test_generate_gives_hugging_faces_tokens_and_gives_the_instance_forward_back() -> None:
    model, reference = tiny_t5(), tiny_t5()
    calls: list[int] = []
    class_forward = model.forward

    def hooked_forward(*args, **kwargs):  # what accelerate's add_hook_to_module leaves on an instance
        calls.append(1)
        return class_forward(*args, **kwargs)

    model.forward = hooked_forward
    engine = dscompile.init_inference(model, dtype=torch.float32, lower="eager")
    ids = torch.randint(3, 40, (2, 6))
    with torch.no_grad():
        expected = reference.generate(input_ids=ids, max_new_tokens=5, do_sample=False)
    got = engine.generate(ids, max_new_tokens=5)
    assert torch.equal(got, expected)
    assert calls, "the compiled forward runs the instance's forward"
    assert model.__dict__["forward"] is hooked_forward  # given back after generate
