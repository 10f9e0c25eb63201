"""A plain multi-layer perceptron classifier: the smallest model, for quick pass tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dscompile.zoo.case import ZooCase, cross_entropy, require, seeded, split_overrides


@dataclass
class MLPConfig:
    in_features: int = 32
    hidden: int = 64
    depth: int = 2
    num_classes: int = 10
    activation: str = "relu"

    def __post_init__(self) -> None:
        require(self.depth >= 1, f"MLPConfig.depth must be >= 1, got {self.depth}")
        require(self.activation in ("relu", "gelu"), f"MLPConfig.activation must be 'relu' or 'gelu', got {self.activation!r}")


class MLP(nn.Module):
    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        self.config = cfg
        act = nn.ReLU if cfg.activation == "relu" else nn.GELU
        layers: list[nn.Module] = []
        width = cfg.in_features
        for _ in range(cfg.depth):
            layers += [nn.Linear(width, cfg.hidden), act()]
            width = cfg.hidden
        layers.append(nn.Linear(width, cfg.num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.net(x)
        return logits if targets is None else cross_entropy(logits, targets)


def build_mlp(name: str = "mlp", **overrides: object) -> ZooCase:
    case_opts, cfg = split_overrides(name, MLPConfig, overrides)
    seed = int(case_opts.get("seed", 0))
    batch_size = int(case_opts.get("batch_size", 4))

    def sampler(gen: torch.Generator) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        x = torch.randn(batch_size, cfg.in_features, generator=gen)
        return (x,), torch.randint(0, cfg.num_classes, (batch_size,), generator=gen)

    with seeded(seed):
        model = MLP(cfg)
    inputs, targets = sampler(torch.Generator().manual_seed(seed))
    return ZooCase(name, model, inputs, targets, seed, sampler, cfg)
