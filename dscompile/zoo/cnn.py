"""A small CNN classifier: conv, batch- or group-norm, ReLU, pooling, linear.

Batch norm brings buffer mutation (running statistics) into the graph, which passes must
carry through untouched; group norm is the buffer-free alternative.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dscompile.zoo.case import ZooCase, cross_entropy, require, seeded, split_overrides


@dataclass
class CNNConfig:
    in_channels: int = 3
    image_size: int = 16
    channels: tuple[int, ...] = (8, 16)
    num_classes: int = 10
    norm: str = "batch"
    groups: int = 4

    def __post_init__(self) -> None:
        self.channels = tuple(self.channels)
        require(self.norm in ("batch", "group"), f"CNNConfig.norm must be 'batch' or 'group', got {self.norm!r}")
        require(len(self.channels) >= 1, "CNNConfig.channels must name at least one conv layer")
        if self.norm == "group":
            bad = [c for c in self.channels if c % self.groups]
            require(not bad, f"CNNConfig.channels {bad} are not divisible by groups={self.groups}")


class CNN(nn.Module):
    def __init__(self, cfg: CNNConfig) -> None:
        super().__init__()
        self.config = cfg
        layers: list[nn.Module] = []
        c_in = cfg.in_channels
        for c_out in cfg.channels:
            norm = nn.BatchNorm2d(c_out) if cfg.norm == "batch" else nn.GroupNorm(cfg.groups, c_out)
            layers += [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), norm, nn.ReLU(), nn.MaxPool2d(2)]
            c_in = c_out
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, cfg.num_classes)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.fc(self.pool(self.features(x)).flatten(1))
        return logits if targets is None else cross_entropy(logits, targets)


def build_cnn(name: str = "cnn", **overrides: object) -> ZooCase:
    case_opts, cfg = split_overrides(name, CNNConfig, overrides)
    seed = int(case_opts.get("seed", 0))
    batch_size = int(case_opts.get("batch_size", 4))
    s = cfg.image_size

    def sampler(gen: torch.Generator) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        x = torch.randn(batch_size, cfg.in_channels, s, s, generator=gen)
        return (x,), torch.randint(0, cfg.num_classes, (batch_size,), generator=gen)

    with seeded(seed):
        model = CNN(cfg)
    inputs, targets = sampler(torch.Generator().manual_seed(seed))
    return ZooCase(name, model, inputs, targets, seed, sampler, cfg)
