"""``dscompile generate TARGET --prompt ... --max-new-tokens N``: tokens as Hugging Face's generate, and tokens/s."""

from __future__ import annotations

import pytest
import torch

from dscompile.cli import main

pytest.importorskip("transformers")


def test_generate_prints_hf_tokens_and_rate(capsys: pytest.CaptureFixture[str]) -> None:
    from dscompile.zoo.targets import hf_gpt2_lm

    model, _ = hf_gpt2_lm()
    prompt = [5, 17, 42, 7]
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt) :].tolist()
    code = main(["generate", "dscompile.zoo.targets:hf_gpt2_lm", "--prompt", "5, 17 42,7", "--max-new-tokens", "6", "--lower", "eager"])
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    assert [int(t) for t in out[0].split()] == expected
    assert "tokens/s" in out[1] and "first token" in out[1] and "'decode': 1" in out[1]


def test_generate_bad_input_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "dscompile.zoo.targets:hf_gpt2_lm", "--prompt", "hello world"]) == 2
    assert "token ids" in capsys.readouterr().err
    assert main(["generate", "dscompile.zoo.targets:hf_gpt2_lm", "--max-new-tokens", "8", "--max-out-tokens", "4", "--lower", "eager"]) == 2
    assert "max_out_tokens" in capsys.readouterr().err
