"""Models and data shared by the DeepSpeed-style scripts of this folder and by the plain PyTorch
reference runs of tests/test_deepspeed_scripts.py (imports torch only: scripts run it under
DeepSpeed and under dscompile alike)."""

from __future__ import annotations

import json
import os

import torch
from torch import nn
from torch.utils.data import TensorDataset

CLASSES = 10


class Net(nn.Module):
    """The image classifier of DeepSpeed's CIFAR-10 tutorial, shrunk to 8x8 images."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 8, 3, padding=1)
        self.fc1 = nn.Linear(8 * 2 * 2, 32)
        self.fc2 = nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        return self.fc2(torch.relu(self.fc1(x)))


def image_dataset(samples: int = 64, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(samples, 3, 8, 8, generator=g)
    labels = torch.randint(0, CLASSES, (samples,), generator=g)
    return TensorDataset(images, labels)


def pipeline_layers() -> list:
    """The classifier as a layer list for PipelineModule (LayerSpecs, modules and functions); the
    second stage starts with nn.ReLU(inplace=True) under the uniform partition. Entries are
    ("spec", class, args, kwargs) for a LayerSpec, ("module", module) or ("function", fn)."""
    return [
        ("spec", nn.Conv2d, (3, 6, 3), {"padding": 1}),
        ("module", nn.MaxPool2d(2, 2)),
        ("spec", nn.Conv2d, (6, 8, 3), {"padding": 1}),
        ("function", lambda x: torch.flatten(x, 1)),
        ("module", nn.ReLU(inplace=True)),
        ("spec", nn.Linear, (8 * 4 * 4, 32), {}),
        ("module", nn.ReLU(inplace=True)),
        ("spec", nn.Linear, (32, CLASSES), {}),
    ]


class Generator(nn.Module):
    def __init__(self, noise: int = 8, out: int = 16) -> None:
        super().__init__()
        self.main = nn.Sequential(nn.Linear(noise, 32), nn.ReLU(), nn.Linear(32, out), nn.Tanh())

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.main(z)


class Discriminator(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.main = nn.Sequential(nn.Linear(width, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1), nn.Sigmoid())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x).view(-1)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class Tower(nn.Module):
    """Residual MLP blocks; ``checkpoint`` (DeepSpeed's checkpointing.checkpoint or None) wraps each block."""

    def __init__(self, width: int = 16, depth: int = 3, classes: int = CLASSES, checkpoint=None) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)
        self.checkpoint = checkpoint
        self.apply(self._init_weights)  # a parent initialising its children, as Hugging Face models do

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.2)
            nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = self.checkpoint(block, h) if self.checkpoint is not None else block(h)
        return self.head(h)


def vector_dataset(samples: int = 64, width: int = 16, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(samples, width, generator=g), torch.randint(0, CLASSES, (samples,), generator=g))


def report(path: str | None, record: dict) -> None:
    """Rank 0 writes what the run measured as JSON (the test reads it back)."""
    if path and int(os.environ.get("RANK", "0")) == 0:
        with open(path, "w") as f:
            json.dump(record, f)
