"""A small GPT-style decoder: the workhorse model for pass and numerics tests.

Attention comes in two spellings selected by `attention=`: "sdpa" calls
`F.scaled_dot_product_attention(is_causal=True)`, "explicit" writes out matmul, scale,
causal mask, softmax, dropout, matmul. Both have identical parameters, so the same seed
gives the same weights, which lets tests check that attention rewrites (e.g. pattern
matching the explicit form into a fused kernel) preserve numerics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dscompile.zoo.case import ZooCase, cross_entropy, init_normal, random_tokens, require, seeded, split_overrides

ATTENTION_KINDS = ("sdpa", "explicit")


@dataclass
class GPTConfig:
    vocab_size: int = 128
    seq_len: int = 16
    d_model: int = 32
    n_heads: int = 4
    n_layers: int = 2
    mlp_ratio: int = 4
    dropout: float = 0.0
    tie_weights: bool = True
    bias: bool = True
    attention: str = "sdpa"

    def __post_init__(self) -> None:
        require(
            self.attention in ATTENTION_KINDS,
            f"GPTConfig.attention must be one of {ATTENTION_KINDS}, got {self.attention!r}",
        )
        require(
            self.d_model % self.n_heads == 0,
            f"GPTConfig.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})",
        )
        require(0.0 <= self.dropout < 1.0, f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.dropout = cfg.dropout
        self.attention = cfg.attention
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)
        if cfg.attention == "explicit":
            mask = torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool).tril()
            self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        qkv = self.qkv(x)
        width = qkv.shape[-1] // 3  # not c: head pruning shrinks it (and leaves n_heads, as DeepSpeed does)
        q, k, v = qkv.split(width, dim=-1)
        q = q.view(b, t, -1, self.head_dim).transpose(1, 2)
        k = k.view(b, t, -1, self.head_dim).transpose(1, 2)
        v = v.view(b, t, -1, self.head_dim).transpose(1, 2)
        p = self.dropout if self.training else 0.0
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
            scores = scores.masked_fill(~self.causal_mask[:t, :t], float("-inf"))
            weights = F.softmax(scores, dim=-1)
            weights = F.dropout(weights, p=p, training=self.training)
            y = weights @ v
        y = y.transpose(1, 2).reshape(b, t, width)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token + learned position embeddings, pre-LN blocks, final LN, tied or untied LM head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        init_normal(self)
        if cfg.tie_weights:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits `(B, T, vocab)`, or the mean next-token cross-entropy when `targets` is given."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits if targets is None else cross_entropy(logits, targets)


def build_gpt(name: str = "gpt", **overrides: object) -> ZooCase:
    """A GPT case; targets are random tokens aligned with positions (no shift inside the model)."""
    case_opts, cfg = split_overrides(name, GPTConfig, overrides)
    seed = int(case_opts.get("seed", 0))
    batch_size = int(case_opts.get("batch_size", 2))

    def sampler(gen: torch.Generator) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        idx = random_tokens(gen, (batch_size, cfg.seq_len), cfg.vocab_size)
        return (idx,), random_tokens(gen, (batch_size, cfg.seq_len), cfg.vocab_size)

    with seeded(seed):
        model = GPT(cfg)
    inputs, targets = sampler(torch.Generator().manual_seed(seed))
    return ZooCase(name, model, inputs, targets, seed, sampler, cfg)
