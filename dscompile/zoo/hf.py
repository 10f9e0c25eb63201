"""Tiny Hugging Face GPT-2 and Llama models with random weights (no download).

They test that dscompile handles real-world modelling code (HF attention dispatch, loss
functions, config plumbing), not just our own compact models. Importing this module requires
`transformers`; `dscompile.zoo` imports it only when an "hf_*" case is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dscompile.zoo.case import ZooCase, random_tokens, seeded, split_overrides

_INSTALL_HINT = (
    "the Hugging Face zoo models ('hf_gpt2', 'hf_llama') need the 'transformers' package: "
    "install it with `pip install 'transformers>=4.45'` (or `pip install -e '.[test]'`)"
)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(_INSTALL_HINT) from exc
    return transformers


class HFCausalLM(nn.Module):
    """Adapts an HF causal LM to the zoo contract: `forward(input_ids, targets=None)` returns
    a plain tensor, the loss given targets (HF `labels`, shifted inside HF) and logits otherwise."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        out = self.model(input_ids=input_ids, labels=targets, use_cache=False, return_dict=True)
        return out.logits if targets is None else out.loss


@dataclass
class HFConfig:
    """The knobs shared by both HF cases; sizes follow the brief: 2 layers, hidden 64, vocab 256."""

    vocab_size: int = 256
    seq_len: int = 16
    hidden: int = 64
    n_layers: int = 2
    n_heads: int = 4
    attn_implementation: str = "sdpa"


def _gpt2_module(cfg: HFConfig) -> nn.Module:
    tf = _transformers()
    config = tf.GPT2Config(
        vocab_size=cfg.vocab_size,
        n_positions=max(cfg.seq_len, 64),
        n_embd=cfg.hidden,
        n_layer=cfg.n_layers,
        n_head=cfg.n_heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=cfg.vocab_size - 1,
        attn_implementation=cfg.attn_implementation,
    )
    model = tf.GPT2LMHeadModel(config)
    # GPT2LMHeadModel's class name does not name its loss, so HF warns on every call; say it.
    model.loss_type = "ForCausalLM"
    return model


def _llama_module(cfg: HFConfig) -> nn.Module:
    tf = _transformers()
    config = tf.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden,
        intermediate_size=2 * cfg.hidden,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_heads,
        max_position_embeddings=max(cfg.seq_len, 64),
        bos_token_id=0,
        eos_token_id=cfg.vocab_size - 1,
        attn_implementation=cfg.attn_implementation,
    )
    return tf.LlamaForCausalLM(config)


def _build(name: str, make: Any, overrides: dict[str, Any]) -> ZooCase:
    case_opts, cfg = split_overrides(name, HFConfig, overrides)
    seed = int(case_opts.get("seed", 0))
    batch_size = int(case_opts.get("batch_size", 2))

    def sampler(gen: torch.Generator) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        # HF convention: labels are the inputs themselves; the model shifts them internally.
        idx = random_tokens(gen, (batch_size, cfg.seq_len), cfg.vocab_size)
        return (idx,), idx.clone()

    with seeded(seed):
        model = HFCausalLM(make(cfg))
    model.train()
    inputs, targets = sampler(torch.Generator().manual_seed(seed))
    return ZooCase(name, model, inputs, targets, seed, sampler, cfg)


def build_hf_gpt2(name: str = "hf_gpt2", **overrides: Any) -> ZooCase:
    return _build(name, _gpt2_module, overrides)


def build_hf_llama(name: str = "hf_llama", **overrides: Any) -> ZooCase:
    return _build(name, _llama_module, overrides)
