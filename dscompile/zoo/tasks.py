"""Learnable synthetic tasks for the zoo's BERT and GPT: training demos and compression benchmarks.

Random tokens teach a model nothing, so accuracy and loss after compression would mean nothing.
These tasks have structure a small model learns in a few hundred steps on a CPU:

- ``MarkerTask`` (BERT classification): the label is the marker token (1..classes) planted most
  often among random filler tokens (3 times); two distractor markers are planted twice and once,
  so the model must count, not just detect.
- ``MarkovTask`` (GPT language modelling): sequences from a fixed sparse Markov chain (each token
  has a few likely successors), so the achievable loss is well below ``log(vocab)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MarkerTask:
    vocab_size: int = 128
    seq_len: int = 32
    num_classes: int = 4

    def batch(self, batch_size: int, gen: torch.Generator) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        """``((input_ids, attention_mask), labels)`` for the zoo's BERT (``head="cls"``)."""
        c, s = self.num_classes, self.seq_len
        ids = torch.randint(c + 1, self.vocab_size, (batch_size, s), generator=gen)
        labels = torch.randint(0, c, (batch_size,), generator=gen)
        for row in range(batch_size):
            others = (int(labels[row]) + 1 + torch.randperm(c - 1, generator=gen)[:2]) % c
            slots = torch.randperm(s - 1, generator=gen)[:6] + 1  # position 0 is the [CLS] slot
            ids[row, slots[:3]] = int(labels[row]) + 1
            ids[row, slots[3:5]] = int(others[0]) + 1
            ids[row, slots[5:6]] = int(others[1]) + 1
        ids[:, 0] = 0
        return (ids, torch.ones_like(ids, dtype=torch.bool)), labels


@dataclass
class MarkovTask:
    vocab_size: int = 128
    seq_len: int = 32
    successors: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        gen = torch.Generator().manual_seed(self.seed)
        table = torch.zeros(self.vocab_size, self.vocab_size)
        for token in range(self.vocab_size):
            nxt = torch.randperm(self.vocab_size, generator=gen)[: self.successors]
            table[token, nxt] = torch.tensor([0.6, 0.3, 0.1][: self.successors])
        self.table = table / table.sum(dim=1, keepdim=True)

    def batch(self, batch_size: int, gen: torch.Generator) -> tuple[tuple[torch.Tensor], torch.Tensor]:
        """``((idx,), targets)`` for the zoo's GPT: targets are the next tokens."""
        tokens = torch.empty(batch_size, self.seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, self.vocab_size, (batch_size,), generator=gen)
        for t in range(self.seq_len):
            tokens[:, t + 1] = torch.multinomial(self.table[tokens[:, t]], 1, generator=gen).squeeze(1)
        return (tokens[:, :-1],), tokens[:, 1:]

    def entropy(self) -> float:
        """The loss a perfect model reaches (the chain's mean next-token entropy, nats)."""
        p = self.table
        return float(-(p * p.clamp_min(1e-12).log()).sum(dim=1).mean())
