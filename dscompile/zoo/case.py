"""The `ZooCase` bundle and the small helpers every zoo model shares.

A case is everything a test or benchmark needs to run one model: the module, a batch of
example inputs, targets, and a sampler that draws fresh batches of the same shapes so that
multi-step training loops see new data while staying reproducible from a seed.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dscompile.errors import suggest

Sampler = Callable[[torch.Generator], tuple[tuple[torch.Tensor, ...], torch.Tensor]]
"""Draws `(inputs, targets)` on CPU from a generator; shapes never depend on the generator."""


@dataclass
class ZooCase:
    """A model with example inputs and targets; `model(*case.batch())` returns the loss."""

    name: str
    model: nn.Module
    example_inputs: tuple[torch.Tensor, ...]
    targets: torch.Tensor
    seed: int
    sampler: Sampler = field(repr=False)
    config: Any = None

    def batch(self) -> tuple[torch.Tensor, ...]:
        """The example inputs followed by the targets, ready for `model(*batch)`."""
        return (*self.example_inputs, self.targets)

    @property
    def device(self) -> torch.device:
        return self.targets.device

    def to(self, device: torch.device | str) -> ZooCase:
        """Move the model (in place) and return a case whose tensors live on `device`."""
        self.model.to(device)
        return dataclasses.replace(
            self,
            example_inputs=tuple(t.to(device) for t in self.example_inputs),
            targets=self.targets.to(device),
        )


def make_batch(case: ZooCase, seed: int, device: torch.device | str | None = None) -> tuple[torch.Tensor, ...]:
    """A fresh `(inputs..., targets)` batch with the case's shapes, determined by `seed` alone.

    `make_batch(case, case.seed)` reproduces `case.batch()`. Tensors land on `device`, by default
    the device of the case's own tensors.
    """
    inputs, targets = case.sampler(torch.Generator().manual_seed(seed))
    dev = torch.device(device) if device is not None else case.device
    return (*(t.to(dev) for t in inputs), targets.to(dev))


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run a block (model construction) under `torch.manual_seed(seed)` without disturbing
    the caller's global RNG state, so building a zoo model never changes other tests' streams."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position; targets equal to -100 are ignored."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)


CASE_KEYS = ("seed", "batch_size")


def split_overrides(name: str, config_cls: type, overrides: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """Separate case options (seed, batch_size) from model-config fields and build the config.

    An unknown key raises a ValueError that names the model, the key, and the valid keys.
    """
    fields = {f.name for f in dataclasses.fields(config_cls)}
    case_opts: dict[str, Any] = {}
    cfg_opts: dict[str, Any] = {}
    for key, value in overrides.items():
        if key in CASE_KEYS:
            case_opts[key] = value
        elif key in fields:
            cfg_opts[key] = value
        else:
            valid = sorted(fields | set(CASE_KEYS))
            hint = suggest(key, valid)
            raise ValueError(
                f"zoo model '{name}' has no option '{key}'"
                + (f" ({hint})" if hint else "")
                + f"; valid options: {', '.join(valid)}"
            )
    return case_opts, config_cls(**cfg_opts)


def random_tokens(gen: torch.Generator, shape: tuple[int, ...], vocab_size: int, low: int = 0) -> torch.Tensor:
    return torch.randint(low, vocab_size, shape, generator=gen, dtype=torch.long)


def init_normal(module: nn.Module, std: float = 0.02) -> None:
    """GPT/BERT-style init: N(0, std) weights for linear and embedding layers, zero biases."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=std)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
