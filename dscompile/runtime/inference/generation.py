"""Token generation over a static KV cache: one compiled prefill graph, one compiled decode graph.

Why static: a cache that grows by a token per step changes the decode graph's shapes every step, so
a compiler would recompile (or go dynamic) per token. Here the cache is pre-allocated to
``max_out_tokens`` positions (Hugging Face's ``StaticCache`` as the container: per layer a
``[batch, kv_heads, max_out_tokens, head_dim]`` key and value tensor, written in place at
``cache_position``), the attention mask is a ``[batch, max_out_tokens]`` tensor whose future
columns are 0 until their token exists, and the decode step's inputs are the new token, its
position and the write index as tensors. Every decode step then has the same shapes and the
decode graph compiles once for any number of new tokens. Prompts of different lengths in one
batch are left padded (``attention_mask`` 0 on the left), as Hugging Face's ``generate`` expects:
positions count only real tokens (``cumsum(mask) - 1``).

Sampling follows ``transformers``' processors in their order (temperature, top-k, top-p, then
``torch.multinomial`` over the softmax), so greedy decoding and seeded sampling give the tokens
Hugging Face's ``generate`` gives from the same logits.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dscompile.errors import DSCompileConfigError

StepFn = Callable[..., torch.Tensor]


@dataclass
class GenerationOutput:
    """What ``generate(..., return_dict_in_generate=True)`` returns.

    ``sequences``: ``[batch, prompt + new]`` token ids (prompt included, as Hugging Face);
    ``logits``: one ``[batch, vocab]`` tensor per generated token when ``output_logits=True``;
    ``first_token_s`` / ``decode_s``: wall time of the prefill (to the first token) and of the decode steps.
    """

    sequences: torch.Tensor
    logits: tuple[torch.Tensor, ...] | None = None
    first_token_s: float = 0.0
    decode_s: float = 0.0
    new_tokens: int = 0
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class SamplingConfig:
    """Hugging Face's sampling knobs (defaults: greedy)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0

    def check(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def next_tokens(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """The next token of each row of ``[batch, vocab]`` logits (argmax, or a draw after HF's warpers)."""
    if not sampling.do_sample:
        return logits.argmax(dim=-1)
    scores = logits.float()
    if sampling.temperature != 1.0:
        scores = scores / sampling.temperature
    if sampling.top_k:
        k = min(sampling.top_k, scores.shape[-1])
        kth = torch.topk(scores, k).values[..., -1, None]
        scores = scores.masked_fill(scores < kth, -float("inf"))
    if sampling.top_p < 1.0:
        sorted_logits, sorted_indices = torch.sort(scores, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - sampling.top_p)
        remove[..., -1:] = False  # keep at least one token
        scores = scores.masked_fill(remove.scatter(1, sorted_indices, remove), -float("inf"))
    probs = scores.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)


def cache_keyword(model: nn.Module) -> str:
    """The forward's name for the KV cache argument (``cache`` in transformers >= 5.2, else ``past_key_values``)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def kv_heads_and_dim(config: Any) -> tuple[int, int]:
    """Key/value heads and head size of a Hugging Face config (grouped-query attention included)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return kv_heads, head_dim


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Positions of left-padded rows as Hugging Face's ``generate`` computes them."""
    positions = mask.long().cumsum(-1) - 1
    return positions.masked_fill(mask == 0, 1)


def steady_decode() -> contextlib.AbstractContextManager[None]:
    """Decode steps after a call's first one: Dynamo evaluates only the guards that tell its cached graphs apart.

    Why it is safe here: the first decode step of every ``generate`` call runs all guards (and compiles
    if they fail); the later steps of the same call pass the same model, cache object, dtypes and
    shapes, changed only in tensor values the graph reads as inputs. Checking every guard again costs
    about a millisecond a token on CPU, several percent of a 100M model's decode step."""
    return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)


