"""A small Llama-style decoder: RMSNorm, SwiGLU MLP, rotary embeddings, causal SDPA, no biases.

Supports grouped-query attention through `n_kv_heads` (keys/values are repeated per query
group before SDPA, so graphs contain only the standard attention op).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dscompile.zoo.case import ZooCase, cross_entropy, init_normal, random_tokens, require, seeded, split_overrides


@dataclass
class LlamaConfig:
    vocab_size: int = 128
    seq_len: int = 16
    d_model: int = 32
    n_heads: int = 4
    n_kv_heads: int | None = None
    n_layers: int = 2
    hidden_dim: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_weights: bool = False

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        require(
            self.d_model % self.n_heads == 0,
            f"LlamaConfig.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})",
        )
        require(
            self.n_heads % self.n_kv_heads == 0,
            f"LlamaConfig.n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})",
        )
        require((self.d_model // self.n_heads) % 2 == 0, "LlamaConfig head dim (d_model / n_heads) must be even for rotary")


def rotary_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables `(seq_len, head_dim)` for the rotate-half form of rotary embeddings."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + d/2) of `x` `(B, H, T, d)` by position-dependent angles."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        assert cfg.n_kv_heads is not None
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.n_kv_heads != self.n_heads:
            rep = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w_gate = nn.Linear(cfg.d_model, cfg.hidden_dim, bias=False)
        self.w_up = nn.Linear(cfg.d_model, cfg.hidden_dim, bias=False)
        self.w_down = nn.Linear(cfg.hidden_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        cos, sin = rotary_tables(cfg.seq_len, cfg.d_model // cfg.n_heads, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        init_normal(self)
        if cfg.tie_weights:
            self.lm_head.weight = self.tok_emb.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits `(B, T, vocab)`, or the mean next-token cross-entropy when `targets` is given."""
        t = idx.shape[1]
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        x = self.tok_emb(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        return logits if targets is None else cross_entropy(logits, targets)


def build_llama(name: str = "llama", **overrides: object) -> ZooCase:
    case_opts, cfg = split_overrides(name, LlamaConfig, overrides)
    seed = int(case_opts.get("seed", 0))
    batch_size = int(case_opts.get("batch_size", 2))

    def sampler(gen: torch.Generator) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        idx = random_tokens(gen, (batch_size, cfg.seq_len), cfg.vocab_size)
        return (idx,), random_tokens(gen, (batch_size, cfg.seq_len), cfg.vocab_size)

    with seeded(seed):
        model = Llama(cfg)
    inputs, targets = sampler(torch.Generator().manual_seed(seed))
    return ZooCase(name, model, inputs, targets, seed, sampler, cfg)
