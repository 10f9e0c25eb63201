"""The model zoo: small, seed-deterministic models every test and benchmark draws from.

    case = build("gpt", seq_len=32, seed=1)
    loss = case.model(*case.batch())           # forward(inputs..., targets) -> loss
    x, y = make_batch(case, seed=step)         # fresh data, same shapes

Names: gpt, gpt_explicit, llama, bert, mlp, cnn, hf_gpt2, hf_llama (the last two need
`transformers`, imported only when they are built).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dscompile.errors import suggest
from dscompile.zoo.bert import build_bert
from dscompile.zoo.case import ZooCase, make_batch
from dscompile.zoo.cnn import build_cnn
from dscompile.zoo.gpt import build_gpt
from dscompile.zoo.llama import build_llama
from dscompile.zoo.mlp import build_mlp

Factory = Callable[..., ZooCase]


def _gpt_explicit(name: str = "gpt_explicit", **overrides: Any) -> ZooCase:
    overrides.setdefault("attention", "explicit")
    return build_gpt(name, **overrides)


def _hf_gpt2(name: str = "hf_gpt2", **overrides: Any) -> ZooCase:
    from dscompile.zoo.hf import build_hf_gpt2

    return build_hf_gpt2(name, **overrides)


def _hf_llama(name: str = "hf_llama", **overrides: Any) -> ZooCase:
    from dscompile.zoo.hf import build_hf_llama

    return build_hf_llama(name, **overrides)


ZOO: dict[str, Factory] = {
    "gpt": build_gpt,
    "gpt_explicit": _gpt_explicit,
    "llama": build_llama,
    "bert": build_bert,
    "mlp": build_mlp,
    "cnn": build_cnn,
    "hf_gpt2": _hf_gpt2,
    "hf_llama": _hf_llama,
}

HF_MODELS = ("hf_gpt2", "hf_llama")


def build(name: str, **overrides: Any) -> ZooCase:
    """Build the zoo case `name`; overrides are `seed`, `batch_size` and model-config fields
    (e.g. `seq_len`, `n_layers`, `dropout`). Unknown names or options raise ValueError."""
    try:
        factory = ZOO[name]
    except KeyError:
        hint = suggest(name, ZOO)
        raise ValueError(
            f"unknown zoo model '{name}'" + (f" ({hint})" if hint else "") + f"; available: {', '.join(ZOO)}"
        ) from None
    return factory(name, **overrides)


__all__ = ["HF_MODELS", "ZOO", "ZooCase", "build", "make_batch"]
