"""``dscompile.init_inference``: DeepSpeed-Inference's entry point, as compiled graphs.

``engine = dscompile.init_inference(model, dtype=torch.float32, max_out_tokens=256, quant={...},
replace_with_kernel_inject=True)`` (or ``config={...}`` with the same keys, DeepSpeed's
``DeepSpeedInferenceConfig``) returns an ``InferenceEngine``: ``engine(input_ids)`` runs the model's
forward through ``torch.compile(backend="dscompile")``, and ``engine.generate(...)`` generates
from a Hugging Face causal LM with a static KV cache of ``max_out_tokens`` slots, so the prefill
and decode steps are two compiled graphs and the decode graph compiles once
(``dscompile.runtime.inference.generation``). With ``replace_with_kernel_inject`` the graphs go
through the inference fusion passes instead of DeepSpeed's per-architecture kernel containers
(``FUSION_PASSES``: shared-input matmuls, rotary embedding, attention over the KV cache, epilogues); with ``quant`` the weights are stored packed
(``dscompile.runtime.inference.weights``). Under ``tensor_parallel`` both compose: the fusion passes run on
each rank's split graph, and the layers are packed at the first split, each rank its slices
(``passes/inference_tensor_parallel.py``), so ``quantized_layers`` fills on the first call. An encoder-decoder
model (T5, BART) generates through Hugging Face's ``generate`` over the compiled forward, or under ``tensor_parallel``
over split encoder and decoder graphs (``TensorParallelSeq2Seq``).

The engine stands on the engine core (``dscompile.runtime.engine_core``), as the training engines do: its
``plan`` is the planner's (``plan_inference``: ``tp_size`` ranks of tensor parallelism, data parallelism over the
rest), the process group comes from the launcher's environment as training's does, inference extensions
(``register_engine_extension(..., kind=INFERENCE)``) configure it, and ``communication_stats()`` counts the
collectives its graphs run; ``destroy()`` releases the compiled graphs.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from dscompile.errors import DSCompileConfigError
from dscompile.frontend import dscompile_backend
from dscompile.passes.inference_tensor_parallel import (
    TensorParallelForward,
    TensorParallelGraphs,
    TensorParallelSeq2Seq,
    TensorParallelStep,
    policy_from_linear_names,
    policy_linears,
)
from dscompile.planner import plan_inference
from dscompile.runtime.comm_stats import collecting
from dscompile.runtime.dynamo_room import make_room
from dscompile.runtime.engine_core import INFERENCE, EngineCore, init_from_launcher, world_info
from dscompile.runtime.inference.config import InferenceConfig, parse_inference_config
from dscompile.runtime.inference.generation import GenerationOutput, SamplingConfig, StaticCacheGenerator
from dscompile.runtime.inference.weights import model_bytes, quantize_model_weights

log = logging.getLogger("dscompile.engines.inference")

_ENTRIES_PER_ENGINE = 4
"""Dynamo cache entries one engine may add to each code it compiles: the model's forward, and the prefill and decode
steps, whose code every engine shares (another batch size or dtype adds one)."""

FUSION_PASSES = ("fuse_shared_input_matmuls", "fuse_rotary_embedding", "fuse_cache_attention", "fuse_inference_epilogues")


def inference_pipeline(config: InferenceConfig) -> str:
    """The pass pipeline of the engine's graphs: cleanup, the fusion passes when kernels are injected, lowering."""
    passes = ["cse", "noop_views", "dce"]
    if config.replace_with_kernel_inject:
        passes += [*FUSION_PASSES, "dce"]
    passes.append("decode_gemv")  # a decode step's few-row matmuls stream their weights (Inductor on CPU; else a no-op)
    passes.append(f"lower({config.lower or 'auto'})")
    return ",".join(passes)


def _prefill_step(model: nn.Module) -> Callable[..., torch.Tensor]:
    """The prefill step; only the last position's logits when the model can skip the others.

    Generation reads the last position's logits only (prompts are left padded), so a forward that
    takes Hugging Face's ``logits_to_keep`` runs the LM head on that one position instead of every
    prompt token (a ``[prompt, hidden] x [hidden, vocab]`` matmul less in the first-token latency)."""
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}

    def prefill(**kwargs: Any) -> torch.Tensor:
        return model(**kwargs, **keep).logits

    return prefill


