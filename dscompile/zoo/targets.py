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
