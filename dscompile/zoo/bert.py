"""A small BERT-style encoder: bidirectional attention with a key-padding mask.

Inputs are `(input_ids, attention_mask)` where `attention_mask` is boolean `(B, T)`, True at
real tokens. The example batch always has padded positions so that passes which mishandle
the mask (sparse attention, fusion) change the result and fail their tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dscompile.zoo.case import ZooCase, cross_entropy, init_normal, random_tokens, require, seeded, split_overrides


@dataclass
class BertConfig:
    vocab_size: int = 128
    seq_len: int = 16
    d_model: int = 32
    n_heads: int = 4
    n_layers: int = 2
    mlp_ratio: int = 4
    dropout: float = 0.0
    norm: str = "post"
    head: str = "cls"
    num_classes: int = 4
    pad_token_id: int = 0
    layer_norm_eps: float = 1e-12

    def __post_init__(self) -> None:
        require(self.norm in ("post", "pre"), f"BertConfig.norm must be 'post' or 'pre', got {self.norm!r}")
        require(self.head in ("cls", "mlm"), f"BertConfig.head must be 'cls' or 'mlm', got {self.head!r}")
        require(
            self.d_model % self.n_heads == 0,
            f"BertConfig.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})",
        )
        require(self.seq_len >= 2, "BertConfig.seq_len must be at least 2 so a batch can contain padding")


class SelfAttention(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        qkv = self.qkv(x)
        width = qkv.shape[-1] // 3  # not c: head pruning shrinks it (and leaves n_heads, as DeepSpeed does)
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in qkv.split(width, dim=-1))
        # key_mask (B, 1, 1, T) bool: True = this key may be attended to.
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, width))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.pre_norm = cfg.norm == "pre"
        self.attn = SelfAttention(cfg)
        self.ln1 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.out = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.drop = nn.Dropout(cfg.dropout)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.out(F.gelu(self.fc(x))))

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        if self.pre_norm:
            x = x + self.drop(self.attn(self.ln1(x), key_mask))
            return x + self._mlp(self.ln2(x))
        x = self.ln1(x + self.drop(self.attn(x, key_mask)))
        return self.ln2(x + self._mlp(x))


class Bert(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        # Post-LN normalises the embeddings (BERT); pre-LN normalises the final hidden states.
        self.emb_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps) if cfg.norm == "post" else nn.Identity()
        self.final_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps) if cfg.norm == "pre" else nn.Identity()
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_layers))
        if cfg.head == "cls":
            self.pooler = nn.Linear(cfg.d_model, cfg.d_model)
            self.classifier = nn.Linear(cfg.d_model, cfg.num_classes)
        else:
            self.mlm_transform = nn.Linear(cfg.d_model, cfg.d_model)
            self.mlm_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
            self.mlm_decoder = nn.Linear(cfg.d_model, cfg.vocab_size)
        init_normal(self)
        if cfg.head == "mlm":
            self.mlm_decoder.weight = self.tok_emb.weight

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Class logits `(B, classes)` or token logits `(B, T, vocab)`; the loss given `targets`.

        MLM targets equal to -100 (padded or unmasked positions) are ignored by the loss.
        """
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.drop(self.emb_norm(self.tok_emb(input_ids) + self.pos_emb(pos)))
        key_mask = attention_mask[:, None, None, :].bool()
        for layer in self.layers:
            x = layer(x, key_mask)
        x = self.final_norm(x)
        if self.config.head == "cls":
            logits = self.classifier(torch.tanh(self.pooler(x[:, 0])))
        else:
            logits = self.mlm_decoder(self.mlm_norm(F.gelu(self.mlm_transform(x))))
        return logits if targets is None else cross_entropy(logits, targets)


def build_bert(name: str = "bert", **overrides: object) -> ZooCase:
    """A BERT case; row 0 is full length and every other row is padded at the end."""
    case_opts, cfg = split_overrides(name, BertConfig, overrides)
    seed = int(case_opts.get("seed", 0))
    batch_size = int(case_opts.get("batch_size", 2))
    s = cfg.seq_len

    def sampler(gen: torch.Generator) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        lengths = torch.randint(max(1, s // 2), s, (batch_size,), generator=gen)
        lengths[0] = s
        mask = torch.arange(s)[None, :] < lengths[:, None]
        real = random_tokens(gen, (batch_size, s), cfg.vocab_size, low=1 if cfg.pad_token_id == 0 else 0)
        ids = torch.where(mask, real, torch.full_like(real, cfg.pad_token_id))
        if cfg.head == "cls":
            targets = torch.randint(0, cfg.num_classes, (batch_size,), generator=gen)
        else:
            targets = random_tokens(gen, (batch_size, s), cfg.vocab_size).masked_fill(~mask, -100)
        return (ids, mask), targets

    with seeded(seed):
        model = Bert(cfg)
    inputs, targets = sampler(torch.Generator().manual_seed(seed))
    return ZooCase(name, model, inputs, targets, seed, sampler, cfg)
