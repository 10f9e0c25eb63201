"""Hugging Face GPT-2 and Llama (random weights from a config, no download) through dscompile."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from dscompile.zoo import build  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", ["hf_gpt2", "hf_llama"])
def test_hf_model_training_matches_eager(name):
    case = build(name)
    reference = case.model
    model = copy.deepcopy(reference)
    compiled = torch.compile(model, backend="dscompile", options={"lower": "eager", "debug": True})
    expected = reference(*case.batch())
    expected.backward()
    got = compiled(*case.batch())
    got.backward()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for (pname, p_ref), p in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=pname: f"{n}: {m}")


@pytest.mark.parametrize("name", ["hf_gpt2", "hf_llama"])
def test_hf_model_inference_matches_eager(name):
    case = build(name)
    compiled = torch.compile(case.model, backend="dscompile", options={"lower": "eager"})
    with torch.no_grad():
        torch.testing.assert_close(compiled(*case.example_inputs), case.model(*case.example_inputs), rtol=1e-5, atol=1e-5)
