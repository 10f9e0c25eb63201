"""CLI targets: `dscompile ... dscompile.zoo.targets:gpt` style `module:factory` entries.

Each function returns `(model, example_inputs)` (inputs without targets, so the model
returns logits) with the zoo's default sizes and seed 0.
"""

from __future__ import annotations

import torch
from torch import nn

from dscompile.zoo import build

Target = tuple[nn.Module, tuple[torch.Tensor, ...]]


def _target(name: str) -> Target:
    case = build(name)
    return case.model, case.example_inputs


def gpt() -> Target:
    return _target("gpt")


def gpt_explicit() -> Target:
    return _target("gpt_explicit")


def llama() -> Target:
    return _target("llama")


def bert() -> Target:
    return _target("bert")


def mlp() -> Target:
    return _target("mlp")


def cnn() -> Target:
    return _target("cnn")


def hf_gpt2() -> Target:
    return _target("hf_gpt2")


def hf_llama() -> Target:
    return _target("hf_llama")


def _hf_lm(make_name: str) -> Target:
    """The bare Hugging Face causal LM (no zoo wrapper), so ``generate`` works on it: ``dscompile generate``'s targets."""
    from dscompile.zoo import hf
    from dscompile.zoo.case import seeded

    with seeded(0):
        model = getattr(hf, make_name)(hf.HFConfig()).eval()
    prompt = torch.randint(0, hf.HFConfig().vocab_size - 1, (1, 8), generator=torch.Generator().manual_seed(0))
    return model, (prompt,)


def hf_gpt2_lm() -> Target:
    return _hf_lm("_gpt2_module")


def hf_llama_lm() -> Target:
    return _hf_lm("_llama_module")