def _decode_step(model: nn.Module) -> Callable[..., torch.Tensor]:
    def decode(**kwargs: Any) -> torch.Tensor:  # its own code object: Dynamo caches it apart from prefill
        return model(**kwargs).logits

    return decode


DESTROYED = "this engine was destroyed (engine.destroy()); build a new one with dscompile.init_inference to run again"


class _Destroyed(nn.Module):
    """What a destroyed engine runs: a clear error."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(DESTROYED)


class InferenceEngine(nn.Module, EngineCore):
    """A model prepared for inference: called like the model, plus ``generate`` for causal LMs.

    ``compile_counts``: graphs compiled so far for the plain forward, the prefill and the decode
    step (the decode count stays at its first value however many tokens are generated).
    """

    extension_kind: ClassVar[str] = INFERENCE

    def __init__(self, model: nn.Module, config: InferenceConfig) -> None:
        nn.Module.__init__(self)
        tp_size = config.tensor_parallel.tp_size if config.tensor_parallel.enabled else 1
        if tp_size > 1:  # collective: every rank of the world builds its engine together
            init_from_launcher()  # as the training engines: the process group from torchrun's environment
        # DeepSpeed's names: ``_config`` the inference settings (the core's), ``config`` the model's own
        self.init_engine(config, plan_inference(world_info()[0], tp_size))
        self.config = getattr(model, "config", None)
        model.eval()
        model.to(config.dtype)
        self.quantized_layers: dict[str, int] = {}
        bits = config.quant.weight_bits
        weight = config.quant.weight
        if bits is not None and tp_size == 1:  # under TP the split packs each rank's slices (passes/inference_tensor_parallel.py)
            self.quantized_layers = quantize_model_weights(
                model, bits, weight.q_groups, weight.q_type == "symmetric", quantize_embeddings=weight.quantize_embeddings
            )
        policy, policy_key = config.injection_policy, "injection_policy"
        if config.injection_policy_tuple:  # the same check, its layers found from the names (an error names the key)
            policy, policy_key = policy_from_linear_names(model, config.injection_policy_tuple), "injection_policy_tuple"
        if policy and tp_size == 1:
            policy_linears(model, policy, policy_key)  # names the model's layers and linears, or an error naming the key
            log.info("init_inference: %s has no effect at tp_size 1 (it names the all-reduce linears of a split)", policy_key)
        self.module = model
        # past Dynamo's per-code limit the ninth engine's steps would run uncompiled (its decode step then fails
        # under steady_decode's stance): a process that serves or evaluates several models builds one each
        make_room(_ENTRIES_PER_ENGINE)
        self.compile_counts = {"forward": 0, "prefill": 0, "decode": 0}
        self.options: dict[str, Any] = {"pipeline": inference_pipeline(config)}
        if config.dump:
            self.options["dump"] = config.dump
        self.tensor_parallel: TensorParallelGraphs | None = None
        if tp_size > 1:
            quant = None if bits is None else (bits, weight.q_groups, weight.q_type == "symmetric", weight.quantize_embeddings)
            self.tensor_parallel = TensorParallelGraphs(model, tp_size, self._compile_graph, quant, policy, policy_key)
            self.quantized_layers = self.tensor_parallel.quantized_layers  # filled when the first graph splits the model
            self._forward: Callable[..., Any] = TensorParallelForward(self.tensor_parallel)
        else:
            self._forward = torch.compile(model, backend=self._backend("forward"))
        self._generator: StaticCacheGenerator | None = None
        self._seq2seq_forward: Callable[..., Any] | None = None
        self._seq2seq_split: TensorParallelSeq2Seq | None = None
        self.configure_extensions()

    def _compile_graph(self, gm: torch.fx.GraphModule, name: str) -> Callable[..., Any]:
        return torch.compile(gm, backend=self._backend(name), dynamic=False)

    def _backend(self, name: str) -> Callable[[torch.fx.GraphModule, Sequence[Any]], Callable[..., Any]]:
        def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
            self.compile_counts[name] += 1
            return dscompile_backend(gm, example_inputs, options=self.options)

        return backend

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad(), collecting(self.comm_stats):
            return self._forward(*args, **kwargs)

    def _check_alive(self) -> None:
        if self.destroyed:
            raise RuntimeError(DESTROYED)

    def release_compiled(self) -> None:
        """``destroy()``: drop the compiled forward, the generator's prefill and decode graphs and the split graphs."""
        self._forward = _Destroyed()  # a module either way: the compiled forward is a child module of the engine
        self._generator = None
        self._seq2seq_forward = None
        self._seq2seq_split = None
        self.tensor_parallel = None

    def model_bytes(self) -> int:
        """Bytes of the model's weights in memory (packed codes and scales when quantized)."""
        return model_bytes(self.module)

    def _static_generator(self) -> StaticCacheGenerator:
        if self._generator is None:
            if not hasattr(self.module, "generation_config") or not hasattr(self.module, "config"):
                raise TypeError(f"generate needs a Hugging Face causal language model; {type(self.module).__name__} has no generation_config")
            config = self._config
            if self.tensor_parallel is not None:
                generator = StaticCacheGenerator(self.module, config.max_out_tokens, config.min_out_tokens, None, None, self.tensor_parallel.tp_size)  # type: ignore[arg-type]
                generator.prefill = TensorParallelStep(self.tensor_parallel, "prefill", generator.full_attention_config())
                generator.decode = TensorParallelStep(self.tensor_parallel, "decode", generator.full_attention_config())
                self._generator = generator
                return generator
            prefill = torch.compile(_prefill_step(self.module), backend=self._backend("prefill"))
            decode = torch.compile(_decode_step(self.module), backend=self._backend("decode"), dynamic=False)
            self._generator = StaticCacheGenerator(self.module, config.max_out_tokens, config.min_out_tokens, prefill, decode)
        return self._generator

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        max_new_tokens: int | None = None,
        max_length: int | None = None,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float = 1.0,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        return_dict_in_generate: bool = False,
        output_logits: bool = False,
        **kwargs: Any,
    ) -> torch.Tensor | GenerationOutput:
        """Hugging Face's ``generate`` for the common arguments: prompt + new tokens, ``[batch, length]``.

        Left-padded batches pass ``attention_mask``. Sampling draws from ``generator``, or from a
        generator seeded with ``seed``, or else from torch's global generator (as Hugging Face does,
        so ``torch.manual_seed(s)`` before either gives the same tokens). ``eos_token_id`` and
        ``pad_token_id`` default to the model's ``generation_config``; rows that reached EOS are
        padded, and generation stops when all have.

        An encoder-decoder model (``config.is_encoder_decoder``: T5, BART) runs Hugging Face's ``generate`` with
        every argument it takes, each step through the compiled forward (``_generate_seq2seq``).
        """
        self._check_alive()
        if getattr(self.config, "is_encoder_decoder", False):
            given = {"max_new_tokens": max_new_tokens, "max_length": max_length, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id}
            hf = {k: v for k, v in given.items() if v is not None}
            hf.update(do_sample=do_sample, return_dict_in_generate=return_dict_in_generate, output_logits=output_logits)
            if do_sample:
                hf.update(temperature=temperature, top_k=top_k, top_p=top_p)
            if seed is not None or generator is not None:
                raise TypeError("generate of an encoder-decoder model draws from torch's global generator: call torch.manual_seed instead of seed/generator")
            return self._generate_seq2seq(input_ids, attention_mask, **hf, **kwargs)
        if kwargs:
            raise TypeError(f"generate() got arguments the engine's generator does not take: {sorted(kwargs)}")
        gen_config = self.module.generation_config if hasattr(self.module, "generation_config") else None
        prompt = input_ids.shape[-1]
        if max_new_tokens is None:
            if max_length is None:
                max_length = getattr(gen_config, "max_length", None) or 20
            max_new_tokens = max_length - prompt
        if max_new_tokens < 1:
            raise ValueError(f"nothing to generate: max_new_tokens={max_new_tokens} (prompt of {prompt} tokens)")
        if eos_token_id is None and gen_config is not None:
            eos_token_id = gen_config.eos_token_id
        if pad_token_id is None and gen_config is not None:
            pad_token_id = gen_config.pad_token_id
        if generator is None and seed is not None:
            generator = torch.Generator(device=input_ids.device).manual_seed(seed)
        sampling = SamplingConfig(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p)
        self._check_alive()
        with collecting(self.comm_stats):
            out = self._static_generator().generate(input_ids, attention_mask, max_new_tokens, sampling, eos_token_id, pad_token_id, generator, output_logits)
        return out if return_dict_in_generate else out.sequences

    def _generate_seq2seq(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, **kwargs: Any) -> Any:
        """An encoder-decoder model (T5, BART): Hugging Face's own ``generate`` loop, each step through the compiled forward.

        The static-cache generator is built for decoder-only models; here the model's ``forward`` is swapped, for the
        call, for its compiled version (the engine's pipeline; it recompiles once for the growing cache, then runs with
        dynamic shapes), so encoder and decoder steps run as dscompile's graphs and the tokens are Hugging Face's.
        Under tensor parallelism: ``_generate_seq2seq_split``."""
        if self.tensor_parallel is not None:
            return self._generate_seq2seq_split(input_ids, attention_mask, **kwargs)
        if self._seq2seq_forward is None:
            self._seq2seq_forward = torch.compile(self.module.forward, backend=self._backend("decode"))
        own = self.module.__dict__.get("forward")  # a forward set on the instance (e.g. accelerate's hooks) comes back
        self.module.forward = self._seq2seq_forward
        try:
            with torch.no_grad(), collecting(self.comm_stats):
                return self.module.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        finally:
            if own is None:
                del self.module.forward  # the class's forward again
            else:
                self.module.forward = own

    def _generate_seq2seq_split(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, **kwargs: Any) -> Any:
        """``_generate_seq2seq`` under tensor parallelism: Hugging Face's ``generate`` without a KV cache, the encoder's
        and the model's ``forward`` swapped for the split graphs (``TensorParallelSeq2Seq``): one encoder graph per
        prompt shape, one decoder graph per generation length (the steps right-padded to it)."""
        assert self.tensor_parallel is not None
        if self._seq2seq_split is None:
            self._seq2seq_split = TensorParallelSeq2Seq(self.tensor_parallel)
        split = self._seq2seq_split
        gen = getattr(self.module, "generation_config", None)
        start = kwargs["decoder_input_ids"].shape[-1] if kwargs.get("decoder_input_ids") is not None else 1
        longest = kwargs.get("max_length") or getattr(gen, "max_length", None) or 20
        split.length = kwargs["max_new_tokens"] + start - 1 if kwargs.get("max_new_tokens") is not None else longest - 1
        encoder = self.module.get_encoder()
        owns = {m: m.__dict__.get("forward") for m in (self.module, encoder)}  # forwards set on the instances come back
        self.module.forward, encoder.forward = split.forward, split.encoder
        try:
            with torch.no_grad(), collecting(self.comm_stats):
                return self.module.generate(input_ids=input_ids, attention_mask=attention_mask, **{**kwargs, "use_cache": False})
        finally:
            for module, own in owns.items():
                if own is None:
                    del module.forward
                else:
                    module.forward = own


def init_inference(model: nn.Module, config: dict[str, Any] | None = None, **kwargs: Any) -> InferenceEngine:
    """DeepSpeed's ``deepspeed.init_inference(model, config=None, **kwargs)``.

    Keys (as keyword arguments or in ``config``; keywords win): ``dtype``, ``max_out_tokens``,
    ``min_out_tokens``, ``replace_with_kernel_inject``, ``quant``, ``tensor_parallel`` (``tp_size``
    ranks per model, launched with torchrun; ``passes/inference_tensor_parallel.py``), and dscompile's
    ``lower`` and ``dump``; DeepSpeed's other keys are refused by
    name when set (``dscompile.runtime.inference.config``).
    """
    if not isinstance(model, nn.Module):
        raise DSCompileConfigError("model", f"expected a torch.nn.Module, got {type(model).__name__}")
    return InferenceEngine(model, parse_inference_config(config, **kwargs))
