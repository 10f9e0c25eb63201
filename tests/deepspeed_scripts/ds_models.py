"""Models and data shared by the DeepSpeed-style scripts of this folder and by the plain PyTorch
reference runs of tests/test_deepspeed_scripts.py (imports torch only: scripts run it under
DeepSpeed and under dscompile alike)."""

from __future__ import annotations

import json
import os
import sys

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


class ResidualBlock(nn.Module):
    """A ResNet basic block (DeepSpeed's CIFAR compression example prunes ``conv1``'s output channels)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(out)))


class ResidualNet(nn.Module):
    """A two-block ResNet for 8x8 images: stem, ``layer1`` (named as in DeepSpeed's CIFAR example), average pool, classifier."""

    def __init__(self, width: int = 8, depth: int = 2) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        self.layer1 = nn.ModuleList(ResidualBlock(width) for _ in range(depth))
        self.fc = nn.Linear(width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.conv(x)))
        for block in self.layer1:
            x = block(x)
        return self.fc(x.mean(dim=(2, 3)))


def vector_dataset(samples: int = 64, width: int = 16, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(samples, width, generator=g), torch.randint(0, CLASSES, (samples,), generator=g))


def report(path: str | None, record: dict) -> None:
    """Rank 0 writes what the run measured as JSON (the test reads it back)."""
    if path and int(os.environ.get("RANK", "0")) == 0:
        with open(path, "w") as f:
            json.dump(record, f)


def end_reference_run() -> None:
    """Under DeepSpeed itself, leave without the interpreter's teardown once every rank is done.

    DeepSpeed 0.19.8's CPU backend sometimes aborts there ("terminate called without an active exception":
    1 run of gan.py in about 12 here, and twice in a row in one CI run), after the losses are written; that
    crash says nothing about dscompile, whose runs keep the normal exit so that a crash of theirs still fails."""
    import torch.distributed as dist

    if "dscompile" in sys.modules or not dist.is_initialized():
        return
    dist.barrier()  # rank 0 has written its report
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# -- masked LM (HelloDeepSpeed's kind) --------------------------------------------------------------
MLM_VOCAB, MLM_SEQ, MLM_MASK_ID = 64, 12, 3


def tiny_roberta() -> nn.Module:
    """A two-layer RoBERTa for masked LM from a config (no download), dropout off so that runs compare exactly."""
    from transformers import RobertaConfig, RobertaForMaskedLM

    config = RobertaConfig(
        vocab_size=MLM_VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=MLM_SEQ + 4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, type_vocab_size=1, pad_token_id=1,
    )  # fmt: skip
    return RobertaForMaskedLM(config)


def masked_batches(rank: int, micro: int, steps: int) -> list[dict[str, torch.Tensor]]:
    """One rank's masked batches: about 15% of the tokens masked (the first always), the others' labels -100."""
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(steps):
        ids = torch.randint(4, MLM_VOCAB, (micro, MLM_SEQ), generator=g)
        masked = torch.rand(micro, MLM_SEQ, generator=g) < 0.15
        masked[:, 0] = True
        out.append({"input_ids": ids.masked_fill(masked, MLM_MASK_ID), "labels": ids.masked_fill(~masked, -100)})
    return out


# -- bf16 master weights (DeepSpeed's bf16_master_weight example's kind) ----------------------------
class TinyTransformer(nn.Module):
    """Embeddings, one pre-norm MLP block and an output projection: the example's model, shrunk."""

    def __init__(self, vocab: int = 64, hidden: int = 32) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.ff = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
        self.output_proj = nn.Linear(hidden, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embedding(input_ids)
        x = x + self.ff(self.norm(x))
        return self.output_proj(x)


def token_batches(rank: int, micro: int, steps: int, vocab: int = 64, seq: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(200 + rank)
    return [(torch.randint(0, vocab, (micro, seq), generator=g), torch.randint(0, vocab, (micro, seq), generator=g)) for _ in range(steps)]