class StaticCacheGenerator:
    """Greedy / sampled generation for a Hugging Face causal LM with a cache of ``max_out_tokens`` slots.

    ``prefill`` and ``decode`` are the compiled step functions (``fn(**model_kwargs) -> logits``);
    the generator owns the caches (one per batch size and dtype, reset between calls). Under tensor
    parallelism (``tp_size`` ranks) each rank's cache holds ``ceil(kv_heads / tp_size)`` heads (its share,
    padded to the largest share when TP does not divide them; the one KV head its query heads use when the pass
    replicates fewer KV heads than ranks).
    """

    def __init__(self, model: nn.Module, max_out_tokens: int, min_out_tokens: int, prefill: StepFn, decode: StepFn, tp_size: int = 1) -> None:
        self.model = model
        self.tp_size = tp_size
        self.max_out_tokens = max_out_tokens
        self.min_out_tokens = min_out_tokens
        self.prefill = prefill
        self.decode = decode
        self.cache_kwarg = cache_keyword(model)
        self._caches: dict[tuple[int, torch.dtype, torch.device], Any] = {}

    def cache_for(self, batch: int, device: torch.device) -> Any:
        """The static cache for this batch size, zeroed (allocated on first use)."""
        from transformers import StaticCache  # the model is a transformers model, so the package is there

        dtype = next(self.model.parameters()).dtype
        key = (batch, dtype, device)
        cache = self._caches.get(key)
        if cache is None:
            cache = StaticCache(config=self.full_attention_config(), max_cache_len=self.max_out_tokens)
            # Allocated here, outside the graphs: lazily, the first (compiled) prefill would create the
            # tensors inside its graph, and the decode graph would never see them as the same state.
            heads, head_dim = kv_heads_and_dim(self.model.config)
            # each rank's share of the KV heads, padded to the largest share when TP does not divide them
            # (the split graph runs every rank on that many heads, the padding's weights zero)
            cache.early_initialization(batch, -(-heads // self.tp_size), head_dim, dtype, device)
            self._caches[key] = cache
        else:
            cache.reset()
        return cache

    def full_attention_config(self) -> Any:
        """The model's config for the cache, sliding windows dropped when they cannot slide within the cache.

        transformers' sliding-window cache layers keep their fill level as a Python int, which a
        compiled decode step would guard on (one recompile per token). A window at least
        ``max_out_tokens`` long never slides in a cache that size, so full-attention layers are exact."""
        config = self.model.config
        window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None)
        # as transformers' caches read it: listed layer types decide alone (Qwen2-MoE keeps ``sliding_window=0`` with
        # every layer full); without them a set ``sliding_window`` makes every layer slide
        slides = "sliding_attention" in layer_types if layer_types is not None else window is not None
        if not slides:
            return config
        if window is not None and window < self.max_out_tokens:
            raise DSCompileConfigError(
                "max_out_tokens",
                f"the model attends over a sliding window of {window} tokens, shorter than max_out_tokens={self.max_out_tokens}: "
                "a sliding static cache is not built yet (its decode step would recompile per token)",
                f"set max_out_tokens <= {window}",
            )
        config = copy.copy(config)
        config.sliding_window = None
        if layer_types:
            config.layer_types = ["full_attention" if t == "sliding_attention" else t for t in layer_types]
        return config

    def check_lengths(self, prompt: int, new: int) -> None:
        room = self.max_out_tokens - prompt
        if prompt > self.max_out_tokens:
            raise DSCompileConfigError(
                "max_out_tokens",
                f"the prompt has {prompt} tokens, more than max_out_tokens={self.max_out_tokens} (the KV cache's size)",
                "pass a larger max_out_tokens to init_inference or shorten the prompt",
            )
        if new > room:
            raise DSCompileConfigError(
                "max_out_tokens",
                f"{prompt} prompt tokens + max_new_tokens={new} exceed max_out_tokens={self.max_out_tokens} (the KV cache's size)",
                f"generate at most {room} new tokens, or raise max_out_tokens in init_inference",
            )
        if room < self.min_out_tokens:
            raise DSCompileConfigError(
                "min_out_tokens",
                f"only {room} of the min_out_tokens={self.min_out_tokens} output tokens fit after a {prompt}-token prompt "
                f"in max_out_tokens={self.max_out_tokens}",
                "raise max_out_tokens or shorten the prompt",
            )

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        max_new_tokens: int,
        sampling: SamplingConfig,
        eos_token_id: int | list[int] | None,
        pad_token_id: int | None,
        generator: torch.Generator | None,
        output_logits: bool,
    ) -> GenerationOutput:
        sampling.check()
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
        batch, prompt = input_ids.shape
        device = input_ids.device
        self.check_lengths(prompt, max_new_tokens)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        eos = torch.tensor([] if eos_token_id is None else ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)), device=device)
        if eos.numel() and pad_token_id is None:
            pad_token_id = int(eos[0])
        cache = self.cache_for(batch, device)
        mask = torch.zeros((batch, self.max_out_tokens), dtype=torch.long, device=device)
        mask[:, :prompt] = attention_mask
        position = positions_from_mask(attention_mask.long())
        start = time.perf_counter()
        logits = self.prefill(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position,
            cache_position=torch.arange(prompt, device=device),
            use_cache=True,
            **{self.cache_kwarg: cache},
        )[:, -1]
        first = time.perf_counter()
        tokens: list[torch.Tensor] = []
        kept: list[torch.Tensor] = []
        unfinished = torch.ones(batch, dtype=torch.bool, device=device)
        last_position = position[:, -1:]
        for step in range(max_new_tokens):
            if output_logits:
                kept.append(logits)
            token = next_tokens(logits, sampling, generator)
            if eos.numel():
                token = torch.where(unfinished, token, torch.full_like(token, pad_token_id))
                unfinished = unfinished & ~torch.isin(token, eos)
            tokens.append(token)
            if step + 1 == max_new_tokens or (eos.numel() and not bool(unfinished.any())):
                break
            slot = prompt + step
            mask[:, slot] = 1
            last_position = last_position + 1
            with steady_decode() if step > 0 else contextlib.nullcontext():
                logits = self.decode(
                    input_ids=token[:, None],
                    attention_mask=mask,
                    position_ids=last_position,
                    cache_position=torch.tensor([slot], device=device),
                    use_cache=True,
                    **{self.cache_kwarg: cache},
                )[:, -1]
        end = time.perf_counter()
        sequences = torch.cat([input_ids, torch.stack(tokens, dim=1)], dim=1)
        return GenerationOutput(
            sequences=sequences,
            logits=tuple(kept) if output_logits else None,
            first_token_s=first - start,
            decode_s=end - first,
            new_tokens=len(tokens),
        )
